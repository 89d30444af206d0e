/* loaderd job (contract: loaderd/job.h): the job spec, JSON object text -> ld_job_spec (its keys:
 * the key tables below, common/keytab.h; the rules between keys: ld_job_spec_parse; transport:
 * proto/client.h), and the names of the bad-line reasons. */
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/bt_json.h"
#include "common/keytab.h"
#include "loaderd/job.h"
#include "proto/job_limits.h"

static const char *const BAD_NAMES[LD_BAD_N] = {"json", "utf8", "field", "empty", "too_long", "zstd", "io", "overlong",
                                                 "memory"};

const char *ld_bad_reason_name(int reason) {
    return (reason >= 0 && reason < LD_BAD_N) ? BAD_NAMES[reason] : "unknown";
}

static int spec_err(bt_keypath *bad, const char *key, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int spec_err(bt_keypath *bad, const char *key, const char *fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (bad) snprintf(bad->s, sizeof bad->s, "%s", key);
    return bt_fail(BT_ERR_INVALID, "job spec: %s", buf);
}

/* ------------------------------------------------------------------ the keys' own parsers */

static void free_strv(char **v, int n) {
    for (int i = 0; i < n; i++) free(v[i]);
    free(v);
}

/* An array of 1..BT_JOB_MAX_SHARD_PATTERNS shard paths or globs, each a non-empty string of safe text (names and
 * paths reach terminals, log lines and metric labels), replacing *out / *n. */
typedef struct {
    char *s;
} str_box;
static const bt_key glob_row = BT_KEY_S("shard", str_box, s, 1, 0, NULL, BT_KEY_SAFE_TEXT, "a shard path or glob");

static int get_shards(json_t *v, const char *path, char ***out, int *n, bt_keypath *bad) {
    if (!json_is_array(v) || json_array_size(v) == 0 || json_array_size(v) > BT_JOB_MAX_SHARD_PATTERNS)
        return bt_fail(BT_ERR_INVALID, "\"%s\": expected a non-empty array of glob strings", path);
    size_t m = json_array_size(v);
    char **g = bt_xcalloc(m, sizeof *g);
    for (size_t i = 0; i < m; i++) {
        char at[BT_KEY_PATH_MAX];
        snprintf(at, sizeof at, "%s[%zu]", path, i);
        str_box b = {0};
        int rc = bt_keytab_parse_value(&glob_row, json_array_get(v, i), &b, at, bad);
        if (rc) {
            free_strv(g, (int)i);
            return rc;
        }
        g[i] = b.s;
    }
    free_strv(*out, *n);
    *out = g;
    *n = (int)m;
    return BT_OK;
}

static int parse_job_shards(const bt_key *k, json_t *v, void *dst, const char *path, bt_keypath *bad) {
    ld_job_spec *sp = dst;
    return get_shards(v, path, &sp->shards, &sp->n_shards, bad);
}
static void release_job_shards(const bt_key *k, void *dst) {
    ld_job_spec *sp = dst;
    free_strv(sp->shards, sp->n_shards);
    sp->shards = NULL;
    sp->n_shards = 0;
}
static int parse_ds_shards(const bt_key *k, json_t *v, void *dst, const char *path, bt_keypath *bad) {
    ld_dataset_spec *ds = dst;
    return get_shards(v, path, &ds->shards, &ds->n_shards, bad);
}
static void release_ds_shards(const bt_key *k, void *dst) {
    ld_dataset_spec *ds = dst;
    free_strv(ds->shards, ds->n_shards);
    ds->shards = NULL;
    ds->n_shards = 0;
}

_Static_assert(sizeof(ld_format) == sizeof(int) && sizeof(ld_chat_tpl) == sizeof(int), "enum rows store an int");
static const char *const FORMATS[] = {"text", "chat", "alpaca", "preference", "kto", NULL}; /* index = ld_format */
static const char *const TEMPLATES[] = {"auto", "chatml", "llama3", "gemma", "llama2", "mistral", "mistral-v3", "phi3",
                                        NULL};
static const int TEMPLATE_VALUES[] = {LD_TPL_AUTO,   LD_TPL_CHATML,  LD_TPL_LLAMA3,     LD_TPL_GEMMA,
                                      LD_TPL_LLAMA2, LD_TPL_MISTRAL, LD_TPL_MISTRAL_V3, LD_TPL_PHI3};
static const char *const OVERLONG[] = {"truncate", "drop", NULL}; /* index = overlong_drop */

/* One entry of "datasets" (its keys are named "datasets[i].key" in errors). */
#define D ld_dataset_spec
static const bt_key dataset_keys[] = {
    BT_KEY_C("shards", D, shards, parse_ds_shards, NULL, release_ds_shards, NULL, BT_KEY_REQUIRED,
             "the dataset's shard paths or globs (absolute; .jsonl or .jsonl.zst)"),
    BT_KEY_E("format", D, format, FORMATS, NULL, NULL, BT_KEY_REQUIRED, "how a line is read: \"chat\", \"alpaca\", \"text\", \"preference\" or \"kto\""),
    BT_KEY_S("text_field", D, text_field, 1, 0, NULL, BT_KEY_SAFE_TEXT,
             "the text's key (format \"text\" only; default \"text\")"),
    BT_KEY_N("weight", D, weight, 0, 1e12, "1", BT_KEY_LO_OPEN, "relative mixing weight"),
    BT_KEY_END,
};
#undef D

static void free_datasets(ld_job_spec *sp) {
    for (int d = 0; d < sp->n_datasets; d++) bt_keytab_free(dataset_keys, &sp->datasets[d]);
    free(sp->datasets);
    sp->datasets = NULL;
    sp->n_datasets = 0;
}

static int parse_datasets(const bt_key *k, json_t *v, void *dst, const char *path, bt_keypath *bad) {
    ld_job_spec *sp = dst;
    if (!json_is_array(v) || json_array_size(v) == 0 || json_array_size(v) > LD_MAX_DATASETS)
        return bt_fail(BT_ERR_INVALID, "\"%s\": expected an array of 1..%d objects", path, LD_MAX_DATASETS);
    free_datasets(sp);
    sp->datasets = bt_xcalloc(json_array_size(v), sizeof *sp->datasets);
    for (size_t i = 0; i < json_array_size(v); i++) {
        ld_dataset_spec *ds = &sp->datasets[i];
        sp->n_datasets = (int)i + 1;
        char at[64];
        snprintf(at, sizeof at, "%s[%zu]", path, i);
        int rc = bt_keytab_defaults(dataset_keys, ds);
        if (!rc) rc = bt_keytab_parse(dataset_keys, json_array_get(v, i), ds, NULL, at, 0, bad);
        if (!rc && ds->text_field && ds->format != LD_FMT_TEXT) {
            snprintf(bad->s, sizeof bad->s, "%s.text_field", at);
            rc = bt_fail(BT_ERR_INVALID, "\"%s\": only valid with \"format\": \"text\"", bad->s);
        }
        if (rc) return rc;
        if (!ds->text_field) ds->text_field = bt_xstrdup("text");
    }
    return BT_OK;
}
static void release_datasets(const bt_key *k, void *dst) { free_datasets(dst); }

/* ------------------------------------------------------------------ the keys */

/* The job spec, one row per key (proto/PROTOCOL.md "attach"): parsing, defaults, the unknown-key
 * refusal and `loaderd --job-keys` all come from these rows; the rules between keys follow in
 * ld_job_spec_parse. The limits are the BT_JOB_* of proto/job_limits.h, one definition with the
 * clients that check a job up front (trainer config --check, the Python client). */
#define J ld_job_spec
static const bt_key job_keys[] = {
    BT_KEY_S("name", J, name, 1, 0, "\"job\"", BT_KEY_SAFE_TEXT, "the job's name in status, metrics and logs"),
    BT_KEY_C("shards", J, shards, parse_job_shards, NULL, release_job_shards, NULL, 0,
             "shard paths or globs of a single dataset (absolute; .jsonl or .jsonl.zst); or \"datasets\""),
    BT_KEY_E("format", J, format, FORMATS, NULL, NULL, 0,
             "how a line of \"shards\" is read: \"chat\", \"alpaca\", \"text\", \"preference\" or \"kto\" (required with \"shards\")"),
    BT_KEY_S("text_field", J, text_field, 1, 0, NULL, BT_KEY_SAFE_TEXT,
             "the text's key (format \"text\" only; default \"text\")"),
    BT_KEY_C("datasets", J, datasets, parse_datasets, NULL, release_datasets, NULL, 0,
             "instead of shards/format/text_field: 1..16 datasets {shards, format, text_field?, weight?} mixed by "
             "weight; epochs count the first"),
    BT_KEY_S("tokenizer", J, tokenizer, 1, 0, NULL, BT_KEY_SAFE_TEXT | BT_KEY_REQUIRED,
             "path of the tokenizer (.gguf, tokenizer.json or a model directory)"),
    BT_KEY_I("seq_len", J, T, BT_JOB_MIN_SEQ_LEN, BT_JOB_MAX_SEQ_LEN, NULL, BT_KEY_REQUIRED, "T, tokens per row"),
    BT_KEY_I("micro_batch_size", J, B, 1, BT_JOB_MAX_BATCH_TOKENS, NULL, BT_KEY_REQUIRED, "B, rows per batch (B x T <= 2^24)"),
    BT_KEY_I("seed", J, seed, 0, INT64_MAX, "0", 0, "shuffling seed"),
    BT_KEY_I("epochs", J, epochs, 0, UINT32_MAX, "0", 0, "passes over the (first) dataset; 0: endless"),
    BT_KEY_I("tokenizer_threads", J, n_threads, 1, BT_JOB_MAX_TOKENIZER_THREADS, "2", 0, "tokenizer workers (loaderd caps it by its config)"),
    BT_KEY_E("chat_template", J, chat_template, TEMPLATES, TEMPLATE_VALUES, "\"auto\"", 0,
             "chat rendering: from the tokenizer (\"auto\"), \"chatml\", \"llama3\", \"gemma\", \"llama2\", "
             "\"mistral\" (7B Instruct v0.1/v0.2), \"mistral-v3\" (v0.3) or \"phi3\""),
    BT_KEY_E("overlong", J, overlong_drop, OVERLONG, NULL, "\"truncate\"", 0,
             "chat/alpaca documents longer than seq_len: \"truncate\" or \"drop\""),
    BT_KEY_I("max_prompt_length", J, max_prompt_length, 0, BT_JOB_MAX_SEQ_LEN, "0", 0,
             "preference/kto: prompt tokens kept (its end) when prompt + longer response exceeds max_length "
             "(TRL's name); 0: none"),
    BT_KEY_I("max_length", J, max_length, 0, BT_JOB_MAX_SEQ_LEN, "0", 0,
             "preference/kto: prompt + longer response, in tokens (TRL's name); 0: none. A pair always fits one "
             "row of seq_len or is skipped as overlong"),
    BT_KEY_S("ref_base", J, ref_base, 1, 128, NULL, BT_KEY_SAFE_TEXT,
             "preference/kto: the reference model's identifier (e.g. the SHA-256 of the base model's weights; "
             "1..128 of A-Z a-z 0-9 . _ : + -); with a token cache, batches carry the reference log-probs trainers "
             "put for it (seg_ref_ok / seg_ref_logp) and op ref_put is accepted"),
    {.name = "ring_slots", .type = BT_KEY_INT, .ilo = 1, .ihi = 1 << 16, .flags = BT_KEY_NO_FIELD,
     .doc = "batches buffered in the ring (loaderd: 1..1024, default from its config)"},
    BT_KEY_END,
};
#undef J

void ld_job_print_keys(FILE *f) {
    bt_keytab_doc_md(job_keys, "", f);
    fputs("\n", f);
    bt_keytab_doc_md(dataset_keys, "datasets[].", f);
}

void ld_job_spec_free(ld_job_spec *spec) {
    if (!spec) return;
    bt_keytab_free(job_keys, spec);
    memset(spec, 0, sizeof *spec);
}

int ld_job_spec_parse(ld_job_spec *spec, const char *json_text, bt_keypath *bad) {
    bt_keypath scratch;
    if (!bad) bad = &scratch;
    bad->s[0] = 0;
    memset(spec, 0, sizeof *spec);
    json_t *root = NULL; /* BOM skipped, duplicate keys refused naming the key (bt_json.h) */
    if (bt_json_loadb(&root, json_text, json_text ? strlen(json_text) : 0, 0, "job spec")) return BT_ERR_INVALID;
    spec->world_size = 1;
    spec->format = LD_FMT_CHAT;
    int rc = bt_keytab_defaults(job_keys, spec);
    if (!rc) rc = bt_keytab_parse(job_keys, root, spec, "job spec", "", 0, bad);
    /* the rules between keys */
    int have_shards = json_object_get(root, "shards") != NULL, have_format = json_object_get(root, "format") != NULL;
    if (rc == 0 && spec->n_datasets && (have_shards || have_format || spec->text_field))
        rc = spec_err(bad, "datasets", "\"datasets\": give either \"datasets\" or \"shards\"/\"format\"/\"text_field\", "
                      "not both");
    if (rc == 0 && !spec->n_datasets && !have_shards) rc = spec_err(bad, "shards", "\"shards\": required (or \"datasets\")");
    if (rc == 0 && !spec->n_datasets && !have_format)
        rc = spec_err(bad, "format", "\"format\": required (\"chat\", \"alpaca\", \"text\", \"preference\" or \"kto\")");
    if (rc == 0 && (uint64_t)spec->B * spec->T > BT_JOB_MAX_BATCH_TOKENS)
        rc = spec_err(bad, "micro_batch_size", "\"micro_batch_size\": %u x seq_len %u = %llu tokens exceeds %u", spec->B,
                      spec->T, (unsigned long long)spec->B * spec->T, BT_JOB_MAX_BATCH_TOKENS);
    if (rc == 0 && spec->ref_base && spec->ref_base[strspn(spec->ref_base, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnop"
                                                                    "qrstuvwxyz0123456789._:+-")])
        rc = spec_err(bad, "ref_base", "\"ref_base\": 1..128 characters of A-Z a-z 0-9 . _ : + -");
    if (rc == 0 && spec->text_field && spec->format != LD_FMT_TEXT)
        rc = spec_err(bad, "text_field", "\"text_field\": only valid with \"format\": \"text\"");
    json_decref(root);
    if (rc) {
        ld_job_spec_free(spec);
        return rc;
    }
    if (!spec->text_field && !spec->n_datasets) spec->text_field = bt_xstrdup("text");
    return BT_OK;
}
