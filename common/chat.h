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

typedef enum { BT_CHAT_CHATML = 0 } bt_chat_style;

/* Appends the rendered conversation to ids and the matching 0/1 loss mask to mask
 * (same length). BT_ERR_INVALID if n == 0 or a role is NULL; BT_ERR_UNSUPPORTED if the
 * tokenizer lacks <|im_start|>/<|im_end|>; BT_ERR_NOMEM when the tokens do not fit in memory
 * (never aborts: loaderd skips such a document). On error ids and mask are left as they were. */
int bt_chat_encode(const bt_tokenizer *t, bt_chat_style style, const bt_chat_msg *msgs, int n,
                   bt_ids *ids, bt_ids *mask);

#endif
