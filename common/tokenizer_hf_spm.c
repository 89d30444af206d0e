/* Merges of the Hugging Face BPE form of a SentencePiece GGUF vocabulary (tokenizer.ggml.model
 * "llama": Llama 2, Mistral, TinyLlama, Phi-3, Gemma 1/2/3). See tokenizer_internal.h
 * (bt_tok_hf_spm_merges) and tokenizer.h (bt_tokenizer_hf_from_gguf).
 *
 * llama.cpp's SentencePiece tokenizer (tokenizer_spm.c) merges, at each step, the adjacent pair of
 * symbols whose concatenation is a token of the highest score (leftmost on ties). HF's BPE model
 * merges the adjacent pair of lowest merge rank (leftmost on ties). So the merges are every split
 * of every token into two tokens, L + R = P, ranked by the score of P (best first): the form of
 * transformers' generate_merges (tokenization_utils_base.py / convert_slow_tokenizer.py, used by
 * its SentencePieceExtractor and by its GGUF tokenizer conversion, integrations/gguf/
 * gguf_tokenizer_mapping.py), with its tie order: score descending, then len(L) descending, then
 * len(R) descending (lengths in code points), then the id of P ascending (its stable order).
 * Where two different merges of equal score compete for the same symbol, llama.cpp takes the
 * leftmost and HF the lower rank: real vocabularies give their normal pieces distinct scores
 * (-rank; Gemma 3 all 255,474, Llama 2 all but 16 of 31,742) and ties among the others (control,
 * user-defined, byte pieces) rarely meet in text; tests/py/test_export_spm_tokenizer.py and
 * tests/unit/common/test_tokenizer_spm.c check the ids against llama.cpp's on the parity and
 * stress corpora (0 differences for Llama 2, Phi-3 and Gemma 3).
 * Cost: one hash lookup per split point of every piece (Gemma 3: 262,144 pieces, 514,847
 * merges); memory 24 bytes per merge while sorting. */
#include "common/tokenizer_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    float score; /* score of the merged piece (NaN read as -inf: a total order) */
    int32_t ncl, ncr; /* code points of L and R */
    int32_t id, l, r; /* P, L, R */
} spm_merge;

static int merge_cmp(const void *pa, const void *pb) {
    const spm_merge *a = pa, *b = pb;
    if (a->score != b->score) return a->score > b->score ? -1 : 1;
    if (a->ncl != b->ncl) return a->ncl > b->ncl ? -1 : 1;
    if (a->ncr != b->ncr) return a->ncr > b->ncr ? -1 : 1;
    if (a->id != b->id) return a->id < b->id ? -1 : 1;
    return a->l < b->l ? -1 : a->l > b->l;
}

static size_t piece_len(const bt_tokenizer *t, int32_t id) { return t->piece_off[id + 1] - t->piece_off[id] - 1; }

int bt_tok_hf_spm_merges(const bt_tokenizer *t, int32_t **pairs, uint64_t *n_merges, int32_t *n_long) {
    *pairs = NULL, *n_merges = 0, *n_long = 0;
    spm_merge *m = NULL;
    size_t n = 0, cap = 0;
    int rc = 0;
    for (int32_t id = 0; id < t->n_vocab && !rc; id++) {
        const char *p = t->pieces + t->piece_off[id];
        size_t len = piece_len(t, id);
        /* the id lookups give, and a piece tokenizer.json's vocabulary holds (no NUL inside) */
        if (len < 2 || strlen(p) != len || bt_tok_vocab_find(t, p, len) != id) continue;
        if (len > BT_HF_SPM_SPLIT_MAX) {
            (*n_long)++;
            continue;
        }
        float sc = t->spm.score ? t->spm.score[id] : 0.0f;
        if (isnan(sc)) sc = -INFINITY;
        int32_t ncl = 0, nc = 0;
        for (size_t k = 0; k < len; k++) nc += ((unsigned char)p[k] & 0xC0) != 0x80;
        for (size_t k = 1; k < len; k++) {
            if (((unsigned char)p[k - 1] & 0xC0) != 0x80) ncl++;
            if (((unsigned char)p[k] & 0xC0) == 0x80) continue; /* split at code points only */
            int32_t l = bt_tok_vocab_find(t, p, k);
            if (l < 0) continue;
            int32_t r = bt_tok_vocab_find(t, p + k, len - k);
            if (r < 0) continue;
            if (n == cap) {
                if (n >= BT_TOKENIZER_MAX_MERGES) {
                    rc = bt_fail(BT_ERR_RANGE, "tokenizer.json: the vocabulary implies more than %u merges "
                                 "(BT_TOKENIZER_MAX_MERGES)", BT_TOKENIZER_MAX_MERGES);
                    break;
                }
                size_t nc2 = cap ? 2 * cap : 4096;
                spm_merge *nm = realloc(m, nc2 * sizeof *m);
                if (!nm) {
                    rc = bt_fail(BT_ERR_NOMEM, "tokenizer.json: out of memory for the merges");
                    break;
                }
                m = nm, cap = nc2;
            }
            m[n++] = (spm_merge){sc, ncl, nc - ncl, id, l, r};
        }
    }
    if (!rc && n) qsort(m, n, sizeof *m, merge_cmp);
    int32_t *lr = rc ? NULL : malloc((n ? n : 1) * 2 * sizeof *lr);
    if (!rc && !lr) rc = bt_fail(BT_ERR_NOMEM, "tokenizer.json: out of memory for the merges");
    for (size_t i = 0; i < n && !rc; i++) lr[2 * i] = m[i].l, lr[2 * i + 1] = m[i].r;
    free(m);
    if (rc) return rc;
    *pairs = lr, *n_merges = n;
    return 0;
}
