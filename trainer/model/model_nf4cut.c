/* dist.shard_base with an NF4 base quantised at load: this rank quantises only its cut of a base
 * linear (docs/ARCHITECTURE.md §Parallel, "Loading only this rank's shard"). Contract:
 * model_internal.h bt_model_nf4_cut. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/quant.h"
#include "kernels/kernels.h"
#include "trainer/backend/plan.h"
#include "trainer/model/model_internal.h"

/* The GGUF reader of bt_model_nf4_cut: HF row r of the linear as fp32 into out[cols], file row
 * r0 + perm(r) of tensor t (perm: the un-permutation of llama q/k rows, model.c unpermute_rows's
 * map, when nh > 0). */
typedef struct {
    const bt_gguf_tensor *t;
    int cols, nh, hd, r0;
} gguf_rows;

static int gguf_row(const void *ctx, int64_t r, float *out) {
    const gguf_rows *g = ctx;
    int64_t fr = r;
    if (g->nh > 0) {
        const int half = g->hd / 2;
        fr = (r / g->hd) * g->hd + 2 * (r % g->hd % half) + (r % g->hd) / half;
    }
    const size_t rb = bt_ggml_row_size(g->t->type, g->cols);
    return bt_ggml_dequantize(g->t->type, (const uint8_t *)g->t->data + (size_t)(g->r0 + fr) * rb, out,
                              g->cols);
}

/* Give back the whole pages of the read-only private file mapping inside [p, p + n): pass 1 read
 * them once; unwritten, they are re-read from the file if ever touched again (never here), so the
 * rank's resident set does not keep the whole matrix's file pages (VmHWM, README). */
void bt_model_drop_pages(const void *p, size_t n) {
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t a = ((uintptr_t)p + pg - 1) & ~(pg - 1), e = ((uintptr_t)p + n) & ~(pg - 1);
    if (e > a) (void)madvise((void *)a, e - a, MADV_DONTNEED);
}

int bt_model_nf4_cut_rows(bt_base_linear *l, const bt_nf4_row_src *src, int rows, int cols,
                          const bt_model_shard *sh, const char *path, const char *name) {
    const int64_t n = (int64_t)rows * cols;
    if (n % BT_NF4_BLOCKSIZE != 0)
        return bt_fail(BT_ERR_UNSUPPORTED, "model: %s: %d x %d elements is not a multiple of the NF4 "
                       "block size 64 (use base_dtype fp32)", name, rows, cols);
    bt_shard_cut c;
    bt_shard_cut_nf4(&c, n, sh->world);
    const int64_t G = BT_SHARD_NF4_WEIGHTS, nb = n / BT_NF4_BLOCKSIZE;
    int64_t a = (int64_t)sh->rank * c.per * G, e = a + c.per * G; /* my weights [a, e) */
    if (a > n) a = n;
    if (e > n) e = n;
    float *am = malloc((size_t)nb * sizeof(float)), *row = malloc((size_t)cols * sizeof(float));
    float *part = bt_aligned_alloc((size_t)(e - a > 0 ? e - a : 1) * sizeof(float));
    float amx = 0.0f; /* the running block's absmax: bt_nf4_block_absmax's fmaxf of fabsf, exact in any order */
    int rc = am && row && part ? 0 : bt_fail(BT_ERR_NOMEM, "model: %s: out of memory for %s", path, name);
    /* pass 1: every row once, in HF order (the mapping's pages are clean and reclaimable), keeping
     * the 64-block absmaxes for the matrix's offset and this rank's weights [a, e) */
    int64_t at = 0, b = 0;
    for (int64_t r = 0; r < rows && !rc; r++) {
        if ((rc = src->row(src->ctx, r, row))) {
            rc = bt_fail(rc, "model: %s: tensor %s: %s", path, name, bt_last_error_in("model"));
            break;
        }
        for (int i = 0; i < cols; i++, at++) {
            if (!isfinite(row[i])) {
                rc = bt_fail(BT_ERR_FORMAT, "model: %s: tensor %s: non-finite value at element %lld", path,
                             name, (long long)(src->elem0 + at));
                break;
            }
            amx = fmaxf(amx, fabsf(row[i]));
            if (at >= a && at < e) part[at - a] = row[i];
            if ((at + 1) % BT_NF4_BLOCKSIZE == 0) {
                am[b++] = amx;
                amx = 0.0f;
            }
        }
    }
    if (!rc) bt_model_drop_pages(src->map, src->map_bytes);
    /* pass 2: my groups with the whole matrix's offset: the bytes of a whole quantisation */
    if (!rc && (rc = bt_nf4_quantize_part(&l->q, part, e - a, bt_nf4_absmax_offset(am, nb), rows, cols)))
        rc = bt_fail(rc, "model: %s: NF4 quantisation failed: %s", name, bt_last_error_in("model"));
    free(am), free(row), free(part);
    if (rc) return rc;
    l->rows = rows;
    l->cols = cols;
    l->is_nf4 = 1;
    l->shard_rank = sh->rank;
    l->shard_world = sh->world;
    l->shard_r0 = (int64_t)sh->rank * c.per; /* the first NF4 unit (past the end: nothing held) */
    return 0;
}

int bt_model_nf4_cut(bt_base_linear *l, const bt_gguf_tensor *t, int rows, int cols, int nh, int hd, int r0,
                     const bt_model_shard *sh, const char *path, const char *name) {
    const gguf_rows g = {t, cols, nh, hd, r0};
    const size_t rb = bt_ggml_row_size(t->type, cols);
    const bt_nf4_row_src src = {gguf_row, &g, (const uint8_t *)t->data + (size_t)r0 * rb, (size_t)rows * rb,
                                (int64_t)r0 * cols};
    return bt_model_nf4_cut_rows(l, &src, rows, cols, sh, path, name);
}
