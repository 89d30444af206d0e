/* Helpers shared by the model loaders (trainer/model/model.c: GGUF and random init;
 * trainer/model/model_hf.c: Hugging Face directories). Not part of the trainer's public API. */
#ifndef BT_TRAINER_MODEL_INTERNAL_H
#define BT_TRAINER_MODEL_INTERNAL_H

#include "common/gguf.h"
#include "trainer/model/model.h"

/* Shape [rows = out, cols = in] of linear `mod` (BT_MOD_*) under hp (q: n_head*head_dim x
 * d_model, k/v: n_kv_head*head_dim x d_model, o: d_model x n_head*head_dim, gate/up: d_ff x
 * d_model, down: d_model x d_ff). */
void bt_model_lin_shape(const bt_llama_hparams *hp, int mod, int *rows, int *cols);

/* Validate hyper-parameters; `src` names the source in messages. head_dim_free = 0 requires
 * head_dim * n_head == d_model (GGUF llama, random init); 1 allows any even head_dim (HF
 * configs with an explicit head_dim). BT_ERR_INVALID with a message otherwise. */
int bt_model_check_hparams(const bt_llama_hparams *hp, const char *src, int head_dim_free);

/* The layer index of a weight named "<prefix><N>.<...>" (prefix "blk." in GGUF files,
 * "model.layers." in Hugging Face checkpoints), or -1 for any other name. The loaders take every
 * layer index found in a file and refuse one at or past the layer count their header / config.json
 * gives: a header that claims fewer layers than the weights hold would load part of the model
 * silently (issue 21 §11; every other dimension is checked by the tensors' exact shapes). */
int bt_model_layer_of(const char *name, const char *prefix);

/* Make *l the frozen linear of fp32 w[rows, cols], taking ownership of w (freed on every path
 * when quantised or on error): fp32 base keeps it, NF4 base quantises it (bt_nf4_quantize; the
 * element count must be a multiple of 64, else BT_ERR_UNSUPPORTED naming `what`). */
int bt_model_lin_set(bt_base_linear *l, float *w, int rows, int cols, int base_dtype,
                     const char *what);

/* llama.rope.scaling.* of a GGUF (llama.cpp's keys: type none / linear / yarn, factor,
 * original_context_length, attn_factor, yarn_beta_fast / yarn_beta_slow) into hp->rope_ext and
 * friends (hp->ctx must already hold llama.context_length). Errors: BT_ERR_FORMAT /
 * BT_ERR_UNSUPPORTED / BT_ERR_NOTFOUND naming the key. */
struct bt_gguf;
/* dist.shard_base loading an NF4 base quantised at load (bt_model_load_gguf_shard with base_dtype
 * nf4 and sh->world > 1): *l gets only rank sh->rank's NF4 units of the [rows, cols] linear
 * (plan.h bt_shard_cut_nf4: whole 16384-weight double-quantisation groups, ceil(groups / W) a
 * rank), quantised with the offset of the whole matrix (kernels.h bt_nf4_quantize_part), so its
 * bytes are exactly the whole quantisation's of those groups. The matrix is HF rows of tensor t's
 * file rows r0 + perm(r) (llama q/k: nh heads of hd, unpermute_rows's map; nh 0: none), decoded a
 * row at a time: one pass reads every row (for the offset), host memory is the n/64 absmaxes, one
 * row and the cut. l->q.n = the weights held (0 past the end); l->shard_r0 = the first unit;
 * rows / cols stay the whole matrix's. Errors: BT_ERR_UNSUPPORTED (rows x cols not a multiple of
 * 64), BT_ERR_FORMAT (a non-finite value, named), BT_ERR_NOMEM, a decoding error. */
int bt_model_nf4_cut(bt_base_linear *l, const bt_gguf_tensor *t, int rows, int cols, int nh, int hd,
                     int r0, const bt_model_shard *sh, const char *path, const char *name);
