/* Training checkpoints (trainer/io/checkpoint.h): exact round trip of parameters, AdamW moments,
 * step and loader resume state (plain LoRA and LoRA+), atomic replacement, and refusal of
 * corrupt (checksum, truncation, bad magic) and mismatched (model, lora r, seq_len, seed,
 * trainable modules) checkpoints with messages naming the field. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "trainer/io/adapter.h"
#include "trainer/io/checkpoint.h"
#include "trainer/config.h"
#include "trainer/model/lora.h"
#include "trainer/model/model.h"
#include "trainer/model/rng.h"
#include "tests/unit/util/test_util.h"

static const bt_llama_hparams k_hp = {
    .n_layer = 2, .d_model = 32, .n_head = 4, .n_kv_head = 2, .head_dim = 8, .d_ff = 64,
    .vocab = 97, .ctx = 64, .rope_theta = 10000.f, .rms_eps = 1e-5f};

static char g_dir[256];

static int setup(void **st) {
    (void)st;
    snprintf(g_dir, sizeof g_dir, "/tmp/bt-ckpt-test-%d", (int)getpid());
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    if (system(cmd) != 0) return -1;
    return mkdir(g_dir, 0755);
}

static int teardown(void **st) {
    (void)st;
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

static void config(bt_train_config *c, const char *extra) {
    char txt[1024];
    snprintf(txt, sizeof txt,
             "{\"model\": \"m.gguf\", \"data\": {\"shards\": [\"d/*.jsonl\"], \"seq_len\": 64,"
             " \"micro_batch_size\": 2}, \"lora\": {\"r\": 4, \"lora_alpha\": 8}, \"steps\": 10%s}",
             extra ? extra : "");
    assert_int_equal(bt_config_parse(c, txt, "t", NULL, 0), 0);
}

static unsigned trainable_of(const bt_train_config *c) {
    return ((c->trainable_mask & (1u << BT_TRAINABLE_EMBED)) ? BT_TRAIN_EMBED : 0) |
           ((c->trainable_mask & (1u << BT_TRAINABLE_NORM)) ? BT_TRAIN_NORM : 0);
}

static void lora_for(bt_lora *lo, const bt_model *m, const bt_train_config *c) {
    assert_int_equal(bt_lora_init(lo, m, c->lora.r, c->lora.alpha, c->lora.dropout,
                                     c->lora.target_mask, trainable_of(c), c->seed),
                     0);
}

/* Fill params / m / v with distinct values (as after some AdamW steps). */
static void scribble(bt_lora *lo, uint64_t seed) {
    bt_rng g;
    bt_rng_seed(&g, seed);
    for (int64_t i = 0; i < lo->n_params; i++) {
        lo->params[i] = bt_rng_normal(&g);
        lo->m[i] = 0.01f * bt_rng_normal(&g);
        lo->v[i] = 1e-4f * bt_rng_uniform(&g);
    }
}

static void path(char *buf, size_t n, const char *leaf) { snprintf(buf, n, "%s/%s", g_dir, leaf); }

