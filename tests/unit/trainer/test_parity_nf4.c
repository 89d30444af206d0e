/* NF4 + double quantisation against bitsandbytes 0.48.2 (tests/fixtures/hf/nf4/nf4_dq.safetensors,
 * from tests/reference/gen_hf_fixtures.py; bnb checkpoint layout QuantState.as_dict(packed=True)):
 * bt_nf4_quantize reproduces the packed bytes, absmax codes, nested absmax and offset exactly;
 * the dequantisation equals bnb's dequantize_4bit; bt_nf4_from_bnb loads the checkpoint layout
 * into the same bt_nf4 without re-quantising and refuses variants the kernels cannot decode;
 * and a Hugging Face model directory holding a bnb 4-bit linear loads it byte for byte (NF4
 * base) or dequantises it exactly (fp32 base), with or without double quantisation. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <ftw.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/safetensors.h"
#include "kernels/kernels.h"
#include "trainer/model/model.h"

static const char *const k_cases[] = {"rand_64x128", "rand_96x576", "tiny_gate_proj_l1"};
#define N_CASES 3

static const char *fixdir(void) {
    const char *d = getenv("BT_HF_FIXTURES");
    return d && *d ? d : "tests/fixtures/hf";
}

static bt_st_file *open_nf4(char *path, size_t n) {
    snprintf(path, n, "%s/nf4/nf4_dq.safetensors", fixdir());
    bt_st_file *f = NULL;
    if (bt_st_open(&f, path)) fail_msg("%s", bt_last_error());
    return f;
}

static const bt_st_tensor *need(const bt_st_file *f, const char *c, const char *suffix) {
    char name[256];
    snprintf(name, sizeof name, "%s%s", c, suffix);
    const bt_st_tensor *t = bt_st_find(f, name);
    if (!t) fail_msg("fixture tensor %s missing", name);
    return t;
}

static double max_abs(const float *a, int64_t n) {
    double d = 0;
    for (int64_t i = 0; i < n; i++) d = fmax(d, fabs((double)a[i]));
    return d;
}

static void nf4_equal(const bt_nf4 *a, const bt_nf4 *b) {
    assert_int_equal(a->n, b->n);
    assert_int_equal(a->rows, b->rows);
    assert_int_equal(a->cols, b->cols);
    assert_memory_equal(a->packed, b->packed, (size_t)a->n / 2);
    assert_memory_equal(a->absmax_q, b->absmax_q, (size_t)a->n / 64);
    assert_memory_equal(a->nested_absmax, b->nested_absmax, (size_t)(a->n / 64 + 255) / 256 * 4);
    assert_memory_equal(&a->offset, &b->offset, 4);
}

/* ---- quantiser and dequantiser vs bnb ---- */

