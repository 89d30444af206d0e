/* Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json, special_tokens_map.json)
 * for a GGUF's tokenizer.ggml.* vocabulary. See tokenizer.h (bt_tokenizer_hf_from_gguf).
 *
 * transformers' own GGUF conversion (integrations/ggml.py GGUFLlamaConverter / GGUFGPTConverter)
 * gives every "gpt2" GGUF one generic ByteLevel pipeline, so a SmolLM2 GGUF (pre "smollm") loses
 * its Digits split and a Llama 3 GGUF its cl100k Split: ids differ from the model's real
 * tokenizer.json on digits, contractions and whitespace runs. Here the pipeline is the one the
 * model family's tokenizer.json has (the same table tokenizer_gguf.c builds ours from, with the
 * same Oniguruma patterns), so AutoTokenizer on the result encodes exactly like bt_tokenize on
 * the GGUF (checked on the parity corpora by tests/reference/check_exports.py).
 * A SentencePiece ("llama") GGUF gets the form of Llama 2's / Gemma's tokenizer.json, with merges
 * derived from the piece scores (tokenizer_hf_spm.c), equal to llama.cpp's ids and decode on the
 * parity and stress corpora (tests/py/test_export_spm_tokenizer.py). */
#include "common/tokenizer_internal.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

void bt_hf_tokenizer_files_free(bt_hf_tokenizer_files *f) {
    if (!f) return;
    free(f->tokenizer_json);
    free(f->tokenizer_config_json);
    free(f->special_tokens_map_json);
    memset(f, 0, sizeof *f);
}

static json_t *byte_level(int add_prefix_space, int trim_offsets, int use_regex) {
    return json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel", "add_prefix_space",
                     add_prefix_space, "trim_offsets", trim_offsets, "use_regex", use_regex);
}

static json_t *split_isolated(const char *pattern) {
    return json_pack("{s:s, s:{s:s}, s:s, s:b}", "type", "Split", "pattern", "Regex", pattern,
                     "behavior", "Isolated", "invert", 0);
}

/* The family pipeline of tokenizer_gguf.c set_pre, as that family's tokenizer.json writes it. */
static json_t *pre_tokenizer(const char *pre) {
    if (!strcmp(pre, "gpt2")) return byte_level(0, 1, 1);
    json_t *seq = json_array();
    if (!strcmp(pre, "smollm")) {
        json_array_append_new(seq, json_pack("{s:s, s:b}", "type", "Digits", "individual_digits", 1));
        json_array_append_new(seq, byte_level(0, 1, 1));
    } else {
        json_array_append_new(seq, split_isolated(!strcmp(pre, "qwen2") ? BT_TOK_QWEN2_PATTERN
                                                                         : BT_TOK_LLAMA3_PATTERN));
        json_array_append_new(seq, byte_level(0, 1, 0));
    }
    return json_pack("{s:s, s:o}", "type", "Sequence", "pretokenizers", seq);
}

/* Byte-level: ByteLevel post-processor, with a TemplateProcessing that adds BOS / EOS around $A
 * when the GGUF says tokenizer.ggml.add_bos_token / add_eos_token (Meta-Llama-3's tokenizer.json
 * layout). SentencePiece: the TemplateProcessing alone (Llama 2's and Gemma's tokenizer.json), or
 * null when it would add nothing. */
