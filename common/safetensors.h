/* safetensors reader and writer.
 * Format: huggingface/safetensors README: u64 little-endian header length N, N bytes of JSON
 * {name: {"dtype","shape","data_offsets":[begin,end]}, "__metadata__": {str: str}}, then the
 * byte buffer. Reader validates: N within file, JSON well-formed (jansson), dtype known,
 * offsets in range and non-overlapping, size == numel * dtype size. */
#ifndef BT_SAFETENSORS_H
#define BT_SAFETENSORS_H
#include <stdint.h>
#include <stddef.h>

typedef enum { BT_ST_F32, BT_ST_F16, BT_ST_BF16, BT_ST_U8, BT_ST_I8, BT_ST_I32, BT_ST_I64,
               BT_ST_F64, BT_ST_BOOL, BT_ST_I16, BT_ST_U16, BT_ST_U32, BT_ST_U64 } bt_st_dtype;

const char *bt_st_dtype_name(bt_st_dtype d); /* "F32" ... */
size_t bt_st_dtype_size(bt_st_dtype d);
/* Parse a dtype name ("F32", "BF16", ...). BT_ERR_UNSUPPORTED for anything else (F8_*, ...). */
int bt_st_dtype_from_name(const char *name, bt_st_dtype *out);

typedef struct {
    char *name;
    bt_st_dtype dtype;
    int n_dims;
    int64_t shape[8];
    const void *data;  /* into the mapping */
    size_t nbytes;
} bt_st_tensor;

typedef struct bt_st_file bt_st_file;
/* Open (read-only mmap) and validate. *out owned by caller (bt_st_close); tensor data pointers
 * live as long as the handle and are only as aligned as the writer made them (8 bytes for files
 * written with the padded header). Tensors are indexed in data-offset order. Errors:
 * BT_ERR_IO, BT_ERR_FORMAT (bad header/JSON/offsets, gaps, overlap, trailing bytes),
 * BT_ERR_RANGE (offsets past the buffer), BT_ERR_UNSUPPORTED (dtype not in bt_st_dtype, > 8 dims);
 * *out = NULL on error. */
int bt_st_open(bt_st_file **out, const char *path);
void bt_st_close(bt_st_file *f);
/* Whether the file changed under the mapping since bt_st_open (bt_map_check); returns rc when it
 * did not, else BT_ERR_IO naming the file. Readers call it with their own result before
 * bt_st_close (`rc = bt_st_check(f, rc)`) and drop what they read when it fails. */
int bt_st_check(const bt_st_file *f, int rc);
int bt_st_n_tensors(const bt_st_file *f);
const bt_st_tensor *bt_st_tensor_at(const bt_st_file *f, int i);
/* NULL if out of range / absent (binary search by name). */
const bt_st_tensor *bt_st_find(const bt_st_file *f, const char *name);
/* __metadata__ value, NULL if absent. */
const char *bt_st_metadata(const bt_st_file *f, const char *key);

/* Writer: tensors are copied in; written in the Python library's order (descending dtype size,
 * then name — for one dtype, as PEFT adapters are, that is simply sorted by name) with 8-byte
 * aligned header padding, atomically (temp file, fsync, rename). */
typedef struct bt_st_writer bt_st_writer;
bt_st_writer *bt_st_writer_new(void);
void bt_st_writer_free(bt_st_writer *w);
/* Key/value are copied; must be UTF-8; duplicate key -> BT_ERR_INVALID. */
int bt_st_w_metadata(bt_st_writer *w, const char *key, const char *value);
/* Copies nbytes (must equal prod(shape) * dtype size; n_dims 0..8, shape >= 0) from data.
 * Unique UTF-8 name, not "__metadata__". BT_ERR_INVALID / BT_ERR_NOMEM otherwise. */
int bt_st_w_tensor(bt_st_writer *w, const char *name, bt_st_dtype dtype, int n_dims,
                   const int64_t *shape, const void *data, size_t nbytes);
/* Order: descending dtype size, then name (safetensors/src/tensor.rs prepare()); header JSON
 * with sorted keys, space-padded to a multiple of 8. PATH.tmp.<pid> + fsync + rename + dir fsync;
 * BT_ERR_IO on failure (PATH untouched). */
int bt_st_writer_write(bt_st_writer *w, const char *path);

#endif