static void test_quantize_parity(void **st) {
    (void)st;
    char path[512];
    bt_st_file *f = open_nf4(path, sizeof path);
    for (int c = 0; c < N_CASES; c++) {
        const char *cs = k_cases[c];
        const bt_st_tensor *in = need(f, cs, ".input");
        assert_int_equal(in->n_dims, 2);
        int64_t rows = in->shape[0], cols = in->shape[1], n = rows * cols, nb = n / 64;
        int64_t nn = (nb + 255) / 256;
        float *W = malloc((size_t)n * 4);
        memcpy(W, in->data, (size_t)n * 4);
        bt_nf4 q;
        assert_int_equal(bt_nf4_quantize(&q, W, rows, cols), 0);
        const bt_st_tensor *pk = need(f, cs, ".weight"), *am = need(f, cs, ".weight.absmax");
        const bt_st_tensor *na = need(f, cs, ".weight.nested_absmax"), *of = need(f, cs, ".offset");
        assert_int_equal(pk->nbytes, n / 2);
        assert_int_equal(am->nbytes, nb);
        assert_int_equal(na->nbytes, nn * 4);
        int64_t bad_p = 0, bad_a = 0;
        for (int64_t i = 0; i < n / 2; i++) bad_p += q.packed[i] != ((const uint8_t *)pk->data)[i];
        for (int64_t i = 0; i < nb; i++) bad_a += q.absmax_q[i] != ((const uint8_t *)am->data)[i];
        int nested_eq = memcmp(q.nested_absmax, na->data, (size_t)nn * 4) == 0;
        int off_eq = memcmp(&q.offset, of->data, 4) == 0;
        /* the quant_state JSON carries the same offset */
        const bt_st_tensor *js = need(f, cs, ".weight.quant_state.bitsandbytes__nf4");
        json_error_t je;
        json_t *j = json_loadb(js->data, js->nbytes, 0, &je);
        assert_non_null(j);
        float joff = (float)json_number_value(json_object_get(j, "nested_offset"));
        json_decref(j);
        assert_memory_equal(&joff, of->data, 4);

        float *deq = malloc((size_t)n * 4);
        bt_nf4_dequantize_rows(&q, 0, rows, deq);
        const bt_st_tensor *rd = need(f, cs, ".dequant");
        double e = 0;
        for (int64_t i = 0; i < n; i++)
            e = fmax(e, fabs((double)deq[i] - ((const float *)rd->data)[i]));
        double rel = e / max_abs(rd->data, n);
        print_message("parity: nf4 %s [%lld x %lld]: packed bytes differing %lld/%lld, absmax codes "
                      "%lld/%lld, nested_absmax %s, offset %s (%.9g), dequant max abs err %.3g "
                      "(%.3g of max)\n", cs, (long long)rows, (long long)cols, (long long)bad_p,
                      (long long)(n / 2), (long long)bad_a, (long long)nb,
                      nested_eq ? "identical" : "DIFFERENT", off_eq ? "identical" : "DIFFERENT",
                      q.offset, e, rel);
        assert_int_equal(bad_p, 0);
        assert_int_equal(bad_a, 0);
        assert_true(nested_eq && off_eq);
        assert_true(rel <= 1e-6);
        /* the fixture's maps are the tables our kernels decode with */
        const bt_st_tensor *qm = need(f, cs, ".weight.quant_map");
        const bt_st_tensor *nm = need(f, cs, ".weight.nested_quant_map");
        assert_memory_equal(qm->data, bt_nf4_code, 64);
        for (int i = 0; i < 256; i++) {
            float v;
            memcpy(&v, (const uint8_t *)nm->data + 4 * i, 4);
            assert_true(v == bt_dynamic_code8(i));
        }
        free(deq);
        free(W);
        bt_nf4_free(&q);
    }
    bt_st_close(f);
}

/* ---- the checkpoint layout ---- */

static void test_from_bnb(void **st) {
    (void)st;
    char path[512];
    bt_st_file *f = open_nf4(path, sizeof path);
    for (int c = 0; c < N_CASES; c++) {
        const char *cs = k_cases[c];
        const bt_st_tensor *in = need(f, cs, ".input");
        int64_t rows = in->shape[0], cols = in->shape[1];
        char w[256];
        snprintf(w, sizeof w, "%s.weight", cs);
        bt_nf4 loaded, ours;
        if (bt_nf4_from_bnb(&loaded, &f, 1, w, rows, cols, path)) fail_msg("%s", bt_last_error());
        assert_int_equal(bt_nf4_quantize(&ours, in->data, rows, cols), 0);
        nf4_equal(&loaded, &ours);
        /* the wrong logical shape is refused, naming the tensor */
        bt_nf4 bad;
        assert_int_equal(bt_nf4_from_bnb(&bad, &f, 1, w, cols, rows, path), BT_ERR_FORMAT);
        assert_non_null(strstr(bt_last_error(), cs));
        assert_null(bad.packed);
        bt_nf4_free(&loaded);
        bt_nf4_free(&ours);
    }
    bt_nf4 q;
    assert_int_equal(bt_nf4_from_bnb(&q, &f, 1, "nope.weight", 64, 128, path), BT_ERR_NOTFOUND);
    assert_non_null(strstr(bt_last_error(), "nope.weight"));
    bt_st_close(f);
}

/* Write the tiny case under name `w` into writer `wr`, with tampering. */
typedef struct {
    int qmap_idx;        /* >= 0: change quant_map[idx] */
    int nmap_idx;        /* >= 0: change nested_quant_map[idx] */
    float nmap_val;
    int no_dq;           /* absmax as F32 (dequantised), no nested tensors */
    int fp4_key;         /* quant_state under bitsandbytes__fp4 */
    const char *json;    /* replacement quant_state JSON text */
    int skip_absmax;
    int short_weight;
} tamper;

