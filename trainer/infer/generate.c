/* Sampling, the decode loop and `trainer generate`. See generate.h. */
#include "trainer/infer/generate.h"

#include <getopt.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/gguf.h"
#include "trainer/io/adapter_load.h"
#include "trainer/config.h"
#include "trainer/model/model.h"

/* ---- sampling ---- */

int32_t bt_argmax(const float *logits, int V) {
    int32_t best = 0;
    float bv = -INFINITY;
    int found = 0;
    for (int i = 0; i < V; i++) {
        float x = logits[i];
        if (isnan(x)) continue;
        if (!found || x > bv) {
            bv = x;
            best = i;
            found = 1;
        }
    }
    return best;
}

int bt_sampler_init(bt_sampler *sp, int V, float temperature, float top_p, uint64_t seed) {
    memset(sp, 0, sizeof *sp);
    if (V < 1) return bt_fail(BT_ERR_INVALID, "sampler: vocabulary size %d < 1", V);
    if (!(temperature >= 0.f) || !isfinite(temperature))
        return bt_fail(BT_ERR_INVALID, "sampler: temperature %g must be a finite number >= 0",
                       (double)temperature);
    if (!(top_p >= 0.f && top_p <= 1.f))
        return bt_fail(BT_ERR_INVALID, "sampler: top_p %g must be in [0, 1]", (double)top_p);
    sp->V = V;
    sp->temperature = temperature;
    sp->top_p = top_p;
    bt_rng_seed(&sp->rng, seed);
    sp->prob = malloc((size_t)V * sizeof(double));
    sp->idx = malloc((size_t)V * sizeof(int32_t));
    if (!sp->prob || !sp->idx) {
        bt_sampler_free(sp);
        return bt_fail(BT_ERR_NOMEM, "sampler: out of memory for %d tokens", V);
    }
    return 0;
}

void bt_sampler_free(bt_sampler *sp) {
    free(sp->prob);
    free(sp->idx);
    sp->prob = NULL;
    sp->idx = NULL;
}

/* qsort_r comparator: descending probability (ctx = the prob array), ties by lower id. */
static int cmp_prob_desc(const void *a, const void *b, void *ctx) {
    const double *prob = ctx;
    int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    double pi = prob[i], pj = prob[j];
    if (pi != pj) return pi > pj ? -1 : 1;
    return (i > j) - (i < j);
}

int32_t bt_sampler_next(bt_sampler *sp, const float *logits) {
    const int V = sp->V;
    int32_t top = bt_argmax(logits, V);
    if (sp->temperature == 0.f || !isfinite(logits[top])) return top;
    double mx = logits[top], inv_t = 1.0 / sp->temperature, sum = 0;
    int n = 0;
    for (int i = 0; i < V; i++) {
        float x = logits[i];
        double p = isfinite(x) ? exp(((double)x - mx) * inv_t) : 0.0;
        sp->prob[i] = p;
        sum += p;
        if (p > 0) sp->idx[n++] = i; /* only tokens with mass can be kept */
    }
    for (int i = 0; i < n; i++) sp->prob[sp->idx[i]] /= sum;
    int keep = n;
    if (sp->top_p < 1.f) {
        qsort_r(sp->idx, (size_t)n, sizeof(int32_t), cmp_prob_desc, sp->prob);
        double before = 0;
        keep = 0;
        while (keep < n && (keep == 0 || before < (double)sp->top_p))
            before += sp->prob[sp->idx[keep++]];
    }
    double mass = 0;
    for (int k = 0; k < keep; k++) mass += sp->prob[sp->idx[k]];
    double u = (double)(bt_rng_next(&sp->rng) >> 11) * (1.0 / 9007199254740992.0) * mass;
    double acc = 0;
    for (int k = 0; k < keep; k++) {
        acc += sp->prob[sp->idx[k]];
        if (u < acc) return sp->idx[k];
    }
    return sp->idx[keep - 1]; /* rounding: u landed at the very end */
}

/* ---- decode loop ---- */

static int is_stop(const bt_gen_opts *o, int32_t id) {
    for (int i = 0; i < o->n_stop; i++)
        if (o->stop_ids && o->stop_ids[i] == id) return 1;
    return 0;
}

