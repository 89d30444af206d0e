/* Trainer job configuration: parsing, overrides, validation. See config.h for the keys. */
#include "trainer/config.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/bt_json.h"
#include "common/yaml_json.h"
#include "proto/client.h"
#include "proto/job_limits.h"

static const char *const k_mod_names[BT_MOD_N] = {"q_proj", "k_proj",    "v_proj", "o_proj",
                                                  "gate_proj", "up_proj", "down_proj"};
static const char *const k_trainable_names[BT_TRAINABLE_N] = {"embed_tokens", "norm"};

const char *bt_base_dtype_name(int base_dtype) {
    static const char *const names[] = {"nf4", "fp32", "gguf", "auto"};
    return base_dtype >= 0 && base_dtype <= BT_BASE_AUTO ? names[base_dtype] : "?";
}

const char *bt_module_name(int mod) {
    return (mod >= 0 && mod < BT_MOD_N) ? k_mod_names[mod] : NULL;
}

/* ---- error helpers ---- */

/* Short JSON rendering of a value for messages (truncated to 60 chars). */
static void render(const json_t *v, char *buf, size_t n) {
    char *s = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    if (!s) {
        snprintf(buf, n, "?");
        return;
    }
    if (strlen(s) > 60) snprintf(buf, n, "%.57s...", s);
    else snprintf(buf, n, "%s", s);
    free(s);
}

static int bad(const char *sect, const char *key, const char *expect, const json_t *got) {
    char g[80];
    render(got, g, sizeof g);
    return bt_fail(BT_ERR_INVALID, "config: %s%s%s: expected %s, got %s", sect ? sect : "",
                   sect ? "." : "", key, expect, g);
}

/* Refuse keys of `obj` not in the NULL-terminated list `known`. */
static int check_keys(const json_t *obj, const char *sect, const char *const *known) {
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)obj, k, v) {
        int ok = k[0] == '#'; /* comment keys (see config.h) */
        for (int i = 0; known[i]; i++)
            if (!strcmp(k, known[i])) ok = 1;
        if (!ok) {
            char list[512] = "";
            size_t used = 0;
            for (int i = 0; known[i] && used < sizeof list - 1; i++)
                used += (size_t)snprintf(list + used, sizeof list - used, "%s%s", i ? ", " : "",
                                         known[i]);
            return bt_fail(BT_ERR_INVALID, "config: unknown key \"%s%s%s\" (known: %s)",
                           sect ? sect : "", sect ? "." : "", k, list);
        }
    }
    return 0;
}

/* ---- typed getters (absent key -> default) ---- */

typedef struct {
    double lo, hi;
    int lo_open, hi_open; /* strict bounds */
} range;

static void range_text(range r, const char *what, char *buf, size_t n) {
    if (isinf(r.hi) || r.hi >= 2147483647.0)
        snprintf(buf, n, "%s %s %.15g", what, r.lo_open ? ">" : ">=", r.lo);
    else
        snprintf(buf, n, "%s in %c%.15g, %.15g%c", what, r.lo_open ? '(' : '[', r.lo, r.hi,
                 r.hi_open ? ')' : ']');
}

static int in_range(range r, double x) {
    if (isnan(x)) return 0;
    if (r.lo_open ? !(x > r.lo) : !(x >= r.lo)) return 0;
    if (r.hi_open ? !(x < r.hi) : !(x <= r.hi)) return 0;
    return 1;
}

static int get_num(const json_t *o, const char *sect, const char *key, double def, range r,
                   double *out) {
    json_t *v = json_object_get(o, key);
    char what[96];
    range_text(r, "a number", what, sizeof what);
    if (!v) {
        *out = def;
        return 0;
    }
    if (!json_is_number(v)) return bad(sect, key, what, v);
    double x = json_number_value(v);
    if (!in_range(r, x)) return bad(sect, key, what, v);
    *out = x;
    return 0;
}

static int get_int(const json_t *o, const char *sect, const char *key, int64_t def, range r,
                   int64_t *out) {
    json_t *v = json_object_get(o, key);
    char what[96];
    range_text(r, "an integer", what, sizeof what);
    if (!v) {
        *out = def;
        return 0;
    }
    double x;
    if (json_is_integer(v)) x = (double)json_integer_value(v);
    else if (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)))
        x = json_real_value(v);
    else
        return bad(sect, key, what, v);
    if (!in_range(r, x) || fabs(x) > 9.0e15) return bad(sect, key, what, v);
    *out = json_is_integer(v) ? (int64_t)json_integer_value(v) : (int64_t)x;
    return 0;
}

static int get_i32(const json_t *o, const char *sect, const char *key, int def, range r, int *out) {
    int64_t x;
    if (r.hi > 2147483647.0) r.hi = 2147483647.0;
    int rc = get_int(o, sect, key, def, r, &x);
    if (rc == 0) *out = (int)x;
    return rc;
}

static int get_bool(const json_t *o, const char *sect, const char *key, int def, int *out) {
    json_t *v = json_object_get(o, key);
    if (!v) {
        *out = def;
        return 0;
    }
    if (!json_is_boolean(v)) return bad(sect, key, "true or false", v);
    *out = json_is_true(v);
    return 0;
}

/* *out = strdup (owned). */
static int get_str(const json_t *o, const char *sect, const char *key, const char *def,
                   char **out) {
    json_t *v = json_object_get(o, key);
    if (!v) {
        if (!def) {
            return bt_fail(BT_ERR_INVALID, "config: %s%s%s: required key missing (expected a string)",
                           sect ? sect : "", sect ? "." : "", key);
        }
        *out = bt_xstrdup(def);
        return 0;
    }
    if (!json_is_string(v) || json_string_length(v) == 0)
        return bad(sect, key, "a non-empty string", v);
    if (strlen(json_string_value(v)) != json_string_length(v))
        return bad(sect, key, "a string without NUL bytes", v);
    *out = bt_xstrdup(json_string_value(v));
    return 0;
}

/* One of NULL-terminated `choices`; *out = index. */
static int get_enum(const json_t *o, const char *sect, const char *key, int def,
                    const char *const *choices, int *out) {
    json_t *v = json_object_get(o, key);
    char what[160] = "one of ";
    for (int i = 0; choices[i]; i++) {
        strncat(what, "\"", sizeof what - strlen(what) - 1);
        strncat(what, choices[i], sizeof what - strlen(what) - 1);
        strncat(what, choices[i + 1] ? "\", " : "\"", sizeof what - strlen(what) - 1);
    }
    if (!v) {
        *out = def;
        return 0;
    }
    if (json_is_string(v))
        for (int i = 0; choices[i]; i++)
            if (!strcmp(json_string_value(v), choices[i])) {
                *out = i;
                return 0;
            }
    return bad(sect, key, what, v);
}

static void free_strv(char **v, int n) {
    if (!v) return;
    for (int i = 0; i < n; i++) free(v[i]);
    free(v);
}