static void roundtrip(const char *extra) {
    bt_train_config c;
    config(&c, extra);
    bt_model m;
    assert_int_equal(bt_model_init_random(&m, &k_hp, BT_BASE_FP32, 1, 42), 0);
    bt_lora a, b;
    lora_for(&a, &m, &c);
    lora_for(&b, &m, &c);
    scribble(&a, 5);
    uint8_t rs[BT_RESUME_STATE_BYTES], got[BT_RESUME_STATE_BYTES];
    for (unsigned i = 0; i < sizeof rs; i++) rs[i] = (uint8_t)(i * 7 + 3);
    char dir[300];
    path(dir, sizeof dir, "sub/ck"); /* parents are created */
    assert_int_equal(bt_checkpoint_save(dir, &c, &m, &a, 7, rs, 1), 0);
    /* saving again replaces it atomically and leaves no temporary directories behind */
    scribble(&a, 6);
    assert_int_equal(bt_checkpoint_save(dir, &c, &m, &a, 8, rs, 1), 0);
    char sub[300];
    path(sub, sizeof sub, "sub");
    DIR *d = opendir(sub);
    assert_non_null(d);
    int entries = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (e->d_name[0] != '.') {
            entries++;
            assert_string_equal(e->d_name, "ck");
        }
    closedir(d);
    assert_int_equal(entries, 1);
    char f[400];
    snprintf(f, sizeof f, "%s/adapter_model.safetensors", dir);
    assert_int_equal(access(f, R_OK), 0);
    snprintf(f, sizeof f, "%s/adapter_config.json", dir);
    assert_int_equal(access(f, R_OK), 0);

    int64_t step = -1;
    int has = 0, steps = 0;
    assert_int_equal(bt_checkpoint_load(dir, &c, &m, &b, &step, got, &has, &steps, 0, 1), 0);
    assert_int_equal(step, 8);
    assert_int_equal(has, 1);
    assert_int_equal(steps, 10);
    assert_memory_equal(got, rs, sizeof rs);
    size_t nb = (size_t)a.n_params * 4;
    assert_memory_equal(b.params, a.params, nb);
    assert_memory_equal(b.m, a.m, nb);
    assert_memory_equal(b.v, a.v, nb);
    if (a.embed) assert_memory_equal(b.embed, a.embed, (size_t)k_hp.vocab * k_hp.d_model * 4);
    /* no resume state (step 0) */
    assert_int_equal(bt_checkpoint_save(dir, &c, &m, &a, 0, NULL, 1), 0);
    assert_int_equal(bt_checkpoint_load(dir, &c, &m, &b, &step, got, &has, NULL, 0, 1), 0);
    assert_int_equal(has, 0);
    assert_int_equal(step, 0);
    bt_lora_free(&a);
    bt_lora_free(&b);
    bt_model_free(&m);
    bt_config_free(&c);
}

static void test_roundtrip(void **st) {
    (void)st;
    roundtrip(NULL);
}

static void test_roundtrip_lora_plus(void **st) {
    (void)st;
    roundtrip(", \"trainable_modules\": [\"embed_tokens\", \"norm\"]");
}

/* The default config, a random fp32 model (seed 42), a trained-looking LoRA `a` (scribbled with
 * `seed`) and a fresh one `b` to load into. */
static void two_loras(bt_train_config *c, bt_model *m, bt_lora *a, bt_lora *b, uint64_t seed) {
    config(c, NULL);
    assert_int_equal(bt_model_init_random(m, &k_hp, BT_BASE_FP32, 1, 42), 0);
    lora_for(a, m, c);
    lora_for(b, m, c);
    scribble(a, seed);
}

/* Non-finite state is never written (issue 10 §4): a checkpoint or adapter save of LoRA
 * parameters or AdamW moments holding nan/inf is refused, and the previous save stays whole
 * (no temporary directory is left either). */
