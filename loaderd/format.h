/* loaderd formats: one JSONL line -> token ids + 0/1 loss mask.
 *   chat   {"messages":[{"role":"...","content":"..."}, ...]}  multi-turn; loss on every
 *          assistant turn's content and its end-of-turn token, nothing else. Templates:
 *          ChatML  via bt_chat_encode (common/chat.h): "<|im_start|>role\ncontent<|im_end|>\n",
 *                  SmolLM2's default system message first when there is none.
 *          Llama-3 (Meta-Llama-3-8B-Instruct tokenizer_config.json chat_template):
 *                  "<|begin_of_text|>" then per message
 *                  "<|start_header_id|>" role "<|end_header_id|>" "\n\n" trim(content) "<|eot_id|>"
 *                  (Jinja `trim` = Python str.strip(): leading/trailing Unicode whitespace
 *                  removed; no default system message). Special tokens are inserted by id; role
 *                  and content are tokenized with parse_special = 0 (data cannot inject control
 *                  tokens); the run "\n\n"+content is tokenized as one piece, as HF does between
 *                  two special tokens, and a token is trained on iff it covers at least one
 *                  content byte.
 *          gemma, llama2, mistral (7B Instruct v0.1/v0.2), mistral-v3 (v0.3), phi3: the
 *                  SentencePiece families' own templates via bt_chat_encode (common/chat.h:
 *                  what each renders, the same mask rule, end-of-turn token trained); they
 *                  place BOS themselves (cfg->add_bos does not add one). A conversation the
 *                  template refuses (roles out of its order, a role it does not know) is a bad
 *                  line (`field`) with the template's message.
 *   alpaca {"instruction":"...","input":"..."?,"output":"..."}  rendered as the chat
 *          [user: instruction + ("\n\n" + input if input is non-empty), assistant: output]
 *          through the same template (Stanford Alpaca's fields, rendered the way TRL/axolotl
 *          render instruction data for chat models).
 *   text   {<text_field>:"..."}  tokenized without special-token parsing, every token carries
 *          loss; BOS prepended when cfg->add_bos and the tokenizer has one, EOS appended once
 *          (when the tokenizer has one).
 * BOS is never doubled: chat/alpaca (ChatML, Llama-3) get a BOS in front only when cfg->add_bos is set and the
 * rendered template does not already start with it (Llama-3's starts with <|begin_of_text|>,
 * the BOS of Llama-3 tokenizers); chat/alpaca get no extra EOS (the end-of-turn token ends the
 * document, as in HF apply_chat_template).
 * Other keys are ignored. The raw line is checked for valid UTF-8 first (so invalid bytes count
 * as `utf8`, not as the `json` error jansson would give), then parsed with jansson
 * (JSON_ALLOW_NUL: "\u0000" inside strings is kept, lengths are explicit everywhere).
 * A document is `empty` when it has no token with loss after its first token (e.g. chat without
 * an assistant message with content, alpaca with an empty output, text "").
 * chat/alpaca documents longer than cfg->T tokens are cut to their first T tokens (*truncated = 1)
 * or, with cfg->overlong_drop, rejected as `overlong`; a cut one with no loss left is `empty`.
 * text documents are never cut here (the packer splits them). Thread-safe (the tokenizer is
 * immutable). */
#ifndef LD_FORMAT_H
#define LD_FORMAT_H
#include <stddef.h>
#include <stdint.h>

#include "common/tokenizer.h"
#include "loaderd/job.h"

typedef struct {
    ld_format format;
    const char *text_field;  /* LD_FMT_TEXT: key of the text (NULL = "text") */
    const bt_tokenizer *tok; /* borrowed */
    uint32_t T;              /* chat/alpaca truncation length in tokens; 0 = none */
    ld_chat_tpl tpl;         /* resolved (ld_chat_tpl_resolve), never LD_TPL_AUTO */
    int add_bos;             /* prepend the tokenizer's BOS (if any and not already there) */
    int overlong_drop;       /* chat/alpaca longer than T: 1 = reject as LD_BAD_OVERLONG */
    /* preference / kto only (ld_format_pref_fit), TRL's DPOConfig / KTOConfig names; 0 = no limit */
    uint32_t max_prompt_length; /* prompt tokens kept (from the end) when a record exceeds max_length */
    uint32_t max_length;        /* prompt + longer response, in tokens */
} ld_format_cfg;