/* Array of non-empty strings. required: must be present and non-empty. */
static int get_strv(const json_t *o, const char *sect, const char *key, int required,
                    char ***out, int *n_out) {
    json_t *v = json_object_get(o, key);
    *out = NULL;
    *n_out = 0;
    if (!v) {
        if (required)
            return bt_fail(BT_ERR_INVALID,
                           "config: %s%s%s: required key missing (expected a non-empty array of strings)",
                           sect ? sect : "", sect ? "." : "", key);
        return 0;
    }
    if (json_is_string(v) && json_string_length(v) > 0) { /* a single string is a 1-list */
        *out = bt_xcalloc(1, sizeof(char *));
        (*out)[0] = bt_xstrdup(json_string_value(v));
        *n_out = 1;
        return 0;
    }
    if (!json_is_array(v) || (required && json_array_size(v) == 0))
        return bad(sect, key, required ? "a non-empty array of strings" : "an array of strings", v);
    size_t n = json_array_size(v);
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(v, i);
        if (!json_is_string(e) || json_string_length(e) == 0)
            return bad(sect, key, "an array of non-empty strings", v);
    }
    *out = bt_xcalloc(n ? n : 1, sizeof(char *));
    for (size_t i = 0; i < n; i++) (*out)[i] = bt_xstrdup(json_string_value(json_array_get(v, i)));
    *n_out = (int)n;
    return 0;
}

/* Sub-object (absent -> empty object, borrowed result in *out; caller json_decref's nothing). */
static int get_obj(const json_t *root, const char *key, json_t **out) {
    json_t *v = json_object_get(root, key);
    if (!v) {
        *out = NULL;
        return 0;
    }
    if (!json_is_object(v)) return bad(NULL, key, "an object", v);
    *out = v;
    return 0;
}

/* ---- --set ---- */

static int apply_set(json_t *root, const char *kv) {
    const char *eq = strchr(kv, '=');
    if (!eq || eq == kv)
        return bt_fail(BT_ERR_INVALID, "config: --set \"%s\": expected key.path=value", kv);
    char *path = strndup(kv, (size_t)(eq - kv));
    if (!path) return bt_fail(BT_ERR_NOMEM, "config: out of memory");
    /* every segment of the key path names a key: "optim..lr", ".lr" or "optim." would otherwise be
     * read as another key (strtok skips empty segments), and a "#" comment key is never read */
    size_t pl = strlen(path);
    const char *why = path[0] == '.' ? "starts with '.'" : path[pl - 1] == '.' ? "ends with '.'"
                      : strstr(path, "..")                     ? "has an empty segment (\"..\")"
                      : path[0] == '#' || strstr(path, ".#")   ? "names a comment key (\"#...\"), which is never read"
                                                               : NULL;
    if (why) {
        int rc = bt_fail(BT_ERR_INVALID, "config: --set \"%s\": the key path \"%s\" %s (write section.key, e.g. "
                         "optim.lr=1e-4)", kv, path, why);
        free(path);
        return rc;
    }
    const char *val = eq + 1;
    json_error_t jerr;
    json_t *jv = json_loads(val, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, &jerr);
    if (!jv && json_error_code(&jerr) == json_error_duplicate_key) {
        free(path);
        return bt_fail(BT_ERR_INVALID, "config: --set %s: %s", kv, jerr.text);
    }
    if (!jv) jv = json_string(val);
    if (!jv) {
        free(path);
        return bt_fail(BT_ERR_INVALID, "config: --set %s: value is not valid UTF-8", kv);
    }
    json_t *cur = root;
    char *save = NULL;
    char *tok = strtok_r(path, ".", &save);
    int rc = 0;
    while (tok) {
        char *next = strtok_r(NULL, ".", &save);
        if (!next) {
            json_object_set(cur, tok, jv);
            break;
        }
        json_t *child = json_object_get(cur, tok);
        if (!child) {
            child = json_object();
            json_object_set_new(cur, tok, child);
        } else if (!json_is_object(child)) {
            rc = bt_fail(BT_ERR_INVALID, "config: --set %.*s: \"%s\" is not an object",
                         (int)(eq - kv), kv, tok);
            break;
        }
        cur = child;
        tok = next;
    }
    if (!tok && rc == 0)
        rc = bt_fail(BT_ERR_INVALID, "config: --set \"%s\": empty key", kv);
    json_decref(jv);
    free(path);
    return rc;
}

/* Same directory as written, ignoring "./" prefixes and trailing slashes ("runs/a/" == "./runs/a"). */
static int same_dir(const char *a, const char *b) {
    while (a[0] == '.' && a[1] == '/') a += 2;
    while (b[0] == '.' && b[1] == '/') b += 2;
    size_t na = strlen(a), nb = strlen(b);
    while (na > 1 && a[na - 1] == '/') na--;
    while (nb > 1 && b[nb - 1] == '/') nb--;
    return na == nb && !memcmp(a, b, na);
}

/* `inner` is `outer` or a path below it, as written (same normalisation as same_dir). */
static int same_or_inside(const char *outer, const char *inner) {
    while (outer[0] == '.' && outer[1] == '/') outer += 2;
    while (inner[0] == '.' && inner[1] == '/') inner += 2;
    size_t no = strlen(outer), ni = strlen(inner);
    while (no > 1 && outer[no - 1] == '/') no--;
    while (ni > 1 && inner[ni - 1] == '/') ni--;
    if (ni < no || memcmp(outer, inner, no)) return 0;
    return ni == no || inner[no] == '/' || (no == 1 && outer[0] == '/');
}

const char *bt_config_default_socket(void) {
    const char *e = getenv("LOADERD_SOCKET");
    return e && *e ? e : BT_DEFAULT_SOCKET;
}

/* ---- the schema ---- */

#define RANGE(lo, hi, lo_open, hi_open) ((range){(lo), (hi), (lo_open), (hi_open)})
#define POS RANGE(0, INFINITY, 1, 0)     /* > 0 */
#define NONNEG RANGE(0, INFINITY, 0, 0)  /* >= 0 */
#define ATLEAST1 RANGE(1, INFINITY, 0, 0)

/* activation_checkpointing: true | false | "auto" (default), with checkpointing_min_seq_len.
 * Needs data.seq_len parsed first. */
static int get_checkpointing(const json_t *root, bt_train_config *c) {
    int rc = get_i32(root, NULL, "checkpointing_min_seq_len", 4096, ATLEAST1,
                     &c->checkpointing_min_seq_len);
    if (rc) return rc;
    json_t *v = json_object_get(root, "activation_checkpointing");
    if (!v || (json_is_string(v) && !strcmp(json_string_value(v), "auto"))) {
        c->checkpointing_auto = 1;
        c->activation_checkpointing = c->data.seq_len >= c->checkpointing_min_seq_len;
        return 0;
    }
    if (!json_is_boolean(v)) return bad(NULL, "activation_checkpointing", "true, false or \"auto\"", v);
    c->activation_checkpointing = json_is_true(v);
    return 0;
}

