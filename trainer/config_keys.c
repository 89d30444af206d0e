/* The trainer's job configuration keys: one row per key (common/keytab.h) drives parsing, the
 * defaults, bt_config_dump, `trainer config --template` (templates.c), which command reads which
 * key (bt_config_key_used) and the reference docs/CONFIG.md (`trainer config --reference`).
 * Adding a key is adding a row here and its field in bt_train_config (config.h); checks across
 * keys live in config.c (check_combinations). Rows are in the order bt_config_dump writes. */
#include <jansson.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/keytab.h"
#include "proto/job_limits.h"
#include "trainer/config.h"

#define C bt_train_config
#define MAXI INT32_MAX /* "an integer >= lo" (BT_KEYTAB_GOT) */

/* User flags of the rows (bt_config_key_used, templates.c). */
enum {
    EV = BT_CFG_EVAL,     /* read by `trainer eval` */
    CK = BT_CFG_CKPT,     /* checked against the checkpoint `trainer eval` evaluates */
    ES = BT_CFG_ESTIMATE, /* read by `trainer estimate` */
    TM = BT_CFG_TEMPLATE, /* written by every template (others: when the recipe sets them) */
};

static const char *const k_mod_names[] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", NULL};
static const char *const k_trainable_names[] = {"embed_tokens", "norm", NULL};

const char *bt_module_name(int mod) { return (mod >= 0 && mod < BT_MOD_N) ? k_mod_names[mod] : NULL; }

/* "<path>: expected <what>, got <v>" (BT_KEYTAB_GOT style, as the table's own rows). */
static int refuse_as(const char *what, const char *path, const json_t *v) {
    char *s = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    char got[80];
    if (!s) snprintf(got, sizeof got, "?");
    else if (strlen(s) > 60) snprintf(got, sizeof got, "%.57s...", s);
    else snprintf(got, sizeof got, "%s", s);
    free(s);
    return bt_fail(BT_ERR_INVALID, "%s: expected %s, got %s", path, what, got);
}

static int refuse(const bt_key *k, const char *path, const json_t *v) { return refuse_as(k->what, path, v); }

/* ---- shard globs: char **field, its count at offset k->ilo, at most k->ihi; a single string is
 * a list of one; BT_KEY_REQUIRED rows refuse [] ---- */

static void release_strv(const bt_key *k, void *dst) {
    char ***v = (char ***)((char *)dst + k->off);
    int *n = (int *)((char *)dst + k->ilo);
    for (int i = 0; *v && i < *n; i++) free((*v)[i]);
    free(*v);
    *v = NULL;
    *n = 0;
}

static int parse_strv(const bt_key *k, json_t *v, void *dst, const char *path, bt_keypath *bad) {
    const int required = (k->flags & BT_KEY_REQUIRED) != 0;
    size_t n = json_is_array(v) ? json_array_size(v) : 1;
    if (json_is_string(v)) {
        if (json_string_length(v) == 0) return refuse(k, path, v);
    } else if (!json_is_array(v) || (required && n == 0)) {
        return refuse(k, path, v);
    } else {
        for (size_t i = 0; i < n; i++) {
            json_t *e = json_array_get(v, i);
            if (!json_is_string(e) || json_string_length(e) == 0)
                return refuse_as("an array of non-empty strings", path, v);
        }
    }
    if (n > (size_t)k->ihi)
        return bt_fail(BT_ERR_INVALID, "%s: %zu patterns, loaderd takes at most %lld", path, n, (long long)k->ihi);
    release_strv(k, dst);
    char **out = bt_xcalloc(n ? n : 1, sizeof(char *));
    for (size_t i = 0; i < n; i++) out[i] = bt_xstrdup(json_string_value(json_is_array(v) ? json_array_get(v, i) : v));
    *(char ***)((char *)dst + k->off) = out;
    *(int *)((char *)dst + k->ilo) = (int)n;
    (void)bad;
    return BT_OK;
}

static json_t *dump_strv(const bt_key *k, const void *src) {
    char *const *v = *(char **const *)((const char *)src + k->off);
    int n = *(const int *)((const char *)src + k->ilo);
    json_t *a = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(a, json_string(v[i]));
    return a;
}

/* ---- module lists as a bit mask (unsigned field): bit i for k->names[i]; at least k->ilo ---- */

