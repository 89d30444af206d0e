/* loaderd job (contract: loaderd/job.h): the job spec, JSON object text -> ld_job_spec (keys and
 * rules: ld_job_spec_parse; transport: proto/client.h), and the names of the bad-line reasons. */
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/bt_json.h"
#include "loaderd/job.h"

#define LD_MIN_T 16u
#define LD_MAX_T (1u << 20)
#define LD_MAX_BT (1u << 24)
#define LD_MAX_THREADS 256u

static const char *const BAD_NAMES[LD_BAD_N] = {"json", "utf8", "field", "empty", "too_long", "zstd", "io", "overlong"};

const char *ld_bad_reason_name(int reason) {
    return (reason >= 0 && reason < LD_BAD_N) ? BAD_NAMES[reason] : "unknown";
}

static int spec_err(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int spec_err(char *err, size_t errlen, const char *fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (err && errlen) snprintf(err, errlen, "job spec: %s", buf);
    return bt_fail(BT_ERR_INVALID, "job spec: %s", buf);
}

void ld_job_spec_free(ld_job_spec *spec) {
    if (!spec) return;
    free(spec->name);
    for (int d = 0; d < spec->n_datasets; d++) {
        ld_dataset_spec *ds = &spec->datasets[d];
        for (int i = 0; i < ds->n_shards; i++) free(ds->shards[i]);
        free(ds->shards);
        free(ds->text_field);
    }
    free(spec->datasets);
    for (int i = 0; i < spec->n_shards; i++) free(spec->shards[i]);
    free(spec->shards);
    free(spec->text_field);
    free(spec->tokenizer);
    memset(spec, 0, sizeof *spec);
}

/* Integer key in [lo, hi]; 0 ok, else error. */
static int get_uint(json_t *v, const char *key, uint64_t lo, uint64_t hi, uint64_t *out, char *err,
                    size_t errlen) {
    if (!json_is_integer(v))
        return spec_err(err, errlen, "\"%s\": expected an integer in [%llu, %llu]", key,
                        (unsigned long long)lo, (unsigned long long)hi);
    json_int_t x = json_integer_value(v);
    if (x < 0 || (uint64_t)x < lo || (uint64_t)x > hi)
        return spec_err(err, errlen, "\"%s\": %lld is out of range [%llu, %llu]", key, (long long)x,
                        (unsigned long long)lo, (unsigned long long)hi);
    *out = (uint64_t)x;
    return 0;
}

static int get_string(json_t *v, const char *key, char **out, char *err, size_t errlen) {
    if (!json_is_string(v) || json_string_length(v) == 0 ||
        strlen(json_string_value(v)) != json_string_length(v))
        return spec_err(err, errlen, "\"%s\": expected a non-empty string", key);
    /* names and paths reach terminals, log lines and metric labels (common/bt_common.h) */
    int32_t cp;
    size_t off = bt_text_unsafe(json_string_value(v), json_string_length(v), &cp);
    if (off < json_string_length(v))
        return spec_err(err, errlen, "\"%s\": holds a control character (%s%04X at byte %zu): names and paths may not "
                        "hold control or bidirectional-control characters", key, cp < 0 ? "byte 0x" : "U+",
                        (unsigned)(cp < 0 ? -cp - 1 : cp), off);
    free(*out);
    *out = bt_xstrdup(json_string_value(v));
    return 0;
}

/* Array of glob strings at key `key` -> *out / *n (owned). */
static int get_shards(json_t *v, const char *key, char ***out, int *n, char *err, size_t errlen) {
    if (!json_is_array(v) || json_array_size(v) == 0 || json_array_size(v) > 100000)
        return spec_err(err, errlen, "\"%s\": expected a non-empty array of glob strings", key);
    size_t m = json_array_size(v);
    *out = bt_xcalloc(m, sizeof(char *));
    for (size_t i = 0; i < m; i++) {
        char k2[96];
        snprintf(k2, sizeof k2, "%s[%zu]", key, i);
        *n = (int)i + 1;
        int rc = get_string(json_array_get(v, i), k2, &(*out)[i], err, errlen);
        if (rc) return rc;
    }
    return 0;
}

static int get_format(json_t *v, const char *key, ld_format *out, char *err, size_t errlen) {
    const char *f = json_string_value(v);
    if (f && strcmp(f, "chat") == 0) *out = LD_FMT_CHAT;
    else if (f && strcmp(f, "alpaca") == 0) *out = LD_FMT_ALPACA;
    else if (f && strcmp(f, "text") == 0) *out = LD_FMT_TEXT;
    else return spec_err(err, errlen, "\"%s\": expected \"chat\", \"alpaca\" or \"text\"", key);
    return 0;
}

/* One entry of "datasets" (its keys are named "datasets[i].key" in errors). */
static int get_dataset(json_t *o, size_t idx, ld_dataset_spec *ds, char *err, size_t errlen) {
    char k[96];
    snprintf(k, sizeof k, "datasets[%zu]", idx);
    if (!json_is_object(o))
        return spec_err(err, errlen, "\"%s\": expected an object {shards, format, text_field?, weight?}", k);
    ds->weight = 1.0;
    int have_shards = 0, have_format = 0, rc = 0;
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v) {
        snprintf(k, sizeof k, "datasets[%zu].%s", idx, key);
        if (strcmp(key, "shards") == 0) {
            rc = get_shards(v, k, &ds->shards, &ds->n_shards, err, errlen);
            have_shards = 1;
        } else if (strcmp(key, "format") == 0) {
            rc = get_format(v, k, &ds->format, err, errlen);
            have_format = 1;
        } else if (strcmp(key, "text_field") == 0) {
            rc = get_string(v, k, &ds->text_field, err, errlen);
        } else if (strcmp(key, "weight") == 0) {
            double w = json_number_value(v);
            if (!json_is_number(v) || !(w > 0) || w > 1e12)
                rc = spec_err(err, errlen, "\"%s\": expected a number in (0, 1e12]", k);
            ds->weight = w;
        } else {
            rc = spec_err(err, errlen, "unknown key \"%s\" (allowed: shards, format, text_field, weight)", k);
        }
        if (rc) return rc;
    }
    snprintf(k, sizeof k, "datasets[%zu]", idx);
    if (!have_shards) return spec_err(err, errlen, "\"%s.shards\": required", k);
    if (!have_format) return spec_err(err, errlen, "\"%s.format\": required (\"chat\", \"alpaca\" or \"text\")", k);
    if (ds->text_field && ds->format != LD_FMT_TEXT)
        return spec_err(err, errlen, "\"%s.text_field\": only valid with \"format\": \"text\"", k);
    if (!ds->text_field) ds->text_field = bt_xstrdup("text");
    return 0;
}