/* eval.lengths: distinct integers in [BT_JOB_MIN_SEQ_LEN, BT_JOB_MAX_SEQ_LEN] (each is the seq_len of
 * a held-out stream from loaderd; at most BT_MAX_EVAL_LENGTHS), kept sorted. */
static int get_lengths(const json_t *eval, bt_train_config *c) {
    json_t *v = json_object_get(eval, "lengths");
    char what[160];
    snprintf(what, sizeof what, "an array of distinct context lengths (integers in [%u, %u], at most %d)",
             BT_JOB_MIN_SEQ_LEN, BT_JOB_MAX_SEQ_LEN, BT_MAX_EVAL_LENGTHS);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_array(v) || json_array_size(v) > BT_MAX_EVAL_LENGTHS) return bad("eval", "lengths", what, v);
    for (size_t i = 0; i < json_array_size(v); i++) {
        json_t *e = json_array_get(v, i);
        json_int_t x = json_is_integer(e) ? json_integer_value(e) : 0;
        if (x < BT_JOB_MIN_SEQ_LEN || x > BT_JOB_MAX_SEQ_LEN) return bad("eval", "lengths", what, e);
        int k = c->eval.n_lengths;
        for (int j = 0; j < k; j++)
            if (c->eval.lengths[j] == (int)x) return bad("eval", "lengths", what, v);
        while (k > 0 && c->eval.lengths[k - 1] > (int)x) { /* insertion: ascending */
            c->eval.lengths[k] = c->eval.lengths[k - 1];
            k--;
        }
        c->eval.lengths[k] = (int)x;
        c->eval.n_lengths++;
    }
    return 0;
}

/* context_extension {target_length, method} and attention {s2: {group_fraction}}. */
static int get_long_context(const json_t *root, bt_train_config *c) {
    static const char *const ext_keys[] = {"target_length", "method", NULL};
    static const char *const ext_methods[] = {"none", "linear", "yarn", "dynamic", NULL};
    static const char *const attention_keys[] = {"s2", NULL};
    static const char *const s2_keys[] = {"group_fraction", NULL};
    int rc;
    json_t *ce = json_object_get(root, "context_extension");
    if (ce && !json_is_null(ce)) {
        if (!json_is_object(ce)) return bad(NULL, "context_extension", "an object or null", ce);
        if ((rc = check_keys(ce, "context_extension", ext_keys))) return rc;
        if (!json_object_get(ce, "target_length"))
            return bt_fail(BT_ERR_INVALID, "config: context_extension.target_length: required key "
                           "missing (expected the context length to train for, e.g. 16384)");
        if ((rc = get_i32(ce, "context_extension", "target_length", 0, RANGE(2, 1 << 24, 0, 0),
                          &c->context_extension.target_length)) ||
            (rc = get_enum(ce, "context_extension", "method", BT_ROPE_EXT_LINEAR, ext_methods,
                           &c->context_extension.method)))
            return rc;
        if (c->context_extension.method == BT_ROPE_EXT_NONE) c->context_extension.target_length = 0;
    }
    json_t *at = json_object_get(root, "attention");
    if (!at || json_is_null(at)) return 0;
    if (!json_is_object(at)) return bad(NULL, "attention", "an object", at);
    if ((rc = check_keys(at, "attention", attention_keys))) return rc;
    json_t *s2 = json_object_get(at, "s2");
    if (!s2 || json_is_null(s2) || json_is_false(s2)) return 0;
    if (!json_is_object(s2)) return bad("attention", "s2", "an object, null or false", s2);
    if ((rc = check_keys(s2, "attention.s2", s2_keys))) return rc;
    return get_num(s2, "attention.s2", "group_fraction", 0.25, RANGE(0, 1, 1, 0),
                   &c->s2_group_fraction);
}

int bt_config_s2_group(const bt_train_config *c) {
    if (!(c->s2_group_fraction > 0)) return 0;
    long g = 2 * lround(c->data.seq_len * c->s2_group_fraction / 2.0);
    return g < 2 ? 2 : (int)g;
}

/* The keys each object of the tree may hold (config.h documents them; check_keys refuses
 * others). */
static const char *const k_top_keys[] = {
    "name", "model", "base_dtype", "base_model_name_or_path", "socket", "data", "eval", "lora",
    "optim", "steps", "grad_accum", "schedule", "min_lr_ratio", "activation_checkpointing",
    "save_every", "out_dir", "threads", "seed", "log_every", "timeout_s", "trainable_modules",
    "checkpoint_every", "checkpoint_dir", "resume_from", "stop_at_step", "device", "cuda",
    "dist", "report", "checkpointing_min_seq_len", "context_extension", "attention", NULL};
static const char *const k_data_keys[] = {"shards", "format", "text_field", "seq_len",
                                          "micro_batch_size", "seed", "tokenizer_threads", NULL};
static const char *const k_eval_keys[] = {"shards", "max_batches", "lengths", "every", NULL};
static const char *const k_lora_keys[] = {"r", "lora_alpha", "lora_dropout", "target_modules",
                                          NULL};
static const char *const k_optim_keys[] = {"lr", "beta1", "beta2", "eps", "weight_decay",
                                           "warmup_steps", "grad_clip", NULL};
static const char *const k_cuda_keys[] = {"attention", "nf4_matmul", "offload_checkpoints", NULL};
static const char *const k_dist_keys[] = {"master_addr", "master_port", "timeout_s",
                                          "heartbeat_timeout_s", "secret_file", NULL};
static const char *const k_report_keys[] = {"dir", "plot", "tensorboard", NULL};

/* The section objects of the tree, borrowed; an absent section is the caller's empty object. */
typedef struct {
    json_t *report, *dist, *cuda, *data, *eval, *lora, *optim;
} sections;

/* Refuses unknown top-level keys and non-object sections (in this order), then fills *s. */
static int get_sections(const json_t *root, json_t *empty, sections *s) {
    int rc;
    if ((rc = check_keys(root, NULL, k_top_keys)) || (rc = get_obj(root, "report", &s->report)) ||
        (rc = get_obj(root, "cuda", &s->cuda)) || (rc = get_obj(root, "dist", &s->dist)) ||
        (rc = get_obj(root, "data", &s->data)) || (rc = get_obj(root, "eval", &s->eval)) ||
        (rc = get_obj(root, "lora", &s->lora)) || (rc = get_obj(root, "optim", &s->optim)))
        return rc;
    json_t **all[] = {&s->report, &s->dist, &s->cuda, &s->data, &s->eval, &s->lora, &s->optim};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (!*all[i]) *all[i] = empty;
    return 0;
}

/* A list of names from names[0..n) as a bit mask: bit i set for names[i] (OR-ed into *mask).
 * nonempty: [] is refused too. Any error names sect.key with `expect`. */
