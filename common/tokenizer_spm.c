/* SentencePiece tokenizer of GGUF vocabularies (tokenizer.ggml.model = "llama": Llama 2,
 * Mistral, TinyLlama, Phi-3, Gemma 1/2/3), bit-exact with llama.cpp's own tokenizer (reference:
 * llama.cpp b4965, src/llama-vocab.cpp: llm_tokenizer_spm_session, tokenizer_st_partition,
 * llama_vocab::impl::load for the token attributes; checked by tests/unit/common/
 * test_tokenizer_spm.c on fixtures made by tests/reference/gen_tokenizer_spm_fixtures.py with
 * that very library).
 *
 * bt_tokenize on such a vocabulary (llama_tokenize with add_special = false):
 *   1. Special partition: the CONTROL, USER_DEFINED and UNKNOWN tokens, sorted by text length
 *      (descending, in the order libstdc++'s std::sort leaves them: reproduced below), are split
 *      out of the raw bytes one token after the other: for each, every leftmost non-overlapping
 *      occurrence inside a remaining text fragment becomes that token (LSTRIP / RSTRIP drop
 *      C-isspace bytes beside it). CONTROL and UNKNOWN ones only with parse_special; USER_DEFINED
 *      always. Done here in one pass over the text: all occurrences are found with a trie, then
 *      applied in the tokens' order on a per-byte state (raw, taken, dropped), which gives the
 *      same fragments as llama.cpp's repeated std::string::find.
 *   2. Each text fragment: " " in front when add_space_prefix (tokenizer.ggml.add_space_prefix,
 *      default true) and it is the first fragment or follows a token; every " " becomes U+2581.
 *   3. llm_tokenizer_spm_session: symbols = UTF-8 chars by lead byte only (unicode_len_utf8:
 *      continuation bytes are not checked, so invalid bytes stay bytes); repeatedly merge the
 *      adjacent pair whose concatenation is a token (any type) of highest score (leftmost on
 *      ties); every final symbol that is not a token becomes its bytes' "<0xNN>" tokens
 *      (llama_vocab::byte_to_token; the byte's own single-char token when there is no "<0xNN>").
 * Token attributes as llama.cpp sets them at load: the end-of-generation texts (<|eot_id|>,
 * <|im_end|>, <|end|>, <end_of_turn>, <|endoftext|>, <|eom_id|>, <EOT>) and, when their GGUF keys
 * are absent, the first (in byte order) EOT / EOM / FIM candidate texts become CONTROL; a
 * general.name containing "phi-3" / "phi3" gives every special token RSTRIP (and "</s>"),
 * except <unk>, <s>, <|endoftext|>.
 * Where llama.cpp aborts (a byte without any byte token) the unknown token is emitted instead
 * (counted in bt_spm.n_unk_bytes at load). Thread-safe: the tokenizer is read-only. */
#include "common/tokenizer_internal.h"

#include <stdlib.h>
#include <string.h>

/* ---- load ---- */

/* Last id whose piece is exactly s (llama.cpp token_to_id), -1 if none. */
static int32_t find_text(const bt_tokenizer *t, const char *s) { return bt_tok_vocab_find(t, s, strlen(s)); }

static size_t tok_len(const bt_tokenizer *t, int32_t id) { return t->piece_off[id + 1] - t->piece_off[id] - 1; }

/* Key present with an id inside the vocabulary (llama.cpp: a value out of range is ignored). */
static int has_id_key(const bt_gguf *g, const char *key, int32_t n) {
    uint64_t v;
    return bt_gguf_get_u64(g, key, &v) == 0 && v < (uint64_t)n;
}

/* libstdc++ std::sort (bits/stl_algo.h: introsort, threshold 16, median of three, heap sort past
 * 2 * floor(log2 n) levels, final insertion sort) of ids by token text length, longest first:
 * llama.cpp sorts cache_special_tokens with it, and its order among equal lengths decides which
 * of two overlapping same-length tokens wins. */
typedef struct {
    const bt_tokenizer *t;
    int32_t *a;
} ssort;
static int s_less(const ssort *s, int32_t x, int32_t y) { return tok_len(s->t, x) > tok_len(s->t, y); }
static void s_swap(int32_t *a, long i, long j) { int32_t v = a[i]; a[i] = a[j]; a[j] = v; }

