/* BarqTrain common: the one growable array. A growable array is an owner's pointer, count and
 * capacity (T *v; size_t n, cap; zero-initialised = empty, freed with free(v)); bt_vec_grow makes
 * room, doubling, so n appends cost O(n). Two ways to run out of memory, chosen per use:
 *   - fallible (bt_vec_grow, bt_ids_try_*, bt_buf with its sticky `oom`): what grows with the
 *     input — a document's token ids in loaderd, a rendered document, a reply line — fails with
 *     BT_ERR_NOMEM and the caller skips that input and says so; the process goes on;
 *   - aborting (bt_vec_xgrow, bt_ids_push): small bookkeeping only (lists of files, of members),
 *     as bt_xrealloc (common/bt_common.h).
 * bt_ids is the int32 array (token ids, loss masks, piece lengths); bt_buf the byte buffer. */
#ifndef BT_VEC_H
#define BT_VEC_H
#include <stddef.h>
#include <stdint.h>

/* Make room for `need` elements of `elem` bytes in the malloc'd array v (NULL: none yet) of
 * *cap elements: returns v when *cap >= need already, else the reallocated array with *cap set
 * to the new capacity (at least 16, doubled until >= need). NULL when need * elem overflows or
 * realloc fails: v is then still valid and *cap unchanged (the caller keeps its array). */
void *bt_vec_grow(void *v, size_t *cap, size_t need, size_t elem);
/* bt_vec_grow that aborts with a message instead of returning NULL (bookkeeping only). */
void *bt_vec_xgrow(void *v, size_t *cap, size_t need, size_t elem);

/* Growable int32 array (ids or masks). Zero-initialise; free with bt_ids_free. */
typedef struct {
    int32_t *v;
    size_t n, cap;
} bt_ids;
/* Append x; BT_OK, or BT_ERR_NOMEM with a unchanged (bt_fail message). */
int bt_ids_try_push(bt_ids *a, int32_t x) __attribute__((warn_unused_result));
/* Append v[0..k); BT_OK, or BT_ERR_NOMEM with a unchanged. */
int bt_ids_try_append(bt_ids *a, const int32_t *v, size_t k) __attribute__((warn_unused_result));
/* Append x, aborting when out of memory (bookkeeping and tools, never a document in loaderd). */
void bt_ids_push(bt_ids *a, int32_t x);
void bt_ids_free(bt_ids *a);

/* Growable byte buffer, NUL-terminated while p != NULL, with a sticky out-of-memory flag: the
 * first failed append sets oom and every later append is a no-op, so a writer appends freely and
 * checks oom once at the end. Zero-initialise; free(p). */
typedef struct {
    char *p;
    size_t n, cap;
    int oom;
} bt_buf;
void bt_buf_put(bt_buf *b, const void *s, size_t n);
void bt_buf_str(bt_buf *b, const char *s);
void bt_buf_printf(bt_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
