/* Tests of the preference / kto formats (loaderd/format.h ld_format_pref_render / _fit, issue 25 §1)
 * with the real SmolLM2 tokenizer (env BT_MODEL, ChatML template). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "common/bt_common.h"
#include "common/tokenizer.h"
#include "loaderd/format.h"
#include "tests/unit/util/test_util.h"

static bt_tokenizer *g_tok;

static int setup(void **state) {
    (void)state;
    return tu_load_tokenizer(&g_tok);
}

static int teardown(void **state) {
    (void)state;
    bt_tokenizer_free(g_tok);
    return 0;
}

static ld_format_cfg cfg_of(ld_format f) {
    ld_format_cfg c = {f, NULL, g_tok, 0, LD_TPL_CHATML, 0, 0, 0, 0};
    return c;
}

/* Render a line; a sentinel token in front must survive success and failure. */
static int render(const ld_format_cfg *c, const char *line, bt_ids *ids, bt_ids *mask, ld_pref_rec *rec,
                  int *reason) {
    ids->n = mask->n = 0;
    bt_ids_push(ids, 42);
    bt_ids_push(mask, 0);
    int rc = ld_format_pref_render(c, line, strlen(line), ids, mask, rec, reason);
    assert_int_equal(ids->n, mask->n);
    assert_int_equal(ids->v[0], 42);
    return rc;
}

/* The "chat" format's rendering of a messages array (the reference the preference sides must match). */
static void chat_ref(const char *messages_json, bt_ids *ids, bt_ids *mask) {
    char line[2048];
    snprintf(line, sizeof line, "{\"messages\":%s}", messages_json);
    ld_format_cfg c = cfg_of(LD_FMT_CHAT);
    int tr, reason;
    ids->n = mask->n = 0;
    if (ld_format_line(&c, line, strlen(line), ids, mask, &tr, &reason) != 0)
        fail_msg("chat reference %s: %s", line, bt_last_error());
}

static void ids_extend(bt_ids *a, const int32_t *v, size_t n) {
    for (size_t i = 0; i < n; i++) bt_ids_push(a, v[i]);
}

/* The text of the loss tokens of doc ids/mask[from, from+n). */
static char *loss_text(const bt_ids *ids, const bt_ids *mask, size_t from, size_t n) {
    bt_ids t = {0};
    for (size_t i = from; i < from + n; i++)
        if (mask->v[i]) bt_ids_push(&t, ids->v[i]);
    char *s;
    size_t len;
    assert_int_equal(bt_detokenize(g_tok, t.v, t.n, 1, &s, &len), BT_OK);
    bt_ids_free(&t);
    return s;
}