static void s_push_heap(const ssort *s, long first, long hole, long top, int32_t v) {
    long parent = (hole - 1) / 2;
    while (hole > top && s_less(s, s->a[first + parent], v)) {
        s->a[first + hole] = s->a[first + parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    s->a[first + hole] = v;
}
static void s_adjust_heap(const ssort *s, long first, long hole, long len, int32_t v) {
    long top = hole, child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (s_less(s, s->a[first + child], s->a[first + child - 1])) child--;
        s->a[first + hole] = s->a[first + child];
        hole = child;
    }
    if ((len & 1) == 0 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        s->a[first + hole] = s->a[first + child - 1];
        hole = child - 1;
    }
    s_push_heap(s, first, hole, top, v);
}
static void s_heap_sort(const ssort *s, long first, long last) {
    long len = last - first;
    if (len >= 2)
        for (long parent = (len - 2) / 2;; parent--) {
            s_adjust_heap(s, first, parent, len, s->a[first + parent]);
            if (parent == 0) break;
        }
    while (last - first > 1) {
        last--;
        int32_t v = s->a[last];
        s->a[last] = s->a[first];
        s_adjust_heap(s, first, 0, last - first, v);
    }
}
static void s_introsort(const ssort *s, long first, long last, int depth) {
    while (last - first > 16) {
        if (depth == 0) {
            s_heap_sort(s, first, last);
            return;
        }
        depth--;
        long a = first + 1, b = first + (last - first) / 2, c = last - 1; /* __move_median_to_first */
        int32_t *v = s->a;
        if (s_less(s, v[a], v[b])) {
            if (s_less(s, v[b], v[c])) s_swap(v, first, b);
            else if (s_less(s, v[a], v[c])) s_swap(v, first, c);
            else s_swap(v, first, a);
        } else if (s_less(s, v[a], v[c])) s_swap(v, first, a);
        else if (s_less(s, v[b], v[c])) s_swap(v, first, c);
        else s_swap(v, first, b);
        long lo = first + 1, hi = last; /* __unguarded_partition around v[first] */
        for (;;) {
            while (s_less(s, v[lo], v[first])) lo++;
            hi--;
            while (s_less(s, v[first], v[hi])) hi--;
            if (!(lo < hi)) break;
            s_swap(v, lo, hi);
            lo++;
        }
        s_introsort(s, lo, last, depth);
        last = lo;
    }
}
static void s_insert(const ssort *s, long i) { /* __unguarded_linear_insert */
    int32_t v = s->a[i];
    long j = i - 1;
    while (s_less(s, v, s->a[j])) {
        s->a[i] = s->a[j];
        i = j--;
    }
    s->a[i] = v;
}
static void s_insertion(const ssort *s, long first, long last) {
    if (first == last) return;
    for (long i = first + 1; i < last; i++) {
        if (s_less(s, s->a[i], s->a[first])) {
            int32_t v = s->a[i];
            memmove(s->a + first + 1, s->a + first, (size_t)(i - first) * sizeof *s->a);
            s->a[first] = v;
        } else {
            s_insert(s, i);
        }
    }
}
static void stl_sort(const bt_tokenizer *t, int32_t *a, long n) {
    if (n < 2) return;
    ssort s = {t, a};
    int lg = 0;
    while ((1L << (lg + 1)) <= n) lg++;
    s_introsort(&s, 0, n, 2 * lg);
    if (n > 16) {
        s_insertion(&s, 0, 16);
        for (long i = 16; i < n; i++) s_insert(&s, i);
    } else {
        s_insertion(&s, 0, n);
    }
}

static int32_t trie_node(bt_spm *p, uint8_t byte) {
    if ((size_t)p->trie_n == p->trie_cap) /* a node is 4 int32 */
        p->trie = bt_vec_xgrow(p->trie, &p->trie_cap, (size_t)p->trie_n + 1, 4 * sizeof *p->trie);
    int32_t *nd = p->trie + (size_t)p->trie_n * 4;
    nd[0] = -1, nd[1] = -1, nd[2] = byte, nd[3] = -1;
    return p->trie_n++;
}

/* Child of node `at` (-1: the root) for byte b, created when `make`; -1 if absent. */
static int32_t trie_child(bt_spm *p, int32_t at, uint8_t b, int make) {
    int32_t *slot = at < 0 ? &p->root[b] : &p->trie[(size_t)at * 4];
    if (at < 0) {
        if (*slot < 0 && make) {
            int32_t k = trie_node(p, b);
            p->root[b] = k;
        }
        return p->root[b];
    }
    int32_t c = *slot;
    while (c >= 0 && p->trie[(size_t)c * 4 + 2] != b) c = p->trie[(size_t)c * 4 + 1];
    if (c >= 0 || !make) return c;
    c = trie_node(p, b);
    int32_t *nd = p->trie + (size_t)c * 4, *parent = p->trie + (size_t)at * 4;
    nd[1] = parent[0];
    parent[0] = c;
    return c;
}

int bt_tok_spm_from_gguf(bt_tokenizer *t, const bt_gguf *g) {
    bt_spm *p = &t->spm;
    const int32_t n = t->n_vocab;
    p->score = bt_xcalloc((size_t)n, sizeof *p->score);
    bt_gguf_vtype et;
    const void *data;
    uint64_t cnt;
    int rc = bt_gguf_get_num_arr(g, "tokenizer.ggml.scores", &et, &data, &cnt);
    if (rc == 0) {
        if (et != BT_GGUF_F32 || cnt != (uint64_t)n)
            return bt_fail(BT_ERR_FORMAT, "tokenizer: tokenizer.ggml.scores has %llu entries of type %d (want %d f32)",
                           (unsigned long long)cnt, (int)et, n);
        memcpy(p->score, data, (size_t)n * sizeof *p->score);
    } else if (rc != BT_ERR_NOTFOUND) {
        return rc;
    }
    p->add_space_prefix = 1;
    int b = 0;
    if (bt_gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", &b) == 0) p->add_space_prefix = b;

    /* attribute overrides of llama_vocab::impl::load (see the top of this file) */
    static const char *const eog[] = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                                      "<|eom_id|>", "<EOT>", NULL};
    static const char *const eot[] = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                                      "<EOT>", "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>", NULL};
    static const char *const eom[] = {"<|eom_id|>", NULL};
    static const char *const pre[] = {"<|fim_prefix|>", "<fim-prefix>", "<\xef\xbd\x9c" "fim\xe2\x96\x81" "begin\xef\xbd\x9c>",
                                      "<PRE>", NULL};
    static const char *const suf[] = {"<|fim_suffix|>", "<fim-suffix>", "<\xef\xbd\x9c" "fim\xe2\x96\x81" "hole\xef\xbd\x9c>",
                                      "<SUF>", NULL};
    static const char *const mid[] = {"<|fim_middle|>", "<fim-middle>", "<\xef\xbd\x9c" "fim\xe2\x96\x81" "end\xef\xbd\x9c>",
                                      "<MID>", NULL};
    static const char *const pad[] = {"<|fim_pad|>", "<fim-pad>", "<PAD>", NULL};
    static const char *const rep[] = {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", NULL};
    static const char *const sep[] = {"<|file_sep|>", NULL};
    static const struct {
        const char *key, *key2;
        const char *const *cands;
    } groups[] = {{"tokenizer.ggml.eot_token_id", NULL, eot},
                  {"tokenizer.ggml.eom_token_id", NULL, eom},
                  {"tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id", pre},
                  {"tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id", suf},
                  {"tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id", mid},
                  {"tokenizer.ggml.fim_pad_token_id", NULL, pad},
                  {"tokenizer.ggml.fim_rep_token_id", NULL, rep},
                  {"tokenizer.ggml.fim_sep_token_id", NULL, sep}};
    for (size_t gi = 0; gi < sizeof groups / sizeof groups[0]; gi++) {
        if (has_id_key(g, groups[gi].key, n) || (groups[gi].key2 && has_id_key(g, groups[gi].key2, n))) continue;
        const char *best = NULL;
        for (int k = 0; groups[gi].cands[k]; k++)
            if (find_text(t, groups[gi].cands[k]) >= 0 && (!best || strcmp(groups[gi].cands[k], best) < 0))
                best = groups[gi].cands[k];
        if (best) t->type[find_text(t, best)] = TT_CONTROL;
    }
    for (int k = 0; eog[k]; k++) {
        int32_t id = find_text(t, eog[k]);
        if (id >= 0) t->type[id] = TT_CONTROL;
    }

    /* the special partition list, in llama.cpp's order */
    int32_t ns = 0;
    for (int32_t i = 0; i < n; i++) ns += t->type[i] == TT_CONTROL || t->type[i] == TT_USER || t->type[i] == TT_UNKNOWN;
    p->sp_id = bt_xmalloc(((size_t)ns + 1) * sizeof *p->sp_id);
    p->sp_flag = bt_xcalloc((size_t)ns + 1, 1);
    for (int32_t i = 0; i < n; i++)
        if (t->type[i] == TT_CONTROL || t->type[i] == TT_USER || t->type[i] == TT_UNKNOWN) p->sp_id[p->n_sp++] = i;
    stl_sort(t, p->sp_id, p->n_sp);

    bt_str name = {0};
    char lname[256] = {0};
    if (bt_gguf_get_str(g, "general.name", &name) == 0)
        for (size_t i = 0; i < name.len && i + 1 < sizeof lname; i++)
            lname[i] = (char)((name.ptr[i] >= 'A' && name.ptr[i] <= 'Z') ? name.ptr[i] + 32 : name.ptr[i]);
    bt_str pre_name = {0};
    char lpre[128] = {0};
    if (bt_gguf_get_str(g, "tokenizer.ggml.pre", &pre_name) == 0)
        memcpy(lpre, pre_name.ptr, pre_name.len < sizeof lpre - 1 ? pre_name.len : sizeof lpre - 1);
    int32_t mask_id = -1, eos_s = -1;
    int phi3 = strstr(lname, "phi-3") || strstr(lname, "phi3");
    if (strstr(lpre, "jina-v2-de") || strstr(lpre, "jina-v2-es") || strstr(lpre, "jina-v2-code")) mask_id = find_text(t, "<mask>");
    if (phi3) eos_s = find_text(t, "</s>");
    for (int32_t k = 0; k < p->n_sp; k++) {
        int32_t id = p->sp_id[k];
        uint8_t f = t->type[id] == TT_USER ? 0 : SPF_PARSE_ONLY;
        if (phi3) f |= SPF_RSTRIP;
        if (id == mask_id) f |= SPF_LSTRIP;
        p->sp_flag[k] = f;
    }
    p->any_strip = phi3 || mask_id >= 0;
    if (phi3) { /* RSTRIP on "</s>" (also outside the list), off for <unk>, <s>, <|endoftext|> */
        static const char *const off[] = {"<unk>", "<s>", "<|endoftext|>"};
        for (int32_t k = 0; k < p->n_sp; k++) {
            int32_t id = p->sp_id[k];
            for (int o = 0; o < 3; o++)
                if (id == find_text(t, off[o])) p->sp_flag[k] &= (uint8_t)~SPF_RSTRIP;
            if (id == eos_s) p->sp_flag[k] |= SPF_RSTRIP;
        }
    }
    for (int i = 0; i < 256; i++) p->root[i] = -1;
    for (int32_t k = 0; k < p->n_sp; k++) {
        int32_t id = p->sp_id[k];
        const uint8_t *s = (const uint8_t *)t->pieces + t->piece_off[id];
        size_t len = tok_len(t, id);
        if (len == 0) continue;
        int32_t at = -1;
        for (size_t j = 0; j < len; j++) at = trie_child(p, at, s[j], 1);
        if (p->trie[(size_t)at * 4 + 3] < 0) p->trie[(size_t)at * 4 + 3] = k; /* first in order: same text */
    }
    for (int c = 0; c < 256; c++)
        if (t->fb_id[c] < 0) p->n_unk_bytes++;
    if (p->n_unk_bytes)
        bt_log(BT_LOG_WARN, "tokenizer", "SentencePiece vocabulary without a byte token for %d byte values: they "
               "become the unknown token (llama.cpp aborts on them)", p->n_unk_bytes);
    return 0;
}

void bt_tok_spm_free(bt_tokenizer *t) {
    free(t->spm.score);
    free(t->spm.sp_id);
    free(t->spm.sp_flag);
    free(t->spm.trie);
}

uint64_t bt_tok_spm_mem(const bt_tokenizer *t) {
    const bt_spm *p = &t->spm;
    return (p->score ? (uint64_t)t->n_vocab * sizeof *p->score : 0) + (uint64_t)p->n_sp * 5 +
           (uint64_t)p->trie_cap * 4 * sizeof *p->trie;
}

/* ---- encode ---- */

typedef struct {
    uint32_t off, n;     /* bytes of the symbol in the escaped text */
    int32_t prev, next;
} spm_sym;

typedef struct {
    float score;
    int32_t left, right;
    uint32_t size;
} spm_bigram;

/* std::priority_queue order of llm_bigram_spm: higher score first, then smaller left. */
static int bg_before(const spm_bigram *a, const spm_bigram *b) {
    return a->score > b->score || (a->score == b->score && a->left < b->left);
}

typedef struct {
    spm_sym *sym;
    size_t nsym, csym;
    spm_bigram *heap;
    size_t nh, ch;
} spm_work;

/* The scratch grows with the text (a document in loaderd): out of memory sets c->err and the
 * encode unwinds (bt_tokenize skips the document), never an abort. */
static void bg_push(bt_enc_ctx *c, spm_work *w, spm_bigram b) {
    if (w->nh == w->ch) {
        spm_bigram *h = bt_vec_grow(w->heap, &w->ch, w->nh + 1, sizeof *w->heap);
        if (!h) {
            c->err = BT_ERR_NOMEM;
            return;
        }
        w->heap = h;
    }
    size_t i = w->nh++;
    while (i > 0) {
        size_t par = (i - 1) / 2;
        if (!bg_before(&b, &w->heap[par])) break;
        w->heap[i] = w->heap[par];
        i = par;
    }
    w->heap[i] = b;
}

static spm_bigram bg_pop(spm_work *w) {
    spm_bigram top = w->heap[0], last = w->heap[--w->nh];
    size_t i = 0, n = w->nh;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && bg_before(&w->heap[c + 1], &w->heap[c])) c++;
        if (!bg_before(&w->heap[c], &last)) break;
        w->heap[i] = w->heap[c];
        i = c;
    }
    if (n) w->heap[i] = last;
    return top;
}