static int parse_mask(const bt_key *k, json_t *v, void *dst, const char *path, bt_keypath *bad) {
    (void)bad;
    if (!json_is_array(v) || json_array_size(v) < (size_t)k->ilo) return refuse(k, path, v);
    unsigned mask = 0;
    for (size_t i = 0; i < json_array_size(v); i++) {
        json_t *e = json_array_get(v, i);
        int found = -1;
        for (int m = 0; k->names[m] && json_is_string(e); m++)
            if (!strcmp(json_string_value(e), k->names[m])) found = m;
        /* Phi-3's fused modules, as PEFT names them (trainer/model/lora.h): the group's bits */
        if (found < 0 && k->names == k_mod_names && json_is_string(e)) {
            if (!strcmp(json_string_value(e), "qkv_proj")) {
                mask |= (1u << BT_MOD_Q) | (1u << BT_MOD_K) | (1u << BT_MOD_V);
                continue;
            }
            if (!strcmp(json_string_value(e), "gate_up_proj")) {
                mask |= (1u << BT_MOD_GATE) | (1u << BT_MOD_UP);
                continue;
            }
        }
        if (found < 0) return refuse(k, path, e);
        mask |= 1u << found;
    }
    *(unsigned *)((char *)dst + k->off) = mask;
    return BT_OK;
}

static json_t *dump_mask(const bt_key *k, const void *src) {
    unsigned mask = *(const unsigned *)((const char *)src + k->off);
    json_t *a = json_array();
    for (int m = 0; k->names[m]; m++)
        if (mask & (1u << m)) json_array_append_new(a, json_string(k->names[m]));
    return a;
}

/* ---- eval.lengths: distinct context lengths in [BT_JOB_MIN_SEQ_LEN, BT_JOB_MAX_SEQ_LEN] (each is
 * the seq_len of a held-out stream from loaderd), at most BT_MAX_EVAL_LENGTHS, kept ascending;
 * null: none ---- */

static int parse_lengths(const bt_key *k, json_t *v, void *dst, const char *path, bt_keypath *bad) {
    (void)bad;
    C *c = dst;
    c->eval.n_lengths = 0;
    if (json_is_null(v)) return BT_OK;
    if (!json_is_array(v) || json_array_size(v) > BT_MAX_EVAL_LENGTHS) return refuse(k, path, v);
    for (size_t i = 0; i < json_array_size(v); i++) {
        json_t *e = json_array_get(v, i);
        json_int_t x = json_is_integer(e) ? json_integer_value(e) : 0;
        if (x < BT_JOB_MIN_SEQ_LEN || x > BT_JOB_MAX_SEQ_LEN) return refuse(k, path, e);
        int n = c->eval.n_lengths;
        for (int j = 0; j < n; j++)
            if (c->eval.lengths[j] == (int)x) return refuse(k, path, v);
        while (n > 0 && c->eval.lengths[n - 1] > (int)x) { /* insertion: ascending */
            c->eval.lengths[n] = c->eval.lengths[n - 1];
            n--;
        }
        c->eval.lengths[n] = (int)x;
        c->eval.n_lengths++;
    }
    return BT_OK;
}

static json_t *dump_lengths(const bt_key *k, const void *src) {
    (void)k;
    const C *c = src;
    json_t *a = json_array();
    for (int i = 0; i < c->eval.n_lengths; i++) json_array_append_new(a, json_integer(c->eval.lengths[i]));
    return a;
}

/* ---- activation_checkpointing: true | false | "auto" (resolved against data.seq_len once the
 * whole config is read: config.c); the dump gives the effective bool ---- */

static int parse_ckpt(const bt_key *k, json_t *v, void *dst, const char *path, bt_keypath *bad) {
    (void)bad;
    C *c = dst;
    if (json_is_string(v) && !strcmp(json_string_value(v), "auto")) {
        c->checkpointing_auto = 1;
        return BT_OK;
    }
    if (!json_is_boolean(v)) return refuse(k, path, v);
    c->checkpointing_auto = 0;
    c->activation_checkpointing = json_is_true(v);
    return BT_OK;
}

static json_t *dump_ckpt(const bt_key *k, const void *src) {
    (void)k;
    return json_boolean(((const C *)src)->activation_checkpointing);
}

/* ---- preference.loss_type: a string or a list of 1..BT_PREF_MAX_LOSS_TYPES strings (TRL's
 * list-valued DPO loss_type), null: the objective's default; checked against the objective once
 * the whole config is read (config.c) ---- */