static void put_bnb(bt_st_writer *wr, const bt_st_file *f, const char *w, const tamper *t) {
    const char *cs = "tiny_gate_proj_l1";
    const bt_st_tensor *pk = need(f, cs, ".weight"), *am = need(f, cs, ".weight.absmax");
    const bt_st_tensor *na = need(f, cs, ".weight.nested_absmax");
    const bt_st_tensor *qm = need(f, cs, ".weight.quant_map");
    const bt_st_tensor *nm = need(f, cs, ".weight.nested_quant_map");
    const bt_st_tensor *js = need(f, cs, ".weight.quant_state.bitsandbytes__nf4");
    char name[320];
    int64_t sh[2] = {(int64_t)pk->nbytes - (t->short_weight ? 2 : 0), 1};
    assert_int_equal(bt_st_w_tensor(wr, w, BT_ST_U8, 2, sh, pk->data, (size_t)sh[0]), 0);
    float qmap[16], nmap[256];
    memcpy(qmap, qm->data, sizeof qmap);
    memcpy(nmap, nm->data, sizeof nmap);
    if (t->qmap_idx >= 0) qmap[t->qmap_idx] += 0.01f;
    if (t->nmap_idx >= 0) nmap[t->nmap_idx] = t->nmap_val;
    int64_t s16 = 16, s256 = 256, snb = (int64_t)am->nbytes, sna = (int64_t)na->nbytes / 4;
    snprintf(name, sizeof name, "%s.quant_map", w);
    assert_int_equal(bt_st_w_tensor(wr, name, BT_ST_F32, 1, &s16, qmap, 64), 0);
    json_error_t je;
    json_t *j = json_loadb(js->data, js->nbytes, 0, &je);
    assert_non_null(j);
    if (t->no_dq) {
        float off = (float)json_number_value(json_object_get(j, "nested_offset"));
        float *a = malloc((size_t)snb * 4);
        for (int64_t b = 0; b < snb; b++) {
            float n0;
            memcpy(&n0, (const uint8_t *)na->data + 4 * (b / 256), 4);
            a[b] = bt_dynamic_code8(((const uint8_t *)am->data)[b]) * n0 + off;
        }
        snprintf(name, sizeof name, "%s.absmax", w);
        if (!t->skip_absmax)
            assert_int_equal(bt_st_w_tensor(wr, name, BT_ST_F32, 1, &snb, a, (size_t)snb * 4), 0);
        free(a);
        json_object_del(j, "nested_blocksize");
        json_object_del(j, "nested_offset");
        json_object_del(j, "nested_dtype");
    } else {
        snprintf(name, sizeof name, "%s.absmax", w);
        if (!t->skip_absmax)
            assert_int_equal(bt_st_w_tensor(wr, name, BT_ST_U8, 1, &snb, am->data, (size_t)snb), 0);
        snprintf(name, sizeof name, "%s.nested_absmax", w);
        assert_int_equal(bt_st_w_tensor(wr, name, BT_ST_F32, 1, &sna, na->data, na->nbytes), 0);
        snprintf(name, sizeof name, "%s.nested_quant_map", w);
        assert_int_equal(bt_st_w_tensor(wr, name, BT_ST_F32, 1, &s256, nmap, 1024), 0);
    }
    if (t->fp4_key) json_object_set_new(j, "quant_type", json_string("fp4"));
    char *text = t->json ? strdup(t->json) : json_dumps(j, JSON_COMPACT);
    json_decref(j);
    snprintf(name, sizeof name, "%s.quant_state.bitsandbytes__%s", w, t->fp4_key ? "fp4" : "nf4");
    int64_t sj = (int64_t)strlen(text);
    assert_int_equal(bt_st_w_tensor(wr, name, BT_ST_U8, 1, &sj, text, (size_t)sj), 0);
    free(text);
}

static int try_tamper(const tamper *t, const char *tmp) {
    char path[512];
    bt_st_file *f = open_nf4(path, sizeof path);
    bt_st_writer *wr = bt_st_writer_new();
    put_bnb(wr, f, "x.weight", t);
    assert_int_equal(bt_st_writer_write(wr, tmp), 0);
    bt_st_writer_free(wr);
    bt_st_close(f);
    bt_st_file *g = NULL;
    assert_int_equal(bt_st_open(&g, tmp), 0);
    bt_nf4 q;
    int rc = bt_nf4_from_bnb(&q, &g, 1, "x.weight", 128, 64, tmp);
    bt_nf4_free(&q);
    bt_st_close(g);
    return rc;
}

