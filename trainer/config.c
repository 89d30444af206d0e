/* Trainer job configuration: the JSON and YAML front ends, --set overrides, what the key table
 * (trainer/config_keys.c) leaves open, the loaderd job spec and the dump. Keys: docs/CONFIG.md. */
#include "trainer/config.h"

#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/bt_json.h"
#include "common/yaml_json.h"
#include "proto/client.h"
#include "proto/job_limits.h"

const char *bt_base_dtype_name(int base_dtype) {
    static const char *const names[] = {"nf4", "fp32", "gguf", "auto"};
    return base_dtype >= 0 && base_dtype <= BT_BASE_AUTO ? names[base_dtype] : "?";
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

/* ---- after the keys: defaults that depend on others, checks across keys ---- */

int bt_config_s2_group(const bt_train_config *c) {
    if (!(c->s2_group_fraction > 0)) return 0;
    long g = 2 * lround(c->data.seq_len * c->s2_group_fraction / 2.0);
    return g < 2 ? 2 : (int)g;
}

/* A refusal about key `key` (its path into *bad for the YAML line; "" for none). */
static int fail_at(bt_keypath *bad, const char *key, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail_at(bt_keypath *bad, const char *key, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(bad->s, sizeof bad->s, "%s", key);
    return bt_fail(BT_ERR_INVALID, "%s", msg);
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
    if (!c->report.dir) return bt_fail(BT_ERR_NOMEM, "out of memory");
    return 0;
}

/* objective and preference.*: the algorithm's TRL defaults (bt_pref_defaults; "simpo" is CPO with
 * loss_type simpo and cpo_alpha 0), then the keys given, checked by bt_pref_check; the data format
 * must carry what the objective trains on. (A backend without the log-prob passes is refused when
 * the run starts: trainer/loop/train.c, keyed off the backend's ops.) */
static int resolve_objective(bt_train_config *c, bt_keypath *bad) {
    const int pref_fmt = !strcmp(c->data.format, "preference"), kto_fmt = !strcmp(c->data.format, "kto");
    c->pref_on = strcmp(c->objective, "sft") != 0;
    if (!c->pref_on) {
        if (pref_fmt || kto_fmt)
            return fail_at(bad, "objective", "objective: \"sft\" trains on demonstrations, but data.format is "
                           "\"%s\": set objective to %s", c->data.format,
                           kto_fmt ? "\"kto\"" : "\"dpo\", \"orpo\", \"simpo\" or \"cpo\"");
        return 0;
    }
    int simpo = 0;
    const int algo = bt_pref_algo_parse(c->objective, &simpo);
    if (algo < 0) return fail_at(bad, "objective", "objective: unknown \"%s\"", c->objective);
    if (algo == BT_PREF_KTO ? !kto_fmt : !pref_fmt)
        return fail_at(bad, "data.format", "data.format: objective \"%s\" trains on %s records, so data.format "
                       "must be \"%s\", got \"%s\"", c->objective,
                       algo == BT_PREF_KTO ? "{prompt, completion, label}" : "{prompt, chosen, rejected}",
                       algo == BT_PREF_KTO ? "kto" : "preference", c->data.format);
    if (c->eval.n_lengths > 0)
        return fail_at(bad, "eval.lengths", "eval.lengths: per-length perplexity is a language-modelling "
                       "measure; objective \"%s\" evaluates its preference metrics on eval.shards", c->objective);
    bt_pref_params *p = &c->pref;
    bt_pref_defaults(p, (bt_pref_algo)algo);
    if (simpo) {
        p->loss_type[0] = BT_PREF_LOSS_SIMPO;
        p->cpo_alpha = 0.0;
    }
    if (c->preference.n_loss_type > 0) {
        for (int i = 0; i < c->preference.n_loss_type; i++) {
            int t = bt_pref_loss_type_parse(p->algo, c->preference.loss_type[i]);
            if (t < 0 || (simpo && t != BT_PREF_LOSS_SIMPO))
                return fail_at(bad, "preference.loss_type", "preference.loss_type: \"%s\" is not a loss type of "
                               "objective \"%s\" (%s)", c->preference.loss_type[i], c->objective,
                               algo == BT_PREF_DPO ? "sigmoid, hinge, ipo, robust, exo_pair"
                               : simpo            ? "simpo"
                               : algo == BT_PREF_CPO ? "sigmoid, hinge, ipo, simpo"
                               : algo == BT_PREF_KTO ? "kto, apo_zero_unpaired"
                                                     : "orpo");
            for (int j = 0; j < i; j++)
                if ((int)p->loss_type[j] == t)
                    return fail_at(bad, "preference.loss_type", "preference.loss_type: \"%s\" is listed twice",
                                   c->preference.loss_type[i]);
            p->loss_type[i] = (bt_pref_loss_type)t;
        }
        p->n_loss_types = c->preference.n_loss_type;
    }
    if (c->preference.n_loss_weights > 0) {
        if (c->preference.n_loss_weights != p->n_loss_types)
            return fail_at(bad, "preference.loss_weights", "preference.loss_weights: %d weights for %d loss types "
                           "(preference.loss_type)", c->preference.n_loss_weights, p->n_loss_types);
        for (int i = 0; i < p->n_loss_types; i++) p->loss_weights[i] = c->preference.loss_weights[i];
    }
    p->beta = c->preference.beta;
    p->label_smoothing = c->preference.label_smoothing;
    p->simpo_gamma = c->preference.simpo_gamma;
    if (!isnan(c->preference.cpo_alpha)) p->cpo_alpha = c->preference.cpo_alpha;
    p->desirable_weight = c->preference.desirable_weight;
    p->undesirable_weight = c->preference.undesirable_weight;
    char why[256];
    if (bt_pref_check(p, why, sizeof why))
        return fail_at(bad, "preference", "preference: %s (objective \"%s\")", why, c->objective);
    if (c->preference.precompute_ref_log_probs && p->algo != BT_PREF_DPO && p->algo != BT_PREF_KTO)
        return fail_at(bad, "preference.precompute_ref_log_probs", "preference.precompute_ref_log_probs: objective "
                       "\"%s\" has no reference model (only dpo and kto use one)", c->objective);
    return 0;
}

/* What the rows leave open: the socket from the environment, "auto" checkpointing against
 * data.seq_len, method "none" as no extension, report.dir beside out_dir; then the constraints
 * between keys of different sections. */
static int finish(bt_train_config *c, bt_keypath *bad) {
    if (!c->socket) c->socket = bt_xstrdup(bt_config_default_socket());
    if (c->checkpointing_auto) c->activation_checkpointing = c->data.seq_len >= c->checkpointing_min_seq_len;
    if (c->context_extension.method == BT_ROPE_EXT_NONE) c->context_extension.target_length = 0;
    int rc = default_report_dir(c);
    if (rc) return rc;
    if (c->eval.every > 0 && c->eval.n_shards == 0)
        return fail_at(bad, "eval.every", "eval.every: %d, but eval.shards is empty (nothing to "
                       "evaluate)", c->eval.every);
    if (c->eval.every > 0 && c->eval.n_lengths > 0)
        return fail_at(bad, "eval.every", "eval.every: periodic evaluation is one loss per step; it "
                       "does not combine with eval.lengths (per-length perplexity is measured before "
                       "and after)");
    if ((int64_t)c->data.seq_len * c->data.micro_batch_size > BT_JOB_MAX_BATCH_TOKENS)
        return fail_at(bad, "", "data.seq_len x data.micro_batch_size = %lld tokens per micro-batch exceeds %u",
                       (long long)c->data.seq_len * c->data.micro_batch_size, BT_JOB_MAX_BATCH_TOKENS);
    /* the adapter saves replace out_dir as a whole: a checkpoint written there would lose
     * its trainer_state.bin at the next adapter save (save_every, or the final save right
     * after a stop_at_step / SIGTERM checkpoint) */
    if (c->checkpoint_every > 0 && same_dir(c->checkpoint_dir, c->out_dir))
        return fail_at(bad, "checkpoint_dir", "checkpoint_dir: expected a directory other than "
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
                return fail_at(bad, outs[j].key, "%s: \"%s\" is %s %s \"%s\": each of out_dir, checkpoint_dir "
                               "and report.dir must be a directory of its own, none inside another (every save "
                               "replaces out_dir and checkpoint_dir as a whole)", outs[j].key, outs[j].path,
                               same_dir(outs[i].path, outs[j].path) ? "the same directory as" : "inside",
                               outs[i].key, outs[i].path);
        }
    if (c->cuda_offload && !c->activation_checkpointing)
        return fail_at(bad, "cuda.offload_checkpoints", "cuda.offload_checkpoints: offloads the "
                       "checkpointed layer inputs, so it needs activation_checkpointing (true, or "
                       "\"auto\" with data.seq_len >= checkpointing_min_seq_len %d; seq_len is %d)",
                       c->checkpointing_min_seq_len, c->data.seq_len);
    if ((rc = resolve_objective(c, bad))) return rc;
    if (c->stop_at_step > c->steps)
        return fail_at(bad, "stop_at_step", "stop_at_step: expected an integer in [0, steps = %d], got %d", c->steps,
                       c->stop_at_step);
    return 0;
}

/* Validates the job config tree `root` (a JSON object, borrowed; --set overrides already applied)
 * into *c (zeroed by the caller): the rows' defaults, then every key through bt_config_keys (in
 * the file's order; unknown keys refused naming the known ones), then finish(). Strings in *c
 * are owned by *c. Returns 0, or BT_ERR_INVALID / BT_ERR_NOMEM with bt_last_error() "<message
 * naming the key>" and *bad = the key's path ("" when the message is about no single key); *c
 * is then partly filled and the caller frees it with bt_config_free. */
static int parse_tree(bt_train_config *c, json_t *root, bt_keypath *bad) {
    bad->s[0] = 0;
    int rc = bt_keytab_defaults(bt_config_keys, c);
    if (!rc) rc = bt_keytab_parse(bt_config_keys, root, c, NULL, "", BT_KEYTAB_COMMENTS | BT_KEYTAB_GOT, bad);
    if (!rc) rc = finish(c, bad);
    return rc;
}

void bt_config_free(bt_train_config *c) {
    if (!c) return;
    bt_keytab_free(bt_config_keys, c);
    memset(c, 0, sizeof *c);
}

/* ---- source lines (YAML configs) ---- */

/* The message of a failed validation as "config: <origin>:<line>: <message>" with the line of
 * the key it is about (path, as bt_keytab_parse returns it; or of its nearest ancestor present in
 * the file, for a missing key), else "config: <message>" (lines NULL: JSON; a key set by --set:
 * lines[path] = -1; path "": about no single key). */
static int with_line(int rc, const char *origin, const json_t *lines, const char *key) {
    char msg[1024], path[BT_KEY_PATH_MAX];
    snprintf(msg, sizeof msg, "%s", bt_last_error());
    snprintf(path, sizeof path, "%s", key);
    for (;;) {
        json_t *l = lines && path[0] ? json_object_get(lines, path) : NULL;
        if (l) {
            if (json_integer_value(l) < 0) break;
            return bt_fail(rc, "config: %s:%lld: %s", origin, (long long)json_integer_value(l), msg);
        }
        char *cut = strrchr(path, '.'), *br = strrchr(path, '[');
        if (br && (!cut || br > cut)) cut = br;
        if (!lines || !cut) break;
        *cut = 0;
    }
    return bt_fail(rc, "config: %s", msg);
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
    bt_keypath bad;
    if (rc == 0 && (rc = parse_tree(cfg, root, &bad))) rc = with_line(rc, origin, lines, bad.s);
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

/* Whether row k, or a row under it (a section), has flag. */
static int row_has(const bt_key *k, unsigned flag) {
    if (k->type != BT_KEY_OBJ) return (k->flags & flag) != 0;
    for (const bt_key *s = k->sub; s->name; s++)
        if (!s->alias && row_has(s, flag)) return 1;
    return 0;
}

int bt_config_key_used(int command, const char *path, const bt_train_config *cfg) {
    const bt_key *k = bt_keytab_find(bt_config_keys, path);
    if ((!strcmp(path, "cuda") || !strncmp(path, "cuda.", 5)) && command != BT_CMD_ESTIMATE)
        return cfg->device == BT_DEVICE_CUDA;
    switch (command) {
    case BT_CMD_TRAIN: return 1;
    case BT_CMD_EVAL:
        if (k && row_has(k, BT_CFG_EVAL)) return !(cfg->eval_adapter && !strcmp(path, "resume_from"));
        return cfg->resume_from && !cfg->eval_adapter && k && row_has(k, BT_CFG_CKPT);
    default: return k && row_has(k, BT_CFG_ESTIMATE);
    }
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

char *bt_config_job_json(const bt_train_config *c, int eval, const char *ref_base) {
    json_t *j = json_object();
    char name[512];
    snprintf(name, sizeof name, "%s%s", c->name, eval ? "-eval" : "");
    json_object_set_new(j, "name", json_string(name));
    json_object_set_new(j, "shards", eval ? abs_strv_json(c->eval.shards, c->eval.n_shards)
                                          : abs_strv_json(c->data.shards, c->data.n_shards));
    json_object_set_new(j, "format", json_string(c->data.format));
    if (!strcmp(c->data.format, "text")) /* loaderd refuses it with other formats */
        json_object_set_new(j, "text_field", json_string(c->data.text_field));
    else if (c->data.chat_template && strcmp(c->data.chat_template, "auto")) /* "auto": loaderd's default */
        json_object_set_new(j, "chat_template", json_string(c->data.chat_template));
    if (c->data.max_prompt_length > 0) /* preference / kto truncation (TRL's names) */
        json_object_set_new(j, "max_prompt_length", json_integer(c->data.max_prompt_length));
    if (c->data.max_length > 0) json_object_set_new(j, "max_length", json_integer(c->data.max_length));
    if (ref_base) json_object_set_new(j, "ref_base", json_string(ref_base));
    /* a Hugging Face model directory: its tokenizer.json (loaderd opens regular files only, and
     * reads the tokenizer_config.json beside it) */
    struct stat mst;
    if (stat(c->model, &mst) == 0 && S_ISDIR(mst.st_mode)) {
        size_t n = strlen(c->model) + sizeof "/tokenizer.json";
        char *tp = bt_xmalloc(n);
        snprintf(tp, n, "%s%stokenizer.json", c->model,
                 c->model[0] && c->model[strlen(c->model) - 1] == '/' ? "" : "/");
        json_object_set_new(j, "tokenizer", abs_path_json(tp));
        free(tp);
    } else {
        json_object_set_new(j, "tokenizer", abs_path_json(c->model));
    }
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
    json_t *j = bt_keytab_dump(bt_config_keys, c);
    char *s = json_dumps(j, JSON_COMPACT | JSON_REAL_PRECISION(10));
    json_decref(j);
    return s;
}

void bt_config_reference_md(FILE *f) {
    fputs("<!-- Generated by `trainer config --reference` from trainer/config_keys.c (make docs);\n"
          "     edit the table there, then regenerate: tests/py/test_trainer_cli.py checks this file. -->\n"
          "# Trainer job configuration keys\n\n"
          "A job is a JSON or YAML (`.yaml` / `.yml`) file of these keys, every one optional unless it says\n"
          "\"required\"; `--set key.path=value` overrides one (the value read as JSON when it parses, else as a\n"
          "string). Keys starting with `#` are comments in every object. `trainer config --check JOB` prints\n"
          "the effective configuration, `trainer config --template NAME --documented` a commented job.\n"
          "Errors name the key and what it accepts, e.g. `config: job.yaml:12: optim.lr: expected a number\n"
          "in (0, 1], got \"abc\"`.\n\n", f);
    bt_keytab_doc_md_ex(bt_config_keys, "", BT_KEYTAB_GOT, f);
    fputs("\nAcross keys: data.seq_len x data.micro_batch_size <= 2^24 tokens; out_dir, checkpoint_dir and\n"
          "report.dir are three directories, none inside another; cuda.offload_checkpoints needs activation\n"
          "checkpointing; stop_at_step <= steps; eval.every needs eval.shards and no eval.lengths; objective\n"
          "\"dpo\", \"orpo\", \"simpo\" and \"cpo\" need data.format \"preference\", \"kto\" needs \"kto\", \"sft\" neither;\n"
          "a preference objective needs a backend with the log-prob passes (device \"cpu\" and \"cuda\" both\n"
          "have them; one without is refused when the run starts).\n", f);
}