static int parse_loss_type(const bt_key *k, json_t *v, void *dst, const char *path, bt_keypath *bad) {
    (void)bad;
    C *c = dst;
    c->preference.n_loss_type = 0;
    if (json_is_null(v)) return BT_OK;
    size_t n = json_is_array(v) ? json_array_size(v) : 1;
    if (!(json_is_string(v) || json_is_array(v)) || n < 1 || n > BT_PREF_MAX_LOSS_TYPES) return refuse(k, path, v);
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_is_array(v) ? json_array_get(v, i) : v;
        if (!json_is_string(e) || json_string_length(e) == 0 ||
            json_string_length(e) >= sizeof c->preference.loss_type[0])
            return refuse(k, path, v);
        snprintf(c->preference.loss_type[i], sizeof c->preference.loss_type[0], "%s", json_string_value(e));
    }
    c->preference.n_loss_type = (int)n;
    return BT_OK;
}

static json_t *dump_loss_type(const bt_key *k, const void *src) {
    (void)k;
    const C *c = src;
    if (c->preference.n_loss_type == 0) return json_null();
    if (c->preference.n_loss_type == 1) return json_string(c->preference.loss_type[0]);
    json_t *a = json_array();
    for (int i = 0; i < c->preference.n_loss_type; i++) json_array_append_new(a, json_string(c->preference.loss_type[i]));
    return a;
}

/* ---- preference.loss_weights: a list of finite numbers >= 0 (one per loss_type), null: all 1 ---- */

static int parse_loss_weights(const bt_key *k, json_t *v, void *dst, const char *path, bt_keypath *bad) {
    (void)bad;
    C *c = dst;
    c->preference.n_loss_weights = 0;
    if (json_is_null(v)) return BT_OK;
    if (!json_is_array(v) || json_array_size(v) < 1 || json_array_size(v) > BT_PREF_MAX_LOSS_TYPES)
        return refuse(k, path, v);
    for (size_t i = 0; i < json_array_size(v); i++) {
        json_t *e = json_array_get(v, i);
        double x = json_is_number(e) ? json_number_value(e) : -1;
        if (!(x >= 0) || !isfinite(x)) return refuse(k, path, v);
        c->preference.loss_weights[i] = x;
    }
    c->preference.n_loss_weights = (int)json_array_size(v);
    return BT_OK;
}

static json_t *dump_loss_weights(const bt_key *k, const void *src) {
    (void)k;
    const C *c = src;
    if (c->preference.n_loss_weights == 0) return json_null();
    json_t *a = json_array();
    for (int i = 0; i < c->preference.n_loss_weights; i++) json_array_append_new(a, json_real(c->preference.loss_weights[i]));
    return a;
}

/* ---- preference.cpo_alpha: a finite number >= 0, null (NAN): the objective's default ---- */

static int parse_opt_nonneg(const bt_key *k, json_t *v, void *dst, const char *path, bt_keypath *bad) {
    (void)bad;
    double *f = (double *)((char *)dst + k->off);
    if (json_is_null(v)) {
        *f = NAN;
        return BT_OK;
    }
    double x = json_is_number(v) ? json_number_value(v) : -1;
    if (!(x >= 0) || !isfinite(x)) return refuse(k, path, v);
    *f = x;
    return BT_OK;
}

static json_t *dump_opt_nonneg(const bt_key *k, const void *src) {
    double x = *(const double *)((const char *)src + k->off);
    return isnan(x) ? json_null() : json_real(x);
}

/* Custom rows: custom list of globs (count field nf, at most max), mask of names. */
#define STRV(key, f, nf, max, dflt, flg, whattext, text)                                                       \
    {.name = key, .type = BT_KEY_CUSTOM, .off = offsetof(C, f), .size = sizeof(char **), .ilo = offsetof(C, nf), \
     .ihi = (max), .def = dflt, .parse = parse_strv, .dump = dump_strv, .release = release_strv, .flags = flg,   \
     .doc = text, .what = whattext}
#define MASK(key, f, nms, min, dflt, flg, whattext, text)                                                      \
    {.name = key, .type = BT_KEY_CUSTOM, .off = offsetof(C, f), .size = sizeof(unsigned), .ilo = (min),       \
     .names = nms, .def = dflt, .parse = parse_mask, .dump = dump_mask, .flags = flg, .doc = text, .what = whattext}

static const char *const k_formats[] = {"chat", "text", "alpaca", "preference", "kto", NULL};
static const char *const k_objectives[] = {"sft", "dpo", "orpo", "simpo", "cpo", "kto", NULL};
/* loaderd's chat renderings (loaderd/format.h ld_chat_tpl; the job spec's chat_template) */
static const char *const k_chat_templates[] = {"auto", "chatml", "llama3", "gemma", "llama2",
                                               "mistral", "mistral-v3", "phi3", NULL};