static int get_name_mask(const json_t *v, const char *sect, const char *key, const char *expect,
                         const char *const *names, int n, int nonempty, unsigned *mask) {
    if (!json_is_array(v) || (nonempty && json_array_size(v) == 0))
        return bad(sect, key, expect, v);
    for (size_t i = 0; i < json_array_size(v); i++) {
        json_t *e = json_array_get(v, i);
        int found = -1;
        for (int m = 0; m < n && json_is_string(e); m++)
            if (!strcmp(json_string_value(e), names[m])) found = m;
        if (found < 0) return bad(sect, key, expect, e);
        *mask |= 1u << found;
    }
    return 0;
}

/* report {dir (null -> beside out_dir, see default_report_dir), plot, tensorboard}. */
static int parse_report(const json_t *report, bt_train_config *c) {
    int rc;
    if ((rc = check_keys(report, "report", k_report_keys)) ||
        (rc = get_bool(report, "report", "plot", 1, &c->report.plot)) ||
        (rc = get_bool(report, "report", "tensorboard", 0, &c->report.tensorboard)))
        return rc;
    json_t *rd = json_object_get(report, "dir");
    if (rd && !json_is_null(rd)) return get_str(report, "report", "dir", NULL, &c->report.dir);
    return 0;
}

/* dist {master_addr, master_port, timeout_s, heartbeat_timeout_s, secret_file (null: none)}. */
static int parse_dist(const json_t *dist, bt_train_config *c) {
    int rc;
    if ((rc = check_keys(dist, "dist", k_dist_keys)) ||
        (rc = get_str(dist, "dist", "master_addr", "127.0.0.1", &c->dist.master_addr)) ||
        (rc = get_i32(dist, "dist", "master_port", 29500, RANGE(1, 65535, 0, 0),
                      &c->dist.master_port)) ||
        (rc = get_i32(dist, "dist", "timeout_s", 600, RANGE(1, 86400, 0, 0), &c->dist.timeout_s)) ||
        (rc = get_i32(dist, "dist", "heartbeat_timeout_s", 60, RANGE(1, 86400, 0, 0),
                      &c->dist.heartbeat_timeout_s)))
        return rc;
    json_t *sf = json_object_get(dist, "secret_file");
    if (sf && !json_is_null(sf))
        return get_str(dist, "dist", "secret_file", NULL, &c->dist.secret_file);
    return 0;
}

/* cuda {attention, nf4_matmul, offload_checkpoints}. */
static int parse_cuda(const json_t *cuda, bt_train_config *c) {
    static const char *const attn_impls[] = {"wmma", "mma", NULL};
    static const char *const nf4_impls[] = {"dequant", "fused", NULL};
    int rc;
    if ((rc = check_keys(cuda, "cuda", k_cuda_keys)) ||
        (rc = get_enum(cuda, "cuda", "attention", BT_CUDA_ATTN_WMMA, attn_impls,
                       &c->cuda_attention)) ||
        (rc = get_enum(cuda, "cuda", "nf4_matmul", BT_CUDA_NF4_DEQUANT, nf4_impls,
                       &c->cuda_nf4_matmul)))
        return rc;
    return get_bool(cuda, "cuda", "offload_checkpoints", 0, &c->cuda_offload);
}

/* Top-level identity: name, model (required), base_dtype, base_model_name_or_path, socket. */
static int parse_identity(const json_t *root, bt_train_config *c) {
    static const char *const dtypes[] = {"nf4", "fp32", "gguf", "auto", NULL}; /* BT_BASE_* order */
    int rc;
    if ((rc = get_str(root, NULL, "name", "barqtrain", &c->name)) ||
        (rc = get_str(root, NULL, "model", NULL, &c->model)) ||
        (rc = get_enum(root, NULL, "base_dtype", BT_BASE_AUTO, dtypes, &c->base_dtype)) ||
        (rc = get_str(root, NULL, "base_model_name_or_path", "HuggingFaceTB/SmolLM2-135M-Instruct",
                      &c->base_model_name_or_path)))
        return rc;
    return get_str(root, NULL, "socket", bt_config_default_socket(), &c->socket);
}

/* data {shards (required), format, text_field, seq_len, micro_batch_size, seed,
 * tokenizer_threads}; a micro-batch holds at most 2^24 tokens. */
static int parse_data(const json_t *data, bt_train_config *c) {
    static const char *const formats[] = {"chat", "text", "alpaca", NULL};
    int rc, fmt;
    int64_t seed;
    if ((rc = get_strv(data, "data", "shards", 1, &c->data.shards, &c->data.n_shards)) ||
        (rc = get_enum(data, "data", "format", 0, formats, &fmt)) ||
        (rc = get_str(data, "data", "text_field", "text", &c->data.text_field)) ||
        /* what loaderd accepts (proto/job_limits.h): refused here, not at attach */
        (rc = get_i32(data, "data", "seq_len", 512, RANGE(BT_JOB_MIN_SEQ_LEN, BT_JOB_MAX_SEQ_LEN, 0, 0),
                      &c->data.seq_len)) ||
        (rc = get_i32(data, "data", "micro_batch_size", 4, RANGE(1, 4096, 0, 0),
                      &c->data.micro_batch_size)) ||
        (rc = get_int(data, "data", "seed", 1234, NONNEG, &seed)))
        return rc;
    c->data.format = bt_xstrdup(formats[fmt]);
    c->data.seed = (uint64_t)seed;
    if ((rc = get_i32(data, "data", "tokenizer_threads", 2, RANGE(1, BT_JOB_MAX_TOKENIZER_THREADS, 0, 0),
                      &c->data.tokenizer_threads)))
        return rc;
    if ((int64_t)c->data.seq_len * c->data.micro_batch_size > BT_JOB_MAX_BATCH_TOKENS)
        return bt_fail(BT_ERR_INVALID,
                       "config: data.seq_len x data.micro_batch_size = %lld tokens per micro-batch"
                       " exceeds %u",
                       (long long)c->data.seq_len * c->data.micro_batch_size, BT_JOB_MAX_BATCH_TOKENS);
    if ((unsigned)c->data.n_shards > BT_JOB_MAX_SHARD_PATTERNS)
        return bt_fail(BT_ERR_INVALID, "config: data.shards: %d patterns, loaderd takes at most %u",
                       c->data.n_shards, BT_JOB_MAX_SHARD_PATTERNS);
    return 0;
}

/* eval {shards, max_batches, lengths, every}. */
static int parse_eval(const json_t *eval, bt_train_config *c) {
    int rc;
    if ((rc = get_strv(eval, "eval", "shards", 0, &c->eval.shards, &c->eval.n_shards)) ||
        (rc = get_i32(eval, "eval", "max_batches", 0, NONNEG, &c->eval.max_batches)) ||
        (rc = get_i32(eval, "eval", "every", 0, NONNEG, &c->eval.every)))
        return rc;
    if ((unsigned)c->eval.n_shards > BT_JOB_MAX_SHARD_PATTERNS)
        return bt_fail(BT_ERR_INVALID, "config: eval.shards: %d patterns, loaderd takes at most %u",
                       c->eval.n_shards, BT_JOB_MAX_SHARD_PATTERNS);
    if ((rc = get_lengths(eval, c))) return rc;
    if (c->eval.every > 0 && c->eval.n_shards == 0)
        return bt_fail(BT_ERR_INVALID, "config: eval.every: %d, but eval.shards is empty (nothing "
                       "to evaluate)", c->eval.every);
    if (c->eval.every > 0 && c->eval.n_lengths > 0)
        return bt_fail(BT_ERR_INVALID, "config: eval.every: periodic evaluation is one loss per "
                       "step; it does not combine with eval.lengths (per-length perplexity is "
                       "measured before and after)");
    return 0;
}

