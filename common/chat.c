/* ChatML rendering to token ids with a loss mask (contract and mask rules: common/chat.h).
 *
 * Template: SmolLM2-135M-Instruct tokenizer.chat_template (GGUF), i.e.
 *   {% if loop.first and messages[0]['role'] != 'system' %}<|im_start|>system\n
 *     You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n{% endif %}
 *   <|im_start|>{role}\n{content}<|im_end|>\n   for every message.
 *
 * Tokenisation equals tokenising the whole rendered string with parse_special = 1 (HF
 * tokenizer(apply_chat_template(...))) as long as the message texts hold no control-token strings:
 * added tokens cut the text into independent runs, so each run "{role}\n{content}" and each "\n"
 * between <|im_end|> and <|im_start|> is tokenised on its own, with parse_special = 0 so content
 * cannot inject control tokens.
 *
 * Mask inside a run: BPE may produce a token straddling the header/content boundary (e.g. "\n  "
 * when content starts with spaces). A token is trained on (mask 1, assistant messages only) iff it
 * covers at least one content byte: the model must emit it to produce the content. */
#include "common/chat.h"

#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"

static const char DEFAULT_SYSTEM[] = "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

/* Input bytes a token produced by bt_tokenize (parse_special = 0) covers: user-defined tokens are
 * matched literally (their piece text), every other token covers the bytes it decodes to. */
static size_t src_len(const bt_tokenizer *t, int32_t id) {
    if (bt_tokenizer_token_type(t, id) == 4) return strlen(bt_tokenizer_piece(t, id));
    size_t n = 0;
    bt_tokenizer_token_bytes(t, id, &n);
    return n;
}

/* Appends a token and its mask bit; BT_ERR_NOMEM (a document larger than memory allows: the
 * caller skips it) leaves both as they were. */
static int push2(bt_ids *ids, bt_ids *mask, int32_t id, int32_t m) {
    if (bt_ids_try_push(ids, id)) return BT_ERR_NOMEM;
    if (bt_ids_try_push(mask, m)) {
        ids->n--;
        return BT_ERR_NOMEM;
    }
    return BT_OK;
}

/* Appends one message. BT_OK or BT_ERR_* (out of memory included). */
static int encode_msg(const bt_tokenizer *t, int32_t im_start, int32_t im_end, const char *role,
                      const char *content, size_t content_len, bt_ids *ids, bt_ids *mask, bt_ids *tmp) {
    int train = strcmp(role, "assistant") == 0;
    size_t role_len = strlen(role);
    if (push2(ids, mask, im_start, 0)) return bt_fail(BT_ERR_NOMEM, "chat: out of memory for the document's tokens");

    /* header length after UTF-8 sanitisation: "\n" ends any invalid subpart of role, so it is
     * the summed source length of the header's own tokens. */
    tmp->n = 0;
    int rc = bt_tokenize(t, role, role_len, 0, tmp);
    if (rc < 0) return rc;
    size_t header = 1;
    for (size_t i = 0; i < tmp->n; i++) header += src_len(t, tmp->v[i]);

    /* the run "{role}\n{content}" */
    size_t run_len = role_len + 1 + content_len;
    char *run = malloc(run_len + 1);
    if (!run) return bt_fail(BT_ERR_NOMEM, "chat: out of memory (%zu bytes)", run_len + 1);
    memcpy(run, role, role_len);
    run[role_len] = '\n';
    if (content_len) memcpy(run + role_len + 1, content, content_len);
    run[run_len] = 0;
    tmp->n = 0;
    rc = bt_tokenize(t, run, run_len, 0, tmp);
    free(run);
    if (rc < 0) return rc;
    size_t off = 0;
    for (size_t i = 0; i < tmp->n && rc == 0; i++) {
        off += src_len(t, tmp->v[i]);
        rc = push2(ids, mask, tmp->v[i], train && off > header ? 1 : 0);
    }
    if (rc == 0) rc = push2(ids, mask, im_end, train ? 1 : 0);
    if (rc) return bt_fail(BT_ERR_NOMEM, "chat: out of memory for the document's tokens");
    tmp->n = 0;
    rc = bt_tokenize(t, "\n", 1, 0, tmp);
    if (rc < 0) return rc;
    for (size_t i = 0; i < tmp->n; i++)
        if (push2(ids, mask, tmp->v[i], 0)) return bt_fail(BT_ERR_NOMEM, "chat: out of memory for the document's tokens");
    return 0;
}

int bt_chat_encode(const bt_tokenizer *t, bt_chat_style style, const bt_chat_msg *msgs, int n, bt_ids *ids,
                   bt_ids *mask) {
    if (!t || !ids || !mask) return bt_fail(BT_ERR_INVALID, "chat_encode: NULL argument");
    if (n <= 0 || !msgs) return bt_fail(BT_ERR_INVALID, "chat_encode: no messages (n = %d)", n);
    for (int i = 0; i < n; i++) {
        if (!msgs[i].role) return bt_fail(BT_ERR_INVALID, "chat_encode: messages[%d].role is NULL", i);
        if (!msgs[i].content && msgs[i].content_len)
            return bt_fail(BT_ERR_INVALID, "chat_encode: messages[%d].content is NULL with length %zu", i,
                           msgs[i].content_len);
    }
    if (style != BT_CHAT_CHATML) return bt_chat_encode_spm(t, style, msgs, n, ids, mask);
    int32_t im_start = bt_tokenizer_find(t, "<|im_start|>"), im_end = bt_tokenizer_find(t, "<|im_end|>");
    if (im_start < 0 || im_end < 0)
        return bt_fail(BT_ERR_UNSUPPORTED, "chat_encode: tokenizer has no <|im_start|>/<|im_end|> (ChatML)");

    size_t n_ids0 = ids->n, n_mask0 = mask->n;
    bt_ids tmp = {0};
    int rc = 0;
    if (strcmp(msgs[0].role, "system") != 0)
        rc = encode_msg(t, im_start, im_end, "system", DEFAULT_SYSTEM, sizeof DEFAULT_SYSTEM - 1, ids, mask, &tmp);
    for (int i = 0; i < n && rc == 0; i++)
        rc = encode_msg(t, im_start, im_end, msgs[i].role, msgs[i].content, msgs[i].content_len, ids, mask, &tmp);
    bt_ids_free(&tmp);
    if (rc < 0) { /* leave the outputs as they were */
        ids->n = n_ids0;
        mask->n = n_mask0;
    }
    return rc;
}