static void test_nonfinite_never_saved(void **st) {
    (void)st;
    bt_train_config c;
    bt_model m;
    bt_lora a, b;
    two_loras(&c, &m, &a, &b, 9);
    char dir[300], ad[300], f[400];
    path(dir, sizeof dir, "nf/ck");
    path(ad, sizeof ad, "nf/adapter");
    uint8_t rs[BT_RESUME_STATE_BYTES] = {3};
    assert_int_equal(bt_checkpoint_save(dir, &c, &m, &a, 4, rs, 1), 0);
    assert_int_equal(bt_adapter_save(&a, "base", ad, NULL), 0);
    snprintf(f, sizeof f, "%s/adapter_model.safetensors", ad);
    size_t n0;
    uint8_t *before = tu_slurp(f, &n0);
    const char *what[3] = {"LoRA parameters", "AdamW first moments", "AdamW second moments"};
    float *arr[3] = {a.params, a.m, a.v};
    for (int k = 0; k < 3; k++) {
        float keep = arr[k][a.n_params / 2];
        arr[k][a.n_params / 2] = k == 1 ? INFINITY : NAN;
        assert_int_equal(bt_checkpoint_save(dir, &c, &m, &a, 5, rs, 1), BT_ERR_INVALID);
        /* parameters: the adapter files, written first, refuse them; moments: the state file */
        if ((k > 0 && !strstr(bt_last_error(), what[k])) || !strstr(bt_last_error(), "non-finite"))
            fail_msg("message: %s", bt_last_error());
        if (k == 0) { /* the adapter writer refuses it too */
            assert_int_equal(bt_adapter_save(&a, "base", ad, NULL), BT_ERR_INVALID);
            assert_non_null(strstr(bt_last_error(), "non-finite"));
        }
        arr[k][a.n_params / 2] = keep;
    }
    int64_t step = -1;
    int has = 0;
    uint8_t got[BT_RESUME_STATE_BYTES];
    assert_int_equal(bt_checkpoint_load(dir, &c, &m, &b, &step, got, &has, NULL, 0, 1), 0);
    assert_int_equal(step, 4); /* the previous checkpoint, whole */
    size_t n1;
    uint8_t *after = tu_slurp(f, &n1);
    assert_int_equal(n0, n1);
    assert_memory_equal(before, after, n0);
    free(before);
    free(after);
    char parent[300];
    path(parent, sizeof parent, "nf");
    DIR *d = opendir(parent);
    struct dirent *e;
    int entries = 0;
    while ((e = readdir(d)))
        if (e->d_name[0] != '.') entries++;
    closedir(d);
    assert_int_equal(entries, 2); /* ck and adapter: no temporaries */
    bt_lora_free(&a);
    bt_lora_free(&b);
    bt_model_free(&m);
    bt_config_free(&c);
}

/* Load must fail with `err` and a message containing `needle`, leaving `lo` untouched. */
static void expect_refused(const char *dir, const bt_train_config *c, const bt_model *m,
                           bt_lora *lo, int err, const char *needle) {
    float p0 = lo->params[0];
    int64_t step = 0;
    int has = 0;
    uint8_t rs[BT_RESUME_STATE_BYTES];
    int rc = bt_checkpoint_load(dir, c, m, lo, &step, rs, &has, NULL, 0, 1);
    if (rc != err || !strstr(bt_last_error(), needle))
        fail_msg("expected error %d containing \"%s\", got %d: %s", err, needle, rc, bt_last_error());
    assert_true(lo->params[0] == p0);
}