/* lora {r, lora_alpha, lora_dropout, target_modules (absent: all BT_MOD_N modules)}. */
static int parse_lora(const json_t *lora, bt_train_config *c) {
    int rc;
    if ((rc = get_i32(lora, "lora", "r", 16, RANGE(1, BT_LORA_R_MAX, 0, 0), &c->lora.r)) ||
        (rc = get_num(lora, "lora", "lora_alpha", 32, RANGE(0, BT_LORA_ALPHA_MAX, 1, 0), &c->lora.alpha)) ||
        (rc = get_num(lora, "lora", "lora_dropout", 0.05, RANGE(0, 1, 0, 1), &c->lora.dropout)))
        return rc;
    json_t *tm = json_object_get(lora, "target_modules");
    if (!tm) {
        c->lora.target_mask = (1u << BT_MOD_N) - 1;
        return 0;
    }
    return get_name_mask(tm, "lora", "target_modules",
                         "a non-empty array of module names (q_proj, k_proj, v_proj, o_proj, "
                         "gate_proj, up_proj, down_proj)",
                         k_mod_names, BT_MOD_N, 1, &c->lora.target_mask);
}

/* optim {lr, weight_decay, beta1, beta2, eps, warmup_steps, grad_clip}.
 * Ranges (issue 10 §4): AdamW moves each parameter by about lr per step, so lr > 1 can only
 * diverge; decoupled weight decay scales by (1 - lr * wd), so wd in [0, 1]; betas are EMA
 * factors in [0, 1); eps only guards a division. */
static int parse_optim(const json_t *optim, bt_train_config *c) {
    int rc;
    if ((rc = get_num(optim, "optim", "lr", 2e-4, RANGE(0, 1, 1, 0), &c->optim.lr)) ||
        (rc = get_num(optim, "optim", "weight_decay", 0.0, RANGE(0, 1, 0, 0),
                      &c->optim.weight_decay)) ||
        (rc = get_num(optim, "optim", "beta1", 0.9, RANGE(0, 1, 0, 1), &c->optim.beta1)) ||
        (rc = get_num(optim, "optim", "beta2", 0.999, RANGE(0, 1, 0, 1), &c->optim.beta2)) ||
        (rc = get_num(optim, "optim", "eps", 1e-8, RANGE(0, 1, 1, 0), &c->optim.eps)) ||
        (rc = get_i32(optim, "optim", "warmup_steps", 0, NONNEG, &c->optim.warmup_steps)))
        return rc;
    return get_num(optim, "optim", "grad_clip", 1.0, RANGE(0, 1e6, 0, 0), &c->optim.grad_clip);
}

/* Top-level loop scalars: steps, grad_accum, schedule, min_lr_ratio, activation checkpointing,
 * save_every, out_dir, threads, device, seed, log_every, timeout_s. Needs data.seq_len. */
static int parse_loop(const json_t *root, bt_train_config *c) {
    static const char *const scheds[] = {"cosine", "linear", "constant", NULL};
    static const char *const devices[] = {"cpu", "cuda", NULL};
    int rc;
    int64_t seed;
    if ((rc = get_i32(root, NULL, "steps", 100, ATLEAST1, &c->steps)) ||
        (rc = get_i32(root, NULL, "grad_accum", 1, RANGE(1, 65536, 0, 0), &c->grad_accum)) ||
        (rc = get_enum(root, NULL, "schedule", BT_SCHED_COSINE, scheds, &c->schedule)) ||
        (rc = get_num(root, NULL, "min_lr_ratio", 0.1, RANGE(0, 1, 0, 0), &c->min_lr_ratio)) ||
        (rc = get_checkpointing(root, c)) ||
        (rc = get_i32(root, NULL, "save_every", 0, NONNEG, &c->save_every)) ||
        (rc = get_str(root, NULL, "out_dir", "runs/adapter", &c->out_dir)) ||
        (rc = get_i32(root, NULL, "threads", 0, RANGE(0, 1024, 0, 0), &c->threads)) ||
        (rc = get_enum(root, NULL, "device", BT_DEVICE_CPU, devices, &c->device)) ||
        (rc = get_int(root, NULL, "seed", 1234, NONNEG, &seed)))
        return rc;
    c->seed = (uint64_t)seed;
    if ((rc = get_i32(root, NULL, "log_every", 1, ATLEAST1, &c->log_every))) return rc;
    /* timeout_s <= INT_MAX / 1000: train.c waits timeout_s * 1000 ms (an int) */
    return get_i32(root, NULL, "timeout_s", 600, RANGE(1, 2147483, 0, 0), &c->timeout_s);
}

/* LoRA+ / LongLoRA trainable_modules (absent: none). */
static int parse_trainable(const json_t *root, bt_train_config *c) {
    json_t *tr = json_object_get(root, "trainable_modules");
    if (!tr) return 0;
    return get_name_mask(tr, NULL, "trainable_modules",
                         "an array of module names (embed_tokens, norm)", k_trainable_names,
                         BT_TRAINABLE_N, 0, &c->trainable_mask);
}

/* report.dir when not given: "report" beside the adapter directory, i.e. dirname(out_dir). */
static int default_report_dir(bt_train_config *c) {
    if (c->report.dir) return 0;
    size_t n = strlen(c->out_dir);
    while (n > 1 && c->out_dir[n - 1] == '/') n--;
    while (n > 0 && c->out_dir[n - 1] != '/') n--;
    while (n > 1 && c->out_dir[n - 1] == '/') n--;
    if (asprintf(&c->report.dir, "%.*s%sreport", (int)n, c->out_dir,
                 n == 0 || c->out_dir[n - 1] == '/' ? "" : "/") < 0)
        c->report.dir = NULL;
    if (!c->report.dir) return bt_fail(BT_ERR_NOMEM, "config: out of memory");
    return 0;
}

/* Checkpoints and resume: checkpoint_every, checkpoint_dir, stop_at_step, resume_from (null:
 * none). */
static int parse_checkpoints(const json_t *root, bt_train_config *c) {
    int rc;
    if ((rc = get_i32(root, NULL, "checkpoint_every", 0, NONNEG, &c->checkpoint_every)) ||
        (rc = get_str(root, NULL, "checkpoint_dir", "runs/checkpoint", &c->checkpoint_dir)) ||
        (rc = get_i32(root, NULL, "stop_at_step", 0, NONNEG, &c->stop_at_step)))
        return rc;
    json_t *rf = json_object_get(root, "resume_from");
    if (rf && !json_is_null(rf)) return get_str(root, NULL, "resume_from", NULL, &c->resume_from);
    return 0;
}