static json_t *post_processor(const bt_tokenizer *t, int add_bos, int add_eos) {
    const int spm = t->model == MODEL_SPM;
    json_t *bl = spm ? json_null() : byte_level(1, 0, 1);
    if ((!add_bos || t->bos < 0) && (!add_eos || t->eos < 0)) return bl;
    json_t *single = json_array(), *pair = json_array(), *specials = json_object();
    const char *bos = add_bos && t->bos >= 0 ? bt_tokenizer_piece(t, t->bos) : NULL;
    const char *eos = add_eos && t->eos >= 0 ? bt_tokenizer_piece(t, t->eos) : NULL;
    for (int seq = 0; seq < 2; seq++) {
        json_t *arr = seq ? pair : single;
        for (int part = 0; part <= seq; part++) {
            if (bos) json_array_append_new(arr, json_pack("{s:{s:s, s:i}}", "SpecialToken", "id", bos,
                                                          "type_id", part));
            json_array_append_new(arr, json_pack("{s:{s:s, s:i}}", "Sequence", "id",
                                                 part ? "B" : "A", "type_id", part));
            if (eos) json_array_append_new(arr, json_pack("{s:{s:s, s:i}}", "SpecialToken", "id", eos,
                                                          "type_id", part));
        }
    }
    int32_t ids[2] = {bos ? t->bos : -1, eos ? t->eos : -1};
    for (int i = 0; i < 2; i++) {
        if (ids[i] < 0) continue;
        const char *p = bt_tokenizer_piece(t, ids[i]);
        json_object_set_new(specials, p, json_pack("{s:s, s:[i], s:[s]}", "id", p, "ids", ids[i],
                                                   "tokens", p));
    }
    json_t *tp = json_pack("{s:s, s:o, s:o, s:o}", "type", "TemplateProcessing", "single", single,
                           "pair", pair, "special_tokens", specials);
    if (spm) return tp;
    return json_pack("{s:s, s:[o, o]}", "type", "Sequence", "processors", bl, tp);
}

/* How token i is an added token of the HF tokenizer: 0 not one (a duplicated string's other ids,
 * an empty SentencePiece piece), 1 special, 2 not special. Byte-level: control tokens are special,
 * user-defined ones are not. SentencePiece: the tokens llama.cpp splits out of the text before
 * the model (tokenizer_spm.c: control and unknown ones only with parse_special, so special;
 * user-defined ones always, so not special). */
static int added_kind(const bt_tokenizer *t, int32_t i) {
    const char *p = bt_tokenizer_piece(t, i);
    int ty = t->type[i];
    if (bt_tok_vocab_find(t, p, strlen(p)) != i || (t->model == MODEL_SPM && !*p)) return 0;
    if (ty == TT_CONTROL || (t->model == MODEL_SPM && ty == TT_UNKNOWN)) return 1;
    return ty == TT_USER ? 2 : 0;
}

/* AddedToken as tokenizer_config.json / special_tokens_map.json write it. */
static json_t *added_token_json(const char *content, int special, int with_special, uint8_t strip) {
    json_t *o = json_pack("{s:s, s:b, s:b, s:b, s:b}", "content", content, "lstrip",
                          (strip & SPF_LSTRIP) != 0, "normalized", 0, "rstrip",
                          (strip & SPF_RSTRIP) != 0, "single_word", 0);
    if (with_special) json_object_set_new(o, "special", json_boolean(special));
    return o;
}

static char *dumps(json_t *j) {
    char *s = j ? json_dumps(j, JSON_INDENT(2) | JSON_REAL_PRECISION(17)) : NULL;
    json_decref(j);
    return s;
}

static int32_t gguf_id(const bt_gguf *g, const char *key, int32_t n) {
    int64_t v;
    return bt_gguf_get_i64(g, key, &v) == 0 && v >= 0 && v < n ? (int32_t)v : -1;
}

/* A boolean key, `def` when absent. */
static int gguf_flag(const bt_gguf *g, const char *key, int def) {
    int v = 0;
    return bt_gguf_get_bool(g, key, &v) == 0 ? v != 0 : def;
}

/* SentencePiece normalizer and decoder, as Llama 2's tokenizer.json (add_space_prefix: Prepend +
 * Replace; decoder ending in Strip, which drops the space the Prepend put in front, as llama.cpp's
 * detokenizer does) and Gemma's (no space prefix: Replace alone; no Strip) write them. The
 * Prepend applies to every text segment between added tokens, as llama.cpp puts " " in front of
 * every fragment that starts the text or follows a special token (tokenizer_spm.c step 2). */