static const char *const k_dtypes[] = {"nf4", "fp32", "gguf", "auto", NULL}; /* BT_BASE_* order */
static const char *const k_scheds[] = {"cosine", "linear", "constant", NULL};
static const char *const k_devices[] = {"cpu", "cuda", NULL};
static const char *const k_attn_impls[] = {"wmma", "mma", NULL};
static const char *const k_matmul_impls[] = {"dequant", "fused", NULL};
static const char *const k_ext_methods[] = {"none", "linear", "yarn", "dynamic", NULL}; /* BT_ROPE_EXT_* */

static const bt_key k_data[] = {
    STRV("shards", data.shards, data.n_shards, BT_JOB_MAX_SHARD_PATTERNS, NULL, BT_KEY_REQUIRED | CK | TM,
         "a non-empty array of strings", "globs of JSONL (.jsonl or .jsonl.zst) shards"),
    BT_KEY_SC("format", C, data.format, k_formats, "\"chat\"", EV | TM,
              "\"chat\" (messages), \"text\" (documents longer than seq_len are cut into consecutive rows), "
              "\"alpaca\", \"preference\" ({prompt, chosen, rejected}: objective dpo, orpo, simpo, cpo) or "
              "\"kto\" ({prompt, completion, label}: objective kto)"),
    BT_KEY_S("text_field", C, data.text_field, 1, 0, "\"text\"", EV, "the document's key with format \"text\""),
    BT_KEY_SC("chat_template", C, data.chat_template, k_chat_templates, "\"auto\"", EV,
              "how loaderd renders format \"chat\" / \"alpaca\" conversations: \"auto\" (from the "
              "tokenizer's own chat template or special tokens), \"chatml\", \"llama3\", \"gemma\", \"llama2\", "
              "\"mistral\" (7B Instruct v0.1/v0.2), \"mistral-v3\" (v0.3) or \"phi3\" (README: chat templates)"),
    BT_KEY_I("seq_len", C, data.seq_len, BT_JOB_MIN_SEQ_LEN, BT_JOB_MAX_SEQ_LEN, "512", EV | ES | TM,
             "T: tokens per packed row (the range loaderd accepts, proto/job_limits.h)"),
    BT_KEY_I("micro_batch_size", C, data.micro_batch_size, 1, 4096, "4", EV | ES | TM,
             "B: rows per micro-batch; seq_len x micro_batch_size <= 2^24"),
    BT_KEY_I("seed", C, data.seed, 0, INT64_MAX, "1234", EV | TM, "shuffle seed of the data stream"),
    BT_KEY_I("tokenizer_threads", C, data.tokenizer_threads, 1, BT_JOB_MAX_TOKENIZER_THREADS, "2", EV | TM,
             "loaderd tokenizer threads for this job"),
    BT_KEY_I("max_prompt_length", C, data.max_prompt_length, 0, BT_JOB_MAX_SEQ_LEN, "0", EV,
             "format preference / kto (TRL's name): prompt tokens kept (its end) when prompt + longer response "
             "exceeds max_length; 0: no prompt cut"),
    BT_KEY_I("max_length", C, data.max_length, 0, BT_JOB_MAX_SEQ_LEN, "0", EV,
             "format preference / kto (TRL's name): longest prompt + response in tokens, longer records are "
             "truncated as TRL does; 0: none (a record that does not fit a row is skipped as overlong)"),
    BT_KEY_END,
};

static const bt_key k_eval[] = {
    STRV("shards", eval.shards, eval.n_shards, BT_JOB_MAX_SHARD_PATTERNS, "[]", EV | ES | TM, "an array of strings",
         "globs of held-out shards ([]: no held-out evaluation)"),
    BT_KEY_I("max_batches", C, eval.max_batches, 0, MAXI, "0", EV | TM,
             "batches to evaluate per rank (0: until the end of the data); the loss is the token mean over all "
             "ranks' batches"),
    BT_KEY_I("every", C, eval.every, 0, MAXI, "0", TM,
             "also a held-out evaluation every this many optimiser steps during training (printed, and in "
             "metrics.jsonl, TensorBoard and report.png); 0: only before and after training; needs eval.shards, "
             "not with eval.lengths"),
    {.name = "lengths", .type = BT_KEY_CUSTOM, .off = offsetof(C, eval.lengths), .size = sizeof(int), .def = "[]",
     .parse = parse_lengths, .dump = dump_lengths, .flags = EV | ES,
     .what = "an array of distinct context lengths (integers in [16, 1048576], at most 16)",
     .doc = "perplexity per context length: the held-out documents cut into consecutive windows of each length "
            "(loaderd's text packing at seq_len L), the loss over the windows of exactly L tokens; []: one "
            "evaluation at data.seq_len over every row"},
    BT_KEY_END,
};