static void try_bigram(bt_enc_ctx *c, spm_work *w, const char *text, int32_t l, int32_t r) {
    const bt_tokenizer *t = c->t;
    if (l < 0 || r < 0 || c->err) return;
    uint32_t size = w->sym[l].n + w->sym[r].n;
    int32_t id = bt_tok_vocab_find(t, text + w->sym[l].off, size);
    if (id < 0) return;
    bg_push(c, w, (spm_bigram){t->spm.score[id], l, r, size});
}

static void emit_bytes(bt_enc_ctx *c, const uint8_t *s, size_t n) {
    const bt_tokenizer *t = c->t;
    for (size_t j = 0; j < n; j++) {
        int32_t id = t->fb_id[s[j]] >= 0 ? t->fb_id[s[j]] : t->unk;
        if (id >= 0) bt_tok_out_push(c, id);
    }
}

/* llm_tokenizer_spm_session::tokenize of text[0..n) (already escaped). */
static void spm_session(bt_enc_ctx *c, spm_work *w, const char *text, size_t n) {
    const bt_tokenizer *t = c->t;
    static const uint8_t lens[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    w->nsym = 0;
    w->nh = 0;
    for (size_t off = 0; off < n;) {
        size_t len = lens[(uint8_t)text[off] >> 4];
        if (len > n - off) len = n - off;
        if (w->nsym == w->csym) {
            spm_sym *sy = bt_vec_grow(w->sym, &w->csym, w->nsym + 1, sizeof *w->sym);
            if (!sy) {
                c->err = BT_ERR_NOMEM;
                return;
            }
            w->sym = sy;
        }
        int32_t i = (int32_t)w->nsym;
        off += len;
        w->sym[w->nsym++] = (spm_sym){(uint32_t)(off - len), (uint32_t)len, i - 1, off == n ? -1 : i + 1};
    }
    for (int32_t i = 1; i < (int32_t)w->nsym; i++) try_bigram(c, w, text, i - 1, i);
    while (w->nh && !c->err) {
        spm_bigram b = bg_pop(w);
        spm_sym *l = &w->sym[b.left], *r = &w->sym[b.right];
        if (l->n == 0 || r->n == 0 || l->n + r->n != b.size) continue;
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0) w->sym[r->next].prev = b.left;
        try_bigram(c, w, text, l->prev, b.left);
        try_bigram(c, w, text, b.left, l->next);
    }
    for (int32_t i = 0; w->nsym && i != -1 && !c->err; i = w->sym[i].next) {
        const spm_sym *s = &w->sym[i];
        int32_t id = bt_tok_vocab_find(t, text + s->off, s->n);
        if (id >= 0) bt_tok_out_push(c, id);
        else emit_bytes(c, (const uint8_t *)text + s->off, s->n);
    }
}