static void test_mismatch(void **st) {
    (void)st;
    bt_train_config c;
    config(&c, NULL);
    bt_model m, m2;
    assert_int_equal(bt_model_init_random(&m, &k_hp, BT_BASE_FP32, 1, 42), 0);
    assert_int_equal(bt_model_init_random(&m2, &k_hp, BT_BASE_FP32, 1, 43), 0);
    bt_lora a;
    lora_for(&a, &m, &c);
    scribble(&a, 1);
    char dir[300];
    path(dir, sizeof dir, "mm");
    uint8_t rs[BT_RESUME_STATE_BYTES] = {1};
    assert_int_equal(bt_checkpoint_save(dir, &c, &m, &a, 3, rs, 1), 0);

    /* a different base model (same shapes, other weights) */
    bt_lora b;
    lora_for(&b, &m2, &c);
    expect_refused(dir, &c, &m2, &b, BT_ERR_INVALID, "base model weights differ");
    bt_lora_free(&b);
    /* lora r */
    bt_train_config c2;
    {
        const char *rsets[] = {"lora.r=8", "lora.lora_alpha=8"}; /* a key given twice is refused */
        char base[512];
        snprintf(base, sizeof base, "{\"model\": \"m.gguf\", \"data\": {\"shards\": [\"d/*.jsonl\"], "
                 "\"seq_len\": 64, \"micro_batch_size\": 2}, \"lora\": {\"r\": 4, \"lora_alpha\": 8}, "
                 "\"steps\": 10}");
        assert_int_equal(bt_config_parse(&c2, base, "t", rsets, 2), 0);
    }
    lora_for(&b, &m, &c2);
    expect_refused(dir, &c2, &m, &b, BT_ERR_INVALID, "lora.r: checkpoint 4, config 8");
    bt_lora_free(&b);
    bt_config_free(&c2);
    /* seq_len */
    const char *sets[] = {"data.seq_len=128"};
    char txt[512];
    snprintf(txt, sizeof txt, "{\"model\": \"m.gguf\", \"data\": {\"shards\": [\"d/*.jsonl\"], "
             "\"seq_len\": 64, \"micro_batch_size\": 2}, \"lora\": {\"r\": 4, \"lora_alpha\": 8}, "
             "\"steps\": 10}");
    assert_int_equal(bt_config_parse(&c2, txt, "t", sets, 1), 0);
    lora_for(&b, &m, &c2);
    expect_refused(dir, &c2, &m, &b, BT_ERR_INVALID, "data.seq_len: checkpoint 64, config 128");
    bt_lora_free(&b);
    bt_config_free(&c2);
    /* trainer seed (the dropout stream) */
    config(&c2, ", \"seed\": 99");
    lora_for(&b, &m, &c2);
    expect_refused(dir, &c2, &m, &b, BT_ERR_INVALID, "seed: checkpoint 1234, config 99");
    bt_lora_free(&b);
    bt_config_free(&c2);
    /* trainable modules */
    config(&c2, ", \"trainable_modules\": [\"norm\"]");
    lora_for(&b, &m, &c2);
    expect_refused(dir, &c2, &m, &b, BT_ERR_INVALID, "trainable_modules");
    bt_lora_free(&b);
    bt_config_free(&c2);
    /* different shards: the saved loader position does not apply */
    config(&c2, NULL);
    free(c2.data.shards[0]);
    c2.data.shards[0] = bt_xstrdup("other/*.jsonl");
    lora_for(&b, &m, &c2);
    expect_refused(dir, &c2, &m, &b, BT_ERR_INVALID, "data: shards");
    bt_lora_free(&b);
    bt_config_free(&c2);
    /* the matching job still loads */
    lora_for(&b, &m, &c);
    int64_t step;
    int has;
    uint8_t got[BT_RESUME_STATE_BYTES];
    assert_int_equal(bt_checkpoint_load(dir, &c, &m, &b, &step, got, &has, NULL, 0, 1), 0);
    assert_int_equal(step, 3);
    bt_lora_free(&b);
    bt_lora_free(&a);
    bt_model_free(&m);
    bt_model_free(&m2);
    bt_config_free(&c);
}

static void rewrite(const char *file, long off, int xor_byte, long truncate_to) {
    FILE *f = fopen(file, "r+b");
    assert_non_null(f);
    if (xor_byte) {
        assert_int_equal(fseek(f, off, SEEK_SET), 0);
        int ch = fgetc(f);
        assert_int_equal(fseek(f, off, SEEK_SET), 0);
        fputc(ch ^ xor_byte, f);
    }
    fclose(f);
    if (truncate_to >= 0) assert_int_equal(truncate(file, truncate_to), 0);
}