static void test_text_pair(void **state) {
    (void)state;
    ld_format_cfg c = cfg_of(LD_FMT_PREFERENCE);
    bt_ids ids = {0}, mask = {0}, ri = {0}, rm = {0};
    ld_pref_rec rec;
    int reason;
    assert_int_equal(render(&c, "{\"prompt\":\"What is 2+2?\",\"chosen\":\"It is 4.\",\"rejected\":\"It is 5, surely.\"}",
                            &ids, &mask, &rec, &reason), 0);
    assert_int_equal(rec.n_docs, 2);
    assert_int_equal(rec.label, -1);
    assert_int_equal(rec.truncated, 0);
    assert_int_equal(1 + rec.len[0] + rec.len[1], ids.n);
    /* chosen == the chat rendering of [user, assistant], tokens and loss mask */
    chat_ref("[{\"role\":\"user\",\"content\":\"What is 2+2?\"},{\"role\":\"assistant\",\"content\":\"It is 4.\"}]", &ri, &rm);
    assert_int_equal(rec.len[0], ri.n);
    assert_memory_equal(ids.v + 1, ri.v, ri.n * sizeof *ri.v);
    assert_memory_equal(mask.v + 1, rm.v, rm.n * sizeof *rm.v);
    chat_ref("[{\"role\":\"user\",\"content\":\"What is 2+2?\"},{\"role\":\"assistant\",\"content\":\"It is 5, surely.\"}]", &ri, &rm);
    assert_int_equal(rec.len[1], ri.n);
    assert_memory_equal(ids.v + 1 + rec.len[0], ri.v, ri.n * sizeof *ri.v);
    assert_memory_equal(mask.v + 1 + rec.len[0], rm.v, rm.n * sizeof *rm.v);
    /* the shared prompt: same tokens in both, no loss, ends with the assistant header */
    assert_memory_equal(ids.v + 1, ids.v + 1 + rec.len[0], rec.prompt_len * sizeof *ids.v);
    for (uint32_t i = 0; i < rec.prompt_len; i++) {
        assert_int_equal(mask.v[1 + i], 0);
        assert_int_equal(mask.v[1 + rec.len[0] + i], 0);
    }
    char *hdr;
    size_t hl;
    assert_int_equal(bt_detokenize(g_tok, ids.v + 1, rec.prompt_len, 1, &hdr, &hl), BT_OK);
    assert_non_null(strstr(hdr, "What is 2+2?<|im_end|>\n<|im_start|>assistant\n"));
    assert_int_equal(strcmp(hdr + hl - strlen("<|im_start|>assistant\n"), "<|im_start|>assistant\n"), 0);
    free(hdr);
    char *a = loss_text(&ids, &mask, 1, rec.len[0]), *b = loss_text(&ids, &mask, 1 + rec.len[0], rec.len[1]);
    assert_string_equal(a, "It is 4.<|im_end|>");
    assert_string_equal(b, "It is 5, surely.<|im_end|>");
    free(a), free(b);
    bt_ids_free(&ids), bt_ids_free(&mask), bt_ids_free(&ri), bt_ids_free(&rm);
}

/* TRL's conversational form: an assistant turn inside the prompt carries no loss. */
static void test_conversational(void **state) {
    (void)state;
    ld_format_cfg c = cfg_of(LD_FMT_PREFERENCE);
    bt_ids ids = {0}, mask = {0}, ri = {0}, rm = {0};
    ld_pref_rec rec;
    int reason;
    const char *prompt = "[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"Hi\"},"
                         "{\"role\":\"assistant\",\"content\":\"Hello!\"},{\"role\":\"user\",\"content\":\"Capital of France?\"}]";
    char line[1024];
    snprintf(line, sizeof line, "{\"prompt\":%s,\"chosen\":[{\"role\":\"assistant\",\"content\":\"Paris.\"}],"
             "\"rejected\":[{\"role\":\"assistant\",\"content\":\"Lyon.\"}]}", prompt);
    assert_int_equal(render(&c, line, &ids, &mask, &rec, &reason), 0);
    assert_int_equal(rec.n_docs, 2);
    chat_ref("[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"Hi\"},"
             "{\"role\":\"assistant\",\"content\":\"Hello!\"},{\"role\":\"user\",\"content\":\"Capital of France?\"},"
             "{\"role\":\"assistant\",\"content\":\"Paris.\"}]", &ri, &rm);
    assert_int_equal(rec.len[0], ri.n);
    assert_memory_equal(ids.v + 1, ri.v, ri.n * sizeof *ri.v);
    int chat_prompt_loss = 0;
    for (uint32_t i = 0; i < rec.prompt_len; i++) {
        assert_int_equal(mask.v[1 + i], 0);
        chat_prompt_loss += rm.v[i];
    }
    assert_true(chat_prompt_loss > 0); /* "chat" trains on "Hello!"; the preference prompt does not */
    for (size_t i = rec.prompt_len; i < ri.n; i++) assert_int_equal(mask.v[1 + i], rm.v[i]);
    char *a = loss_text(&ids, &mask, 1, rec.len[0]), *b = loss_text(&ids, &mask, 1 + rec.len[0], rec.len[1]);
    assert_string_equal(a, "Paris.<|im_end|>");
    assert_string_equal(b, "Lyon.<|im_end|>");
    free(a), free(b);
    bt_ids_free(&ids), bt_ids_free(&mask), bt_ids_free(&ri), bt_ids_free(&rm);
}

