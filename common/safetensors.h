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

typedef struct {
    char *name;
    bt_st_dtype dtype;
    int n_dims;
    int64_t shape[8];
    const void *data;  /* into the mapping */
    size_t nbytes;
} bt_st_tensor;

typedef struct bt_st_file bt_st_file;
int bt_st_open(bt_st_file **out, const char *path);
void bt_st_close(bt_st_file *f);
int bt_st_n_tensors(const bt_st_file *f);
const bt_st_tensor *bt_st_tensor_at(const bt_st_file *f, int i);
const bt_st_tensor *bt_st_find(const bt_st_file *f, const char *name);
/* __metadata__ value, NULL if absent. */
const char *bt_st_metadata(const bt_st_file *f, const char *key);

/* Writer: tensors are copied in; written sorted by name (as the Python library does) with
 * 8-byte aligned header padding, atomically (temp file, fsync, rename). */
typedef struct bt_st_writer bt_st_writer;
bt_st_writer *bt_st_writer_new(void);
void bt_st_writer_free(bt_st_writer *w);
int bt_st_w_metadata(bt_st_writer *w, const char *key, const char *value);
int bt_st_w_tensor(bt_st_writer *w, const char *name, bt_st_dtype dtype, int n_dims,
                   const int64_t *shape, const void *data, size_t nbytes);
int bt_st_writer_write(bt_st_writer *w, const char *path);

#endif