static tamper none(void) {
    tamper t = {.qmap_idx = -1, .nmap_idx = -1};
    return t;
}

static void test_bnb_refusals(void **st) {
    (void)st;
    char tmp[] = "/tmp/bt_bnb_XXXXXX.safetensors";
    int fd = mkstemps(tmp, 12);
    assert_true(fd >= 0);
    close(fd);
    tamper t = none();
    assert_int_equal(try_tamper(&t, tmp), 0); /* the untouched copy loads */
    t = none();
    t.qmap_idx = 3;
    assert_int_equal(try_tamper(&t, tmp), BT_ERR_UNSUPPORTED);
    assert_non_null(strstr(bt_last_error(), "x.weight.quant_map[3]"));
    t = none();
    t.nmap_idx = 0, t.nmap_val = -1.0f; /* bnb CPU's overwrite of code[0]: unused here, accepted */
    assert_int_equal(try_tamper(&t, tmp), 0);
    t = none();
    t.nmap_idx = 10, t.nmap_val = 0.5f;
    assert_int_equal(try_tamper(&t, tmp), BT_ERR_UNSUPPORTED);
    assert_non_null(strstr(bt_last_error(), "nested_quant_map[10]"));
    t = none();
    t.no_dq = 1;
    assert_int_equal(try_tamper(&t, tmp), BT_ERR_UNSUPPORTED);
    assert_non_null(strstr(bt_last_error(), "double quantisation"));
    t = none();
    t.fp4_key = 1;
    assert_int_equal(try_tamper(&t, tmp), BT_ERR_UNSUPPORTED);
    assert_non_null(strstr(bt_last_error(), "fp4"));
    t = none();
    t.skip_absmax = 1;
    assert_int_equal(try_tamper(&t, tmp), BT_ERR_NOTFOUND);
    assert_non_null(strstr(bt_last_error(), "x.weight.absmax"));
    t = none();
    t.short_weight = 1;
    assert_int_equal(try_tamper(&t, tmp), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "x.weight"));
    t = none();
    t.json = "{\"quant_type\": \"nf4\", \"blocksize\": 64, \"shape\": [64, 128], "
             "\"nested_blocksize\": 256, \"nested_offset\": 0.33}";
    assert_int_equal(try_tamper(&t, tmp), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "shape"));
    t = none();
    t.json = "{\"quant_type\": \"nf4\", \"blocksize\": 64, \"shape\": [128, 64], "
             "\"nested_blocksize\": 256}";
    assert_int_equal(try_tamper(&t, tmp), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "nested_offset"));
    t = none();
    t.json = "{\"quant_type\": \"nf4\", \"blocksize\": 128, \"shape\": [128, 64], "
             "\"nested_blocksize\": 256, \"nested_offset\": 0.33}";
    assert_int_equal(try_tamper(&t, tmp), BT_ERR_FORMAT); /* absmax count no longer matches */
    t = none();
    t.json = "not json";
    assert_int_equal(try_tamper(&t, tmp), BT_ERR_FORMAT);
    assert_non_null(strstr(bt_last_error(), "quant_state"));
    unlink(tmp);
}

/* ---- a model directory with a bnb linear ---- */

static int rm_cb(const char *p, const struct stat *s, int flag, struct FTW *ftw) {
    (void)s, (void)flag, (void)ftw;
    return remove(p);
}

/* <tmpdir>/config.json = the tied fixture's; model.safetensors = its tensors (F32), with
 * model.layers.1.mlp.gate_proj.weight replaced by the bnb case tiny_gate_proj_l1 (which is that
 * very matrix, quantised by bnb). */
