/* Resumable training checkpoints. See checkpoint.h for the layout and the guarantees. */
#include "trainer/io/checkpoint.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/atomic_io.h"
#include "common/bt_common.h"
#include "common/out_dir.h"
#include "trainer/io/adapter.h"
#include "trainer/io/outputs.h"

#define CKPT_MAGIC BT_CKPT_MAGIC
#define CKPT_VERSION 2u /* 2: world size + every rank's loader state; 1 (one rank) still loads */
#define CKPT_V1_HEADER_BYTES (112u + BT_RESUME_STATE_BYTES)
#define CKPT_STATE "trainer_state.bin"

typedef struct {
    char magic[8];
    uint32_t version;
    uint32_t header_bytes;
    int64_t step;
    uint64_t model_fp;
    uint64_t data_fp;
    uint64_t seed;
    int64_t n_params;
    int32_t base_dtype, r;
    float alpha, dropout;
    uint32_t target_mask, trainable;
    int32_t seq_len, micro_batch, grad_accum, steps;
    int32_t n_layer, d_model, vocab, has_resume;
    uint8_t resume[BT_RESUME_STATE_BYTES]; /* rank 0's; ranks 1.. follow the header (v2) */
    int32_t world, reserved;               /* v2 only */
} ckpt_header;
_Static_assert(sizeof(ckpt_header) == CKPT_V1_HEADER_BYTES + 8, "ckpt_header has padding");

/* ---- fingerprints ---- */

static uint64_t h_i64(uint64_t h, int64_t v) { return bt_fnv1a64(h, &v, sizeof v); }
static uint64_t h_f32(uint64_t h, float v) { return bt_fnv1a64(h, &v, sizeof v); }
static uint64_t h_str(uint64_t h, const char *s) {
    h = h_i64(h, s ? (int64_t)strlen(s) : -1);
    return s ? bt_fnv1a64(h, s, strlen(s)) : h;
}

static uint64_t h_sample(uint64_t h, const float *w, int64_t rows, int64_t cols) {
    int64_t n = rows * cols;
    for (int64_t i = 0; i < n; i += 4093) h = h_f32(h, w[i]);
    if (rows > 0) h = bt_fnv1a64(h, w + (rows - 1) * cols, (size_t)cols * sizeof(float));
    return h;
}

uint64_t bt_model_fingerprint(const bt_model *m) {
    const bt_llama_hparams *hp = &m->hp;
    uint64_t h = BT_FNV64_INIT;
    int64_t iv[] = {hp->n_layer, hp->d_model, hp->n_head, hp->n_kv_head, hp->head_dim,
                    hp->d_ff, hp->vocab, m->base_dtype, m->tied};
    for (size_t i = 0; i < sizeof iv / sizeof iv[0]; i++) h = h_i64(h, iv[i]);
    h = h_f32(h, hp->rope_theta);
    h = h_f32(h, hp->rms_eps);
    h = h_f32(h, hp->rope_factor);
    /* the rotary frequency table covers every rope_scaling parameter (llama3 factors, GGUF
     * rope_freqs) in one place */
    h = h_i64(h, hp->rope_type);
    if (hp->rope_ext != BT_ROPE_EXT_NONE) { /* context scaling (and the job's extension) */
        h = h_i64(h, hp->rope_ext);
        h = h_f32(h, hp->rope_ext_factor);
        h = h_i64(h, hp->rope_ext_orig_ctx);
        h = h_f32(h, bt_model_attn_scale(hp));
    }
    if (m->inv_freq) h = bt_fnv1a64(h, m->inv_freq, (size_t)(hp->head_dim / 2) * sizeof(float));
    size_t D = (size_t)hp->d_model;
    if (m->output_norm) h = bt_fnv1a64(h, m->output_norm, D * sizeof(float));
    for (int l = 0; m->layers && l < hp->n_layer; l++) {
        if (m->layers[l].attn_norm) h = bt_fnv1a64(h, m->layers[l].attn_norm, D * sizeof(float));
        if (m->layers[l].ffn_norm) h = bt_fnv1a64(h, m->layers[l].ffn_norm, D * sizeof(float));
    }
    if (m->tok_embd) h = h_sample(h, m->tok_embd, hp->vocab, hp->d_model);
    if (!m->tied && m->lm_head) h = h_sample(h, m->lm_head, hp->vocab, hp->d_model);
    return h;
}