static json_t *spm_normalizer(const bt_tokenizer *t) {
    json_t *seq = json_array();
    if (t->spm.add_space_prefix)
        json_array_append_new(seq, json_pack("{s:s, s:s}", "type", "Prepend", "prepend", "\u2581"));
    json_array_append_new(seq, json_pack("{s:s, s:{s:s}, s:s}", "type", "Replace", "pattern", "String",
                                         " ", "content", "\u2581"));
    return json_pack("{s:s, s:o}", "type", "Sequence", "normalizers", seq);
}

static json_t *spm_decoder(const bt_tokenizer *t) {
    json_t *seq = json_pack("[{s:s, s:{s:s}, s:s}, {s:s}, {s:s}]", "type", "Replace", "pattern", "String",
                            "\u2581", "content", " ", "type", "ByteFallback", "type", "Fuse");
    if (t->spm.add_space_prefix)
        json_array_append_new(seq, json_pack("{s:s, s:s, s:i, s:i}", "type", "Strip", "content", " ",
                                             "start", 1, "stop", 0));
    return json_pack("{s:s, s:o}", "type", "Sequence", "decoders", seq);
}

/* tokenizer.json: vocabulary (the id our piece lookup gives a duplicated string: the first one
 * for byte-level, the last for SentencePiece, as llama.cpp), merges, added tokens.
 * Byte-level: the GGUF's merges as "a b" strings (readable by every tokenizers release), the
 * family's pre-tokenizer, ByteLevel decoder. SentencePiece: BPE with byte_fallback, fuse_unk and
 * the unknown token, the merges of bt_tok_hf_spm_merges as ["a", "b"] pairs (pieces may hold
 * spaces: Gemma's whitespace runs), no pre-tokenizer, spm_normalizer / spm_decoder; added
 * tokens with llama.cpp's LSTRIP / RSTRIP attributes (Phi-3). */