static void test_corrupt(void **st) {
    (void)st;
    bt_train_config c;
    config(&c, NULL);
    bt_model m;
    assert_int_equal(bt_model_init_random(&m, &k_hp, BT_BASE_FP32, 1, 42), 0);
    bt_lora a;
    lora_for(&a, &m, &c);
    scribble(&a, 2);
    char dir[300], file[400];
    path(dir, sizeof dir, "bad");
    snprintf(file, sizeof file, "%s/trainer_state.bin", dir);
    struct stat sb;
    /* one flipped bit anywhere in the optimiser state */
    assert_int_equal(bt_checkpoint_save(dir, &c, &m, &a, 3, NULL, 1), 0);
    assert_int_equal(stat(file, &sb), 0);
    rewrite(file, (long)sb.st_size - 100, 0x01, -1);
    expect_refused(dir, &c, &m, &a, BT_ERR_FORMAT, "checksum mismatch");
    /* the checksum itself */
    assert_int_equal(bt_checkpoint_save(dir, &c, &m, &a, 3, NULL, 1), 0);
    rewrite(file, (long)sb.st_size - 1, 0x80, -1);
    expect_refused(dir, &c, &m, &a, BT_ERR_FORMAT, "checksum mismatch");
    /* a header field (the step) */
    assert_int_equal(bt_checkpoint_save(dir, &c, &m, &a, 3, NULL, 1), 0);
    rewrite(file, 16, 0x02, -1);
    expect_refused(dir, &c, &m, &a, BT_ERR_FORMAT, "checksum mismatch");
    /* truncated */
    assert_int_equal(bt_checkpoint_save(dir, &c, &m, &a, 3, NULL, 1), 0);
    rewrite(file, 0, 0, (long)sb.st_size / 2);
    expect_refused(dir, &c, &m, &a, BT_ERR_FORMAT, "checksum mismatch");
    rewrite(file, 0, 0, 10);
    expect_refused(dir, &c, &m, &a, BT_ERR_FORMAT, "truncated");
    /* not a checkpoint */
    assert_int_equal(bt_checkpoint_save(dir, &c, &m, &a, 3, NULL, 1), 0);
    rewrite(file, 0, 0x20, -1);
    expect_refused(dir, &c, &m, &a, BT_ERR_FORMAT, "bad magic");
    /* missing */
    char nodir[300];
    path(nodir, sizeof nodir, "absent");
    expect_refused(nodir, &c, &m, &a, BT_ERR_IO, "cannot read");
    bt_lora_free(&a);
    bt_model_free(&m);
    bt_config_free(&c);
}

/* The whole of `file` (malloc'd; *n = its size). */
static uint8_t *read_all(const char *file, size_t *n) {
    struct stat sb;
    assert_int_equal(stat(file, &sb), 0);
    *n = (size_t)sb.st_size;
    uint8_t *buf = malloc(*n);
    assert_non_null(buf);
    FILE *f = fopen(file, "rb");
    assert_non_null(f);
    assert_int_equal(fread(buf, 1, *n, f), *n);
    fclose(f);
    return buf;
}

/* Recompute the trailing FNV-1a checksum of buf[0..n) and write it as `file`. */
static void reseal_and_write(const char *file, uint8_t *buf, size_t n) {
    uint64_t h = bt_fnv1a64(BT_FNV64_INIT, buf, n - 8);
    memcpy(buf + n - 8, &h, 8);
    FILE *f = fopen(file, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(buf, 1, n, f), n);
    fclose(f);
}

/* Data-parallel checkpoints: every rank's loader state round-trips; a different world size is
 * refused when there is a loader position; version-1 files (one rank) still load. */