int bt_generate(bt_infer *s, const int32_t *prompt, int n_prompt, const bt_gen_opts *o,
                bt_gen_cb cb, void *ud, bt_ids *out, int *n_new) {
    if (n_new) *n_new = 0;
    if (!s || !o || !prompt || n_prompt < 1)
        return bt_fail(BT_ERR_INVALID, "generate: empty prompt (%d tokens)", n_prompt);
    if (o->max_new_tokens < 1)
        return bt_fail(BT_ERR_INVALID, "generate: max_new_tokens %d < 1", o->max_new_tokens);
    if (o->n_stop < 0 || (o->n_stop > 0 && !o->stop_ids))
        return bt_fail(BT_ERR_INVALID, "generate: bad stop list (%d ids)", o->n_stop);
    if ((int64_t)n_prompt + o->max_new_tokens - 1 > bt_infer_max_ctx(s))
        return bt_fail(BT_ERR_RANGE, "generate: %d prompt + %d new tokens exceed the context of %d",
                       n_prompt, o->max_new_tokens, bt_infer_max_ctx(s));
    bt_sampler sp;
    const int V = bt_infer_vocab(s);
    int rc = bt_sampler_init(&sp, V, o->temperature, o->top_p, o->seed);
    if (rc) return rc;
    float *logits = malloc((size_t)V * sizeof(float));
    if (!logits) {
        bt_sampler_free(&sp);
        return bt_fail(BT_ERR_NOMEM, "generate: out of memory for logits");
    }
    bt_infer_reset(s);
    rc = bt_infer_forward(s, prompt, n_prompt, BT_INFER_LOGITS_LAST, logits);
    for (int t = 0; rc == 0 && t < o->max_new_tokens; t++) {
        int32_t id = bt_sampler_next(&sp, logits);
        if (out) bt_ids_push(out, id);
        if (n_new) *n_new = t + 1;
        if ((cb && cb(ud, id)) || is_stop(o, id) || t + 1 == o->max_new_tokens) break;
        rc = bt_infer_forward(s, &id, 1, BT_INFER_LOGITS_LAST, logits);
    }
    free(logits);
    bt_sampler_free(&sp);
    return rc;
}

/* ---- prompts ---- */

/* A raw --prompt gets the BOS token in front when the model is a GGUF whose
 * tokenizer.ggml.add_bos_token is true and the text did not start with BOS itself (llama.cpp's
 * llama_tokenize with add_special; Hugging Face's add_bos_token): Gemma's and Llama 2's models
 * are trained with it and degrade without it. A directory (HF tokenizer) is left as is. Errors:
 * BT_ERR_NOMEM. */
static int prepend_bos(const char *model, const bt_tokenizer *tok, bt_ids *ids) {
    const int32_t bos = bt_tokenizer_bos(tok);
    if (bos < 0 || (ids->n > 0 && ids->v[0] == bos)) return 0;
    bt_gguf *g = NULL;
    if (bt_gguf_open(&g, model) != 0) return 0; /* not a GGUF: nothing to read */
    int add = 0;
    if (bt_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &add) != 0) add = 0;
    bt_gguf_close(g);
    if (!add) return 0;
    bt_ids out = {0};
    if (bt_ids_try_push(&out, bos) || bt_ids_try_append(&out, ids->v, ids->n)) {
        bt_ids_free(&out);
        return bt_fail(BT_ERR_NOMEM, "generate: out of memory (prompt)");
    }
    bt_ids_free(ids);
    *ids = out;
    return 0;
}

int bt_gen_raw_prompt(const char *model, const bt_tokenizer *tok, const char *text, bt_ids *ids) {
    int rc = bt_tokenize(tok, text, strlen(text), 1, ids);
    return rc ? rc : prepend_bos(model, tok, ids);
}

int bt_gen_chat_prompt(const bt_tokenizer *t, const bt_chat_msg *msgs, int n, bt_ids *ids) {
    bt_ids mask = {0};
    size_t n0 = ids ? ids->n : 0;
    int rc = bt_chat_encode(t, BT_CHAT_CHATML, msgs, n, ids, &mask);
    bt_ids_free(&mask);
    if (rc) return rc;
    static const char hdr[] = "<|im_start|>assistant\n";
    rc = bt_tokenize(t, hdr, sizeof hdr - 1, 1, ids);
    if (rc) ids->n = n0;
    return rc;
}

