/* GGUF v3 reader and writer.
 * Spec: ggml-org/ggml docs/gguf.md (see docs/formats/gguf.md).
 * The reader memory-maps the file and validates everything before returning: magic "GGUF",
 * version 2 or 3, counts against the file size, every string/array length in range, tensor
 * offsets aligned (general.alignment, default 32) and inside the data section, no overlap,
 * n_dims 1..4, known tensor types, byte size = bt_ggml_row_size(type, ne[0]) * rows.
 * Any violation -> BT_ERR_FORMAT / BT_ERR_RANGE / BT_ERR_UNSUPPORTED with a message naming
 * the file, the key or tensor, and the offending value. */
#ifndef BT_GGUF_H
#define BT_GGUF_H
#include <stdint.h>
#include <stddef.h>

/* Metadata value types (gguf.md "gguf_metadata_value_type"). */
typedef enum {
    BT_GGUF_U8 = 0, BT_GGUF_I8 = 1, BT_GGUF_U16 = 2, BT_GGUF_I16 = 3,
    BT_GGUF_U32 = 4, BT_GGUF_I32 = 5, BT_GGUF_F32 = 6, BT_GGUF_BOOL = 7,
    BT_GGUF_STRING = 8, BT_GGUF_ARRAY = 9, BT_GGUF_U64 = 10, BT_GGUF_I64 = 11,
    BT_GGUF_F64 = 12,
} bt_gguf_vtype;

/* ggml tensor types (ggml.h enum ggml_type values). */
typedef enum {
    BT_GGML_F32 = 0, BT_GGML_F16 = 1, BT_GGML_Q4_0 = 2, BT_GGML_Q4_1 = 3,
    BT_GGML_Q5_0 = 6, BT_GGML_Q5_1 = 7, BT_GGML_Q8_0 = 8, BT_GGML_Q8_1 = 9,
    BT_GGML_Q2_K = 10, BT_GGML_Q3_K = 11, BT_GGML_Q4_K = 12, BT_GGML_Q5_K = 13,
    BT_GGML_Q6_K = 14, BT_GGML_Q8_K = 15, BT_GGML_BF16 = 30,
} bt_ggml_type;

/* A string inside the mapping: NOT NUL-terminated. */
typedef struct {
    const char *ptr;
    uint64_t len;
} bt_str;

typedef struct {
    bt_str name;
    uint32_t n_dims;
    uint64_t ne[4];       /* ne[0] is the fastest-varying (row length); unused dims are 1 */
    int type;             /* bt_ggml_type */
    uint64_t offset;      /* relative to the data section start */
    uint64_t nbytes;
    const void *data;     /* points into the mapping */
} bt_gguf_tensor;

typedef struct bt_gguf bt_gguf;

/* Open (read-only mmap) and validate. *out owned by caller, release with bt_gguf_close; every
 * bt_str / tensor data pointer handed out points into the mapping and dies with the handle.
 * Errors: BT_ERR_IO (open/mmap), BT_ERR_FORMAT (malformed), BT_ERR_RANGE (tensor data outside
 * the file), BT_ERR_UNSUPPORTED (version, big-endian, unknown ggml type), BT_ERR_NOMEM;
 * *out = NULL on error. Allocation is bounded by a small multiple of the file size. */
int bt_gguf_open(bt_gguf **out, const char *path);
/* Parse from a caller-owned buffer (not copied; must outlive the handle). `name` is for messages. */
int bt_gguf_open_buffer(bt_gguf **out, const void *data, size_t size, const char *name);
void bt_gguf_close(bt_gguf *g);
/* For a handle from bt_gguf_open: whether the file changed under the mapping since it was
 * opened (bt_map_check: truncated, rewritten in place). Returns rc when it did not, else
 * BT_ERR_IO naming the file; every reader calls it with its own result before bt_gguf_close
 * (`rc = bt_gguf_check(g, rc)`) and throws away what it read when it fails. A buffer handle
 * returns rc. */
int bt_gguf_check(const bt_gguf *g, int rc);

uint32_t bt_gguf_version(const bt_gguf *g);
uint64_t bt_gguf_alignment(const bt_gguf *g);
int64_t bt_gguf_n_kv(const bt_gguf *g);
/* File offset of the tensor data section (multiple of the alignment). */
uint64_t bt_gguf_data_offset(const bt_gguf *g);
/* Key name of the i-th KV pair (file order); {NULL, 0} if i is out of range. */
bt_str bt_gguf_key_at(const bt_gguf *g, int64_t i);
/* Index of a NUL-terminated key (hash lookup), -1 if absent. */
int64_t bt_gguf_find_key(const bt_gguf *g, const char *key);
/* Value type of the i-th KV; for arrays also the element type and count (else NULL ok).
 * Out-of-range i returns (bt_gguf_vtype)-1; for non-arrays *arr_type = (bt_gguf_vtype)-1, *arr_n = 0. */
bt_gguf_vtype bt_gguf_kv_type(const bt_gguf *g, int64_t i, bt_gguf_vtype *arr_type, uint64_t *arr_n);