/* Constraints between keys of different sections, once every key is parsed. */
static int check_combinations(const bt_train_config *c) {
    /* the adapter saves replace out_dir as a whole: a checkpoint written there would lose
     * its trainer_state.bin at the next adapter save (save_every, or the final save right
     * after a stop_at_step / SIGTERM checkpoint) */
    if (c->checkpoint_every > 0 && same_dir(c->checkpoint_dir, c->out_dir))
        return bt_fail(BT_ERR_INVALID, "config: checkpoint_dir: expected a directory other than "
                       "out_dir (\"%s\": every adapter save replaces out_dir and would delete the "
                       "checkpoint's trainer_state.bin)", c->out_dir);
    /* each output directory belongs to one writer (trainer/io/outputs.h): one inside another would
     * be deleted by its replacement, or make it refuse to save */
    const struct {
        const char *key, *path;
    } outs[] = {{"out_dir", c->out_dir}, {"checkpoint_dir", c->checkpoint_dir}, {"report.dir", c->report.dir}};
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 3; j++) {
            if (i == j || (i + j == 1 && same_dir(c->out_dir, c->checkpoint_dir))) continue; /* checked above */
            if (same_or_inside(outs[i].path, outs[j].path))
                return bt_fail(BT_ERR_INVALID, "config: %s: \"%s\" is %s %s \"%s\": each of out_dir, checkpoint_dir "
                               "and report.dir must be a directory of its own, none inside another (every save "
                               "replaces out_dir and checkpoint_dir as a whole)", outs[j].key, outs[j].path,
                               same_dir(outs[i].path, outs[j].path) ? "the same directory as" : "inside",
                               outs[i].key, outs[i].path);
        }
    if (c->cuda_offload && !c->activation_checkpointing)
        return bt_fail(BT_ERR_INVALID, "config: cuda.offload_checkpoints: offloads the "
                       "checkpointed layer inputs, so it needs activation_checkpointing (true, or "
                       "\"auto\" with data.seq_len >= checkpointing_min_seq_len %d; seq_len is %d)",
                       c->checkpointing_min_seq_len, c->data.seq_len);
    if (c->stop_at_step > c->steps)
        return bt_fail(BT_ERR_INVALID, "config: stop_at_step: expected an integer in [0, steps = %d], "
                       "got %d", c->steps, c->stop_at_step);
    return 0;
}

/* Validates the job config tree `root` (a JSON object, borrowed; --set overrides already applied)
 * into *c (zeroed by the caller): every key of config.h with its default, type and range.
 * Sections are read in a fixed order (unknown top-level keys and non-object sections first, then
 * report, dist, cuda, the unknown keys of data/eval/lora/optim, identity, data, eval, long
 * context, lora, optim, loop, trainable modules, checkpoints, cross-key constraints), so the
 * first error reported for a given tree is always the same. Strings in *c are owned by *c.
 * Returns 0, or BT_ERR_INVALID / BT_ERR_NOMEM with bt_last_error() "config: <key path>: ..."
 * (the form message_path reads); *c is then partly filled and the caller frees it with
 * bt_config_free. */
static int parse_tree(bt_train_config *c, const json_t *root) {
    json_t *empty = json_object();
    sections s;
    int rc = get_sections(root, empty, &s);
    if (!rc) rc = parse_report(s.report, c);
    if (!rc) rc = parse_dist(s.dist, c);
    if (!rc) rc = parse_cuda(s.cuda, c);
    if (!rc) rc = check_keys(s.data, "data", k_data_keys);
    if (!rc) rc = check_keys(s.eval, "eval", k_eval_keys);
    if (!rc) rc = check_keys(s.lora, "lora", k_lora_keys);
    if (!rc) rc = check_keys(s.optim, "optim", k_optim_keys);
    if (!rc) rc = parse_identity(root, c);
    if (!rc) rc = parse_data(s.data, c);
    if (!rc) rc = parse_eval(s.eval, c);
    if (!rc) rc = get_long_context(root, c);
    if (!rc) rc = parse_lora(s.lora, c);
    if (!rc) rc = parse_optim(s.optim, c);
    if (!rc) rc = parse_loop(root, c); /* after data: "auto" checkpointing reads data.seq_len */
    if (!rc) rc = parse_trainable(root, c);
    if (!rc) rc = default_report_dir(c); /* after out_dir */
    if (!rc) rc = parse_checkpoints(root, c);
    if (!rc) rc = check_combinations(c);
    json_decref(empty);
    return rc;
}

void bt_config_free(bt_train_config *c) {
    if (!c) return;
    free(c->name);
    free(c->model);
    free(c->base_model_name_or_path);
    free(c->socket);
    free(c->dist.master_addr);
    free(c->dist.secret_file);
    free_strv(c->data.shards, c->data.n_shards);
    free(c->data.format);
    free(c->data.text_field);
    free_strv(c->eval.shards, c->eval.n_shards);
    free(c->out_dir);
    free(c->checkpoint_dir);
    free(c->resume_from);
    free(c->report.dir);
    memset(c, 0, sizeof *c);
}

/* ---- source lines (YAML configs) ---- */

/* The key path a validation message is about: "config: unknown key \"a.b\" ..." or
 * "config: a.b: ..." (every message of parse_tree names its key this way); "" if none. */
