/* Config templates for `trainer config --template NAME [--documented]`. See config.h
 * (bt_config_template) for the recipes and their sources. Documentation is carried by "#"-keys,
 * which the config parser ignores: "#" documents the enclosing object, "#key" the key after it. */
#include <getopt.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/yaml_json.h"
#include "trainer/config.h"

const char *const bt_config_template_names[] = {"default", "qlora", "long-context", NULL};

/* A recipe: its header and the keys it sets ("path=JSON", over k_base), on the table's defaults.
 * A template writes the rows flagged BT_CFG_TEMPLATE and the keys its recipe sets, in the table's
 * order, each with its row's doc as "#key" when documented. */
typedef struct {
    const char *name, *header;
    const char *const *sets;
} recipe;

static const char *const k_base[] = {"model=\"models/SmolLM2-135M-Instruct.Q4_1.gguf\"",
                                     "data.shards=[\"data/train-*.jsonl.zst\"]", NULL};

static const char *const k_default_sets[] = {
    "name=\"default\"", "steps=30", "optim.lr=1e-3", "optim.warmup_steps=3", "activation_checkpointing=false", NULL};

static const char *const k_qlora_sets[] = {
    "name=\"qlora\"", "base_dtype=\"nf4\"", "data.seq_len=1024", "grad_accum=4", "steps=1000",
    "optim.warmup_steps=30", "lora.r=64", "lora.lora_alpha=16.0", "lora.lora_dropout=0.1", "optim.grad_clip=0.3",
    "min_lr_ratio=1.0", "schedule=\"constant\"", "log_every=10", "activation_checkpointing=false", NULL};

static const char *const k_long_sets[] = {
    "name=\"long-context\"", "data.format=\"text\"", "data.seq_len=16384", "data.micro_batch_size=1",
    "eval.lengths=[2048, 4096, 8192, 16384]", "context_extension.target_length=16384",
    "context_extension.method=\"linear\"", "attention.s2.group_fraction=0.25", "lora.r=8", "lora.lora_alpha=16.0",
    "lora.lora_dropout=0.0", "lora.target_modules=[\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\"]", "optim.lr=2e-5",
    "optim.warmup_steps=20", "steps=1000", "grad_accum=8", "schedule=\"constant\"", "min_lr_ratio=1.0",
    "activation_checkpointing=\"auto\"", "checkpointing_min_seq_len=4096", "log_every=10",
    "trainable_modules=[\"embed_tokens\", \"norm\"]", NULL};

static const recipe k_recipes[] = {
    {"default",
     "The SmolLM2-135M demo job: LoRA r 16 on all linear layers over the GGUF's own Q4_1 "
     "weights (base_dtype auto = gguf), 512-token packed rows x 4, 30 steps, cosine schedule.",
     k_default_sets},
    {"qlora",
     "QLoRA recipe (Dettmers et al. 2023, arXiv 2305.14314): NF4 base with double quantisation, "
     "LoRA r 64 alpha 16 dropout 0.1 on all linear layers, lr 2e-4 constant, max grad norm 0.3, "
     "warm-up 3% of steps, effective batch 16.",
     k_qlora_sets},
    {"long-context",
     "LongLoRA recipe (Chen et al. 2023, arXiv 2309.12307, fine-tune.py, supervised-fine-tune "
     "settings aside): extend the context of SmolLM2 (trained at 8192) to 16384 tokens with "
     "linear position interpolation, train with S2-Attn (group 1/4 of the row, half the heads "
     "shifted) and activation checkpointing on plain text rows, LoRA r 8 alpha 16 on q/k/v/o plus "
     "trainable embed_tokens and norms (\"LoRA+\"), lr 2e-5 constant after 20 warm-up steps, no "
     "weight decay, batch 1 x grad_accum 8; held-out perplexity at 2K / 4K / 8K / 16K tokens.",
     k_long_sets},
};

/* sets ("path=JSON") into the map path -> value. */
static void add_sets(json_t *map, const char *const *sets) {
    for (int i = 0; sets[i]; i++) {
        const char *eq = strchr(sets[i], '=');
        char path[BT_KEY_PATH_MAX];
        snprintf(path, sizeof path, "%.*s", (int)(eq - sets[i]), sets[i]);
        json_object_set_new(map, path, json_loads(eq + 1, JSON_DECODE_ANY, NULL));
    }
}

/* Whether the recipe sets a key under section path. */
static int sets_under(const json_t *map, const char *path) {
    size_t n = strlen(path);
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)map, k, v) {
        if (!strncmp(k, path, n) && k[n] == '.') return 1;
    }
    return 0;
}