/* ---- command line ---- */

void bt_generate_usage(FILE *f) {
    fprintf(f,
            "usage: trainer generate --model PATH.gguf [--adapter DIR] (--prompt TEXT | --chat TEXT)\n"
            "                        [--system TEXT] [--max-new-tokens N] [--temperature T]\n"
            "                        [--top-p P] [--seed S] [--base-dtype auto|gguf|nf4|fp32]\n"
            "                        [--ignore-eos] [--show-special]\n"
            "\n"
            "Generate a continuation with the base model (plus a PEFT LoRA adapter directory with\n"
            "--adapter) and stream it to stdout.\n"
            "  --prompt TEXT        raw text (special-token strings such as <|im_start|> are parsed;\n"
            "                       BOS in front when the GGUF sets tokenizer.ggml.add_bos_token,\n"
            "                       as llama.cpp tokenizes a prompt: Gemma, Llama 2)\n"
            "  --chat TEXT          one user message rendered with the ChatML template (default\n"
            "                       system prompt unless --system) plus \"<|im_start|>assistant\\n\"\n"
            "  --max-new-tokens N   default 256\n"
            "  --temperature T      0 (default) = greedy; > 0 samples from softmax(logits / T)\n"
            "  --top-p P            nucleus sampling mass in (0, 1], default 1 (off)\n"
            "  --seed S             sampling seed, default 0 (same seed, same output)\n"
            "  --base-dtype D       frozen base linears as gguf (the file's own blocks), nf4 or\n"
            "                       fp32; default auto (gguf for a .gguf, nf4 for a directory):\n"
            "                       use the base the adapter was trained against\n"
            "  --ignore-eos         do not stop at EOS / <|im_end|>\n"
            "  --show-special       also print control tokens (<|im_end|>, ...)\n"
            "Generation stops at the tokenizer's EOS or <|im_end|>, or after N tokens.\n");
}

static int parse_int(const char *s, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

static int parse_float(const char *s, float *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v)) return -1;
    *out = (float)v;
    return 0;
}

typedef struct {
    const bt_tokenizer *tok;
    int show_special;
} stream_ctx;

static int stream_token(void *ud, int32_t id) {
    stream_ctx *c = ud;
    int type = bt_tokenizer_token_type(c->tok, id);
    if (c->show_special || type != 3 /* control */) {
        size_t len;
        const uint8_t *b = bt_tokenizer_token_bytes(c->tok, id, &len);
        if (b && len) fwrite(b, 1, len, stdout);
        fflush(stdout);
    }
    return 0;
}

typedef struct {
    const char *model, *adapter, *prompt, *chat, *system;
    long max_new, seed;
    float temperature, top_p;
    int base_dtype, ignore_eos, show_special;
    int seed_given, top_p_given; /* sampling options, refused with greedy decoding */
} gen_args;