static void test_world(void **st) {
    (void)st;
    bt_train_config c;
    bt_model m;
    bt_lora a, b;
    two_loras(&c, &m, &a, &b, 11);
    enum { W = 3 };
    uint8_t rs[W * BT_RESUME_STATE_BYTES], got[BT_RESUME_STATE_BYTES];
    for (unsigned i = 0; i < sizeof rs; i++) rs[i] = (uint8_t)(i * 13 + i / 256);
    char dir[300], file[400];
    path(dir, sizeof dir, "world");
    snprintf(file, sizeof file, "%s/trainer_state.bin", dir);
    assert_int_equal(bt_checkpoint_save(dir, &c, &m, &a, 5, rs, W), 0);
    for (int r = 0; r < W; r++) {
        int64_t step = -1;
        int has = 0;
        memset(got, 0, sizeof got);
        assert_int_equal(bt_checkpoint_load(dir, &c, &m, &b, &step, got, &has, NULL, r, W), 0);
        assert_int_equal(step, 5);
        assert_int_equal(has, 1);
        assert_memory_equal(got, rs + (size_t)r * BT_RESUME_STATE_BYTES, sizeof got);
        assert_memory_equal(b.params, a.params, (size_t)a.n_params * 4);
        assert_memory_equal(b.v, a.v, (size_t)a.n_params * 4);
    }
    expect_refused(dir, &c, &m, &b, BT_ERR_INVALID, "written by 3 rank(s), this run has 1");
    int64_t step = 0;
    int has = 0;
    assert_int_equal(bt_checkpoint_load(dir, &c, &m, &b, &step, got, &has, NULL, 1, 2),
                     BT_ERR_INVALID);
    assert_non_null(strstr(bt_last_error(), "world size"));
    assert_int_equal(bt_checkpoint_load(dir, &c, &m, &b, &step, got, &has, NULL, 2, 2),
                     BT_ERR_INVALID); /* rank outside the world */
    /* another world size with the same global batch (issue 26): every rank gets rank 0's state and
     * the writing world size, for loaderd to continue at the same row; a different global batch is
     * refused naming it */
    {
        int rw = -1, ga = c.grad_accum;
        assert_int_equal(bt_checkpoint_load_from(dir, &c, &m, &b, &step, got, &has, NULL, 0, 1, &rw),
                         BT_ERR_INVALID);
        assert_non_null(strstr(bt_last_error(), "global batch: checkpoint written by 3 rank(s) x grad_accum"));
        c.grad_accum = 3 * ga;
        memset(got, 0, sizeof got);
        memset(b.params, 0, (size_t)b.n_params * 4);
        assert_int_equal(bt_checkpoint_load_from(dir, &c, &m, &b, &step, got, &has, NULL, 0, 1, &rw), 0);
        assert_int_equal(rw, 3);
        assert_int_equal(has, 1);
        assert_memory_equal(got, rs, sizeof got);
        assert_memory_equal(b.params, a.params, (size_t)a.n_params * 4);
        c.grad_accum = ga;
        assert_int_equal(bt_checkpoint_load_from(dir, &c, &m, &b, &step, got, &has, NULL, 2, 3, &rw), 0);
        assert_int_equal(rw, 0); /* the same world: rank 2's own state */
        assert_memory_equal(got, rs + 2 * BT_RESUME_STATE_BYTES, sizeof got);
    }
    assert_int_equal(bt_checkpoint_save(dir, &c, &m, &a, 5, rs, 0), BT_ERR_INVALID);
    /* a lying world field (checksum fixed up) is refused, not read past the end */
    {
        size_t n;
        uint8_t *buf = read_all(file, &n);
        int32_t w = 1000;
        memcpy(buf + 368, &w, 4); /* the v2 world field follows the v1 header */
        reseal_and_write(file, buf, n);
        free(buf);
    }
    expect_refused(dir, &c, &m, &b, BT_ERR_FORMAT, "does not match");
    /* step 0 (no loader position) loads with any world size */
    assert_int_equal(bt_checkpoint_save(dir, &c, &m, &a, 0, NULL, W), 0);
    assert_int_equal(bt_checkpoint_load(dir, &c, &m, &b, &step, got, &has, NULL, 0, 1), 0);
    assert_int_equal(has, 0);
    /* version 1 (header without the world field, checksum over the old layout) */
    assert_int_equal(bt_checkpoint_save(dir, &c, &m, &a, 4, rs, 1), 0);
    {
        size_t n;
        uint8_t *buf = read_all(file, &n);
        size_t v1 = n - 8;
        uint8_t *old = malloc(v1);
        assert_non_null(old);
        uint32_t ver = 1, hb = 368;
        memcpy(old, buf, 368);
        memcpy(old + 8, &ver, 4);
        memcpy(old + 12, &hb, 4);
        memcpy(old + 368, buf + 376, n - 376 - 8);
        reseal_and_write(file, old, v1);
        free(buf);
        free(old);
    }
    memset(b.params, 0, (size_t)b.n_params * 4);
    assert_int_equal(bt_checkpoint_load(dir, &c, &m, &b, &step, got, &has, NULL, 0, 1), 0);
    assert_int_equal(step, 4);
    assert_int_equal(has, 1);
    assert_memory_equal(got, rs, sizeof got);
    assert_memory_equal(b.params, a.params, (size_t)a.n_params * 4);
    expect_refused(dir, &c, &m, &b, 0, ""); /* sanity of the helper: loads again */
    bt_lora_free(&a);
    bt_lora_free(&b);
    bt_model_free(&m);
    bt_config_free(&c);
}