/* Preference objectives (objective != "sft"): TRL 1.16.0's keys and defaults (DPOConfig, ORPOConfig,
 * CPOConfig, KTOConfig; trainer/preference.h), read for the objective only. */
static const bt_key k_preference[] = {
    BT_KEY_N("beta", C, preference.beta, 0, 1e6, "0.1", BT_KEY_LO_OPEN | TM,
             "temperature of the implicit reward (DPO, KTO), the odds-ratio weight (ORPO), CPO / SimPO's beta"),
    {.name = "loss_type", .type = BT_KEY_CUSTOM, .off = offsetof(C, preference.loss_type),
     .size = sizeof(((C *)0)->preference.loss_type), .def = "null", .parse = parse_loss_type,
     .dump = dump_loss_type, .flags = TM,
     .what = "a loss type name or a list of up to 4 (dpo), or null",
     .doc = "dpo: \"sigmoid\" (default), \"hinge\", \"ipo\", \"robust\", \"exo_pair\" or a list of them (summed with "
            "loss_weights); cpo: \"sigmoid\" (default), \"hinge\", \"ipo\", \"simpo\"; simpo: \"simpo\"; kto: \"kto\" "
            "(default), \"apo_zero_unpaired\"; orpo: \"orpo\"; null: the objective's default"},
    {.name = "loss_weights", .type = BT_KEY_CUSTOM, .off = offsetof(C, preference.loss_weights),
     .size = sizeof(((C *)0)->preference.loss_weights), .def = "null", .parse = parse_loss_weights,
     .dump = dump_loss_weights, .flags = 0, .what = "a list of numbers >= 0, or null",
     .doc = "dpo with a list loss_type: one weight per loss type (null: every weight 1)"},
    BT_KEY_N("label_smoothing", C, preference.label_smoothing, 0, 1, "0.0", 0,
             "dpo robust / exo_pair, cpo sigmoid / simpo: the label noise epsilon (robust: < 0.5; exo_pair: > 0)"),
    BT_KEY_N("simpo_gamma", C, preference.simpo_gamma, -1e6, 1e6, "0.5", 0, "simpo (cpo loss_type simpo): target reward margin"),
    {.name = "cpo_alpha", .type = BT_KEY_CUSTOM, .off = offsetof(C, preference.cpo_alpha), .size = sizeof(double),
     .def = "null", .parse = parse_opt_nonneg, .dump = dump_opt_nonneg, .flags = 0,
     .what = "a number >= 0, or null",
     .doc = "cpo / simpo: weight of the chosen responses' NLL term; null: 1 for cpo, 0 for simpo (TRL's SimPO recipe)"},
    BT_KEY_N("desirable_weight", C, preference.desirable_weight, 0, 1e6, "1.0", 0,
             "kto: weight of the desirable (label true) examples' losses"),
    BT_KEY_N("undesirable_weight", C, preference.undesirable_weight, 0, 1e6, "1.0", 0,
             "kto: weight of the undesirable (label false) examples' losses"),
    BT_KEY_B("precompute_ref_log_probs", C, preference.precompute_ref_log_probs, "false", 0,
             "dpo / kto: the reference log-probs kept in loaderd's token cache (job key ref_base: the base's "
             "identity), computed once and handed back; a micro-batch whose values are all cached skips "
             "the reference forward (needs loaderd's token_cache_dir; KTO's KL sequences are computed every step)"),
    BT_KEY_END,
};

static const bt_key k_lora[] = {
    BT_KEY_I("r", C, lora.r, 1, BT_LORA_R_MAX, "16", CK | ES | TM, "rank"),
    BT_KEY_N("lora_alpha", C, lora.alpha, 0, BT_LORA_ALPHA_MAX, "32", BT_KEY_LO_OPEN | CK | TM,
             "scaling numerator (scale = lora_alpha / r)"),
    BT_KEY_N("lora_dropout", C, lora.dropout, 0, 1, "0.05", BT_KEY_HI_OPEN | CK | TM, "dropout on the LoRA branch input"),
    MASK("target_modules", lora.target_mask, k_mod_names, 1,
         "[\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\", \"gate_proj\", \"up_proj\", \"down_proj\"]", CK | ES | TM,
         "a non-empty array of module names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; "
         "qkv_proj, gate_up_proj)",
         "the adapted linears; Phi-3's fused qkv_proj / gate_up_proj are one PEFT module each (one lora_A), "
         "named so or by all of their parts (on other families qkv_proj = q_proj, k_proj, v_proj and "
         "gate_up_proj = gate_proj, up_proj)"),
    BT_KEY_END,
};