/* bytes [0, n) of a frozen buffer: a 32-byte window every 2048 bytes (1/64 of them) and the last
 * 256 bytes; every window when n < 2048 */
static uint64_t h_bytes_sample(uint64_t h, const void *p, size_t n) {
    const uint8_t *b = p;
    h = h_i64(h, (int64_t)n);
    if (!b) return h;
    for (size_t i = 0; i < n; i += 2048) h = bt_fnv1a64(h, b + i, n - i < 32 ? n - i : 32);
    return bt_fnv1a64(h, b + (n > 256 ? n - 256 : 0), n > 256 ? 256 : n);
}

static uint64_t h_linear(uint64_t h, const bt_base_linear *L) {
    int64_t iv[] = {L->rows, L->cols, L->is_nf4, L->is_gguf, L->is_gguf ? L->g.type : -1};
    for (size_t i = 0; i < sizeof iv / sizeof iv[0]; i++) h = h_i64(h, iv[i]);
    const size_t n = (size_t)L->rows * (size_t)L->cols;
    if (L->is_gguf) {
        h = h_bytes_sample(h, L->g.data, (size_t)L->g.rows * L->g.row_bytes);
    } else if (L->is_nf4) {
        h = h_bytes_sample(h, L->q.packed, (size_t)L->q.n / 2);
        h = h_bytes_sample(h, L->q.absmax_q, (size_t)L->q.n / BT_NF4_BLOCKSIZE);
        const size_t nb = (size_t)L->q.n / BT_NF4_BLOCKSIZE;
        h = h_bytes_sample(h, L->q.nested_absmax,
                           (nb + BT_NF4_NESTED_BLOCKSIZE - 1) / BT_NF4_NESTED_BLOCKSIZE * sizeof(float));
        h = h_f32(h, L->q.offset);
    } else {
        h = h_bytes_sample(h, L->w, n * sizeof(float));
    }
    if (L->bias) h = bt_fnv1a64(h, L->bias, (size_t)L->rows * sizeof(float));
    return h;
}

void bt_model_ref_id(const bt_model *m, char out[BT_MODEL_REF_ID_LEN + 1]) {
    uint64_t h = bt_model_fingerprint(m);
    const uint64_t h1 = h;
    const bt_llama_hparams *hp = &m->hp;
    h = h_i64(h, hp->qk_norm);
    for (int l = 0; m->layers && l < hp->n_layer; l++) {
        const bt_layer *L = &m->layers[l];
        if (L->q_norm) h = bt_fnv1a64(h, L->q_norm, (size_t)hp->head_dim * sizeof(float));
        if (L->k_norm) h = bt_fnv1a64(h, L->k_norm, (size_t)hp->head_dim * sizeof(float));
        for (int k = 0; k < BT_MOD_N; k++) h = h_linear(h, &L->lin[k]);
    }
    snprintf(out, BT_MODEL_REF_ID_LEN + 1, "btm1-%016llx%016llx", (unsigned long long)h1,
             (unsigned long long)h);
}

uint64_t bt_config_data_fingerprint(const bt_train_config *c) {
    uint64_t h = BT_FNV64_INIT;
    h = h_i64(h, c->data.n_shards);
    for (int i = 0; i < c->data.n_shards; i++) h = h_str(h, c->data.shards[i]);
    h = h_str(h, c->data.format);
    h = h_str(h, c->data.text_field);
    h = h_i64(h, c->data.seq_len);
    h = h_i64(h, c->data.micro_batch_size);
    h = h_i64(h, (int64_t)c->data.seed);
    /* preference / kto truncation decides which records are skipped (hashed only when set, so
     * that checkpoints written before these keys keep their fingerprint) */
    if (c->data.max_prompt_length || c->data.max_length) {
        h = h_i64(h, c->data.max_prompt_length);
        h = h_i64(h, c->data.max_length);
    }
    return h;
}