/* Typed getters by key. Integers accept any integer vtype whose value fits; floats accept F32/F64.
 * Return BT_ERR_NOTFOUND if absent, BT_ERR_FORMAT on type mismatch (message names the key). */
int bt_gguf_get_u64(const bt_gguf *g, const char *key, uint64_t *out);
int bt_gguf_get_i64(const bt_gguf *g, const char *key, int64_t *out);
int bt_gguf_get_f64(const bt_gguf *g, const char *key, double *out);
int bt_gguf_get_bool(const bt_gguf *g, const char *key, int *out);
int bt_gguf_get_str(const bt_gguf *g, const char *key, bt_str *out);
/* Array of strings: *out is a malloc'd array of n bt_str pointing into the mapping (free(*out));
 * never NULL on success, even for n = 0. BT_ERR_FORMAT if the key is not a string array. */
int bt_gguf_get_str_arr(const bt_gguf *g, const char *key, bt_str **out, uint64_t *n);
/* Array of fixed-size numbers: *data points into the mapping (unaligned: memcpy elements out);
 * *elem_type (may be NULL) gets the element vtype, *n the count. BT_ERR_FORMAT otherwise. */
int bt_gguf_get_num_arr(const bt_gguf *g, const char *key, bt_gguf_vtype *elem_type,
                        const void **data, uint64_t *n);

int64_t bt_gguf_n_tensors(const bt_gguf *g);
const bt_gguf_tensor *bt_gguf_tensor_at(const bt_gguf *g, int64_t i);
/* Tensor by index (file order) or by NUL-terminated name (hash lookup); NULL if absent. */
const bt_gguf_tensor *bt_gguf_find_tensor(const bt_gguf *g, const char *name);

/* ---- writer ---- (builds everything in memory, writes atomically: temp file, fsync, rename)
 * Output: GGUF v3, KVs in insertion order, tensor infos and data in insertion order, each
 * tensor's offset aligned to general.alignment (default 32) and zero-padded; readable by
 * gguf-py and llama.cpp. All bt_gguf_w_* return 0 or BT_ERR_INVALID (bad/duplicate key or
 * argument) / BT_ERR_NOMEM; the writer stays usable after a rejected call. */
typedef struct bt_gguf_writer bt_gguf_writer;
bt_gguf_writer *bt_gguf_writer_new(void);
void bt_gguf_writer_free(bt_gguf_writer *w);
/* Key rules for every bt_gguf_w_*: 1..65535 bytes, unique (BT_ERR_INVALID otherwise).
 * "general.alignment" must be a u32 power of two; it sets the data alignment (default 32). */
/* Any fixed-size scalar (U8..I64, F32, F64, BOOL 0/1); `value` points to the native value. */
int bt_gguf_w_scalar(bt_gguf_writer *w, const char *key, bt_gguf_vtype type, const void *value);
int bt_gguf_w_u64(bt_gguf_writer *w, const char *key, uint64_t v);
int bt_gguf_w_u32(bt_gguf_writer *w, const char *key, uint32_t v);
int bt_gguf_w_i32(bt_gguf_writer *w, const char *key, int32_t v);
int bt_gguf_w_f32(bt_gguf_writer *w, const char *key, float v);
int bt_gguf_w_bool(bt_gguf_writer *w, const char *key, int v);
int bt_gguf_w_str(bt_gguf_writer *w, const char *key, const char *s, uint64_t len);
int bt_gguf_w_str_arr(bt_gguf_writer *w, const char *key, const bt_str *v, uint64_t n);
int bt_gguf_w_num_arr(bt_gguf_writer *w, const char *key, bt_gguf_vtype elem_type,
                      const void *data, uint64_t n);
/* Copies a KV pair verbatim from a reader (used to carry tokenizer metadata over).
 * BT_ERR_NOTFOUND if src lacks the key. */
int bt_gguf_w_copy_kv(bt_gguf_writer *w, const bt_gguf *src, const char *key);
/* Adds a tensor; data (nbytes = bt_ggml_row_size(type, ne[0]) * ne[1]*..*ne[n_dims-1]) is
 * copied. ne[0] fastest (a PyTorch [out, in] weight has ne = {in, out}). Name 1..63 bytes and
 * unique, n_dims 1..4, every ne >= 1. BT_ERR_INVALID / BT_ERR_UNSUPPORTED (type) otherwise.
 * A tensor holding a NaN or infinity (F32/F16/BF16 values, block scales of the Q types) is
 * refused with BT_ERR_INVALID naming the element; IQ and TQ blocks are not inspected. */
int bt_gguf_w_tensor(bt_gguf_writer *w, const char *name, int type, uint32_t n_dims,
                     const uint64_t *ne, const void *data, uint64_t nbytes);
/* Writes PATH.tmp.<pid>, fsyncs, renames over PATH, fsyncs the directory. BT_ERR_IO on
 * failure (the temp file is removed, PATH untouched). The writer can be written again. */
int bt_gguf_writer_write(bt_gguf_writer *w, const char *path);

#endif