/* The rows of tab (section prefix, "" at the top) into o. */
static void emit(const bt_key *tab, const char *prefix, json_t *o, const json_t *map, int doc) {
    for (const bt_key *k = tab; k->name; k++) {
        if (k->alias) continue;
        char path[BT_KEY_PATH_MAX], hash[BT_KEY_PATH_MAX + 1];
        snprintf(path, sizeof path, "%s%s", prefix, k->name);
        snprintf(hash, sizeof hash, "#%s", k->name);
        const int every = (k->flags & BT_CFG_TEMPLATE) != 0;
        if (k->type == BT_KEY_OBJ) {
            if (!every && !sets_under(map, path)) continue;
            json_t *sub = json_object();
            if (doc) json_object_set_new(sub, "#", json_string(k->doc));
            char sp[BT_KEY_PATH_MAX + 1];
            snprintf(sp, sizeof sp, "%s.", path);
            emit(k->sub, sp, sub, map, doc);
            json_object_set_new(o, k->name, sub);
            continue;
        }
        json_t *v = json_object_get(map, path);
        if (v) v = json_incref(v);
        else if (every && k->def) v = json_loads(k->def, JSON_DECODE_ANY, NULL);
        if (!v) { /* unset: a key whose default is not a value (socket) is documented only */
            if (doc && !k->def && !every) json_object_set_new(o, hash, json_string(k->doc));
            continue;
        }
        if (doc) json_object_set_new(o, hash, json_string(k->doc));
        json_object_set_new(o, k->name, v);
    }
}

static json_t *build(const recipe *R, int doc) {
    json_t *root = json_object(), *map = json_object();
    if (doc) {
        json_object_set_new(root, "#", json_string(R->header));
        json_object_set_new(root, "#comments",
                            json_string("Keys starting with '#' are comments: the trainer ignores "
                                        "them in every object. Relative paths are resolved "
                                        "against the trainer's working directory. Every key: "
                                        "docs/CONFIG.md."));
    }
    add_sets(map, k_base);
    add_sets(map, R->sets);
    emit(bt_config_keys, "", root, map, doc);
    json_decref(map);
    return root;
}

char *bt_config_template(const char *name, int documented) {
    for (size_t i = 0; i < sizeof k_recipes / sizeof k_recipes[0]; i++) {
        if (!name || strcmp(name, k_recipes[i].name) != 0) continue;
        json_t *j = build(&k_recipes[i], documented != 0);
        char *s = json_dumps(j, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(10));
        json_decref(j);
        if (!s) bt_fail(BT_ERR_NOMEM, "config: out of memory");
        return s;
    }
    bt_fail(BT_ERR_INVALID, "config: unknown template \"%s\" (known: default, qlora, long-context)",
            name ? name : "(null)");
    return NULL;
}

/* JSON text (freed) -> YAML text (malloc'd), NULL with bt_last_error on failure. */
static char *as_yaml(char *json_text) {
    json_t *j = json_loads(json_text, 0, NULL);
    free(json_text);
    char *y = bt_yaml_dump(j);
    json_decref(j);
    if (!y) bt_fail(BT_ERR_NOMEM, "config: out of memory");
    return y;
}

/* The value at dotted `key` of the effective config `dump` (JSON text): a string as is, anything
 * else as compact JSON, then a newline. 2 with a message when there is no such key. */
static int print_key(const char *dump, const char *key, FILE *out) {
    json_t *root = json_loads(dump, 0, NULL), *v = root;
    char part[256];
    for (const char *p = key; v && *p;) {
        size_t n = strcspn(p, ".");
        snprintf(part, sizeof part, "%.*s", (int)(n < sizeof part ? n : sizeof part - 1), p);
        v = json_is_object(v) ? json_object_get(v, part) : NULL;
        p += n + (p[n] == '.');
    }
    int rc = 0;
    if (!v || !*key) {
        fprintf(stderr, "trainer config: --print %s: no such key in the effective config (trainer config "
                "--check JOB.json lists them all)\n", key);
        rc = 2;
    } else {
        char *text = json_is_string(v) ? NULL : json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
        if (fprintf(out, "%s\n", text ? text : json_string_value(v)) < 0 || fflush(out) != 0) rc = 1;
        free(text);
    }
    json_decref(root);
    return rc;
}