/* ---- files ---- */

/* fwrite + running checksum */
typedef struct {
    FILE *f;
    uint64_t h;
    int err;
} wsum;

static void w_put(wsum *w, const void *p, size_t n) {
    if (w->err) return;
    w->h = bt_fnv1a64(w->h, p, n);
    if (n && fwrite(p, 1, n, w->f) != n) w->err = errno ? errno : EIO;
}

static void fill_header(ckpt_header *H, const bt_train_config *cfg, const bt_model *m,
                        const bt_lora *lo, int64_t step, const uint8_t *resume, int world) {
    memset(H, 0, sizeof *H);
    memcpy(H->magic, CKPT_MAGIC, 8);
    H->version = CKPT_VERSION;
    H->header_bytes = (uint32_t)sizeof *H;
    H->step = step;
    H->model_fp = bt_model_fingerprint(m);
    H->data_fp = bt_config_data_fingerprint(cfg);
    H->seed = cfg->seed;
    H->n_params = lo->n_params;
    H->base_dtype = m->base_dtype;
    H->r = lo->r;
    H->alpha = lo->alpha;
    H->dropout = lo->dropout;
    H->target_mask = lo->target_mask;
    H->trainable = lo->trainable;
    H->seq_len = cfg->data.seq_len;
    H->micro_batch = cfg->data.micro_batch_size;
    H->grad_accum = cfg->grad_accum;
    H->steps = cfg->steps;
    H->n_layer = m->hp.n_layer;
    H->d_model = m->hp.d_model;
    H->vocab = m->hp.vocab;
    H->has_resume = resume != NULL;
    if (resume) memcpy(H->resume, resume, BT_RESUME_STATE_BYTES);
    H->world = world;
}

/* resume: NULL or world x BT_RESUME_STATE_BYTES (rank 0's is in the header) */
static int write_state(const char *path, const ckpt_header *H, const bt_lora *lo,
                       const uint8_t *resume) {
    /* no nan/inf ever reaches a checkpoint (issue 10 §4): the previous one stays in place */
    const float *arrs[3] = {lo->params, lo->m, lo->v};
    static const char *const names[3] = {"LoRA parameters", "AdamW first moments", "AdamW second moments"};
    for (int k = 0; k < 3; k++) {
        size_t at = 0;
        if (arrs[k] && !bt_all_finite_f32(arrs[k], (size_t)lo->n_params, &at))
            return bt_fail(BT_ERR_INVALID, "checkpoint: the %s hold a non-finite value (index %zu): refusing "
                           "to write %s", names[k], at, path);
    }
    FILE *f = fopen(path, "wb");
    if (!f) return bt_fail(BT_ERR_IO, "checkpoint: create %s: %s", path, strerror(errno));
    wsum w = {f, BT_FNV64_INIT, 0};
    size_t nb = (size_t)lo->n_params * sizeof(float);
    w_put(&w, H, sizeof *H);
    for (int r = 1; r < H->world; r++) {
        static const uint8_t zero[BT_RESUME_STATE_BYTES];
        w_put(&w, resume ? resume + (size_t)r * BT_RESUME_STATE_BYTES : zero, sizeof zero);
    }
    w_put(&w, lo->params, nb);
    w_put(&w, lo->m, nb);
    w_put(&w, lo->v, nb);
    uint64_t sum = w.h;
    if (!w.err && fwrite(&sum, sizeof sum, 1, f) != 1) w.err = errno ? errno : EIO;
    if (!w.err && (fflush(f) != 0 || fsync(fileno(f)) != 0)) w.err = errno ? errno : EIO;
    if (fclose(f) != 0 && !w.err) w.err = errno ? errno : EIO;
    if (w.err) return bt_fail(BT_ERR_IO, "checkpoint: write %s: %s", path, strerror(w.err));
    return 0;
}