/* 0 ok, 1 --help shown, 2 usage error (message printed). */
static int parse_args(gen_args *a, int argc, char **argv) {
    memset(a, 0, sizeof *a);
    a->max_new = 256;
    a->top_p = 1.f;
    a->base_dtype = BT_BASE_AUTO;
    enum { O_MODEL = 256, O_ADAPTER, O_PROMPT, O_CHAT, O_SYSTEM, O_MAX_NEW, O_TEMP, O_TOP_P, O_SEED, O_DTYPE,
           O_IGNORE_EOS, O_SHOW_SPECIAL };
    static const struct option opts[] = {
        {"help", no_argument, NULL, 'h'},
        {"model", required_argument, NULL, O_MODEL},
        {"adapter", required_argument, NULL, O_ADAPTER},
        {"prompt", required_argument, NULL, O_PROMPT},
        {"chat", required_argument, NULL, O_CHAT},
        {"system", required_argument, NULL, O_SYSTEM},
        {"max-new-tokens", required_argument, NULL, O_MAX_NEW},
        {"temperature", required_argument, NULL, O_TEMP},
        {"top-p", required_argument, NULL, O_TOP_P},
        {"seed", required_argument, NULL, O_SEED},
        {"base-dtype", required_argument, NULL, O_DTYPE},
        {"ignore-eos", no_argument, NULL, O_IGNORE_EOS},
        {"show-special", no_argument, NULL, O_SHOW_SPECIAL},
        {NULL, 0, NULL, 0},
    };
    optind = 0;
    opterr = 0;
    int o;
    while ((o = getopt_long(argc, argv, "+:h", opts, NULL)) != -1) {
        const char *v = optarg;
        long n;
        switch (o) {
        case 'h': bt_generate_usage(stdout); return 1;
        case O_IGNORE_EOS: a->ignore_eos = 1; break;
        case O_SHOW_SPECIAL: a->show_special = 1; break;
        case O_MODEL: a->model = v; break;
        case O_ADAPTER: a->adapter = v; break;
        case O_PROMPT: a->prompt = v; break;
        case O_CHAT: a->chat = v; break;
        case O_SYSTEM: a->system = v; break;
        case O_MAX_NEW:
            if (parse_int(v, 1, 1 << 20, &n)) {
                fprintf(stderr, "trainer generate: --max-new-tokens: expected 1..1048576, got "
                        "\"%s\"\n", v);
                return 2;
            }
            a->max_new = n;
            break;
        case O_SEED:
            if (parse_int(v, 0, 0x7fffffffL, &n)) {
                fprintf(stderr, "trainer generate: --seed: expected an integer >= 0, got \"%s\"\n", v);
                return 2;
            }
            a->seed = n;
            a->seed_given = 1;
            break;
        case O_TEMP:
            if (parse_float(v, &a->temperature) || a->temperature < 0) {
                fprintf(stderr, "trainer generate: --temperature: expected a number >= 0, got "
                        "\"%s\"\n", v);
                return 2;
            }
            break;
        case O_TOP_P:
            if (parse_float(v, &a->top_p) || !(a->top_p > 0 && a->top_p <= 1)) {
                fprintf(stderr, "trainer generate: --top-p: expected a number in (0, 1], got "
                        "\"%s\"\n", v);
                return 2;
            }
            a->top_p_given = 1;
            break;
        case O_DTYPE:
            a->base_dtype = -1;
            for (int d = BT_BASE_NF4; d <= BT_BASE_AUTO; d++)
                if (!strcmp(v, bt_base_dtype_name(d))) a->base_dtype = d;
            if (a->base_dtype < 0) {
                fprintf(stderr, "trainer generate: --base-dtype: expected auto, gguf, nf4 or fp32, "
                        "got \"%s\"\n", v);
                return 2;
            }
            break;
        case ':': /* a known option without its value */
            fprintf(stderr, "trainer generate: %s needs a value\n", argv[optind - 1]);
            return 2;
        default:
            fprintf(stderr, "trainer generate: unexpected argument \"%s\" (try --help)\n", argv[optind - 1]);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "trainer generate: unexpected argument \"%s\" (try --help)\n", argv[optind]);
        return 2;
    }
    if (!a->model) {
        fprintf(stderr, "trainer generate: --model PATH is required (try --help)\n");
        return 2;
    }
    if (!a->prompt == !a->chat) {
        fprintf(stderr, "trainer generate: give exactly one of --prompt TEXT and --chat TEXT\n");
        return 2;
    }
    if (a->system && !a->chat) {
        fprintf(stderr, "trainer generate: --system only applies to --chat\n");
        return 2;
    }
    if (a->temperature == 0 && (a->seed_given || a->top_p_given)) { /* greedy would ignore them */
        fprintf(stderr, "trainer generate: %s only applies to sampling (--temperature > 0); "
                "greedy decoding would ignore it\n", a->seed_given ? "--seed" : "--top-p");
        return 2;
    }
    return 0;
}