/* Ranges (issue 10 §4): AdamW moves each parameter by about lr per step, so lr > 1 can only
 * diverge; decoupled weight decay scales by (1 - lr * wd), so wd in [0, 1]; betas are EMA
 * factors in [0, 1); eps only guards a division. */
static const bt_key k_optim[] = {
    BT_KEY_N("lr", C, optim.lr, 0, 1, "2e-4", BT_KEY_LO_OPEN | TM, "peak learning rate"),
    BT_KEY_N("weight_decay", C, optim.weight_decay, 0, 1, "0.0", TM, "decoupled weight decay (not on norm weights)"),
    BT_KEY_N("beta1", C, optim.beta1, 0, 1, "0.9", BT_KEY_HI_OPEN | TM, "AdamW beta1"),
    BT_KEY_N("beta2", C, optim.beta2, 0, 1, "0.999", BT_KEY_HI_OPEN | TM, "AdamW beta2"),
    BT_KEY_N("eps", C, optim.eps, 0, 1, "1e-8", BT_KEY_LO_OPEN | TM, "AdamW epsilon"),
    BT_KEY_I("warmup_steps", C, optim.warmup_steps, 0, MAXI, "0", TM,
             "linear warm-up steps (more than steps is allowed, as in HF Trainer, with a warning: the rate never "
             "reaches lr)"),
    BT_KEY_N("grad_clip", C, optim.grad_clip, 0, 1e6, "1.0", TM, "max global gradient norm (0: no clipping)"),
    BT_KEY_END,
};

static const bt_key k_cuda[] = {
    BT_KEY_E("attention", C, cuda_attention, k_attn_impls, NULL, "\"wmma\"", 0,
             "attention kernels: \"wmma\" (kernels/cuda/attention.cu) or \"mma\" (attention_mma.cu, "
             "register-resident mma.sync FA2; head_dim 64 and 128 only, a head_dim 256 model "
             "needs \"wmma\")"),
    BT_KEY_E("base_matmul", C, cuda_base_matmul, k_matmul_impls, NULL, "\"dequant\"", 0,
             "matmuls against the frozen quantised base, NF4 and GGUF-native alike: \"dequant\" (dequantise the "
             "weight, then cuBLAS) or \"fused\" (dequantise in the GEMM main loop: nf4_gemm.cu, the ggml blocks' "
             "own kernels)"),
    BT_KEY_ALIAS("nf4_matmul", "base_matmul", "the name before the GGUF-native path also took it"),
    BT_KEY_B("offload_checkpoints", C, cuda_offload, "false", ES,
             "keep the checkpointed layer inputs in pinned host memory instead of on the GPU (copies overlap the "
             "compute; needs activation checkpointing)"),
    BT_KEY_END,
};

static const bt_key k_report[] = {
    BT_KEY_S("dir", C, report.dir, 1, 0, "null", BT_KEY_NULLABLE,
             "the run report's directory (metrics.jsonl, report.png, TensorBoard events); null: \"report\" beside "
             "out_dir (runs/demo/adapter -> runs/demo/report)"),
    BT_KEY_B("plot", C, report.plot, "true", 0, "draw report.png at the end (gnuplot)"),
    BT_KEY_B("tensorboard", C, report.tensorboard, "false", 0,
             "also write TensorBoard scalar event files (events.out.tfevents.*)"),
    BT_KEY_END,
};

static const bt_key k_context_extension[] = {
    BT_KEY_I("target_length", C, context_extension.target_length, 2, 1 << 24, NULL, BT_KEY_REQUIRED | EV | ES | TM,
             "the context length to train for (factor = target_length / the model's context_length)"),
    BT_KEY_E("method", C, context_extension.method, k_ext_methods, NULL, "\"linear\"", EV | ES | TM,
             "\"linear\" (position interpolation, as LongLoRA), \"yarn\" or \"dynamic\" (NTK-aware), as "
             "transformers' modeling_rope_utils.py; \"none\": no extension"),
    BT_KEY_END,
};