static int write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    if (!f) return bt_fail(BT_ERR_IO, "checkpoint: create %s: %s", path, strerror(errno));
    size_t n = strlen(text);
    int bad = fwrite(text, 1, n, f) != n || fputc('\n', f) == EOF || fflush(f) != 0 ||
              fsync(fileno(f)) != 0;
    int e = errno;
    if (fclose(f) != 0 && !bad) {
        bad = 1;
        e = errno;
    }
    return bad ? bt_fail(BT_ERR_IO, "checkpoint: write %s: %s", path, strerror(e)) : 0;
}

int bt_checkpoint_save(const char *dir, const bt_train_config *cfg, const bt_model *m,
                       const bt_lora *lo, int64_t step, const uint8_t *resume_states,
                       int world) {
    if (world < 1 || world > BT_CKPT_MAX_WORLD)
        return bt_fail(BT_ERR_INVALID, "checkpoint: world size %d out of [1, %d]", world,
                       BT_CKPT_MAX_WORLD);
    size_t n = strlen(dir);
    while (n > 1 && dir[n - 1] == '/') n--;
    char *d = strndup(dir, n), *tmp = NULL, *p = NULL, *dump = NULL;
    if (!d) return bt_fail(BT_ERR_NOMEM, "checkpoint: out of memory");
    int rc = 0, lock = -1, made = 0; /* made: tmp is ours to remove on failure */
    if (asprintf(&tmp, "%s.tmp-%d", d, (int)getpid()) < 0) {
        tmp = NULL;
        rc = bt_fail(BT_ERR_NOMEM, "checkpoint: out of memory");
        goto out;
    }
    /* never replace a directory BarqTrain did not write (common/out_dir.h): refused before any
     * file is written (bt_replace_dir checks again) */
    if ((rc = bt_out_dir_check(d, &bt_out_checkpoint, "checkpoint"))) goto out;
    if (access(tmp, F_OK) == 0) { /* leftovers of a crashed save by a process with our pid */
        if (!bt_tmp_is_ours(tmp)) {
            rc = bt_fail(BT_ERR_IO, "checkpoint: %s exists and was not written by BarqTrain: refusing to "
                         "remove it", tmp);
            goto out;
        }
        bt_rm_tree(tmp);
    }
    /* the adapter files and the marker (creates tmp and the parents of d) */
    if ((rc = bt_adapter_save(lo, cfg->base_model_name_or_path, tmp, m))) {
        rc = bt_fail(rc, "checkpoint: %s", bt_last_error_in("checkpoint"));
        goto out;
    }
    made = 1;
    lock = bt_tmpdir_lock(tmp); /* "a save is writing this" (bt_clean_stale_temps) */
    if ((rc = bt_out_dir_mark(tmp, &bt_out_checkpoint, "checkpoint"))) goto out;
    ckpt_header H;
    fill_header(&H, cfg, m, lo, step, resume_states, world);
    if (asprintf(&p, "%s/" CKPT_STATE, tmp) < 0) {
        p = NULL;
        rc = bt_fail(BT_ERR_NOMEM, "checkpoint: out of memory");
        goto out;
    }
    if ((rc = write_state(p, &H, lo, resume_states))) goto out;
    free(p);
    p = NULL;
    dump = bt_config_dump(cfg);
    if (dump && asprintf(&p, "%s/config.json", tmp) >= 0) {
        if ((rc = write_text(p, dump))) goto out;
    } else {
        p = NULL;
    }
    bt_test_pause_point(tmp); /* tests SIGKILL the save here (bt_common.h) */
    if ((rc = bt_fsync_path(tmp, 1, "checkpoint")) ||
        (rc = bt_replace_dir(tmp, d, &bt_out_checkpoint, "checkpoint")))
        goto out;
    rc = bt_fsync_parent(d, "checkpoint"); /* make the rename durable */
out:
    if (rc && made) bt_rm_tree(tmp);
    if (lock >= 0) close(lock);
    free(dump);
    free(p);
    free(tmp);
    free(d);
    return rc;
}

/* ---- load ---- */

#define MISMATCH(field, fmt, a, b)                                                                 \
    bt_fail(BT_ERR_INVALID,                                                                        \
            "checkpoint %s does not match this job: %s: checkpoint " fmt ", config " fmt           \
            " (resume with the same settings, or start a fresh run)",                              \
            dir, field, a, b)

