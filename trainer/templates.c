/* Config templates for `trainer config --template NAME [--documented]`. See config.h
 * (bt_config_template) for the recipes and their sources. Documentation is carried by "#"-keys,
 * which the config parser ignores: "#" documents the enclosing object, "#key" the key after it. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/yaml_json.h"
#include "trainer/config.h"

const char *const bt_config_template_names[] = {"default", "qlora", "long-context", NULL};

typedef struct {
    int doc;
} ctx_t;

/* o[key] = v (stolen), preceded by "#key": doc when documenting. */
static void put(const ctx_t *c, json_t *o, const char *key, json_t *v, const char *doc) {
    if (c->doc && doc) {
        char k[96];
        snprintf(k, sizeof k, "#%s", key);
        json_object_set_new(o, k, json_string(doc));
    }
    json_object_set_new(o, key, v);
}

static json_t *obj_doc(const ctx_t *c, const char *doc) {
    json_t *o = json_object();
    if (c->doc && doc) json_object_set_new(o, "#", json_string(doc));
    return o;
}

static json_t *strs(const char *const *v) {
    json_t *a = json_array();
    for (int i = 0; v[i]; i++) json_array_append_new(a, json_string(v[i]));
    return a;
}

typedef struct {
    const char *name, *header;
    int seq_len, micro_batch, grad_accum, steps, warmup, r, ckpt, trainable, log_every;
    double alpha, dropout, lr, wd, clip, min_lr_ratio;
    const char *schedule;
    const char *const *targets;
    /* long context: context_extension target (0 = none), S^2 group fraction (0 = off), data
     * format, per-length held-out perplexity */
    int ext_target;
    double s2_fraction;
    const char *format;
    int long_eval;
} recipe;

static const char *const k_all[] = {"q_proj", "k_proj", "v_proj", "o_proj",
                                    "gate_proj", "up_proj", "down_proj", NULL};
static const char *const k_attn[] = {"q_proj", "k_proj", "v_proj", "o_proj", NULL};

static const recipe k_recipes[] = {
    {"default",
     "The SmolLM2-135M demo job: LoRA r 16 on all linear layers over the GGUF's own Q4_1 "
     "weights (base_dtype auto = gguf), 512-token packed rows x 4, 30 steps, cosine schedule.",
     512, 4, 1, 30, 3, 16, 0, 0, 1, 32, 0.05, 1e-3, 0.0, 1.0, 0.1, "cosine", k_all, 0, 0.0, "chat",
     0},
    {"qlora",
     "QLoRA recipe (Dettmers et al. 2023, arXiv 2305.14314): NF4 base with double quantisation, "
     "LoRA r 64 alpha 16 dropout 0.1 on all linear layers, lr 2e-4 constant, max grad norm 0.3, "
     "warm-up 3% of steps, effective batch 16.",
     1024, 4, 4, 1000, 30, 64, 0, 0, 10, 16, 0.1, 2e-4, 0.0, 0.3, 1.0, "constant", k_all, 0, 0.0,
     "chat", 0},
    {"long-context",
     "LongLoRA recipe (Chen et al. 2023, arXiv 2309.12307, fine-tune.py, supervised-fine-tune "
     "settings aside): extend the context of SmolLM2 (trained at 8192) to 16384 tokens with "
     "linear position interpolation, train with S2-Attn (group 1/4 of the row, half the heads "
     "shifted) and activation checkpointing on plain text rows, LoRA r 8 alpha 16 on q/k/v/o plus "
     "trainable embed_tokens and norms (\"LoRA+\"), lr 2e-5 constant after 20 warm-up steps, no "
     "weight decay, batch 1 x grad_accum 8; held-out perplexity at 2K / 4K / 8K / 16K tokens.",
     16384, 1, 8, 1000, 20, 8, 1, 1, 10, 16, 0.0, 2e-5, 0.0, 1.0, 1.0, "constant", k_attn, 16384,
     0.25, "text", 1},
};

