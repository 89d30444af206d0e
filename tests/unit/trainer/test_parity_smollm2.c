/* Logit and greedy-decoding parity of the inference forward (trainer/infer/infer.c) with Hugging Face
 * transformers 4.46.3 on SmolLM2-135M-Instruct loaded from the Q4_1 GGUF ($BT_MODEL, fp32 base).
 * Fixtures (tests/reference/gen_hf_fixtures.py, README "SmolLM2-135M-Instruct from the GGUF"):
 * tests/fixtures/hf/smollm2/smollm2_ref.safetensors, per prompt p{i}: ids [P+32] (prompt + HF's
 * greedy 32 new tokens), top8_ids/top8_logits [P+32, 8] and logsumexp [P+32] of one full
 * forward; prompts.json: the chat messages, prompt_len, first_eos_in_new.
 * Checks, for all three prompts:
 *   - the messages rendered by bt_gen_chat_prompt equal the fixture's prompt ids;
 *   - one full forward (LOGITS_ALL): at every position the logits at the reference top-8 ids and
 *     our own sorted top-8 values are within 1e-3 (max abs) of the reference values, the top-1 id
 *     is the reference's wherever the reference top1-top2 gap exceeds 2e-3, logsumexp within 1e-3;
 *   - greedy decoding with the KV cache (prefill + 32 single-token steps) reproduces the 32
 *     reference tokens exactly (EOS does not stop it), and with EOS as a stop id it stops right
 *     after the first <|im_end|> (first_eos_in_new).
 * Measured errors are printed. Run from the repository root. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/safetensors.h"
#include "common/tokenizer.h"
#include "trainer/infer/generate.h"
#include "trainer/infer/infer.h"
#include "trainer/model/model.h"

#define FIX "tests/fixtures/hf/smollm2/"
#define N_PROMPTS 3
#define N_NEW 32

static bt_model g_m;
static bt_tokenizer *g_tok;
static bt_st_file *g_ref;
static json_t *g_prompts;

static const char *model_path(void) {
    const char *p = getenv("BT_MODEL");
    return p && *p ? p : "models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

static int setup(void **state) {
    (void)state;
    double t0 = bt_now();
    bt_model_load_opts o = {BT_BASE_FP32, 0};
    if (access(model_path(), R_OK) != 0) {
        fprintf(stderr, "%s not readable (run `make model`)\n", model_path());
        return -1;
    }
    if (bt_model_load_gguf(&g_m, model_path(), &o) || bt_tokenizer_load(&g_tok, model_path()) ||
        bt_st_open(&g_ref, FIX "smollm2_ref.safetensors")) {
        fprintf(stderr, "setup: %s\n", bt_last_error());
        return -1;
    }
    json_error_t e;
    if (!(g_prompts = json_load_file(FIX "prompts.json", 0, &e))) {
        fprintf(stderr, "prompts.json: %s (line %d)\n", e.text, e.line);
        return -1;
    }
    fprintf(stderr, "# model + tokenizer loaded in %.2f s\n", bt_now() - t0);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    bt_model_free(&g_m);
    bt_tokenizer_free(g_tok);
    bt_st_close(g_ref);
    json_decref(g_prompts);
    return 0;
}

static const void *ref_tensor(int p, const char *name, bt_st_dtype dt, int64_t d0, int64_t d1) {
    char key[64];
    snprintf(key, sizeof key, "p%d.%s", p, name);
    const bt_st_tensor *t = bt_st_find(g_ref, key);
    if (!t) fail_msg("fixture tensor %s missing", key);
    assert_int_equal(t->dtype, dt);
    assert_int_equal(t->shape[0], d0);
    if (d1) assert_int_equal(t->shape[1], d1);
    return t->data;
}

static int cmp_desc(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

static double logsumexp(const float *x, int V) {
    float mx = x[bt_argmax(x, V)];
    double s = 0;
    for (int i = 0; i < V; i++) s += exp((double)x[i] - mx);
    return mx + log(s);
}

/* Render the fixture's messages and compare with its prompt ids. */
static void check_prompt_ids(json_t *jp, const int32_t *ids, int P) {
    json_t *msgs = json_object_get(jp, "messages");
    size_t n = json_array_size(msgs);
    assert_true(n >= 1 && n <= 8);
    bt_chat_msg cm[8];
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(msgs, i);
        const char *c = json_string_value(json_object_get(m, "content"));
        cm[i] = (bt_chat_msg){json_string_value(json_object_get(m, "role")), c, strlen(c)};
    }
    bt_ids out = {0};
    assert_int_equal(bt_gen_chat_prompt(g_tok, cm, (int)n, &out), 0);
    assert_int_equal((int)out.n, P);
    assert_memory_equal(out.v, ids, (size_t)P * sizeof(int32_t));
    bt_ids_free(&out);
}