static void test_fingerprints(void **st) {
    (void)st;
    bt_model m, m2;
    assert_int_equal(bt_model_init_random(&m, &k_hp, BT_BASE_FP32, 1, 42), 0);
    assert_int_equal(bt_model_init_random(&m2, &k_hp, BT_BASE_FP32, 1, 42), 0);
    assert_true(bt_model_fingerprint(&m) == bt_model_fingerprint(&m2));
    m2.layers[1].ffn_norm[3] += 1e-3f;
    assert_true(bt_model_fingerprint(&m) != bt_model_fingerprint(&m2));
    m2.layers[1].ffn_norm[3] -= 1e-3f;
    m2.tok_embd[(size_t)(k_hp.vocab - 1) * k_hp.d_model] += 1.f; /* last row is hashed whole */
    assert_true(bt_model_fingerprint(&m) != bt_model_fingerprint(&m2));
    bt_train_config a, b;
    config(&a, NULL);
    config(&b, NULL);
    assert_true(bt_config_data_fingerprint(&a) == bt_config_data_fingerprint(&b));
    b.data.seed = 9;
    assert_true(bt_config_data_fingerprint(&a) != bt_config_data_fingerprint(&b));
    bt_config_free(&a);
    bt_config_free(&b);
    bt_model_free(&m);
    bt_model_free(&m2);
}

static long peak_rss_kib(void) {
    struct rusage ru;
    assert_int_equal(getrusage(RUSAGE_SELF, &ru), 0);
    return ru.ru_maxrss;
}

/* trainer_state.bin's size is checked before it is read (issue 21 §11): a 3 GiB sparse file is
 * refused by its size without costing its size in memory; one that is too large for this job but
 * whose header is another job's says which setting differs. */
static void test_state_size_checked_before_reading(void **st) {
    (void)st;
    bt_train_config c;
    config(&c, NULL);
    bt_model m;
    assert_int_equal(bt_model_init_random(&m, &k_hp, BT_BASE_FP32, 1, 42), 0);
    bt_lora a;
    lora_for(&a, &m, &c);
    scribble(&a, 4);
    char dir[300], file[400];
    path(dir, sizeof dir, "huge");
    snprintf(file, sizeof file, "%s/trainer_state.bin", dir);
    assert_int_equal(bt_checkpoint_save(dir, &c, &m, &a, 3, NULL, 1), 0);
    assert_int_equal(truncate(file, (off_t)3 << 30), 0);
    long rss0 = peak_rss_kib();
    expect_refused(dir, &c, &m, &a, BT_ERR_FORMAT, "is 3221225472 bytes, more than a checkpoint of this job's");
    assert_true(peak_rss_kib() - rss0 < 64 * 1024); /* not read: well under its 3 GiB */
    /* another job's (larger) checkpoint, grown past this job's limit: named by its identity */
    bt_train_config c64;
    config(&c64, ", \"seed\": 1234");
    c64.lora.r = 64;
    bt_lora b;
    lora_for(&b, &m, &c64);
    assert_int_equal(bt_checkpoint_save(dir, &c64, &m, &b, 3, NULL, 1), 0);
    assert_int_equal(truncate(file, (off_t)1 << 30), 0);
    expect_refused(dir, &c, &m, &a, BT_ERR_INVALID, "lora.r: checkpoint 64, config 4");
    bt_lora_free(&b);
    bt_config_free(&c64);
    bt_lora_free(&a);
    bt_model_free(&m);
    bt_config_free(&c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip), cmocka_unit_test(test_roundtrip_lora_plus),
        cmocka_unit_test(test_mismatch),  cmocka_unit_test(test_corrupt), cmocka_unit_test(test_nonfinite_never_saved),
        cmocka_unit_test(test_fingerprints), cmocka_unit_test(test_world),
        cmocka_unit_test(test_state_size_checked_before_reading),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