/* Give back (madvise MADV_DONTNEED) the whole pages inside [p, p + n) of a read-only private file
 * mapping whose bytes were read and decoded into memory of our own: unwritten, they are re-read
 * from the file if touched again, so the resident set (VmHWM) does not keep a copy of tensors
 * already decoded. Pages only partly inside are kept. Errors: none (advice only). */
void bt_model_drop_pages(const void *p, size_t n);
/* The rows bt_model_nf4_cut_rows quantises, whatever the file: row(ctx, r, out) writes HF row r
 * (0 <= r < rows) of the linear as fp32 into out[cols] (returns 0 or a decoding error, set with
 * bt_fail); map / map_bytes: the read-only file mapping's bytes those rows are read from, given
 * back (madvise MADV_DONTNEED) once pass 1 has read them all; elem0: the tensor's element index
 * of row 0's first weight (a fused tensor's part starts past 0), for the non-finite error. */
typedef struct {
    int (*row)(const void *ctx, int64_t r, float *out);
    const void *ctx;
    const void *map;
    size_t map_bytes;
    int64_t elem0;
} bt_nf4_row_src;
/* bt_model_nf4_cut over any row source (a GGUF tensor: bt_model_nf4_cut; a safetensors F32 / F16
 * / BF16 tensor: model_hf.c): the same two passes and the same contract, errors and bytes. */
int bt_model_nf4_cut_rows(bt_base_linear *l, const bt_nf4_row_src *src, int rows, int cols,
                          const bt_model_shard *sh, const char *path, const char *name);
int bt_model_gguf_rope_scaling(const struct bt_gguf *g, const char *path, bt_llama_hparams *hp);

/* 1 and *out = the value when v is a JSON number (integer or real), else 0 (config.json and
 * bitsandbytes quant_state fields). */
#include <jansson.h>
static inline int bt_model_json_num(json_t *v, double *out) {
    if (!json_is_number(v)) return 0;
    *out = json_number_value(v);
    return 1;
}

/* ---- bitsandbytes 4-bit (trainer/model/model_bnb.c) */
struct bt_st_file;
/* The pieces of one bnb 4-bit linear, validated; pointers borrow the mapped files. */
typedef struct {
    int64_t n;                  /* rows * cols */
    const uint8_t *packed;      /* [ceil(n/2)] */
    int fp4;                    /* quant_type "fp4" */
    int blocksize;              /* 64 for every default bnb 4-bit checkpoint */
    int nested;                 /* double quantisation (absmax U8) */
    const void *absmax;         /* U8 [nb] (nested) or F32 [nb] (any alignment) */
    int64_t nb;                 /* ceil(n / blocksize) */
    float qmap[16];
    const void *nested_absmax;  /* F32 [ceil(nb / nested_blocksize)] */
    int64_t n_nested;
    float nmap[256];
    int nested_blocksize;
    float offset;
} bt_bnb_parts;

/* Read and validate every piece of the bnb checkpoint of weight `w` [rows, cols] from files[n_files]
 * (pointers in *p borrow the mapped files); errors name `path` and the tensor. */
int bt_bnb_read(bt_bnb_parts *p, struct bt_st_file *const *files, int n_files, const char *w,
                int64_t rows, int64_t cols, const char *path);
/* Dequantise *p into *out (fp32 [n], caller frees). */
int bt_bnb_dequant(const bt_bnb_parts *p, float **out, const char *w, const char *path);
/* 0 when *p can be taken as NF4 blocks as they are (else the reason, BT_ERR_UNSUPPORTED). */
int bt_bnb_direct_ok(const bt_bnb_parts *p, const char *w, const char *path);
/* Take *p's blocks into q [rows, cols] without re-quantising. */
int bt_bnb_to_nf4(bt_nf4 *q, const bt_bnb_parts *p, int64_t rows, int64_t cols, const char *w,
                  const char *path);

#endif