static int tokenizer_json(const bt_tokenizer *t, const bt_gguf *g, int add_bos, int add_eos,
                          const uint8_t *strip, char **out) {
    const int spm = t->model == MODEL_SPM;
    bt_str *merges = NULL;
    uint64_t n_merge = 0;
    int rc = 0;
    if (!spm && (rc = bt_gguf_get_str_arr(g, "tokenizer.ggml.merges", &merges, &n_merge)))
        return bt_fail(rc, "tokenizer.json: tokenizer.ggml.merges: %s", bt_last_error());
    json_t *vocab = json_object(), *jm = json_array(), *added = json_array();
    int n_dup = 0;
    for (int32_t i = 0; i < t->n_vocab && !rc; i++) {
        const char *p = bt_tokenizer_piece(t, i);
        if (!bt_tok_utf8_valid((const uint8_t *)p, strlen(p)))
            rc = bt_fail(BT_ERR_UNSUPPORTED, "tokenizer.json: token %d is not valid UTF-8 (JSON "
                         "cannot hold it)", i);
        else if (bt_tok_vocab_find(t, p, strlen(p)) != i) n_dup++;
        else json_object_set_new(vocab, p, json_integer(i));
        int kind = rc ? 0 : added_kind(t, i);
        if (kind)
            json_array_append_new(added, json_pack("{s:i, s:s, s:b, s:b, s:b, s:b, s:b}", "id", i,
                                                   "content", p, "single_word", 0, "lstrip",
                                                   strip && (strip[i] & SPF_LSTRIP), "rstrip",
                                                   strip && (strip[i] & SPF_RSTRIP), "normalized", 0,
                                                   "special", kind == 1));
    }
    for (uint64_t m = 0; m < n_merge && !rc; m++) {
        json_t *s = json_stringn(merges[m].ptr, merges[m].len);
        if (!s) rc = bt_fail(BT_ERR_UNSUPPORTED, "tokenizer.json: merge %llu is not valid UTF-8",
                             (unsigned long long)m);
        else json_array_append_new(jm, s);
    }
    free(merges);
    int32_t *pairs = NULL, n_long = 0;
    if (!rc && spm) rc = bt_tok_hf_spm_merges(t, &pairs, &n_merge, &n_long);
    for (uint64_t m = 0; spm && m < n_merge && !rc; m++) {
        const int32_t l = pairs[2 * m], r = pairs[2 * m + 1];
        json_t *pr = json_pack("[s, s]", bt_tokenizer_piece(t, l), bt_tokenizer_piece(t, r)); /* no NUL inside */
        if (!pr || json_array_append_new(jm, pr)) rc = bt_fail(BT_ERR_NOMEM, "tokenizer.json: out of memory");
    }
    free(pairs);
    if (rc) {
        json_decref(vocab), json_decref(jm), json_decref(added);
        return rc;
    }
    if (n_dup)
        bt_log(BT_LOG_WARN, "tokenizer", "tokenizer.json: %d duplicated token strings kept once "
               "(the id our tokenizer reads them as)", n_dup);
    if (n_long)
        bt_log(BT_LOG_WARN, "tokenizer", "tokenizer.json: %d tokens longer than %d bytes get no merges "
               "(Hugging Face will not form them from text; llama.cpp may)", (int)n_long,
               BT_HF_SPM_SPLIT_MAX);
    json_t *model;
    if (spm) {
        const char *unk = t->unk >= 0 ? bt_tokenizer_piece(t, t->unk) : NULL;
        model = json_pack("{s:s, s:n, s:o, s:n, s:n, s:b, s:b, s:b, s:o, s:o}", "type", "BPE", "dropout",
                          "unk_token", unk ? json_string(unk) : json_null(), "continuing_subword_prefix",
                          "end_of_word_suffix", "fuse_unk", 1, "byte_fallback", 1, "ignore_merges", 0,
                          "vocab", vocab, "merges", jm);
    } else {
        model = json_pack("{s:s, s:n, s:n, s:n, s:n, s:b, s:b, s:b, s:o, s:o}", "type", "BPE",
                          "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix",
                          "fuse_unk", 0, "byte_fallback", 0, "ignore_merges", t->ignore_merges,
                          "vocab", vocab, "merges", jm);
    }
    json_t *norm = spm ? spm_normalizer(t) : t->n_norm ? json_pack("{s:s}", "type", "NFC") : json_null();
    json_t *root = json_pack("{s:s, s:n, s:n, s:o, s:o, s:o, s:o, s:o, s:o}", "version", "1.0",
                             "truncation", "padding", "added_tokens", added, "normalizer", norm,
                             "pre_tokenizer", spm ? json_null() : pre_tokenizer(t->pre),
                             "post_processor", post_processor(t, add_bos, add_eos), "decoder",
                             spm ? spm_decoder(t) : byte_level(1, 1, 1), "model", model);
    *out = dumps(root);
    return *out ? 0 : bt_fail(BT_ERR_NOMEM, "tokenizer.json: out of memory");
}