/* The identity fields of header H (checkpoint.h) against the running job; 0 or BT_ERR_INVALID naming
 * the first that differs. */
static int check_identity(const char *dir, const ckpt_header *hp, const bt_train_config *cfg, const bt_model *m,
                          const bt_lora *lo, int world, int rewrap) {
    const ckpt_header H = *hp;
    int rc = 0;
    uint64_t mfp = bt_model_fingerprint(m);
    if (H.n_layer != m->hp.n_layer || H.d_model != m->hp.d_model || H.vocab != m->hp.vocab) {
        rc = bt_fail(BT_ERR_INVALID, "checkpoint %s does not match this job: model: checkpoint "
                     "written for %d layers, d_model %d, vocab %d; %s has %d, %d, %d", dir,
                     H.n_layer, H.d_model, H.vocab, cfg->model, m->hp.n_layer, m->hp.d_model,
                     m->hp.vocab);
    } else if (H.base_dtype != m->base_dtype) {
        rc = MISMATCH("base_dtype", "%s", bt_base_dtype_name(H.base_dtype),
                      bt_base_dtype_name(m->base_dtype));
    } else if (H.model_fp != mfp) {
        rc = bt_fail(BT_ERR_INVALID, "checkpoint %s does not match this job: model: the base model "
                     "weights differ (fingerprint %016llx, %s has %016llx)", dir,
                     (unsigned long long)H.model_fp, cfg->model, (unsigned long long)mfp);
    } else if (H.r != lo->r) {
        rc = MISMATCH("lora.r", "%d", H.r, lo->r);
    } else if (H.alpha != lo->alpha) {
        rc = MISMATCH("lora.lora_alpha", "%g", (double)H.alpha, (double)lo->alpha);
    } else if (H.dropout != lo->dropout) {
        rc = MISMATCH("lora.lora_dropout", "%g", (double)H.dropout, (double)lo->dropout);
    } else if (H.target_mask != lo->target_mask) {
        rc = MISMATCH("lora.target_modules", "mask %#x", H.target_mask, lo->target_mask);
    } else if (H.trainable != lo->trainable) {
        rc = MISMATCH("trainable_modules", "mask %#x", H.trainable, lo->trainable);
    } else if (H.seq_len != cfg->data.seq_len) {
        rc = MISMATCH("data.seq_len", "%d", H.seq_len, cfg->data.seq_len);
    } else if (H.micro_batch != cfg->data.micro_batch_size) {
        rc = MISMATCH("data.micro_batch_size", "%d", H.micro_batch, cfg->data.micro_batch_size);
    } else if (H.world != world && H.has_resume && rewrap &&
               (int64_t)H.world * H.grad_accum != (int64_t)world * cfg->grad_accum) {
        /* another world size continues the same rows only with the same global batch */
        rc = bt_fail(BT_ERR_INVALID, "checkpoint %s does not match this job: global batch: checkpoint written "
                     "by %d rank(s) x grad_accum %d, this run has %d x %d (resume on another number of ranks "
                     "with world size x grad_accum = %lld)", dir, H.world, H.grad_accum, world, cfg->grad_accum,
                     (long long)H.world * H.grad_accum);
    } else if (H.grad_accum != cfg->grad_accum && !(rewrap && H.world != world && H.has_resume)) {
        rc = MISMATCH("grad_accum", "%d", H.grad_accum, cfg->grad_accum);
    } else if (H.data_fp != bt_config_data_fingerprint(cfg)) {
        rc = bt_fail(BT_ERR_INVALID, "checkpoint %s does not match this job: data: shards, format, "
                     "text_field, data.seed, max_prompt_length or max_length differ, so the saved loader position does not apply",
                     dir);
    } else if (H.seed != cfg->seed) {
        rc = MISMATCH("seed", "%llu", (unsigned long long)H.seed, (unsigned long long)cfg->seed);
    } else if (H.n_params != lo->n_params) {
        rc = MISMATCH("parameter count", "%lld", (long long)H.n_params, (long long)lo->n_params);
    } else if (H.world != world && H.has_resume && !rewrap) {
        /* every rank's loader stream depends on the world size (proto/batch.h resume state) */
        rc = bt_fail(BT_ERR_INVALID, "checkpoint %s does not match this job: world size: "
                     "checkpoint written by %d rank(s), this run has %d (resume with the same "
                     "number of processes)", dir, H.world, world);
    }
    return rc;
}

