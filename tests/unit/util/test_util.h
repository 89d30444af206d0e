/* Helpers shared by the unit tests (the .c files of tests/unit/util are compiled into every test binary, see
 * TESTUTIL_SRC in the Makefile): the test model and its tokenizer, temporary directories, whole
 * files, a growing string buffer, zstd frames. A failure inside a helper is a cmocka assertion
 * failure of the calling test. No static state, no static initialisation. */
#ifndef BT_TEST_UTIL_H
#define BT_TEST_UTIL_H
#include <stddef.h>
#include <stdint.h>

#include "common/tokenizer.h"

/* The model whose tokenizer the tests use: env BT_MODEL, else
 * models/SmolLM2-135M-Instruct.Q4_1.gguf (tests run from the repository root). Static string. */
const char *tu_model_path(void);

/* Load the tokenizer of tu_model_path() into *tok (free with bt_tokenizer_free). Returns 0, or
 * -1 after printing "cannot load tokenizer <path>: <error>" to stderr (for cmocka setups). */
int tu_load_tokenizer(bt_tokenizer **tok);

/* mkdtemp "/tmp/bt_test_<tag>_XXXXXX" into dir (at least 64 bytes). 0, or -1 on failure. */
int tu_make_tmpdir(char *dir, size_t dir_size, const char *tag);

/* rm -rf dir (no shell). 0 when it is gone, -1 if something is left. */
int tu_remove_dir(const char *dir);

/* Whole contents of `path`, malloc'ed with one spare byte after the end (callers may
 * NUL-terminate); *n = its size. Fails the test, naming path, if it cannot be opened; asserts on
 * read errors. Caller frees. */
uint8_t *tu_slurp(const char *path, size_t *n);

/* Create or truncate the file `path` (dir == NULL) or "<dir>/<path>" with n bytes of data;
 * asserts on any error. */
void tu_write_file(const char *dir, const char *path, const void *data, size_t n);

/* Growing byte buffer, always NUL-terminated after the first append. Start with {0}; the caller
 * frees p. Aborts on OOM. */
typedef struct {
    char *p;
    size_t n, cap;
} tu_sbuf;
void tu_sb_add(tu_sbuf *b, const void *s, size_t n);
void tu_sb_str(tu_sbuf *b, const char *s);

/* Whole decompressed contents of the zstd file `path` (frames without a content size too),
 * malloc'ed and NUL-terminated; *out_len = its size. Fails the test on any error. Caller frees. */
char *tu_read_zst(const char *path, size_t *out_len);

/* One zstd frame (level 3) of src[0..n); *zn = its size. Caller frees. Asserts on failure. */
void *tu_zstd_frame(const void *src, size_t n, size_t *zn);

/* Overwrite element `elem` of tensor `name` in the safetensors file `path` with a NaN of the
 * tensor's dtype (F32, F16 or BF16), in place: the hostile file our writers refuse to produce
 * (they never write non-finite tensors). Returns 1 when patched, 0 when the file has no such
 * tensor; asserts on anything else. */
int tu_st_put_nan(const char *path, const char *name, size_t elem);

/* The data of fixture tensor `name` in an open safetensors file, checked to have dtype dt (a
 * bt_st_dtype) and n 4-byte elements (n < 0: any count); fails the test naming the tensor
 * otherwise. Borrowed from the file. */
struct bt_st_file;
const void *tu_st_data(struct bt_st_file *f, const char *name, int dt, int64_t n);

/* The tiny-model parity fixtures of tests/reference/gen_qwen_fixtures.py and gen_phi3_fixtures.py:
 * $BT_HF_FIXTURES (default tests/fixtures/hf), the safetensors file `rel` of family dir `fam`
 * ("qwen", "phi3"; fails the test when it cannot be opened; close with bt_st_close), and its
 * packed batch (TU_FIX_B rows of TU_FIX_T tokens, 3 documents) as a bt_microbatch viewing *b. */
enum { TU_FIX_B = 2, TU_FIX_T = 24, TU_FIX_M = TU_FIX_B * TU_FIX_T };
typedef struct {
    int32_t ids[TU_FIX_M], lab[TU_FIX_M], pos[TU_FIX_M], cu[4];
} tu_fix_batch;
const char *tu_hf_fixdir(void);
struct bt_st_file *tu_fix_open(const char *fam, const char *rel);
/* max |a - b| and max |a| over n floats, in double */
double tu_max_abs_diff(const float *a, const float *b, int64_t n);
double tu_max_abs(const float *a, int64_t n);

#endif