static const bt_key k_s2[] = {
    BT_KEY_N("group_fraction", C, s2_group_fraction, 0, 1, "0.25", BT_KEY_LO_OPEN | ES | TM,
             "group size as a fraction of seq_len (rounded to even; LongLoRA's default 1/4)"),
    BT_KEY_END,
};

static const bt_key k_attention[] = {
    BT_KEY_O("s2", k_s2, BT_KEY_NULLABLE | BT_KEY_FALSE_NULL | ES,
             "LongLoRA shifted sparse attention in training: groups of group_fraction x seq_len tokens, half the "
             "heads shifted by half a group (evaluation and generation use full attention); absent, null or false: "
             "full attention"),
    BT_KEY_END,
};

static const bt_key k_dist[] = {
    BT_KEY_S("master_addr", C, dist.master_addr, 1, 0, "\"127.0.0.1\"", EV,
             "rank 0's address for the start-up rendezvous (MASTER_ADDR takes precedence)"),
    BT_KEY_I("master_port", C, dist.master_port, 1, 65535, "29500", EV,
             "rank 0's TCP port for the rendezvous (MASTER_PORT takes precedence)"),
    BT_KEY_I("timeout_s", C, dist.timeout_s, 1, 86400, "600", EV,
             "how long the rendezvous, NCCL start-up and each collective wait for every rank"),
    BT_KEY_I("heartbeat_timeout_s", C, dist.heartbeat_timeout_s, 1, 86400, "60", EV,
             "a rank that dies, stops or loses its network is named on every rank and the run ends within this time"),
    BT_KEY_S("secret_file", C, dist.secret_file, 1, 0, "null", BT_KEY_NULLABLE | EV,
             "a file only you can read (mode 0600) holding the job secret that authenticates the ranks; null: "
             "$BT_DIST_SECRET"),
    BT_KEY_B("shard_base", C, dist.shard_base, "false", EV | ES,
             "FSDP-QLoRA: each of the W ranks keeps 1/W of every frozen base linear (cut at its NF4 / GGUF "
             "blocks) and all-gathers a layer before it runs; device \"cuda\" only, a no-op with one rank "
             "(`trainer estimate --world-size W` bills it, `--gpus-for GiB` finds W)"),
    BT_KEY_END,
};