/* *limit = the size trainer_state.bin may have for this job: its header (v2; v1 is smaller), the
 * loader states of at most BT_CKPT_MAX_WORLD ranks, the job's parameters and moments, the checksum.
 * The header is read first (pread) so that a file past that size is refused with its identity
 * mismatch when there is one ("lora.r: checkpoint 64, config 8"), else by its size; 0 when the
 * file is within the limit (or too short for a header: the reader says "truncated"). */
static int size_limit(int fd, const char *dir, const bt_train_config *cfg, const bt_model *m, const bt_lora *lo,
                      int world, size_t *limit) {
    *limit = sizeof(ckpt_header) + (size_t)(BT_CKPT_MAX_WORLD - 1) * BT_RESUME_STATE_BYTES +
             (size_t)lo->n_params * 12 + 8;
    struct stat st;
    if (fstat(fd, &st) != 0) return bt_fail(BT_ERR_IO, "checkpoint %s: " CKPT_STATE ": %s", dir, strerror(errno));
    if (!S_ISREG(st.st_mode) || (uint64_t)st.st_size <= *limit) return 0; /* bt_read_fd says the rest */
    ckpt_header H;
    memset(&H, 0, sizeof H);
    int rc = 0;
    if (pread(fd, &H, CKPT_V1_HEADER_BYTES, 0) == (ssize_t)CKPT_V1_HEADER_BYTES &&
        !memcmp(H.magic, CKPT_MAGIC, 8)) {
        H.world = 1;
        if (H.version == CKPT_VERSION && pread(fd, &H, sizeof H, 0) != (ssize_t)sizeof H) H.world = 1;
        if (H.world < 1 || H.world > BT_CKPT_MAX_WORLD) H.world = 1;
        rc = check_identity(dir, &H, cfg, m, lo, world, 0);
    }
    if (!rc)
        rc = bt_fail(BT_ERR_FORMAT, "checkpoint %s: " CKPT_STATE " is %lld bytes, more than a checkpoint of this "
                     "job's %lld LoRA parameters can be (%zu bytes): not read", dir, (long long)st.st_size,
                     (long long)lo->n_params, *limit);
    return rc;
}

int bt_checkpoint_load(const char *dir, const bt_train_config *cfg, const bt_model *m,
                       bt_lora *lo, int64_t *step, uint8_t *resume_state, int *has_resume,
                       int *ckpt_steps, int rank, int world) {
    return bt_checkpoint_load_from(dir, cfg, m, lo, step, resume_state, has_resume, ckpt_steps, rank, world, NULL);
}