static json_t *build(const recipe *R, const ctx_t *c) {
    json_t *root = obj_doc(c, R->header);
    if (c->doc)
        json_object_set_new(root, "#comments",
                            json_string("Keys starting with '#' are comments: the trainer ignores "
                                        "them in every object. Relative paths are resolved "
                                        "against the trainer's working directory."));
    put(c, root, "name", json_string(R->name), "job name given to loaderd");
    put(c, root, "model", json_string("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        "base model: a llama-architecture .gguf file (required)");
    const int qlora = !strcmp(R->name, "qlora"); /* the paper's recipe is an NF4 base */
    put(c, root, "base_dtype", json_string(qlora ? "nf4" : "auto"),
        "how the frozen base linears are held: \"gguf\" (the GGUF file's own blocks, no "
        "re-quantisation), \"nf4\" (QLoRA, bitsandbytes layout), \"fp32\", or \"auto\" (gguf "
        "for a .gguf model, nf4 for a Hugging Face directory)");
    put(c, root, "base_model_name_or_path", json_string("HuggingFaceTB/SmolLM2-135M-Instruct"),
        "written to adapter_config.json so PEFT can find the base model");
    if (c->doc) /* unset: $LOADERD_SOCKET, else the default; a template pins neither */
        json_object_set_new(root, "#socket",
                            json_string("loaderd control socket; unset: $LOADERD_SOCKET, else "
                                        "/run/loaderd/loaderd.sock (set it: \"socket\": PATH)"));

    json_t *data = obj_doc(c, "the training stream, served by loaderd");
    const char *const shards[] = {"data/train-*.jsonl.zst", NULL};
    put(c, data, "shards", strs(shards), "globs of JSONL (.jsonl or .jsonl.zst) shards (required)");
    put(c, data, "format", json_string(R->format),
        "\"chat\" (messages), \"text\" (documents longer than seq_len are cut into consecutive "
        "rows) or \"alpaca\"");
    put(c, data, "seq_len", json_integer(R->seq_len), "T: tokens per packed row");
    put(c, data, "micro_batch_size", json_integer(R->micro_batch), "B: rows per micro-batch");
    put(c, data, "seed", json_integer(1234), "shuffle seed of the data stream");
    put(c, data, "tokenizer_threads", json_integer(2), "loaderd tokenizer threads for this job");
    put(c, root, "data", data, NULL);

    json_t *ev = obj_doc(c, "held-out evaluation before and after training (empty = none)");
    put(c, ev, "shards", json_array(), "globs of held-out shards");
    put(c, ev, "max_batches", json_integer(0), "batches to evaluate (0 = all)");
    put(c, ev, "every", json_integer(0),
        "also evaluate every this many steps during training (0 = before and after only)");
    if (R->long_eval) {
        json_t *lens = json_array();
        for (int L = 2048; L <= R->seq_len; L *= 2) json_array_append_new(lens, json_integer(L));
        put(c, ev, "lengths", lens,
            "perplexity per context length: the held-out documents cut into windows of each "
            "length (shows both the gain at long lengths and any loss at short ones)");
    }
    put(c, root, "eval", ev, NULL);
    if (R->ext_target > 0) {
        json_t *ce = obj_doc(c, "extend the model's context window (RoPE scaling, transformers' "
                                "semantics; recorded in the adapter and every export)");
        put(c, ce, "target_length", json_integer(R->ext_target),
            "context length to reach (factor = target_length / the model's context_length)");
        put(c, ce, "method", json_string("linear"),
            "\"linear\" (position interpolation, as LongLoRA), \"yarn\" or \"dynamic\" (NTK)");
        put(c, root, "context_extension", ce, NULL);
    }
    if (R->s2_fraction > 0) {
        json_t *at = obj_doc(c, "attention in training (evaluation and generation always use full "
                                "attention)");
        json_t *s2 = obj_doc(c, "LongLoRA shifted sparse attention: groups of group_fraction x "
                                "seq_len tokens, half the heads shifted by half a group");
        put(c, s2, "group_fraction", json_real(R->s2_fraction), "LongLoRA's default is 1/4");
        put(c, at, "s2", s2, NULL);
        put(c, root, "attention", at, NULL);
    }

    json_t *lora = obj_doc(c, "LoRA (PEFT semantics): y = W x + lora_alpha / r * B A dropout(x)");
    put(c, lora, "r", json_integer(R->r), "rank");
    put(c, lora, "lora_alpha", json_real(R->alpha), "scaling numerator (scale = lora_alpha / r)");
    put(c, lora, "lora_dropout", json_real(R->dropout), "dropout on the LoRA branch input, [0, 1)");
    put(c, lora, "target_modules", strs(R->targets),
        "adapted linears: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj");
    put(c, root, "lora", lora, NULL);

    json_t *tm = json_array();
    if (R->trainable) {
        json_array_append_new(tm, json_string("embed_tokens"));
        json_array_append_new(tm, json_string("norm"));
    }
    put(c, root, "trainable_modules", tm,
        "LongLoRA LoRA+: also train \"embed_tokens\" (and a tied lm_head) and/or every \"norm\" "
        "weight densely; saved as PEFT modules_to_save");

    json_t *op = obj_doc(c, "AdamW (torch.optim.AdamW semantics) and gradient clipping");
    put(c, op, "lr", json_real(R->lr), "peak learning rate");
    put(c, op, "weight_decay", json_real(R->wd), "decoupled weight decay (not on norm weights)");
    put(c, op, "beta1", json_real(0.9), NULL);
    put(c, op, "beta2", json_real(0.999), NULL);
    put(c, op, "eps", json_real(1e-8), NULL);
    put(c, op, "warmup_steps", json_integer(R->warmup), "linear warm-up steps");
    put(c, op, "grad_clip", json_real(R->clip), "max global grad norm (0 = no clipping)");
    put(c, root, "optim", op, NULL);

    put(c, root, "steps", json_integer(R->steps), "optimiser steps");
    put(c, root, "grad_accum", json_integer(R->grad_accum), "micro-batches per optimiser step");
    put(c, root, "schedule", json_string(R->schedule), "\"cosine\", \"linear\" or \"constant\"");
    put(c, root, "min_lr_ratio", json_real(R->min_lr_ratio),
        "floor of the cosine/linear decay as a fraction of lr");
    if (R->ckpt) {
        put(c, root, "activation_checkpointing", json_string("auto"),
            "recompute each layer in backward instead of keeping its activations: true, false, or "
            "\"auto\" = on when data.seq_len >= checkpointing_min_seq_len (same gradients)");
        put(c, root, "checkpointing_min_seq_len", json_integer(4096),
            "the row length from which \"auto\" checkpoints");
    } else {
        put(c, root, "activation_checkpointing", json_boolean(0),
            "recompute each layer in backward instead of keeping its activations (true, false, or "
            "\"auto\" = on from checkpointing_min_seq_len tokens per row)");
    }
    put(c, root, "save_every", json_integer(0), "also save the adapter every N steps (0 = end only)");
    put(c, root, "out_dir", json_string("runs/adapter"), "PEFT adapter directory");
    put(c, root, "checkpoint_every", json_integer(0),
        "resumable checkpoint (adapter, AdamW moments, step, loader position) every N steps");
    put(c, root, "checkpoint_dir", json_string("runs/checkpoint"), "checkpoint directory");
    put(c, root, "resume_from", json_null(), "checkpoint directory to continue from (or --resume)");
    put(c, root, "stop_at_step", json_integer(0),
        "stop and checkpoint after this many steps, keeping the schedule of `steps` (0 = off)");
    put(c, root, "threads", json_integer(0),
        "OpenMP threads (0 = the CPUs Slurm gives the task, else every core the process may use)");
    put(c, root, "seed", json_integer(1234), "LoRA initialisation and dropout seed");
    put(c, root, "log_every", json_integer(R->log_every), "progress line every N steps");
    put(c, root, "timeout_s", json_integer(600), "longest wait for one batch from loaderd");
    return root;
}

char *bt_config_template(const char *name, int documented) {
    for (size_t i = 0; i < sizeof k_recipes / sizeof k_recipes[0]; i++) {
        if (!name || strcmp(name, k_recipes[i].name) != 0) continue;
        ctx_t c = {documented != 0};
        json_t *j = build(&k_recipes[i], &c);
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
    int documented = 0, n_sets = 0;
    const char **sets = calloc((size_t)(argc > 0 ? argc : 1), sizeof(char *));
    if (!sets) return 1;
    int rc = 0;
    for (int i = 1; i < argc && rc == 0; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--template") && i + 1 < argc) tmpl = argv[++i];
        else if (!strncmp(a, "--template=", 11)) tmpl = a + 11;
        else if (!strcmp(a, "--documented")) documented = 1;
        else if (!strcmp(a, "--format") && i + 1 < argc) format = argv[++i];
        else if (!strncmp(a, "--format=", 9)) format = a + 9;
        else if (!strcmp(a, "--check") && i + 1 < argc) check = argv[++i];
        else if (!strcmp(a, "--print") && i + 1 < argc) print = argv[++i];
        else if (!strcmp(a, "--set") && i + 1 < argc) sets[n_sets++] = argv[++i];
        else if (!strncmp(a, "--set=", 6)) sets[n_sets++] = a + 6;
        else {
            fprintf(stderr, "trainer config: unexpected argument \"%s\" (usage: trainer config "
                    "--template default|qlora|long-context [--documented] | --check JOB.json "
                    "[--set key=value ...] [--print KEY]) [--format json|yaml]\n", a);
            rc = 2;
        }
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