/* One text fragment: optional " " prefix, " " -> U+2581, then the session. */
static void spm_fragment(bt_enc_ctx *c, spm_work *w, const char *s, size_t n, int prefix) {
    if (c->err) return;
    size_t sp = prefix;
    for (size_t i = 0; i < n; i++) sp += s[i] == ' ';
    size_t need = n + prefix + 2 * sp;
    if (c->mcap < need + 1) {
        char *mb = bt_vec_grow(c->mbuf, &c->mcap, need + 1, 1);
        if (!mb) {
            c->err = BT_ERR_NOMEM;
            return;
        }
        c->mbuf = mb;
    }
    char *d = c->mbuf;
    size_t o = 0;
    if (prefix) { memcpy(d, "\xe2\x96\x81", 3); o = 3; }
    for (size_t i = 0; i < n; i++) {
        if (s[i] == ' ') { memcpy(d + o, "\xe2\x96\x81", 3); o += 3; }
        else d[o++] = s[i];
    }
    spm_session(c, w, d, o);
}

static int c_isspace(uint8_t ch) { return ch == ' ' || (ch >= '\t' && ch <= '\r'); }

enum { ST_RAW = 0, ST_TAKEN, ST_DROP };

typedef struct {
    int32_t k;   /* index into sp_id (the token's order) */
    uint32_t pos;
} occ_t;