/* Resolve the chat template to use with tok: an explicit want is checked (the tokenizer must have
 * that template's special tokens: ChatML's, Llama-3's, <start_of_turn>/<end_of_turn> + bos for
 * gemma, <|system|>/<|user|>/<|assistant|>/<|end|>/<|endoftext|> for phi3, bos + eos for
 * llama2 / mistral / mistral-v3); LD_TPL_AUTO picks from the tokenizer's chat_template string by
 * text only that family's official template has ("<|im_start|>" ChatML, "<|start_header_id|>"
 * Llama-3, "<start_of_turn>" gemma, "<|assistant|>" + "<|end|>" phi3, "<<SYS>>" + Llama 2's
 * content.strip() line, Mistral v1's ' [INST] ' + system_message, v3's "[INST] " +
 * system_message); a chat_template matching none is refused, quoting it (an other [INST]
 * template: naming the three to choose from), never rendered as something else. Without a
 * chat_template: from which special tokens exist (ChatML, Llama-3, Gemma, Phi-3 in that order).
 * Returns 0 with *out set, or BT_ERR_UNSUPPORTED naming the template and what is missing. */
int ld_chat_tpl_resolve(const bt_tokenizer *tok, ld_chat_tpl want, ld_chat_tpl *out);
/* "auto", "chatml", "llama3", "gemma", "llama2", "mistral", "mistral-v3", "phi3"; "unknown" otherwise. */
const char *ld_chat_tpl_name(ld_chat_tpl t);

/* Offset of the first byte of s[0..n) that is not part of well-formed UTF-8 (Unicode 15
 * Table 3-7: no overlongs, no surrogates, <= U+10FFFF), or n if all of it is valid. */
size_t ld_utf8_check(const uint8_t *s, size_t n);

/* Format and tokenize one line (`len` bytes, no newline, need not be NUL-terminated).
 * On success returns 0 and appends the document to ids (token ids, int32 in [0, vocab)) and
 * mask (same length, 0/1); *truncated says whether it was cut to cfg->T.
 * A bad line returns 1 with *reason = LD_BAD_JSON / LD_BAD_UTF8 / LD_BAD_FIELD / LD_BAD_EMPTY /
 * LD_BAD_OVERLONG, a short description in bt_last_error() (this thread's) and ids/mask left as
 * they were. Internal failures (tokenizer error; BT_ERR_NOMEM: the document's tokens do not fit
 * in memory, never an abort) return the negative bt_err, ids/mask as they were. */
int ld_format_line(const ld_format_cfg *cfg, const char *line, size_t len, bt_ids *ids,
                   bt_ids *mask, int *truncated, int *reason);
/* ld_format_line in two stages (the token cache stores the first stage's output, which does not
 * depend on T or the overlong policy). ld_format_render: UTF-8 and JSON checks, the format and
 * tokenization, no cut and no loss check: 0 with the document appended, 1 (bad: json, utf8,
 * field, empty) with *reason and the description in bt_last_error(), <0 internal error.
 * ld_format_fit: the T rules on the document at ids/mask[n0..] (chat/alpaca longer than cfg->T: cut, *truncated = 1, or
 * overlong with overlong_drop) and the loss check (`empty`); 0 or 1 as above (the document is
 * removed again on 1), BT_ERR_INVALID when ids and mask differ in length. ld_format_line ==
 * render then fit (ids and mask must have the same length on entry). */
int ld_format_render(const ld_format_cfg *cfg, const char *line, size_t len, bt_ids *ids, bt_ids *mask,
                     int *reason);
int ld_format_fit(const ld_format_cfg *cfg, bt_ids *ids, bt_ids *mask, size_t n0, int *truncated, int *reason);