static void test_kto(void **state) {
    (void)state;
    ld_format_cfg c = cfg_of(LD_FMT_KTO);
    bt_ids ids = {0}, mask = {0};
    ld_pref_rec rec;
    int reason;
    assert_int_equal(render(&c, "{\"prompt\":\"Name a colour.\",\"completion\":\"Blue.\",\"label\":true}", &ids, &mask,
                            &rec, &reason), 0);
    assert_int_equal(rec.n_docs, 1);
    assert_int_equal(rec.label, 1);
    assert_int_equal(1 + rec.len[0], ids.n);
    char *a = loss_text(&ids, &mask, 1, rec.len[0]);
    assert_string_equal(a, "Blue.<|im_end|>");
    free(a);
    assert_int_equal(render(&c, "{\"prompt\":\"Name a colour.\",\"completion\":\"Seven.\",\"label\":false}", &ids,
                            &mask, &rec, &reason), 0);
    assert_int_equal(rec.label, 0);
    bt_ids_free(&ids), bt_ids_free(&mask);
}

static void test_bad_records(void **state) {
    (void)state;
    struct {
        ld_format f;
        const char *line;
        int reason;
        const char *msg; /* a piece of the description */
    } cases[] = {
        {LD_FMT_PREFERENCE, "{\"prompt\":\"p\",\"chosen\":\"a\"}", LD_BAD_FIELD, "missing \"rejected\""},
        {LD_FMT_PREFERENCE, "{\"chosen\":\"a\",\"rejected\":\"b\"}", LD_BAD_FIELD, "missing \"prompt\""},
        {LD_FMT_PREFERENCE, "{\"prompt\":\"p\",\"chosen\":\"\",\"rejected\":\"b\"}", LD_BAD_EMPTY, "\"chosen\" is empty"},
        {LD_FMT_PREFERENCE, "{\"prompt\":\"p\",\"chosen\":\"a\",\"rejected\":[]}", LD_BAD_EMPTY, "\"rejected\" is empty"},
        {LD_FMT_PREFERENCE, "{\"prompt\":\"\",\"chosen\":\"a\",\"rejected\":\"b\"}", LD_BAD_EMPTY, "\"prompt\" is empty"},
        {LD_FMT_PREFERENCE, "{\"prompt\":\"p\",\"chosen\":\"same\",\"rejected\":\"same\"}", LD_BAD_FIELD, "identical"},
        {LD_FMT_PREFERENCE, "{\"prompt\":\"p\",\"chosen\":[{\"role\":\"assistant\",\"content\":\"x\"}],"
                            "\"rejected\":[{\"role\":\"assistant\",\"content\":\"x\"}]}", LD_BAD_FIELD, "identical"},
        {LD_FMT_PREFERENCE, "{\"prompt\":\"p\",\"chosen\":5,\"rejected\":\"b\"}", LD_BAD_FIELD, "got integer"},
        {LD_FMT_PREFERENCE, "{\"prompt\":{},\"chosen\":\"a\",\"rejected\":\"b\"}", LD_BAD_FIELD, "got object"},
        {LD_FMT_PREFERENCE, "{\"prompt\":\"p\",\"chosen\":[{\"content\":\"a\"}],\"rejected\":\"b\"}", LD_BAD_FIELD,
         "\"chosen\"[0].role: missing"},
        {LD_FMT_PREFERENCE, "{\"prompt\":\"p\",\"chosen\":[\"a\"],\"rejected\":\"b\"}", LD_BAD_FIELD, "expected object"},
        {LD_FMT_PREFERENCE, "{\"prompt\":[{\"role\":\"user\",\"content\":7}],\"chosen\":\"a\",\"rejected\":\"b\"}",
         LD_BAD_FIELD, "\"prompt\"[0].content"},
        {LD_FMT_PREFERENCE, "{\"prompt\":\"p\",\"chosen\":[{\"role\":\"assistant\",\"content\":\"\"}],\"rejected\":\"b\"}",
         LD_BAD_EMPTY, "no assistant message with content"},
        {LD_FMT_PREFERENCE, "{\"prompt\":\"p\",\"chosen\":\"a\",\"rejected\":\"b\"", LD_BAD_JSON, "column"},
        {LD_FMT_PREFERENCE, "[1]", LD_BAD_JSON, "expected an object"},
        {LD_FMT_PREFERENCE, "{\"prompt\":\"\xff\",\"chosen\":\"a\",\"rejected\":\"b\"}", LD_BAD_UTF8, "UTF-8"},
        {LD_FMT_KTO, "{\"prompt\":\"p\",\"completion\":\"a\",\"label\":\"yes\"}", LD_BAD_FIELD, "expected true or false"},
        {LD_FMT_KTO, "{\"prompt\":\"p\",\"completion\":\"a\",\"label\":1}", LD_BAD_FIELD, "got integer"},
        {LD_FMT_KTO, "{\"prompt\":\"p\",\"completion\":\"a\"}", LD_BAD_FIELD, "missing \"label\""},
        {LD_FMT_KTO, "{\"prompt\":\"p\",\"completion\":\"\",\"label\":true}", LD_BAD_EMPTY, "\"completion\" is empty"},
        {LD_FMT_KTO, "{\"prompt\":\"p\",\"chosen\":\"a\",\"label\":true}", LD_BAD_FIELD, "missing \"completion\""},
    };
    bt_ids ids = {0}, mask = {0};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ld_format_cfg c = cfg_of(cases[i].f);
        ld_pref_rec rec;
        int reason = -1;
        int rc = render(&c, cases[i].line, &ids, &mask, &rec, &reason);
        const char *msg = bt_last_error();
        if (rc != 1 || reason != cases[i].reason || !strstr(msg, cases[i].msg))
            fail_msg("case %zu %s: rc %d reason %d (want %d) msg \"%s\" (want \"%s\")", i, cases[i].line, rc, reason,
                     cases[i].reason, msg, cases[i].msg);
        assert_int_equal(ids.n, 1); /* untouched */
        assert_int_equal(rec.n_docs, 0);
    }
    /* another format through this entry point is a caller error, not a bad line */
    ld_format_cfg c = cfg_of(LD_FMT_CHAT);
    ld_pref_rec rec;
    int reason;
    assert_int_equal(render(&c, "{}", &ids, &mask, &rec, &reason), BT_ERR_INVALID);
    bt_ids_free(&ids), bt_ids_free(&mask);
}