static void make_bnb_dir(char *dir, const tamper *t) {
    strcpy(dir, "/tmp/bt_bnbdir_XXXXXX");
    assert_non_null(mkdtemp(dir));
    char src[512], dst[600];
    snprintf(src, sizeof src, "%s/tiny-llama-tied/config.json", fixdir());
    snprintf(dst, sizeof dst, "%s/config.json", dir);
    json_error_t je;
    json_t *cfg = json_load_file(src, 0, &je);
    assert_non_null(cfg);
    assert_int_equal(json_dump_file(cfg, dst, JSON_INDENT(2)), 0);
    json_decref(cfg);
    bt_st_writer *wr = bt_st_writer_new();
    for (int s = 1; s <= 3; s++) {
        snprintf(src, sizeof src, "%s/tiny-llama-tied/model-0000%d-of-00003.safetensors", fixdir(),
                 s);
        bt_st_file *f = NULL;
        assert_int_equal(bt_st_open(&f, src), 0);
        for (int i = 0; i < bt_st_n_tensors(f); i++) {
            const bt_st_tensor *x = bt_st_tensor_at(f, i);
            if (!strcmp(x->name, "model.layers.1.mlp.gate_proj.weight")) continue;
            assert_int_equal(bt_st_w_tensor(wr, x->name, x->dtype, x->n_dims, x->shape, x->data,
                                            x->nbytes),
                             0);
        }
        bt_st_close(f);
    }
    char path[512];
    bt_st_file *nf = open_nf4(path, sizeof path);
    put_bnb(wr, nf, "model.layers.1.mlp.gate_proj.weight", t);
    bt_st_close(nf);
    snprintf(dst, sizeof dst, "%s/model.safetensors", dir);
    assert_int_equal(bt_st_writer_write(wr, dst), 0);
    bt_st_writer_free(wr);
}

static void test_model_dir(void **st) {
    (void)st;
    char path[512];
    bt_st_file *f = open_nf4(path, sizeof path);
    const bt_st_tensor *in = need(f, "tiny_gate_proj_l1", ".input");
    const float *deq_ref = need(f, "tiny_gate_proj_l1", ".dequant")->data;
    bt_nf4 ours;
    assert_int_equal(bt_nf4_quantize(&ours, in->data, 128, 64), 0);
    float *deq = malloc(128 * 64 * 4);
    for (int dq = 1; dq >= 0; dq--) {
        tamper t = none();
        t.no_dq = !dq;
        char dir[64];
        make_bnb_dir(dir, &t);
        bt_model m;
        bt_model_load_opts nf4 = {BT_BASE_NF4, 0}, fp = {BT_BASE_FP32, 0};
        /* NF4 base: with double quantisation the bytes are taken as they are; without, the exact
         * dequantisation is re-quantised (close to, not equal to, bnb's) */
        bt_log_set_level(BT_LOG_ERROR); /* the re-quantisation warning is expected */
        if (bt_model_load(&m, dir, &nf4)) fail_msg("%s", bt_last_error());
        bt_log_set_level(BT_LOG_INFO);
        const bt_base_linear *g = &m.layers[1].lin[BT_MOD_GATE];
        assert_true(g->is_nf4);
        assert_null(g->w);
        if (dq) {
            nf4_equal(&g->q, &ours);
        } else {
            bt_nf4_dequantize_rows(&g->q, 0, 128, deq);
            double e = 0;
            for (int i = 0; i < 128 * 64; i++) e = fmax(e, fabs((double)deq[i] - deq_ref[i]));
            print_message("parity: nf4 model dir without double quantisation, NF4 base: "
                          "re-quantised, max abs err vs bnb dequant %.3g (max %.3g)\n", e,
                          max_abs(deq_ref, 128 * 64));
            assert_true(e <= 0.05 * max_abs(deq_ref, 128 * 64));
        }
        bt_model_free(&m);
        /* fp32 base: exact dequantisation (bnb's formula with the stored maps) */
        if (bt_model_load(&m, dir, &fp)) fail_msg("%s", bt_last_error());
        g = &m.layers[1].lin[BT_MOD_GATE];
        assert_false(g->is_nf4);
        double e = 0;
        for (int i = 0; i < 128 * 64; i++) e = fmax(e, fabs((double)g->w[i] - deq_ref[i]));
        print_message("parity: nf4 model dir (%s double quantisation): fp32 base dequant max abs "
                      "err %.3g\n", dq ? "with" : "without", e);
        assert_true(e <= 1e-6 * max_abs(deq_ref, 128 * 64));
        /* the other linears are the plain F32 tensors */
        assert_false(m.layers[0].lin[BT_MOD_GATE].is_nf4);
        bt_model_free(&m);
        nftw(dir, rm_cb, 8, FTW_DEPTH | FTW_PHYS);
    }
    free(deq);
    bt_nf4_free(&ours);
    bt_st_close(f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_quantize_parity),
        cmocka_unit_test(test_from_bnb),
        cmocka_unit_test(test_bnb_refusals),
        cmocka_unit_test(test_model_dir),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