int bt_tokenizer_hf_from_gguf(const bt_gguf *g, int64_t model_max_length, bt_hf_tokenizer_files *f) {
    memset(f, 0, sizeof *f);
    f->bos = f->eos = f->pad = f->unk = -1;
    bt_tokenizer *t = NULL;
    int rc = bt_tokenizer_from_gguf(&t, g);
    if (rc) return rc;
    /* bt_tokenizer_from_gguf accepts exactly the families pre_tokenizer() writes, and "llama" */
    const int spm = t->model == MODEL_SPM;
    /* llama.cpp adds BOS to a SentencePiece vocabulary whose GGUF does not say (llama-vocab.cpp) */
    const int add_bos = gguf_flag(g, "tokenizer.ggml.add_bos_token", spm);
    const int add_eos = gguf_flag(g, "tokenizer.ggml.add_eos_token", 0);
    f->bos = t->bos, f->eos = t->eos, f->pad = t->pad;
    f->unk = spm ? t->unk : gguf_id(g, "tokenizer.ggml.unknown_token_id", t->n_vocab);
    /* llama.cpp's LSTRIP / RSTRIP attributes of the SentencePiece special tokens, by id */
    uint8_t *strip = spm ? calloc((size_t)t->n_vocab, 1) : NULL;
    if (spm && !strip) {
        rc = bt_fail(BT_ERR_NOMEM, "tokenizer.json: out of memory");
        goto out;
    }
    for (int32_t k = 0; spm && k < t->spm.n_sp; k++) strip[t->spm.sp_id[k]] = t->spm.sp_flag[k];
    if ((rc = tokenizer_json(t, g, add_bos, add_eos, strip, &f->tokenizer_json))) goto out;

    /* tokenizer_config.json and special_tokens_map.json, as save_pretrained writes them for a
     * PreTrainedTokenizerFast: every control token is special (so skip_special_tokens drops
     * them, as bt_detokenize without keep_special does) */
    json_t *cfg = json_object(), *map = json_object(), *dec = json_object();
    json_t *extra = json_array(), *extra_map = json_array();
    static const char *const roles[4] = {"bos_token", "eos_token", "pad_token", "unk_token"};
    const int32_t role_id[4] = {f->bos, f->eos, f->pad, f->unk};
    for (int32_t i = 0; i < t->n_vocab; i++) {
        const char *p = bt_tokenizer_piece(t, i);
        int kind = added_kind(t, i);
        if (!kind) continue;
        char key[16];
        snprintf(key, sizeof key, "%d", i);
        json_object_set_new(dec, key, added_token_json(p, kind == 1, 1, strip ? strip[i] : 0));
        int role = 0;
        for (int r = 0; r < 4; r++) role |= role_id[r] == i;
        if (kind == 1 && !role) {
            json_array_append_new(extra, json_string(p));
            json_array_append_new(extra_map, added_token_json(p, 1, 0, strip ? strip[i] : 0));
        }
    }
    json_object_set_new(cfg, "add_bos_token", json_boolean(add_bos));
    json_object_set_new(cfg, "add_eos_token", json_boolean(add_eos));
    if (!spm) json_object_set_new(cfg, "add_prefix_space", json_false());
    json_object_set_new(cfg, "added_tokens_decoder", dec);
    json_object_set_new(cfg, "additional_special_tokens", extra);
    json_object_set_new(map, "additional_special_tokens", extra_map);
    for (int r = 0; r < 4; r++) {
        const char *p = role_id[r] >= 0 ? bt_tokenizer_piece(t, role_id[r]) : NULL;
        json_object_set_new(cfg, roles[r], p ? json_string(p) : json_null());
        if (p) json_object_set_new(map, roles[r], added_token_json(p, 1, 0, strip ? strip[role_id[r]] : 0));
    }
    if (t->chat_template && json_object_set_new(cfg, "chat_template", json_string(t->chat_template))) {
        json_decref(cfg), json_decref(map);
        rc = bt_fail(BT_ERR_UNSUPPORTED, "tokenizer_config.json: tokenizer.chat_template is not "
                     "valid UTF-8");
        goto out;
    }
    json_object_set_new(cfg, "clean_up_tokenization_spaces", json_false());
    if (model_max_length > 0)
        json_object_set_new(cfg, "model_max_length", json_integer(model_max_length));
    json_object_set_new(cfg, "tokenizer_class", json_string("PreTrainedTokenizerFast"));
    f->tokenizer_config_json = dumps(cfg);
    f->special_tokens_map_json = dumps(map);
    if (!f->tokenizer_config_json || !f->special_tokens_map_json)
        rc = bt_fail(BT_ERR_NOMEM, "tokenizer_config.json: out of memory");
out:
    free(strip);
    bt_tokenizer_free(t);
    if (rc) bt_hf_tokenizer_files_free(f);
    return rc;
}