/* ---- preference records (issue 25 §1) ----------------------------------------------------------
 *   preference {"prompt", "chosen", "rejected"}: each either a string or TRL's conversational form
 *          (a list of {"role","content"} messages: the prompt's turns; chosen / rejected the
 *          assistant turn(s) that answer it). A string prompt is the conversation
 *          [user: prompt], a string response [assistant: response] (rendered through the chat
 *          template as alpaca is; TRL would tokenize a text prompt without a template).
 *   kto    {"prompt", "completion", "label": true|false}: prompt and completion as above.
 * Each side is rendered as prompt ++ response with cfg->tpl (the chat renderer above: same BOS
 * rule, same mask rule); the prompt alone (prompt turns + the template's assistant header, i.e.
 * HF add_generation_prompt) is the common token prefix, rendered once and checked to be a prefix
 * of every side's rendering. Loss (mask 1) is on the response's assistant content and end-of-turn
 * tokens only: never on the prompt, not even on assistant turns inside a conversational prompt.
 * Bad records (1 with *reason, description in bt_last_error()): `field` (a key missing, a wrong
 * type, a message that is not {"role": string, "content": string}, "label" not a boolean, chosen
 * and rejected identical (json_equal), a conversation the template refuses), `empty` (an empty
 * prompt or side, or a side with no assistant content to train on). */
typedef struct {
    int n_docs;          /* 2 (preference: chosen then rejected) or 1 (kto) */
    uint32_t len[2];     /* tokens of each document, appended in this order to ids / mask */
    uint32_t prompt_len; /* tokens of the shared prompt prefix at the start of every document */
    int label;           /* kto: 1 desirable (label true), 0 undesirable; preference: -1 */
    int truncated;       /* ld_format_pref_fit cut the prompt and/or the responses */
} ld_pref_rec;

/* Render one preference / kto line (cfg->format LD_FMT_PREFERENCE or LD_FMT_KTO): 0 with the
 * document(s) appended to ids / mask (int32 token ids, 0/1 loss mask) and *rec filled, no
 * truncation; 1 bad (as above, ids/mask unchanged); <0 internal error (BT_ERR_NOMEM, tokenizer,
 * BT_ERR_INVALID for another format). Thread-safe. */
int ld_format_pref_render(const ld_format_cfg *cfg, const char *line, size_t len, bt_ids *ids, bt_ids *mask,
                          ld_pref_rec *rec, int *reason);
/* Truncate a rendered record (its documents at ids/mask[n0..], described by *rec) as TRL's
 * DPOTrainer.tokenize_row does (trl/trainer/dpo_trainer.py, v0.11, truncation_mode "keep_end",
 * the default; KTOTrainer's _process_tokens does the same for one completion; TRL 1.16.0 has no
 * max_prompt_length and cuts each prompt + response to its first max_length tokens in
 * DataCollatorForPreference ("keep_start") / DataCollatorForUnpairedPreference after dropping
 * records whose prompt fills max_length: with max_prompt_length 0 the rule below is exactly that,
 * tests/fixtures/preference/trl_truncation.json): with L the longer
 * response, if prompt_len + L > max_length the prompt keeps its last max_prompt_length tokens
 * (cut from the left); if prompt + L still exceeds max_length every response keeps its first
 * max_length - max_prompt_length tokens (max_prompt_length 0: no prompt cut, responses keep
 * max_length - prompt_len); max_length 0: no truncation at all. Then the
 * record must fit one row: sum of its documents' lengths <= cfg->T (when T > 0), else 1 with
 * LD_BAD_OVERLONG (a pair is never split across rows); a response left with no loss token is
 * LD_BAD_EMPTY. On 1 the record is removed from ids / mask. BT_ERR_INVALID when ids and mask
 * differ in length or *rec does not describe ids[n0..]. */
int ld_format_pref_fit(const ld_format_cfg *cfg, bt_ids *ids, bt_ids *mask, size_t n0, ld_pref_rec *rec,
                       int *reason);

#endif