static int occ_cmp(const void *a, const void *b) {
    const occ_t *x = a, *y = b;
    if (x->k != y->k) return x->k < y->k ? -1 : 1;
    return x->pos < y->pos ? -1 : x->pos > y->pos;
}

int bt_tok_spm_encode(bt_enc_ctx *c, const char *text, size_t len, int parse_special) {
    const bt_tokenizer *t = c->t;
    const bt_spm *p = &t->spm;
    spm_work w = {0};
    occ_t *occ = NULL;
    size_t nocc = 0, cocc = 0;
    /* all occurrences of the special texts (trie walk from every byte) */
    for (size_t i = 0; i < len && p->n_sp; i++) {
        int32_t at = p->root[(uint8_t)text[i]];
        for (size_t j = i; at >= 0;) {
            int32_t k = p->trie[(size_t)at * 4 + 3];
            if (k >= 0 && (parse_special || !(p->sp_flag[k] & SPF_PARSE_ONLY))) {
                if (nocc == cocc) {
                    occ_t *o = bt_vec_grow(occ, &cocc, nocc + 1, sizeof *occ);
                    if (!o) {
                        free(occ);
                        return c->err = BT_ERR_NOMEM;
                    }
                    occ = o;
                }
                occ[nocc++] = (occ_t){k, (uint32_t)i};
            }
            if (++j >= len) break;
            int32_t ch = p->trie[(size_t)at * 4];
            while (ch >= 0 && p->trie[(size_t)ch * 4 + 2] != (uint8_t)text[j]) ch = p->trie[(size_t)ch * 4 + 1];
            at = ch;
        }
    }
    int prev_special = 1;
    if (nocc == 0) {
        if (len) spm_fragment(c, &w, text, len, p->add_space_prefix && prev_special);
    } else {
        /* tokenizer_st_partition, token by token in order, on per-byte states */
        uint8_t *st = calloc(len, 1);
        int32_t *tok_at = malloc(len * sizeof *tok_at);
        if (!st || !tok_at) {
            free(st);
            free(tok_at);
            free(occ);
            return c->err = BT_ERR_NOMEM;
        }
        qsort(occ, nocc, sizeof *occ, occ_cmp);
        for (size_t q = 0; q < nocc; q++) {
            int32_t k = occ[q].k, id = p->sp_id[k];
            size_t L = tok_len(t, id), a = occ[q].pos, e = a + L, j = a;
            while (j < e && st[j] == ST_RAW) j++;
            if (j < e) continue; /* overlaps a token or stripped bytes: not inside one fragment */
            memset(st + a, ST_TAKEN, L);
            tok_at[a] = id;
            if (p->sp_flag[k] & SPF_LSTRIP)
                for (size_t b = a; b > 0 && st[b - 1] == ST_RAW && c_isspace((uint8_t)text[b - 1]); b--) st[b - 1] = ST_DROP;
            if (p->sp_flag[k] & SPF_RSTRIP)
                for (size_t b = e; b < len && st[b] == ST_RAW && c_isspace((uint8_t)text[b]); b++) st[b] = ST_DROP;
        }
        for (size_t i = 0; i < len && !c->err;) {
            if (st[i] == ST_RAW) {
                size_t e = i;
                while (e < len && st[e] == ST_RAW) e++;
                spm_fragment(c, &w, text + i, e - i, p->add_space_prefix && prev_special);
                prev_special = 0;
                i = e;
            } else if (st[i] == ST_TAKEN) {
                int32_t id = tok_at[i];
                bt_tok_out_push(c, id);
                prev_special = 1;
                i += tok_len(t, id);
            } else {
                i++;
            }
        }
        free(st);
        free(tok_at);
    }
    free(occ);
    free(w.sym);
    free(w.heap);
    return c->err;
}
