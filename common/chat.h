/* Chat templates rendered to token ids with a loss mask.
 * ChatML (SmolLM2's tokenizer.chat_template): for each message
 *   "<|im_start|>" + role + "\n" + content + "<|im_end|>" + "\n"
 * and, as SmolLM2's template does, when the first message is not "system", a default system
 * message "You are a helpful AI assistant named SmolLM, trained by Hugging Face" first.
 * Loss mask: 1 on the tokens of each assistant message's content and its closing "<|im_end|>"
 * (what the model must learn to produce, including when to stop), 0 everywhere else (system,
 * user, role headers, the "\n" after <|im_end|>). Special-token strings inside message content
 * are NOT parsed (kept as text) so data cannot inject control tokens. */
#ifndef BT_CHAT_H
#define BT_CHAT_H
#include "tokenizer.h"

typedef struct {
    const char *role;     /* "system" | "user" | "assistant" (others allowed, never trained on) */
    const char *content;  /* UTF-8 */
    size_t content_len;
} bt_chat_msg;

/* The SentencePiece families' templates (common/chat_spm.c), each what the model's own Jinja
 * chat template renders (transformers apply_chat_template; sources and the bit-exact check:
 * tests/reference/gen_chat_template_fixtures.py, tests/unit/loaderd/test_chat_spm.c):
 *   GEMMA       Gemma 3 instruction-tuned ("<start_of_turn>user\n...<end_of_turn>\n
 *               <start_of_turn>model\n...<end_of_turn>\n"; = Gemma 1/2's without a system message)
 *   LLAMA2      Llama 2 chat ("<s>[INST] <<SYS>>\n...\n<</SYS>>\n\n... [/INST] ... </s>")
 *   MISTRAL     Mistral 7B Instruct v0.1/v0.2 ('v1': "<s> [INST] ... [/INST] ...</s>")
 *   MISTRAL_V3  Mistral 7B Instruct v0.3 ('v3': "<s>[INST] ...[/INST] ...</s>")
 *   PHI3        Phi-3 / Phi-3.5 ("<|user|>\n...<|end|>\n<|assistant|>\n...<|end|>\n<|endoftext|>")
 * They insert bos themselves where their template does. Loss: every assistant message's content
 * and the end-of-turn token after it (</s>, <end_of_turn>, <|end|>). */
typedef enum {
    BT_CHAT_CHATML = 0,
    BT_CHAT_GEMMA,
    BT_CHAT_LLAMA2,
    BT_CHAT_MISTRAL,
    BT_CHAT_MISTRAL_V3,
    BT_CHAT_PHI3,
} bt_chat_style;

/* "chatml", "gemma", "llama2", "mistral", "mistral-v3", "phi3"; "unknown" otherwise. */
const char *bt_chat_style_name(bt_chat_style s);

/* Appends the rendered conversation to ids and the matching 0/1 loss mask to mask
 * (same length). BT_ERR_INVALID if n == 0 or a role is NULL; BT_ERR_UNSUPPORTED if the
 * tokenizer lacks the template's special tokens (the message names the template and the token);
 * BT_ERR_FORMAT when the template refuses the conversation (roles not alternating as it requires,
 * a role it does not know: the message names the template; loaderd counts the line as bad), or
 * when a run's token lengths do not add up to its text (never mis-masked); BT_ERR_NOMEM when the
 * tokens do not fit in memory (never aborts: loaderd skips such a document). On error ids and
 * mask are left as they were. */
int bt_chat_encode(const bt_tokenizer *t, bt_chat_style style, const bt_chat_msg *msgs, int n,
                   bt_ids *ids, bt_ids *mask);
/* bt_chat_encode for the SentencePiece families' styles (arguments already checked). */
int bt_chat_encode_spm(const bt_tokenizer *t, bt_chat_style style, const bt_chat_msg *msgs, int n,
                       bt_ids *ids, bt_ids *mask);
/* Python str.strip() on s[0..*n) (left and/or right): Unicode White_Space plus U+001C..U+001F,
 * what Jinja's `trim` filter and `.strip()` remove. Moves *s, shrinks *n; s is valid UTF-8. */
void bt_chat_py_strip(const char **s, size_t *n, int left, int right);

#endif
