/* loaderd formats: one JSONL line -> token ids + 0/1 loss mask.
 *   chat   {"messages":[{"role":"...","content":"..."}, ...]}  rendered with bt_chat_encode
 *          (ChatML, common/chat.h): loss on assistant contents and their <|im_end|>.
 *   alpaca {"instruction":"...","input":"..."?,"output":"..."}  rendered as the chat
 *          [user: instruction + ("\n\n" + input if input is non-empty), assistant: output]
 *          through the same template (Stanford Alpaca's fields, rendered the way TRL/axolotl
 *          render instruction data for chat models).
 *   text   {<text_field>:"..."}  tokenized without special-token parsing, EOS appended (when the
 *          tokenizer has one), every token carries loss.
 * Other keys are ignored. The raw line is checked for valid UTF-8 first (so invalid bytes count
 * as `utf8`, not as the `json` error jansson would give), then parsed with jansson
 * (JSON_ALLOW_NUL: "\u0000" inside strings is kept, lengths are explicit everywhere).
 * A document is `empty` when it has no token with loss after its first token (e.g. chat without
 * an assistant message with content, alpaca with an empty output, text "").
 * chat/alpaca documents longer than T tokens are cut to their first T tokens (*truncated = 1);
 * one that then has no loss left is `empty`. text documents are never cut here (the packer
 * splits them). Thread-safe (the tokenizer is immutable). */
#ifndef LD_FORMAT_H
#define LD_FORMAT_H
#include <stddef.h>
#include <stdint.h>

#include "common/tokenizer.h"
#include "loaderd/pipeline.h"

typedef struct {
    ld_format format;
    const char *text_field;  /* LD_FMT_TEXT: key of the text (NULL = "text") */
    const bt_tokenizer *tok; /* borrowed */
    uint32_t T;              /* chat/alpaca truncation length in tokens; 0 = none */
} ld_format_cfg;

/* Offset of the first byte of s[0..n) that is not part of well-formed UTF-8 (Unicode 15
 * Table 3-7: no overlongs, no surrogates, <= U+10FFFF), or n if all of it is valid. */
size_t ld_utf8_check(const uint8_t *s, size_t n);

/* Format and tokenize one line (`len` bytes, no newline, need not be NUL-terminated).
 * On success returns 0 and appends the document to ids (token ids, int32 in [0, vocab)) and
 * mask (same length, 0/1); *truncated says whether it was cut to cfg->T.
 * A bad line returns 1 with *reason = LD_BAD_JSON / LD_BAD_UTF8 / LD_BAD_FIELD / LD_BAD_EMPTY,
 * a short description in msg (msglen bytes, NUL-terminated) and ids/mask left as they were.
 * Internal failures (tokenizer error, out of memory) return the negative bt_err. */
int ld_format_line(const ld_format_cfg *cfg, const char *line, size_t len, bt_ids *ids,
                   bt_ids *mask, int *truncated, int *reason, char *msg, size_t msglen);

#endif