int bt_generate_cli(int argc, char **argv) {
    gen_args a;
    int prc = parse_args(&a, argc, argv);
    if (prc) return prc == 1 ? 0 : 2;

    bt_model m;
    memset(&m, 0, sizeof m);
    bt_lora lo;
    memset(&lo, 0, sizeof lo);
    bt_tokenizer *tok = NULL;
    bt_infer *s = NULL;
    bt_ids ids = {0};
    int loaded = 0, exit_code = 1, rc;
    double t0 = bt_now();
    bt_model_load_opts lopt = {a.base_dtype, 0};
    if ((rc = bt_model_load(&m, a.model, &lopt))) goto fail;
    loaded = 1;
    if ((rc = bt_tokenizer_load(&tok, a.model))) goto fail;
    if (a.adapter) {
        if ((rc = bt_lora_load_peft(&lo, &m, a.adapter))) goto fail;
        if ((rc = bt_adapter_apply_context(&m, a.adapter))) goto fail;
    }
    if (a.chat) {
        bt_chat_msg msgs[2];
        int n = 0;
        if (a.system) msgs[n++] = (bt_chat_msg){"system", a.system, strlen(a.system)};
        msgs[n++] = (bt_chat_msg){"user", a.chat, strlen(a.chat)};
        rc = bt_gen_chat_prompt(tok, msgs, n, &ids);
    } else {
        rc = bt_gen_raw_prompt(a.model, tok, a.prompt, &ids);
    }
    if (rc) goto fail;
    if (ids.n == 0) {
        fprintf(stderr, "trainer generate: the prompt is empty after tokenization\n");
        exit_code = 2;
        goto done;
    }
    if (ids.n + (size_t)a.max_new <= (size_t)1 << 24 &&
        (rc = bt_model_check_window(&m, (int64_t)ids.n + a.max_new, "the prompt + --max-new-tokens",
                                     1 /* trainer/infer/infer.c applies the window */)))
        goto fail;
    if (ids.n + (size_t)a.max_new > (size_t)1 << 24) {
        rc = bt_fail(BT_ERR_RANGE, "generate: %zu prompt + %ld new tokens is too long", ids.n,
                     a.max_new);
        goto fail;
    }
    int max_ctx = (int)ids.n + (int)a.max_new;
    if (m.hp.ctx > 0 && max_ctx > m.hp.ctx)
        bt_log(BT_LOG_WARN, "generate", "%d tokens exceed the model's context_length %d", max_ctx,
               m.hp.ctx);
    if ((rc = bt_infer_new(&s, &m, a.adapter ? &lo : NULL, max_ctx, 256))) goto fail;
    int32_t stops[2];
    int n_stop = 0;
    int32_t eos = bt_tokenizer_eos(tok), im_end = bt_tokenizer_find(tok, "<|im_end|>");
    if (!a.ignore_eos) {
        if (eos >= 0) stops[n_stop++] = eos;
        if (im_end >= 0 && im_end != eos) stops[n_stop++] = im_end;
    }
    bt_gen_opts o = {(int)a.max_new, a.temperature, a.top_p, (uint64_t)a.seed, stops, n_stop};
    stream_ctx sc = {tok, a.show_special};
    double t1 = bt_now();
    bt_log(BT_LOG_INFO, "generate", "model loaded in %.1f s (%s base%s), prompt %zu tokens",
           t1 - t0, bt_base_dtype_name(m.base_dtype), a.adapter ? " + adapter" : "",
           ids.n);
    int n_new = 0;
    rc = bt_generate(s, ids.v, (int)ids.n, &o, stream_token, &sc, NULL, &n_new);
    fputc('\n', stdout);
    fflush(stdout);
    if (rc) goto fail;
    double dt = bt_now() - t1;
    bt_log(BT_LOG_INFO, "generate", "%d new tokens in %.2f s (%.1f tok/s, prefill included)",
           n_new, dt, dt > 0 ? n_new / dt : 0.0);
    exit_code = 0;
    goto done;
fail:
    fprintf(stderr, "trainer generate: %s\n", bt_last_error());
    exit_code = rc == BT_ERR_DIVERGED ? 3 : 1; /* non-finite logits: trainer/loop/train.h BT_EXIT_DIVERGED */
done:
    bt_infer_free(s);
    bt_ids_free(&ids);
    bt_tokenizer_free(tok);
    if (lo.mods || lo.params) bt_lora_free(&lo);
    if (loaded) bt_model_free(&m);
    return exit_code;
}