static void test_prompt(int p) {
    json_t *jp = json_array_get(json_object_get(g_prompts, "prompts"), (size_t)p);
    assert_non_null(jp);
    const int P = (int)json_integer_value(json_object_get(jp, "prompt_len"));
    const int first_eos = (int)json_integer_value(json_object_get(jp, "first_eos_in_new"));
    assert_int_equal((int)json_integer_value(json_object_get(jp, "n_new")), N_NEW);
    const int N = P + N_NEW, V = g_m.hp.vocab;
    const int32_t *ids = ref_tensor(p, "ids", BT_ST_I32, N, 0);
    const int32_t *top8_ids = ref_tensor(p, "top8_ids", BT_ST_I32, N, 8);
    const float *top8 = ref_tensor(p, "top8_logits", BT_ST_F32, N, 8);
    const float *lse_ref = ref_tensor(p, "logsumexp", BT_ST_F32, N, 0);
    check_prompt_ids(jp, ids, P);

    /* 1. one full forward over prompt + reference continuation */
    double t0 = bt_now();
    bt_infer *s;
    assert_int_equal(bt_infer_new(&s, &g_m, NULL, N, N), 0);
    float *logits = malloc((size_t)N * V * sizeof(float)), *row = malloc((size_t)V * sizeof(float));
    assert_non_null(logits);
    assert_non_null(row);
    assert_int_equal(bt_infer_forward(s, ids, N, BT_INFER_LOGITS_ALL, logits), 0);
    double t_fwd = bt_now() - t0;
    double e_at_ids = 0, e_sorted = 0, e_lse = 0;
    int top1_same = 0, top1_required = 0;
    for (int t = 0; t < N; t++) {
        const float *lg = logits + (size_t)t * V;
        for (int k = 0; k < 8; k++) {
            int32_t id = top8_ids[t * 8 + k];
            assert_true(id >= 0 && id < V);
            e_at_ids = fmax(e_at_ids, fabs((double)lg[id] - top8[t * 8 + k]));
        }
        memcpy(row, lg, (size_t)V * sizeof(float));
        /* our top 8 by partial selection: sort a copy (V is small enough for a test) */
        qsort(row, (size_t)V, sizeof(float), cmp_desc);
        for (int k = 0; k < 8; k++) e_sorted = fmax(e_sorted, fabs((double)row[k] - top8[t * 8 + k]));
        e_lse = fmax(e_lse, fabs(logsumexp(lg, V) - lse_ref[t]));
        int same = bt_argmax(lg, V) == top8_ids[t * 8];
        top1_same += same;
        if (top8[t * 8] - top8[t * 8 + 1] > 2e-3f) {
            top1_required++;
            if (!same) fail_msg("p%d position %d: top-1 %d, reference %d (gap %g)", p, t,
                                bt_argmax(lg, V), top8_ids[t * 8], (double)(top8[t * 8] - top8[t * 8 + 1]));
        }
    }
    fprintf(stderr, "# p%d: %d positions, forward %.2f s: max|err| top8 at ref ids %.3g, sorted "
            "top8 %.3g, logsumexp %.3g; top-1 equal at %d/%d (required %d)\n", p, N, t_fwd,
            e_at_ids, e_sorted, e_lse, top1_same, N, top1_required);
    assert_true(e_at_ids <= 1e-3);
    assert_true(e_sorted <= 1e-3);
    assert_true(e_lse <= 1e-3);

    /* 2. greedy decoding with the KV cache reproduces HF's 32 tokens (EOS does not stop it) */
    t0 = bt_now();
    bt_gen_opts go = {N_NEW, 0.f, 1.f, 0, NULL, 0};
    bt_ids out = {0};
    int n_new = 0;
    assert_int_equal(bt_generate(s, ids, P, &go, NULL, NULL, &out, &n_new), 0);
    double t_gen = bt_now() - t0;
    assert_int_equal(n_new, N_NEW);
    assert_int_equal((int)out.n, N_NEW);
    int first_diff = -1;
    for (int j = 0; j < N_NEW && first_diff < 0; j++)
        if (out.v[j] != ids[P + j]) first_diff = j;
    fprintf(stderr, "# p%d: greedy %d tokens in %.2f s, %s\n", p, N_NEW, t_gen,
            first_diff < 0 ? "identical" : "DIFFERENT");
    if (first_diff >= 0)
        fail_msg("p%d: greedy token %d is %d, reference %d", p, first_diff, out.v[first_diff],
                 ids[P + first_diff]);

    /* 3. with EOS as a stop id: the prefix up to and including the first <|im_end|> */
    if (p == 0) {
        int32_t eos = bt_tokenizer_eos(g_tok);
        assert_int_equal(eos, 2);
        assert_int_equal(ids[P + first_eos], eos);
        bt_gen_opts gs = {N_NEW, 0.f, 1.f, 0, &eos, 1};
        out.n = 0;
        assert_int_equal(bt_generate(s, ids, P, &gs, NULL, NULL, &out, &n_new), 0);
        assert_int_equal(n_new, first_eos + 1);
        assert_memory_equal(out.v, ids + P, (size_t)n_new * sizeof(int32_t));
        char *txt;
        size_t len;
        assert_int_equal(bt_detokenize(g_tok, out.v, out.n - 1, 0, &txt, &len), 0);
        fprintf(stderr, "# p0 answer: \"%s\"\n", txt);
        assert_string_equal(txt, "The capital of France is Paris.");
        free(txt);
    }
    bt_ids_free(&out);
    free(row);
    free(logits);
    bt_infer_free(s);
}

static void test_p0(void **st) { (void)st; test_prompt(0); }
static void test_p1(void **st) { (void)st; test_prompt(1); }
static void test_p2(void **st) { (void)st; test_prompt(2); }

int main(void) {
    const struct CMUnitTest tests[N_PROMPTS] = {
        cmocka_unit_test(test_p0),
        cmocka_unit_test(test_p1),
        cmocka_unit_test(test_p2),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
