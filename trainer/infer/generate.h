/* Text generation on the KV-cache inference forward (trainer/infer/infer.h): token sampling (greedy,
 * temperature + nucleus/top-p), the decode loop, ChatML prompt rendering, and the
 * `trainer generate` command line. */
#ifndef BT_TRAINER_GENERATE_H
#define BT_TRAINER_GENERATE_H
#include <stdint.h>
#include <stdio.h>

#include "common/chat.h"
#include "common/tokenizer.h"
#include "trainer/infer/infer.h"
#include "trainer/model/rng.h"

/* Index of the largest of logits[V] (V >= 1; the lowest index on ties; NaN never wins unless all
 * are NaN, then 0). */
int32_t bt_argmax(const float *logits, int V);

/* Token sampler. temperature 0 = greedy (argmax, no randomness). temperature > 0: softmax of
 * logits / temperature (max subtracted, double accumulation), then nucleus filtering (Holtzman et
 * al. 2019, "The Curious Case of Neural Text Degeneration"; HF TopPLogitsWarper semantics): in
 * descending probability order (ties by lower id) keep a token while the mass of the tokens before
 * it is < top_p, always keeping the first; then draw from the kept tokens renormalised, with a
 * xoshiro256** stream seeded by `seed` (53-bit uniforms), so a seed reproduces the sequence.
 * top_p = 1 keeps every token; top_p -> 0 keeps only the argmax (= greedy). No top-k. */
typedef struct {
    int V;
    float temperature, top_p;
    bt_rng rng;
    double *prob;    /* [V] (owned) */
    int32_t *idx;    /* [V] (owned) */
} bt_sampler;

/* Allocate for a vocabulary of V (>= 1). Errors: BT_ERR_INVALID (V < 1, temperature < 0 or not
 * finite, top_p outside [0, 1] or NaN), BT_ERR_NOMEM. Free with bt_sampler_free. */
int bt_sampler_init(bt_sampler *sp, int V, float temperature, float top_p, uint64_t seed);
void bt_sampler_free(bt_sampler *sp);
/* Next token from logits[V] (read only). Non-finite logits are treated as -inf; if every logit is
 * -inf/NaN the argmax rule applies (id 0). Always returns an id in [0, V). */
int32_t bt_sampler_next(bt_sampler *sp, const float *logits);

/* Called with each new token id as it is produced; a nonzero return stops generation. */
typedef int (*bt_gen_cb)(void *ud, int32_t id);

typedef struct {
    int max_new_tokens;      /* >= 1 */
    float temperature;       /* 0 = greedy */
    float top_p;             /* (0, 1], 1 = off */
    uint64_t seed;
    const int32_t *stop_ids; /* generation ends after producing one of these (it is included in
                              * the output and passed to the callback); may be NULL */
    int n_stop;
} bt_gen_opts;

/* Generate from prompt[n_prompt] (n_prompt >= 1): resets the session's cache, prefills the prompt
 * in one call (chunked by the session), then samples and feeds one token at a time until a stop
 * id, max_new_tokens, or the callback asks to stop. New ids are appended to *out (caller-owned,
 * may be NULL); *n_new (may be NULL) gets their count. Needs n_prompt + max_new_tokens - 1 <=
 * bt_infer_max_ctx(s). Errors: BT_ERR_INVALID (bad options), BT_ERR_RANGE (context too small,
 * prompt id out of range), BT_ERR_NOMEM, BT_ERR_DIVERGED (logits not finite: bt_infer_forward;
 * nothing is sampled from them); tokens produced before an error stay in *out. */
int bt_generate(bt_infer *s, const int32_t *prompt, int n_prompt, const bt_gen_opts *o,
                bt_gen_cb cb, void *ud, bt_ids *out, int *n_new);

/* Render msgs[n] with ChatML (common/chat.h: default system prompt when the first message is not
 * "system") and append the generation prompt "<|im_start|>assistant\n" (SmolLM2's template with
 * add_generation_prompt=True), appending the ids to *ids. Errors: those of bt_chat_encode and
 * bt_tokenize. */
int bt_gen_chat_prompt(const bt_tokenizer *t, const bt_chat_msg *msgs, int n, bt_ids *ids);
/* The ids of a raw --prompt: bt_tokenize(parse_special = 1) of text, with the BOS token in front
 * when `model` is a GGUF whose tokenizer.ggml.add_bos_token is true and the text did not start
 * with BOS (llama.cpp's llama_tokenize with add_special; HF add_bos_token). ids: appended to
 * (caller-owned, bt_ids_free). Errors: those of bt_tokenize, BT_ERR_NOMEM. */
int bt_gen_raw_prompt(const char *model, const bt_tokenizer *tok, const char *text, bt_ids *ids);

/* `trainer generate ...`; argv[0] is "generate". Prints the usage on --help. Streams the decoded
 * continuation to stdout (flushed per token; control tokens such as <|im_end|> are not printed
 * unless --show-special), a summary (tokens, tok/s) to stderr. Returns the process exit status:
 * 0 success, 1 runtime failure, 2 usage error, 3 the logits are not finite (the model or adapter
 * overflows fp32: bt_infer_forward's BT_ERR_DIVERGED). */
int bt_generate_cli(int argc, char **argv);
/* The usage text of `trainer generate`. */
void bt_generate_usage(FILE *f);

#endif