const bt_key bt_config_keys[] = {
    BT_KEY_S("name", C, name, 1, 0, "\"barqtrain\"", EV | TM, "job name given to loaderd"),
    BT_KEY_S("model", C, model, 1, 0, NULL, BT_KEY_REQUIRED | EV | ES | TM,
             "the base model: a .gguf file (llama architecture) or a Hugging Face directory"),
    BT_KEY_E("base_dtype", C, base_dtype, k_dtypes, NULL, "\"auto\"", EV | ES | TM,
             "how the frozen base linears are held: \"gguf\" (the GGUF file's own blocks, no re-quantisation), "
             "\"nf4\" (QLoRA, bitsandbytes layout), \"fp32\", or \"auto\" (gguf for a .gguf model, nf4 for a "
             "Hugging Face directory)"),
    BT_KEY_S("base_model_name_or_path", C, base_model_name_or_path, 1, 0, "\"HuggingFaceTB/SmolLM2-135M-Instruct\"",
             TM, "written to adapter_config.json so PEFT can find the base model"),
    BT_KEY_S("socket", C, socket, 1, 0, NULL, EV,
             "loaderd control socket; unset: $LOADERD_SOCKET, else /run/loaderd/loaderd.sock"),
    BT_KEY_O("data", k_data, TM, "the training stream, served by loaderd (sent in the job spec)"),
    BT_KEY_O("eval", k_eval, TM, "held-out evaluation before and after training"),
    BT_KEY_O("lora", k_lora, TM,
             "LoRA (PEFT semantics): y = W x + lora_alpha / r * B A dropout(x); the same limits apply to an "
             "adapter read from disk"),
    BT_KEY_O("optim", k_optim, TM, "AdamW (torch.optim.AdamW semantics) and gradient clipping"),
    BT_KEY_SC("objective", C, objective, k_objectives, "\"sft\"", EV | TM,
              "the training objective: \"sft\" (cross-entropy on the labelled tokens) or a preference objective on "
              "data.format \"preference\" (\"dpo\", \"orpo\", \"simpo\", \"cpo\") or \"kto\" (\"kto\"), with the keys "
              "of preference (README: preference training)"),
    BT_KEY_O("preference", k_preference, 0, "preference objectives: TRL 1.16.0's parameter names and defaults"),
    BT_KEY_I("steps", C, steps, 1, MAXI, "100", TM, "optimiser steps"),
    BT_KEY_I("grad_accum", C, grad_accum, 1, 65536, "1", CK | ES | TM, "micro-batches per optimiser step"),
    BT_KEY_E("schedule", C, schedule, k_scheds, NULL, "\"cosine\"", TM, "learning-rate schedule after warm-up"),
    BT_KEY_N("min_lr_ratio", C, min_lr_ratio, 0, 1, "0.1", TM,
             "floor of the cosine / linear decay as a fraction of lr"),
    {.name = "activation_checkpointing", .type = BT_KEY_CUSTOM, .off = offsetof(C, activation_checkpointing),
     .size = sizeof(int), .def = "\"auto\"", .parse = parse_ckpt, .dump = dump_ckpt, .flags = EV | ES | TM,
     .what = "true, false or \"auto\"",
     .doc = "recompute each layer's activations in backward instead of keeping them (bit-identical gradients, one "
            "extra forward per step); \"auto\": on when data.seq_len >= checkpointing_min_seq_len"},
    BT_KEY_I("save_every", C, save_every, 0, MAXI, "0", TM, "also save the adapter every N steps (0: only at the end)"),
    BT_KEY_S("out_dir", C, out_dir, 1, 0, "\"runs/adapter\"", TM, "PEFT adapter directory (replaced atomically on every save)"),
    BT_KEY_I("threads", C, threads, 0, 1024, "0", EV | ES | TM,
             "OpenMP threads for every kernel (0: the CPUs Slurm gives the task, else every CPU the process may "
             "use)"),
    BT_KEY_I("seed", C, seed, 0, INT64_MAX, "1234", CK | TM, "LoRA initialisation and dropout seed"),
    BT_KEY_I("log_every", C, log_every, 1, MAXI, "1", TM, "progress line every N steps (and at the last step)"),
    /* timeout_s <= INT_MAX / 1000: train.c waits timeout_s * 1000 ms (an int) */
    BT_KEY_I("timeout_s", C, timeout_s, 1, 2147483, "600", EV | TM, "longest wait for one batch from loaderd, seconds"),
    MASK("trainable_modules", trainable_mask, k_trainable_names, 0, "[]", CK | ES | TM,
         "an array of module names (embed_tokens, norm)",
         "LongLoRA \"LoRA+\": also train \"embed_tokens\" (and a tied lm_head) and / or every \"norm\" weight "
         "densely; saved as PEFT modules_to_save"),
    BT_KEY_I("checkpoint_every", C, checkpoint_every, 0, MAXI, "0", TM,
             "resumable checkpoint (adapter, AdamW moments, step, loader position) every N steps (0: never; also "
             "written when a run stops early)"),
    BT_KEY_S("checkpoint_dir", C, checkpoint_dir, 1, 0, "\"runs/checkpoint\"", TM,
             "the checkpoint directory (replaced atomically; not out_dir)"),
    BT_KEY_S("resume_from", C, resume_from, 1, 0, "null", BT_KEY_NULLABLE | EV | TM,
             "checkpoint directory to continue from (also --resume DIR); null: a fresh start"),
    BT_KEY_I("stop_at_step", C, stop_at_step, 0, MAXI, "0", TM,
             "stop and checkpoint once this many steps are done, keeping the schedule of steps (0: run to steps)"),
    BT_KEY_E("device", C, device, k_devices, NULL, "\"cpu\"", EV,
             "\"cpu\" or \"cuda\" (the GPU trainer, in a trainer built with make CUDA=1)"),
    BT_KEY_O("cuda", k_cuda, 0, "kernel choices of the GPU trainer (device \"cuda\" only)"),
    BT_KEY_O("report", k_report, 0, "the run report (trainer/report/report.h)"),
    BT_KEY_I("checkpointing_min_seq_len", C, checkpointing_min_seq_len, 1, MAXI, "4096", ES,
             "the row length from which activation_checkpointing \"auto\" checkpoints"),
    BT_KEY_O("context_extension", k_context_extension, BT_KEY_NULLABLE | EV | ES,
             "extend the model's context window: RoPE scaled so that target_length positions cover the trained "
             "context; composes with the model's own scaling (llama3); recorded in the adapter and every export"),
    BT_KEY_O("attention", k_attention, BT_KEY_NULLABLE | ES, "attention in training"),
    BT_KEY_O("dist", k_dist, EV,
             "data-parallel training, one process per GPU (device \"cuda\"); rank and world size come from "
             "RANK / WORLD_SIZE / LOCAL_RANK or SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID"),
    BT_KEY_END,
};