/* TRL tokenize_row truncation: the prompt keeps its END, the responses their START; the pair
 * stays whole and must fit one row. */
static void test_truncation(void **state) {
    (void)state;
    const char *line = "{\"prompt\":\"one two three four five six seven eight nine ten eleven twelve thirteen fourteen\","
                       "\"chosen\":\"alpha beta gamma delta epsilon zeta eta theta\",\"rejected\":\"omega psi\"}";
    ld_format_cfg c = cfg_of(LD_FMT_PREFERENCE);
    bt_ids ids = {0}, mask = {0}, oi = {0}, om = {0};
    ld_pref_rec rec, orig;
    int reason;
    assert_int_equal(render(&c, line, &ids, &mask, &orig, &reason), 0);
    ids_extend(&oi, ids.v, ids.n);
    ids_extend(&om, mask.v, mask.n);
    uint32_t P = orig.prompt_len, Lc = orig.len[0] - P, Lr = orig.len[1] - P;
    assert_true(P > 12 && Lc > Lr && Lc >= 8);

    /* fits max_length: untouched */
    rec = orig;
    c.max_length = P + Lc;
    c.max_prompt_length = 4;
    assert_int_equal(ld_format_pref_fit(&c, &ids, &mask, 1, &rec, &reason), 0);
    assert_int_equal(rec.truncated, 0);
    assert_int_equal(ids.n, oi.n);

    /* prompt cut from the left only */
    c.max_length = 8 + Lc;
    c.max_prompt_length = 8;
    rec = orig;
    assert_int_equal(ld_format_pref_fit(&c, &ids, &mask, 1, &rec, &reason), 0);
    assert_int_equal(rec.truncated, 1);
    assert_int_equal(rec.prompt_len, 8);
    assert_int_equal(rec.len[0], 8 + Lc);
    assert_int_equal(rec.len[1], 8 + Lr);
    assert_int_equal(ids.n, 1 + rec.len[0] + rec.len[1]);
    assert_memory_equal(ids.v + 1, oi.v + 1 + P - 8, (8 + Lc) * sizeof *ids.v);                 /* chosen */
    assert_memory_equal(ids.v + 1 + rec.len[0], oi.v + 1 + orig.len[0] + P - 8, (8 + Lr) * sizeof *ids.v); /* rejected */
    assert_memory_equal(mask.v + 1, om.v + 1 + P - 8, (8 + Lc) * sizeof *mask.v);

    /* prompt and responses: responses keep max_length - max_prompt_length tokens */
    ids.n = mask.n = 0;
    ids_extend(&ids, oi.v, oi.n);
    ids_extend(&mask, om.v, om.n);
    c.max_length = 8 + 3;
    rec = orig;
    assert_int_equal(ld_format_pref_fit(&c, &ids, &mask, 1, &rec, &reason), 0);
    assert_int_equal(rec.prompt_len, 8);
    assert_int_equal(rec.len[0], 8 + 3);
    assert_int_equal(rec.len[1], 8 + (Lr < 3 ? Lr : 3));
    assert_memory_equal(ids.v + 1 + 8, oi.v + 1 + P, 3 * sizeof *ids.v); /* the response's start */

    /* the pair must fit one row, never split: overlong, record removed */
    ids.n = mask.n = 0;
    ids_extend(&ids, oi.v, oi.n);
    ids_extend(&mask, om.v, om.n);
    c.max_length = c.max_prompt_length = 0;
    c.T = orig.len[0] + orig.len[1] - 1;
    rec = orig;
    assert_int_equal(ld_format_pref_fit(&c, &ids, &mask, 1, &rec, &reason), 1);
    assert_int_equal(reason, LD_BAD_OVERLONG);
    assert_non_null(strstr(bt_last_error(), "does not fit a row"));
    assert_int_equal(ids.n, 1);
    assert_int_equal(mask.n, 1);

    /* exactly one row: fits */
    ids.n = mask.n = 0;
    ids_extend(&ids, oi.v, oi.n);
    ids_extend(&mask, om.v, om.n);
    c.T = orig.len[0] + orig.len[1];
    rec = orig;
    assert_int_equal(ld_format_pref_fit(&c, &ids, &mask, 1, &rec, &reason), 0);

    /* max_prompt_length >= max_length: no response left -> empty */
    c.T = 0;
    c.max_length = 8;
    c.max_prompt_length = 8;
    rec = orig;
    assert_int_equal(ld_format_pref_fit(&c, &ids, &mask, 1, &rec, &reason), 1);
    assert_int_equal(reason, LD_BAD_EMPTY);
    assert_int_equal(ids.n, 1);

    /* a record that does not describe ids is refused */
    rec = orig;
    assert_int_equal(ld_format_pref_fit(&c, &ids, &mask, 1, &rec, &reason), BT_ERR_INVALID);
    bt_ids_free(&ids), bt_ids_free(&mask), bt_ids_free(&oi), bt_ids_free(&om);
}