int bt_config_cmd(int argc, char **argv, FILE *out) {
    const char *tmpl = NULL, *check = NULL, *print = NULL, *format = "json";
    int documented = 0, reference = 0, n_sets = 0;
    const char **sets = calloc((size_t)(argc > 0 ? argc : 1), sizeof(char *));
    if (!sets) return 1;
    int rc = 0;
    enum { O_TEMPLATE = 256, O_DOCUMENTED, O_FORMAT, O_CHECK, O_PRINT, O_SET, O_REFERENCE };
    static const struct option opts[] = {
        {"template", required_argument, NULL, O_TEMPLATE}, {"documented", no_argument, NULL, O_DOCUMENTED},
        {"format", required_argument, NULL, O_FORMAT},     {"check", required_argument, NULL, O_CHECK},
        {"print", required_argument, NULL, O_PRINT},       {"set", required_argument, NULL, O_SET},
        {"reference", no_argument, NULL, O_REFERENCE},     {NULL, 0, NULL, 0},
    };
    optind = 0; /* a fresh scan (glibc), also when called twice in one process */
    opterr = 0;
    int o;
    while (rc == 0 && (o = getopt_long(argc, argv, "+:", opts, NULL)) != -1) {
        switch (o) {
        case O_TEMPLATE: tmpl = optarg; break;
        case O_DOCUMENTED: documented = 1; break;
        case O_FORMAT: format = optarg; break;
        case O_CHECK: check = optarg; break;
        case O_PRINT: print = optarg; break;
        case O_SET: sets[n_sets++] = optarg; break;
        case O_REFERENCE: reference = 1; break;
        default: /* an unknown option, or one without its value */
            fprintf(stderr, "trainer config: unexpected argument \"%s\" (usage: trainer config "
                    "--template default|qlora|long-context [--documented] | --check JOB.json "
                    "[--set key=value ...] [--print KEY] | --reference) [--format json|yaml]\n", argv[optind - 1]);
            rc = 2;
        }
    }
    if (rc == 0 && optind < argc) {
        fprintf(stderr, "trainer config: unexpected argument \"%s\" (usage: trainer config "
                "--template default|qlora|long-context [--documented] | --check JOB.json "
                "[--set key=value ...] [--print KEY] | --reference) [--format json|yaml]\n", argv[optind]);
        rc = 2;
    }
    if (rc == 0 && reference) { /* docs/CONFIG.md */
        if (tmpl || check || print || n_sets || documented) {
            fprintf(stderr, "trainer config: --reference takes no other option\n");
            rc = 2;
        } else {
            bt_config_reference_md(out);
            rc = fflush(out) != 0 || ferror(out) ? 1 : 0;
        }
        free(sets);
        return rc;
    }
    int yaml = !strcmp(format, "yaml");
    if (rc == 0 && !yaml && strcmp(format, "json")) {
        fprintf(stderr, "trainer config: --format \"%s\": expected json or yaml\n", format);
        rc = 2;
    }
    if (rc == 0 && documented && !tmpl) { /* settings it would ignore */
        fprintf(stderr, "trainer config: --documented applies to --template only\n");
        rc = 2;
    }
    if (rc == 0 && n_sets > 0 && tmpl) {
        fprintf(stderr, "trainer config: --set applies to --check only (a template is printed as "
                "it is)\n");
        rc = 2;
    }
    if (rc == 0 && !!tmpl == !!check) {
        fprintf(stderr, "trainer config: give exactly one of --template NAME or --check JOB.json\n");
        rc = 2;
    }
    if (rc == 0 && print && !check) {
        fprintf(stderr, "trainer config: --print KEY goes with --check JOB.json\n");
        rc = 2;
    }
    if (rc == 0 && tmpl) {
        char *s = bt_config_template(tmpl, documented);
        if (s && yaml) s = as_yaml(s);
        if (!s) {
            fprintf(stderr, "trainer %s\n", bt_last_error());
            rc = 2;
        } else {
            if (fprintf(out, yaml ? "%s" : "%s\n", s) < 0 || fflush(out) != 0) rc = 1;
            free(s);
        }
    } else if (rc == 0) {
        bt_train_config cfg;
        if (bt_config_load(&cfg, check, sets, n_sets) != 0) {
            fprintf(stderr, "trainer: %s\n", bt_last_error());
            rc = 2;
        } else {
            char *d = bt_config_dump(&cfg);
            if (!d) rc = 1;
            else if (print) rc = print_key(d, print, out);
            else if ((d = yaml ? as_yaml(d) : d) == NULL || fprintf(out, yaml ? "%s" : "%s\n", d) < 0) rc = 1;
            free(d);
            bt_config_free(&cfg);
        }
    }
    free(sets);
    return rc;
}
