/* loaderd job spec: JSON object text -> ld_job_spec (see pipeline.h, proto/client.h). */
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "loaderd/pipeline.h"

#define LD_MIN_T 16u
#define LD_MAX_T (1u << 20)
#define LD_MAX_BT (1u << 24)
#define LD_MAX_THREADS 256u

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
    free(*out);
    *out = bt_xstrdup(json_string_value(v));
    return 0;
}

int ld_job_spec_parse(ld_job_spec *spec, const char *json_text, char *err, size_t errlen) {
    memset(spec, 0, sizeof *spec);
    if (err && errlen) err[0] = 0;
    json_error_t jerr;
    json_t *root = json_loads(json_text ? json_text : "", 0, &jerr);
    if (!root) return spec_err(err, errlen, "not valid JSON (line %d column %d: %s)", jerr.line, jerr.column, jerr.text);
    if (!json_is_object(root)) {
        json_decref(root);
        return spec_err(err, errlen, "expected a JSON object");
    }
    spec->world_size = 1;
    spec->n_threads = 2;
    spec->format = LD_FMT_CHAT;
    int have_shards = 0, have_format = 0, have_T = 0, have_B = 0, rc = 0;
    uint64_t u;
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        if (strcmp(key, "name") == 0) {
            rc = get_string(v, key, &spec->name, err, errlen);
        } else if (strcmp(key, "shards") == 0) {
            if (!json_is_array(v) || json_array_size(v) == 0 || json_array_size(v) > 100000) {
                rc = spec_err(err, errlen, "\"shards\": expected a non-empty array of glob strings");
                break;
            }
            size_t n = json_array_size(v);
            spec->shards = bt_xcalloc(n, sizeof(char *));
            for (size_t i = 0; i < n && rc == 0; i++) {
                char k2[32];
                snprintf(k2, sizeof k2, "shards[%zu]", i);
                rc = get_string(json_array_get(v, i), k2, &spec->shards[i], err, errlen);
                if (rc == 0) spec->n_shards = (int)i + 1;
            }
            have_shards = 1;
        } else if (strcmp(key, "format") == 0) {
            const char *f = json_string_value(v);
            if (f && strcmp(f, "chat") == 0) spec->format = LD_FMT_CHAT;
            else if (f && strcmp(f, "alpaca") == 0) spec->format = LD_FMT_ALPACA;
            else if (f && strcmp(f, "text") == 0) spec->format = LD_FMT_TEXT;
            else rc = spec_err(err, errlen, "\"format\": expected \"chat\", \"alpaca\" or \"text\"");
            have_format = 1;
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
                          "tokenizer, seq_len, micro_batch_size, seed, epochs, tokenizer_threads, "
                          "ring_slots)", key);
        }
        if (rc) break;
    }
    json_decref(root);
    if (rc == 0 && !have_shards) rc = spec_err(err, errlen, "\"shards\": required");
    if (rc == 0 && !have_format) rc = spec_err(err, errlen, "\"format\": required (\"chat\", \"alpaca\" or \"text\")");
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
    if (!spec->text_field) spec->text_field = bt_xstrdup("text");
    return BT_OK;
}