/* Append the fixture's int array arr to a; returns its length. */
static size_t json_ids(const json_t *arr, bt_ids *a) {
    size_t i;
    json_t *v;
    json_array_foreach(arr, i, v) bt_ids_push(a, (int32_t)json_integer_value(v));
    return json_array_size(arr);
}

/* TRL 1.16.0's truncation (tests/reference/gen_pref_truncation_fixtures.py ->
 * tests/fixtures/preference/trl_truncation.json): with max_prompt_length 0, ld_format_pref_fit
 * keeps what TRL's collators keep of each prompt + response sequence (its first max_length
 * tokens, DataCollatorForPreference truncation_mode "keep_start" / DataCollatorForUnpairedPreference)
 * and skips, as LD_BAD_EMPTY, the records TRL's _prepare_dataset drops (prompt alone fills
 * max_length). */
static void test_truncation_matches_trl(void **state) {
    (void)state;
    json_error_t jerr;
    json_t *doc = json_load_file("tests/fixtures/preference/trl_truncation.json", 0, &jerr);
    if (!doc) fail_msg("tests/fixtures/preference/trl_truncation.json: %s (line %d)", jerr.text, jerr.line);
    int n_cases = 0, n_dropped = 0, n_cut = 0;
    for (int kto = 0; kto < 2; kto++) {
        size_t ci;
        json_t *cs;
        json_array_foreach(json_object_get(doc, kto ? "kto" : "dpo"), ci, cs) {
            const char *sides[2] = {kto ? "completion_ids" : "chosen_ids", "rejected_ids"};
            const char *outs[2] = {kto ? "completion" : "chosen", "rejected"};
            int nd = kto ? 1 : 2;
            bt_ids ids = {0}, mask = {0}, p = {0};
            bt_ids_push(&ids, 42);
            bt_ids_push(&mask, 0);
            size_t P = json_ids(json_object_get(cs, "prompt_ids"), &p);
            ld_pref_rec rec = {nd, {0, 0}, (uint32_t)P, kto ? 1 : -1, 0};
            for (int d = 0; d < nd; d++) {
                for (size_t i = 0; i < P; i++) bt_ids_push(&ids, p.v[i]), bt_ids_push(&mask, 0);
                size_t L = json_ids(json_object_get(cs, sides[d]), &ids);
                for (size_t i = 0; i < L; i++) bt_ids_push(&mask, 1);
                rec.len[d] = (uint32_t)(P + L);
            }
            ld_format_cfg c = cfg_of(kto ? LD_FMT_KTO : LD_FMT_PREFERENCE);
            c.max_length = (int)json_integer_value(json_object_get(cs, "max_length"));
            int reason = -1, rc = ld_format_pref_fit(&c, &ids, &mask, 1, &rec, &reason);
            n_cases++;
            if (json_is_true(json_object_get(cs, "dropped"))) {
                if (rc != 1 || reason != LD_BAD_EMPTY)
                    fail_msg("%s case %zu (prompt %zu, max_length %d): TRL drops it, fit gave %d reason %d",
                             kto ? "kto" : "dpo", ci, P, c.max_length, rc, reason);
                assert_int_equal(ids.n, 1);
                n_dropped++;
            } else {
                if (rc != 0) fail_msg("%s case %zu: fit gave %d reason %d", kto ? "kto" : "dpo", ci, rc, reason);
                bt_ids want = {0}, wmask = {0};
                bt_ids_push(&want, 42);
                bt_ids_push(&wmask, 0);
                for (int d = 0; d < nd; d++) {
                    const json_t *o = json_object_get(cs, outs[d]);
                    size_t n = json_ids(json_object_get(o, "input_ids"), &want);
                    json_ids(json_object_get(o, "completion_mask"), &wmask);
                    assert_int_equal(rec.len[d], n);
                }
                assert_int_equal(ids.n, want.n);
                assert_memory_equal(ids.v, want.v, want.n * sizeof *ids.v);
                assert_memory_equal(mask.v, wmask.v, wmask.n * sizeof *mask.v);
                n_cut += rec.truncated;
                bt_ids_free(&want), bt_ids_free(&wmask);
            }
            bt_ids_free(&ids), bt_ids_free(&mask), bt_ids_free(&p);
        }
    }
    print_message("TRL 1.16.0 truncation: %d cases, %d dropped, %d cut, all equal\n", n_cases, n_dropped, n_cut);
    assert_true(n_cases == 96 && n_dropped > 0 && n_cut > 0);
    json_decref(doc);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_text_pair),
        cmocka_unit_test(test_conversational),
        cmocka_unit_test(test_kto),
        cmocka_unit_test(test_bad_records),
        cmocka_unit_test(test_truncation),
        cmocka_unit_test(test_truncation_matches_trl),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