int bt_checkpoint_load_from(const char *dir, const bt_train_config *cfg, const bt_model *m,
                            bt_lora *lo, int64_t *step, uint8_t *resume_state, int *has_resume,
                            int *ckpt_steps, int rank, int world, int *resume_world) {
    if (resume_world) *resume_world = 0;
    if (world < 1 || rank < 0 || rank >= world)
        return bt_fail(BT_ERR_INVALID, "checkpoint: rank %d of world size %d", rank, world);
    char *path = NULL;
    if (asprintf(&path, "%s/" CKPT_STATE, dir) < 0)
        return bt_fail(BT_ERR_NOMEM, "checkpoint: out of memory");
    struct {
        char *data;
        size_t size;
    } mp = {NULL, 0}; /* read(2) into private memory: a file cut meanwhile is an error, never a SIGBUS */
    int fd = bt_open_ro(path), rc = 0;
    if (fd < 0) {
        rc = bt_fail(BT_ERR_IO, "checkpoint %s: cannot read %s: %s", dir, path, strerror(errno));
        free(path);
        return rc;
    }
    /* the largest file a checkpoint of this job can be, known before a byte is read: a file past it
     * (a 3 GiB sparse one, a checkpoint of a far larger LoRA) is never read whole (issue 21 §11) */
    size_t limit;
    if ((rc = size_limit(fd, dir, cfg, m, lo, world, &limit))) {
        close(fd);
        free(path);
        return rc;
    }
    rc = bt_read_fd(fd, path, limit, &mp.data, &mp.size);
    close(fd);
    if (rc) {
        rc = bt_fail(BT_ERR_IO, "checkpoint %s: cannot read %s: %s", dir, path, bt_last_error());
        free(path);
        return rc;
    }
    free(path);
    const uint8_t *b = (const uint8_t *)mp.data;
    ckpt_header H;
    if (mp.size < CKPT_V1_HEADER_BYTES + 8) {
        rc = bt_fail(BT_ERR_FORMAT, "checkpoint %s: " CKPT_STATE " is truncated (%zu bytes)", dir,
                     mp.size);
        goto out;
    }
    memset(&H, 0, sizeof H);
    memcpy(&H, b, CKPT_V1_HEADER_BYTES);
    if (memcmp(H.magic, CKPT_MAGIC, 8) != 0) {
        rc = bt_fail(BT_ERR_FORMAT, "checkpoint %s: " CKPT_STATE " is not a BarqTrain checkpoint "
                     "(bad magic)", dir);
        goto out;
    }
    if (!(H.version == 1 && H.header_bytes == CKPT_V1_HEADER_BYTES) &&
        !(H.version == CKPT_VERSION && H.header_bytes == sizeof H && mp.size >= sizeof H + 8)) {
        rc = bt_fail(BT_ERR_FORMAT, "checkpoint %s: unsupported version %u (header %u bytes); this "
                     "trainer reads version %u", dir, H.version, H.header_bytes, CKPT_VERSION);
        goto out;
    }
    uint64_t want;
    memcpy(&want, b + mp.size - 8, 8);
    if (bt_fnv1a64(BT_FNV64_INIT, b, mp.size - 8) != want) {
        rc = bt_fail(BT_ERR_FORMAT, "checkpoint %s: checksum mismatch: " CKPT_STATE " is corrupt "
                     "or truncated", dir);
        goto out;
    }
    if (H.version == 1) {
        H.world = 1;
    } else {
        memcpy(&H, b, sizeof H);
        if (H.world < 1 || H.world > BT_CKPT_MAX_WORLD) {
            rc = bt_fail(BT_ERR_FORMAT, "checkpoint %s: world size %d out of [1, %d]", dir,
                         H.world, BT_CKPT_MAX_WORLD);
            goto out;
        }
    }
    /* v2: the loader states of ranks 1 .. world-1 follow the header */
    size_t hb = H.header_bytes + (size_t)(H.world - 1) * BT_RESUME_STATE_BYTES;
    if (hb + 8 > mp.size || H.n_params < 0 || (uint64_t)H.n_params > (mp.size - hb - 8) / 12 ||
        hb + (size_t)H.n_params * 12 + 8 != mp.size || H.step < 0) {
        rc = bt_fail(BT_ERR_FORMAT, "checkpoint %s: size %zu does not match %lld parameters", dir,
                     mp.size, (long long)H.n_params);
        goto out;
    }
    if ((rc = check_identity(dir, &H, cfg, m, lo, world, resume_world != NULL))) goto out;
    size_t nb = (size_t)H.n_params * sizeof(float);
    const uint8_t *arr = b + hb;
    memcpy(lo->params, arr, nb);
    memcpy(lo->m, arr + nb, nb);
    memcpy(lo->v, arr + 2 * nb, nb);
    *step = H.step;
    *has_resume = H.has_resume != 0;
    if (rank == 0 || H.world != world) memcpy(resume_state, H.resume, BT_RESUME_STATE_BYTES);
    else memcpy(resume_state, b + H.header_bytes + (size_t)(rank - 1) * BT_RESUME_STATE_BYTES,
                BT_RESUME_STATE_BYTES);
    if (ckpt_steps) *ckpt_steps = H.steps;
    if (resume_world && H.world != world && H.has_resume) *resume_world = H.world; /* rank 0's state */
out:
    free(mp.data);
    return rc;
}