static void message_path(const char *msg, char *path, size_t n) {
    path[0] = 0;
    const char *p;
    if (!strncmp(msg, "config: unknown key \"", 21)) {
        p = msg + 21;
        size_t k = strcspn(p, "\"");
        snprintf(path, n, "%.*s", (int)(k < n ? k : n - 1), p);
        return;
    }
    if (strncmp(msg, "config: ", 8)) return;
    p = msg + 8;
    size_t k = strspn(p, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.#[]");
    if (k && p[k] == ':') snprintf(path, n, "%.*s", (int)(k < n ? k : n - 1), p);
}

/* Prefix the message of a failed validation with "<origin>:<line>" of the key it names (or of
 * its nearest ancestor present in the file, for a missing key); a key set by --set keeps the
 * message as it is (lines[path] = -1). */
static int with_line(int rc, const char *origin, const json_t *lines) {
    char msg[1024], path[256];
    snprintf(msg, sizeof msg, "%s", bt_last_error());
    message_path(msg, path, sizeof path);
    for (;;) {
        json_t *l = path[0] ? json_object_get(lines, path) : NULL;
        if (l) {
            if (json_integer_value(l) < 0) return rc;
            return bt_fail(rc, "config: %s:%lld: %s", origin, (long long)json_integer_value(l),
                           msg + 8);
        }
        char *cut = strrchr(path, '.'), *br = strrchr(path, '[');
        if (br && (!cut || br > cut)) cut = br;
        if (!cut) return rc;
        *cut = 0;
    }
}

/* --set overrides `kv`'s key: its lines (and those of the keys under it) no longer apply. */
static void lines_set(json_t *lines, const char *kv) {
    const char *eq = strchr(kv, '=');
    if (!lines || !eq) return;
    size_t n = (size_t)(eq - kv);
    const char *k;
    json_t *v;
    void *tmp;
    json_object_foreach_safe(lines, tmp, k, v) {
        if (!strncmp(k, kv, n) && (k[n] == '.' || k[n] == '[')) json_object_del(lines, k);
    }
    char *path = strndup(kv, n);
    if (path) json_object_set_new(lines, path, json_integer(-1));
    free(path);
}

/* The common back end of the JSON and YAML front ends: --set overrides, then validation. root
 * and lines are borrowed; lines (NULL for JSON) maps key paths to source lines. */
static int parse_root(bt_train_config *cfg, json_t *root, json_t *lines, const char *origin,
                      const char *const *sets, int n_sets) {
    int rc = 0;
    for (int i = 0; i < n_sets && rc == 0; i++) {
        rc = apply_set(root, sets[i]);
        lines_set(lines, sets[i]);
    }
    if (rc == 0 && (rc = parse_tree(cfg, root)) && lines) rc = with_line(rc, origin, lines);
    if (rc) bt_config_free(cfg);
    return rc;
}

int bt_config_parse(bt_train_config *cfg, const char *json_text, const char *origin,
                    const char *const *sets, int n_sets) {
    memset(cfg, 0, sizeof *cfg);
    json_t *root = NULL;
    const char *org = origin ? origin : "<text>";
    if (bt_json_loadb(&root, json_text, strlen(json_text), 0, org)) {
        /* "<origin>:<line>:<col>: ...": a YAML text fed to the JSON parser fails at 1:0 or 1:1 */
        const char *msg = bt_last_error();
        int line = 0, col = 0;
        size_t ol = strlen(org);
        if (!strncmp(msg, org, ol)) sscanf(msg + ol, ":%d:%d:", &line, &col);
        int yaml_hint = line == 1 && col <= 1 && origin &&
                        !(strlen(origin) > 5 && !strcmp(origin + strlen(origin) - 5, ".json"));
        return bt_fail(BT_ERR_FORMAT, "config: %s%s", msg,
                       yaml_hint ? " (a YAML config needs a .yaml or .yml file name)" : "");
    }
    if (!json_is_object(root)) {
        json_decref(root);
        return bt_fail(BT_ERR_FORMAT, "config: %s: expected a JSON object at top level",
                       origin ? origin : "<text>");
    }
    int rc = parse_root(cfg, root, NULL, origin, sets, n_sets);
    json_decref(root);
    return rc;
}

int bt_config_parse_yaml(bt_train_config *cfg, const char *text, size_t len, const char *origin,
                         const char *const *sets, int n_sets) {
    memset(cfg, 0, sizeof *cfg);
    if (!origin) origin = "<yaml>";
    json_t *root = NULL, *lines = NULL;
    int rc = bt_yaml_load(text, len, origin, &root, &lines);
    if (rc) return bt_fail(rc, "config: %s", bt_last_error_in("config"));
    rc = parse_root(cfg, root, lines, origin, sets, n_sets);
    json_decref(root);
    json_decref(lines);
    return rc;
}

int bt_config_is_yaml(const char *path) {
    size_t n = path ? strlen(path) : 0;
    return (n > 5 && !strcmp(path + n - 5, ".yaml")) || (n > 4 && !strcmp(path + n - 4, ".yml"));
}

int bt_config_load(bt_train_config *cfg, const char *path, const char *const *sets, int n_sets) {
    memset(cfg, 0, sizeof *cfg);
    char *text = NULL;
    size_t size = 0;
    int rc = bt_read_file(path, 64u << 20, &text, &size);
    if (rc) return bt_fail(rc, "config: cannot read %s: %s", path, bt_last_error_in("config"));
    rc = bt_config_is_yaml(path) ? bt_config_parse_yaml(cfg, text, size, path, sets, n_sets)
                                 : bt_config_parse(cfg, text, path, sets, n_sets);
    free(text);
    return rc;
}

/* ---- which command reads which key ---- */

/* path is read when it equals an entry, lies under one ("eval.shards" under "eval"), or is a
 * section holding one ("data" holds "data.seq_len"). */
static int in_list(const char *path, const char *const *list) {
    size_t n = strlen(path);
    for (int i = 0; list[i]; i++) {
        size_t m = strlen(list[i]);
        if (!strcmp(path, list[i])) return 1;
        if (n > m && !strncmp(path, list[i], m) && path[m] == '.') return 1;
        if (m > n && !strncmp(list[i], path, n) && list[i][n] == '.') return 1;
    }
    return 0;
}

int bt_config_key_used(int command, const char *path, const bt_train_config *cfg) {
    static const char *const eval_keys[] = {
        "name", "model", "base_dtype", "socket", "data.format", "data.text_field", "data.seq_len",
        "data.micro_batch_size", "data.seed", "data.tokenizer_threads", "eval",
        "activation_checkpointing", "threads", "timeout_s", "device", "dist", "resume_from",
        "context_extension", NULL};
    static const char *const ckpt_keys[] = {"lora", "trainable_modules", "seed", "grad_accum",
                                            "data.shards", NULL};
    static const char *const estimate_keys[] = {
        "model", "base_dtype", "data.seq_len", "data.micro_batch_size", "grad_accum", "lora.r",
        "lora.target_modules", "trainable_modules", "activation_checkpointing", "threads",
        "checkpointing_min_seq_len", "context_extension", "attention", "eval.lengths",
        "eval.shards", NULL};
    static const char *const cuda_keys[] = {"cuda", NULL};
    if (in_list(path, cuda_keys) && command != BT_CMD_ESTIMATE)
        return cfg->device == BT_DEVICE_CUDA;
    switch (command) {
    case BT_CMD_TRAIN: return 1;
    case BT_CMD_EVAL:
        if (in_list(path, eval_keys)) return !(cfg->eval_adapter && !strcmp(path, "resume_from"));
        return cfg->resume_from && !cfg->eval_adapter && in_list(path, ckpt_keys);
    default: return in_list(path, estimate_keys);
    }
}

static json_t *strv_json(char *const *v, int n) {
    json_t *a = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(a, json_string(v[i]));
    return a;
}

/* Relative paths (and globs) are resolved against the trainer's working directory, since
 * loaderd runs elsewhere. */
static json_t *abs_path_json(const char *p) {
    if (p[0] == '/') return json_string(p);
    char *cwd = getcwd(NULL, 0);
    if (!cwd) return json_string(p);
    size_t n = strlen(cwd) + strlen(p) + 2;
    char *buf = bt_xmalloc(n);
    snprintf(buf, n, "%s/%s", cwd, p[0] == '.' && p[1] == '/' ? p + 2 : p);
    json_t *j = json_string(buf);
    free(buf);
    free(cwd);
    return j;
}

static json_t *abs_strv_json(char *const *v, int n) {
    json_t *a = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(a, abs_path_json(v[i]));
    return a;
}

char *bt_config_job_json(const bt_train_config *c, int eval) {
    json_t *j = json_object();
    char name[512];
    snprintf(name, sizeof name, "%s%s", c->name, eval ? "-eval" : "");
    json_object_set_new(j, "name", json_string(name));
    json_object_set_new(j, "shards", eval ? abs_strv_json(c->eval.shards, c->eval.n_shards)
                                          : abs_strv_json(c->data.shards, c->data.n_shards));
    json_object_set_new(j, "format", json_string(c->data.format));
    if (!strcmp(c->data.format, "text")) /* loaderd refuses it with other formats */
        json_object_set_new(j, "text_field", json_string(c->data.text_field));
    json_object_set_new(j, "tokenizer", abs_path_json(c->model));
    json_object_set_new(j, "seq_len", json_integer(c->data.seq_len));
    json_object_set_new(j, "micro_batch_size", json_integer(c->data.micro_batch_size));
    json_object_set_new(j, "seed", json_integer((json_int_t)c->data.seed));
    json_object_set_new(j, "epochs", json_integer(eval ? 1 : 0));
    /* not in proto/client.h's list, but loaderd's job spec parser accepts it */
    json_object_set_new(j, "tokenizer_threads", json_integer(c->data.tokenizer_threads));
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    return s;
}

char *bt_config_dump(const bt_train_config *c) {
    static const char *const scheds[] = {"cosine", "linear", "constant"};
    json_t *tm = json_array();
    for (int m = 0; m < BT_MOD_N; m++)
        if (c->lora.target_mask & (1u << m)) json_array_append_new(tm, json_string(k_mod_names[m]));
    json_t *trm = json_array();
    for (int m = 0; m < BT_TRAINABLE_N; m++)
        if (c->trainable_mask & (1u << m))
            json_array_append_new(trm, json_string(k_trainable_names[m]));
    json_t *j = json_pack(
        "{s:s, s:s, s:s, s:s, s:s,"
        " s:{s:o, s:s, s:s, s:i, s:i, s:I, s:i},"
        " s:{s:o, s:i, s:i},"
        " s:{s:i, s:f, s:f, s:o},"
        " s:{s:f, s:f, s:f, s:f, s:f, s:i, s:f},"
        " s:i, s:i, s:s, s:f, s:b, s:i, s:s, s:i, s:I, s:i, s:i}",
        "name", c->name, "model", c->model, "base_dtype", bt_base_dtype_name(c->base_dtype),
        "base_model_name_or_path", c->base_model_name_or_path, "socket", c->socket,
        "data", "shards", strv_json(c->data.shards, c->data.n_shards), "format", c->data.format,
        "text_field", c->data.text_field, "seq_len", c->data.seq_len, "micro_batch_size",
        c->data.micro_batch_size, "seed", (json_int_t)c->data.seed, "tokenizer_threads",
        c->data.tokenizer_threads,
        "eval", "shards", strv_json(c->eval.shards, c->eval.n_shards), "max_batches",
        c->eval.max_batches, "every", c->eval.every,
        "lora", "r", c->lora.r, "lora_alpha", c->lora.alpha, "lora_dropout", c->lora.dropout,
        "target_modules", tm,
        "optim", "lr", c->optim.lr, "weight_decay", c->optim.weight_decay, "beta1", c->optim.beta1,
        "beta2", c->optim.beta2, "eps", c->optim.eps, "warmup_steps", c->optim.warmup_steps,
        "grad_clip", c->optim.grad_clip,
        "steps", c->steps, "grad_accum", c->grad_accum, "schedule", scheds[c->schedule],
        "min_lr_ratio", c->min_lr_ratio, "activation_checkpointing", c->activation_checkpointing,
        "save_every", c->save_every, "out_dir", c->out_dir, "threads", c->threads, "seed",
        (json_int_t)c->seed, "log_every", c->log_every, "timeout_s", c->timeout_s);
    if (!j) {
        json_decref(trm);
        return NULL;
    }
    json_object_set_new(j, "trainable_modules", trm);
    json_object_set_new(j, "checkpoint_every", json_integer(c->checkpoint_every));
    json_object_set_new(j, "checkpoint_dir", json_string(c->checkpoint_dir));
    json_object_set_new(j, "resume_from", c->resume_from ? json_string(c->resume_from) : json_null());
    json_object_set_new(j, "stop_at_step", json_integer(c->stop_at_step));
    json_object_set_new(j, "device", json_string(c->device == BT_DEVICE_CUDA ? "cuda" : "cpu"));
    json_object_set_new(j, "cuda", json_pack("{s:s, s:s, s:b}", "attention",
                                             c->cuda_attention == BT_CUDA_ATTN_MMA ? "mma" : "wmma",
                                             "nf4_matmul",
                                             c->cuda_nf4_matmul == BT_CUDA_NF4_FUSED ? "fused"
                                                                                     : "dequant",
                                             "offload_checkpoints", c->cuda_offload));
    json_object_set_new(j, "report", json_pack("{s:s, s:b, s:b}", "dir", c->report.dir, "plot",
                                               c->report.plot, "tensorboard", c->report.tensorboard));
    json_object_set_new(j, "checkpointing_min_seq_len", json_integer(c->checkpointing_min_seq_len));
    static const char *const methods[] = {"none", "linear", "yarn", "dynamic"};
    json_object_set_new(j, "context_extension",
                        c->context_extension.target_length > 0
                            ? json_pack("{s:i, s:s}", "target_length",
                                        c->context_extension.target_length, "method",
                                        methods[c->context_extension.method])
                            : json_null());
    json_object_set_new(j, "attention",
                        json_pack("{s:o}", "s2",
                                  c->s2_group_fraction > 0
                                      ? json_pack("{s:f}", "group_fraction", c->s2_group_fraction)
                                      : json_null()));
    json_t *lens = json_array();
    for (int i = 0; i < c->eval.n_lengths; i++)
        json_array_append_new(lens, json_integer(c->eval.lengths[i]));
    json_object_set_new(json_object_get(j, "eval"), "lengths", lens);
    json_object_set_new(j, "dist", json_pack("{s:s, s:i, s:i, s:i, s:o}", "master_addr",
                                             c->dist.master_addr, "master_port", c->dist.master_port,
                                             "timeout_s", c->dist.timeout_s, "heartbeat_timeout_s",
                                             c->dist.heartbeat_timeout_s, "secret_file",
                                             c->dist.secret_file ? json_string(c->dist.secret_file)
                                                                 : json_null()));
    char *s = json_dumps(j, JSON_COMPACT | JSON_REAL_PRECISION(10));
    json_decref(j);
    return s;
}
