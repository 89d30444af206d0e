/* libFuzzer target: one JSONL line -> format -> tokenize (ld_format_line, loaderd/format.h) with
 * the real model vocabulary.
 * Input: byte 0 picks the format (bits 0-1: text, chat, alpaca), bit 2 overlong drop and text
 * field "body" instead of "text", bit 3 BOS,
 * bit 4 the llama3 template instead of ChatML (only if the tokenizer resolves it), bits 5-7 the
 * truncation length T (0 = none, else 8 << k); the rest is the line.
 * Invariants: result 0 (document: ids and mask grow by the same count, ids in [0, vocab), mask
 * 0/1, chat/alpaca at most T tokens when T is set, some token after the first carries loss) or
 * 1 (bad line: a known reason, a message, ids/mask untouched); never an internal error on
 * content. */
#include <stdint.h>
#include <string.h>

#include "fuzz_common.h"
#include "loaderd/format.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const bt_tokenizer *tok = fuzz_tokenizer();
    if (size == 0) return 0;
    uint8_t ctl = data[0];
    ld_format fmt = (ctl & 3) == 0 ? LD_FMT_TEXT : (ctl & 3) == 1 ? LD_FMT_CHAT : LD_FMT_ALPACA;
    unsigned k = ctl >> 5;
    ld_chat_tpl tpl = LD_TPL_CHATML;
    if ((ctl & 16) && ld_chat_tpl_resolve(tok, LD_TPL_LLAMA3, &tpl) != BT_OK) tpl = LD_TPL_CHATML;
    ld_format_cfg cfg = {.format = fmt, .text_field = (ctl & 4) ? "body" : NULL, .tok = tok,
                         .T = k ? 8u << k : 0, .tpl = tpl, .add_bos = (ctl >> 3) & 1,
                         .overlong_drop = (ctl >> 2) & 1};
    bt_ids ids = {0}, mask = {0};
    bt_ids_push(&ids, 7); /* a previous document: must stay untouched */
    bt_ids_push(&mask, 1);
    int truncated = 0, reason = -1;
    bt_fail(BT_OK, "%s", ""); /* no message left over */
    int rc = ld_format_line(&cfg, (const char *)data + 1, size - 1, &ids, &mask, &truncated, &reason);
    if (rc < 0) fuzz_fail("internal error on line content");
    if (ids.n != mask.n || ids.v[0] != 7 || mask.v[0] != 1) fuzz_fail("ids/mask out of step or earlier data changed");
    if (rc == 1) {
        if (reason < 0 || reason >= LD_BAD_N) fuzz_fail("bad line without a known reason");
        if (!bt_last_error()[0]) fuzz_fail("bad line without a message");
        if (ids.n != 1) fuzz_fail("a bad line appended tokens");
    } else if (rc == 0) {
        size_t n = ids.n - 1;
        int32_t vocab = bt_tokenizer_vocab_size(tok);
        int loss_after_first = 0;
        for (size_t i = 1; i < ids.n; i++) {
            if (ids.v[i] < 0 || ids.v[i] >= vocab) fuzz_fail("token id out of range");
            if (mask.v[i] != 0 && mask.v[i] != 1) fuzz_fail("mask not 0/1");
            if (i > 1 && mask.v[i]) loss_after_first = 1;
        }
        if (n == 0) fuzz_fail("accepted an empty document");
        if (!loss_after_first) fuzz_fail("accepted a document without loss after its first token");
        if (fmt != LD_FMT_TEXT && cfg.T && n > cfg.T) fuzz_fail("chat/alpaca document longer than T");
    } else {
        fuzz_fail("unexpected return value");
    }
    bt_ids_free(&ids);
    bt_ids_free(&mask);
    return 0;
}