int ld_job_spec_parse(ld_job_spec *spec, const char *json_text, char *err, size_t errlen) {
    memset(spec, 0, sizeof *spec);
    if (err && errlen) err[0] = 0;
    json_t *root = NULL; /* BOM skipped, duplicate keys refused naming the key (bt_json.h) */
    if (bt_json_loadb(&root, json_text, json_text ? strlen(json_text) : 0, 0, "job spec")) {
        if (err && errlen) snprintf(err, errlen, "%s", bt_last_error());
        return BT_ERR_INVALID;
    }
    if (!json_is_object(root)) {
        json_decref(root);
        return spec_err(err, errlen, "expected a JSON object");
    }
    spec->world_size = 1;
    spec->n_threads = 2;
    spec->format = LD_FMT_CHAT;
    spec->chat_template = LD_TPL_AUTO;
    int have_shards = 0, have_format = 0, have_T = 0, have_B = 0, rc = 0;
    uint64_t u;
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        if (strcmp(key, "name") == 0) {
            rc = get_string(v, key, &spec->name, err, errlen);
        } else if (strcmp(key, "shards") == 0) {
            rc = get_shards(v, key, &spec->shards, &spec->n_shards, err, errlen);
            have_shards = 1;
        } else if (strcmp(key, "format") == 0) {
            rc = get_format(v, key, &spec->format, err, errlen);
            have_format = 1;
        } else if (strcmp(key, "datasets") == 0) {
            if (!json_is_array(v) || json_array_size(v) == 0 || json_array_size(v) > LD_MAX_DATASETS) {
                rc = spec_err(err, errlen, "\"datasets\": expected an array of 1..%d objects", LD_MAX_DATASETS);
                break;
            }
            spec->datasets = bt_xcalloc(json_array_size(v), sizeof *spec->datasets);
            for (size_t i = 0; i < json_array_size(v) && rc == 0; i++) {
                spec->n_datasets = (int)i + 1;
                rc = get_dataset(json_array_get(v, i), i, &spec->datasets[i], err, errlen);
            }
        } else if (strcmp(key, "chat_template") == 0) {
            const char *t = json_string_value(v);
            if (t && strcmp(t, "auto") == 0) spec->chat_template = LD_TPL_AUTO;
            else if (t && strcmp(t, "chatml") == 0) spec->chat_template = LD_TPL_CHATML;
            else if (t && strcmp(t, "llama3") == 0) spec->chat_template = LD_TPL_LLAMA3;
            else rc = spec_err(err, errlen, "\"chat_template\": expected \"auto\", \"chatml\" or \"llama3\"");
        } else if (strcmp(key, "overlong") == 0) {
            const char *t = json_string_value(v);
            if (t && strcmp(t, "truncate") == 0) spec->overlong_drop = 0;
            else if (t && strcmp(t, "drop") == 0) spec->overlong_drop = 1;
            else rc = spec_err(err, errlen, "\"overlong\": expected \"truncate\" or \"drop\"");
        } else if (strcmp(key, "text_field") == 0) {
            rc = get_string(v, key, &spec->text_field, err, errlen);
        } else if (strcmp(key, "tokenizer") == 0) {
            rc = get_string(v, key, &spec->tokenizer, err, errlen);
        } else if (strcmp(key, "seq_len") == 0) {
            rc = get_uint(v, key, LD_MIN_T, LD_MAX_T, &u, err, errlen);
            spec->T = (uint32_t)u;
            have_T = 1;
        } else if (strcmp(key, "micro_batch_size") == 0) {
            rc = get_uint(v, key, 1, LD_MAX_BT, &u, err, errlen);
            spec->B = (uint32_t)u;
            have_B = 1;
        } else if (strcmp(key, "seed") == 0) {
            rc = get_uint(v, key, 0, INT64_MAX, &u, err, errlen);
            spec->seed = u;
        } else if (strcmp(key, "epochs") == 0) {
            rc = get_uint(v, key, 0, UINT32_MAX, &u, err, errlen);
            spec->epochs = (uint32_t)u;
        } else if (strcmp(key, "tokenizer_threads") == 0) {
            rc = get_uint(v, key, 1, LD_MAX_THREADS, &u, err, errlen);
            spec->n_threads = (uint32_t)u;
        } else if (strcmp(key, "ring_slots") == 0) {
            rc = get_uint(v, key, 1, 1u << 16, &u, err, errlen); /* used by the server */
        } else {
            rc = spec_err(err, errlen, "unknown key \"%s\" (allowed: name, shards, format, text_field, "
                          "datasets, tokenizer, seq_len, micro_batch_size, seed, epochs, tokenizer_threads, "
                          "chat_template, overlong, ring_slots)", key);
        }
        if (rc) break;
    }
    json_decref(root);
    if (rc == 0 && spec->n_datasets && (have_shards || have_format || spec->text_field))
        rc = spec_err(err, errlen, "\"datasets\": give either \"datasets\" or \"shards\"/\"format\"/\"text_field\", "
                      "not both");
    if (rc == 0 && !spec->n_datasets && !have_shards)
        rc = spec_err(err, errlen, "\"shards\": required (or \"datasets\")");
    if (rc == 0 && !spec->n_datasets && !have_format)
        rc = spec_err(err, errlen, "\"format\": required (\"chat\", \"alpaca\" or \"text\")");
    if (rc == 0 && !spec->tokenizer) rc = spec_err(err, errlen, "\"tokenizer\": required (path of a .gguf)");
    if (rc == 0 && !have_T) rc = spec_err(err, errlen, "\"seq_len\": required");
    if (rc == 0 && !have_B) rc = spec_err(err, errlen, "\"micro_batch_size\": required");
    if (rc == 0 && (uint64_t)spec->B * spec->T > LD_MAX_BT)
        rc = spec_err(err, errlen, "\"micro_batch_size\": %u x seq_len %u = %llu tokens exceeds %u",
                      spec->B, spec->T, (unsigned long long)spec->B * spec->T, LD_MAX_BT);
    if (rc == 0 && spec->text_field && spec->format != LD_FMT_TEXT)
        rc = spec_err(err, errlen, "\"text_field\": only valid with \"format\": \"text\"");
    if (rc) {
        ld_job_spec_free(spec);
        return rc;
    }
    if (!spec->name) spec->name = bt_xstrdup("job");
    if (!spec->text_field && !spec->n_datasets) spec->text_field = bt_xstrdup("text");
    return BT_OK;
}
