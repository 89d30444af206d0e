/* libFuzzer target: the GGUF reader (common/gguf.h) on hostile bytes, and the tokenizer built
 * from a GGUF's tokenizer.ggml.* keys (bt_tokenizer_from_gguf: what loaderd does with a client's
 * tokenizer file). The input is the whole file (bt_gguf_open_buffer).
 * Invariants: never crashes, leaks or reads outside the buffer (ASan); a refusal has a message;
 * an accepted file has every key reachable by index and by name (the hash index agrees), every
 * typed getter either answers or refuses with a message, string arrays and numeric arrays lie
 * inside the buffer, every tensor has 1..4 dimensions, data inside the buffer at an aligned
 * offset past the data section start, nbytes = row size x rows, and is found by its name; a
 * tokenizer built from it has a vocabulary of at least one token (and at most
 * BT_TOKENIZER_MAX_VOCAB), every token decodes, and the memory estimate made from the file's
 * counts (bt_tok_gguf_estimate, what loaderd checks its budget with) bounds what it holds. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/gguf.h"
#include "common/quant.h"
#include "common/tokenizer_internal.h"
#include "fuzz_common.h"

static int inside(const void *p, uint64_t n, const uint8_t *b, size_t size) {
    const uint8_t *q = p;
    return q >= b && n <= size && (size_t)(q - b) <= size - n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    bt_log_set_level(BT_LOG_ERROR);
    bt_gguf *g = NULL;
    if (bt_gguf_open_buffer(&g, data, size, "fuzz.gguf")) {
        if (!bt_last_error()[0]) fuzz_fail("refused without a message");
        if (g) fuzz_fail("refused but returned a handle");
        return 0;
    }
    for (int64_t i = 0; i < bt_gguf_n_kv(g); i++) {
        bt_str k = bt_gguf_key_at(g, i);
        if (!k.ptr || !inside(k.ptr, k.len, data, size)) fuzz_fail("key outside the buffer");
        char *key = malloc(k.len + 1);
        memcpy(key, k.ptr, k.len);
        key[k.len] = 0;
        int64_t j = bt_gguf_find_key(g, key);
        /* a key with a NUL inside cannot be looked up by its C string */
        if (strlen(key) == k.len && j != i) fuzz_fail("find_key disagrees with key_at");
        bt_gguf_vtype at;
        uint64_t an = 0;
        bt_gguf_vtype t = bt_gguf_kv_type(g, i, &at, &an);
        if ((int)t < 0 || t > BT_GGUF_F64) fuzz_fail("unknown value type accepted");
        uint64_t u;
        int64_t s;
        double d;
        int b;
        bt_str str;
        bt_str *sv = NULL;
        uint64_t n = 0;
        const void *arr = NULL;
        bt_gguf_vtype et;
        if (strlen(key) == k.len) {
            int rcs[] = {bt_gguf_get_u64(g, key, &u), bt_gguf_get_i64(g, key, &s), bt_gguf_get_f64(g, key, &d),
                         bt_gguf_get_bool(g, key, &b), bt_gguf_get_str(g, key, &str)};
            for (size_t r = 0; r < sizeof rcs / sizeof rcs[0]; r++)
                if (rcs[r] != 0 && !bt_last_error()[0]) fuzz_fail("getter refused without a message");
            if (rcs[4] == 0 && !inside(str.ptr, str.len, data, size)) fuzz_fail("string outside the buffer");
            if (bt_gguf_get_str_arr(g, key, &sv, &n) == 0) {
                for (uint64_t e = 0; e < n; e++)
                    if (!inside(sv[e].ptr, sv[e].len, data, size)) fuzz_fail("array string outside the buffer");
                free(sv);
            }
            if (bt_gguf_get_num_arr(g, key, &et, &arr, &n) == 0 && n && !inside(arr, 1, data, size))
                fuzz_fail("number array outside the buffer");
        }
        free(key);
    }
    uint64_t al = bt_gguf_alignment(g), off0 = bt_gguf_data_offset(g);
    if (al == 0 || (al & (al - 1)) || off0 % al) fuzz_fail("bad alignment or data offset");
    for (int64_t i = 0; i < bt_gguf_n_tensors(g); i++) {
        const bt_gguf_tensor *t = bt_gguf_tensor_at(g, i);
        if (!t || t->n_dims < 1 || t->n_dims > 4) fuzz_fail("tensor with bad dimensions");
        if (t->offset % al || !inside(t->data, t->nbytes, data, size)) fuzz_fail("tensor data outside or unaligned");
        uint64_t rows = t->ne[1] * t->ne[2] * t->ne[3];
        if (bt_ggml_row_size(t->type, (int64_t)t->ne[0]) * rows != t->nbytes) fuzz_fail("tensor size mismatch");
        if (!inside(t->name.ptr, t->name.len, data, size)) fuzz_fail("tensor name outside the buffer");
        char name[80];
        if (t->name.len < sizeof name && !memchr(t->name.ptr, 0, t->name.len)) {
            memcpy(name, t->name.ptr, t->name.len);
            name[t->name.len] = 0;
            if (bt_gguf_find_tensor(g, name) != t) fuzz_fail("find_tensor disagrees with tensor_at");
        }
    }
    bt_tokenizer *tok = NULL;
    if (bt_tokenizer_from_gguf(&tok, g) == 0) {
        int32_t nv = bt_tokenizer_vocab_size(tok);
        if (nv < 1) fuzz_fail("tokenizer with an empty vocabulary");
        if ((uint32_t)nv > BT_TOKENIZER_MAX_VOCAB) fuzz_fail("tokenizer past the vocabulary bound");
        uint64_t est = 0;
        if (bt_tok_gguf_estimate(g, &est) != BT_OK || est < bt_tokenizer_mem_bytes(tok))
            fuzz_fail("the memory estimate does not bound the tokenizer");
        for (int32_t id = 0; id < nv && id < 4096; id++) {
            char *text = NULL;
            size_t len = 0;
            if (bt_detokenize(tok, &id, 1, 1, &text, &len)) fuzz_fail("a token of the vocabulary does not decode");
            free(text);
        }
        bt_tokenizer_free(tok);
    } else if (!bt_last_error()[0]) {
        fuzz_fail("tokenizer refused without a message");
    }
    bt_gguf_close(g);
    return 0;
}
