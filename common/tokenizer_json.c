/* Byte-level BPE tokenizer from a Hugging Face tokenizer.json (tokenizers 0.20.3 serialization,
 * tokenizers/src/tokenizer/serialization.rs), plus the file-type dispatch of bt_tokenizer_load.
 *
 * Supported (anything else fails with BT_ERR_UNSUPPORTED naming the key):
 *   model           BPE: vocab, merges as "a b" strings or ["a", "b"] pairs, ignore_merges,
 *                   unk_token, fuse_unk, byte_fallback; dropout null/0,
 *                   continuing_subword_prefix / end_of_word_suffix null or ""
 *   normalizer      null, NFC, NFD, NFKC, NFKD, Prepend (prepend), Replace (String pattern,
 *                   content), Sequence of those
 *   pre_tokenizer   null or a Sequence of Split (Regex | String pattern, any behavior, invert),
 *                   Digits (individual_digits), Metaspace (replacement, prepend_scheme always /
 *                   first / never or the older add_prefix_space, split), ByteLevel
 *                   (add_prefix_space, use_regex), which must come last
 *   decoder         with ByteLevel: ByteLevel or null (the vocabulary is byte-level); without
 *                   (the SentencePiece-converted files of Llama 2, Mistral, Gemma: a BPE over
 *                   chars, MODEL_CHARS): null or a Sequence of Replace (String pattern),
 *                   ByteFallback, Fuse, Strip (" ", start 0/1, stop 0), or Metaspace
 *   added_tokens    id, content, special, single_word, lstrip, rstrip, normalized (defaults as HF
 *                   AddedToken: false, except normalized = !special)
 *   post_processor  only read for BOS/EOS: the special tokens a TemplateProcessing "single"
 *                   template puts before / after $A (nothing is ever added by bt_tokenize)
 * tokenizer_config.json (next to tokenizer.json) supplies bos/eos/pad tokens and chat_template. */
#include "common/bt_json.h"
#include "common/tokenizer_internal.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#define LOGC "tokenizer"

static int jfail(const char *key, const char *what) {
    return bt_fail(BT_ERR_FORMAT, "tokenizer.json: %s: %s", key, what);
}

/* Optional bool member: default when absent or null; BT_ERR_FORMAT when not a bool. */
static int get_bool(json_t *o, const char *key, int def, int *out) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) { *out = def; return 0; }
    if (!json_is_boolean(v)) return jfail(key, "not a boolean");
    *out = json_is_true(v);
    return 0;
}

static const char *type_of(json_t *o) {
    json_t *ty = json_object_get(o, "type");
    return json_is_string(ty) ? json_string_value(ty) : NULL;
}

static int parse_normalizer(bt_tokenizer *t, json_t *n) {
    if (!n || json_is_null(n)) return 0;
    const char *ty = type_of(n);
    if (!ty) return jfail("normalizer", "no \"type\"");
    if (strcmp(ty, "Sequence") == 0) {
        json_t *arr = json_object_get(n, "normalizers");
        if (!json_is_array(arr)) return jfail("normalizer.normalizers", "not an array");
        for (size_t i = 0; i < json_array_size(arr); i++) {
            int rc = parse_normalizer(t, json_array_get(arr, i));
            if (rc < 0) return rc;
        }
        return 0;
    }
    int kind = strcmp(ty, "NFC") == 0 ? NORM_NFC : strcmp(ty, "NFD") == 0 ? NORM_NFD
             : strcmp(ty, "NFKC") == 0 ? NORM_NFKC : strcmp(ty, "NFKD") == 0 ? NORM_NFKD
             : strcmp(ty, "Prepend") == 0 ? NORM_PREPEND : strcmp(ty, "Replace") == 0 ? NORM_REPLACE : 0;
    if (!kind)
        return bt_fail(BT_ERR_UNSUPPORTED, "tokenizer.json: normalizer \"%s\" unsupported (NFC, NFD, NFKC, NFKD, "
                       "Prepend, Replace, Sequence)", ty);
    if (t->n_norm >= BT_TOK_MAX_NORM) return bt_fail(BT_ERR_UNSUPPORTED, "tokenizer.json: more than %d normalizers", BT_TOK_MAX_NORM);
    int k = t->n_norm;
    if (kind == NORM_PREPEND) {
        json_t *pp = json_object_get(n, "prepend");
        if (!json_is_string(pp)) return jfail("normalizer.Prepend.prepend", "not a string");
        t->norm_al[k] = json_string_length(pp);
        t->norm_a[k] = bt_xmalloc(t->norm_al[k] + 1);
        memcpy(t->norm_a[k], json_string_value(pp), t->norm_al[k] + 1);
    } else if (kind == NORM_REPLACE) {
        json_t *pat = json_object_get(n, "pattern"), *ct = json_object_get(n, "content");
        json_t *str = json_is_object(pat) ? json_object_get(pat, "String") : NULL;
        if (json_is_object(pat) && json_object_get(pat, "Regex"))
            return bt_fail(BT_ERR_UNSUPPORTED, "tokenizer.json: normalizer Replace with a Regex pattern unsupported "
                           "(String patterns only)");
        if (!json_is_string(str) || json_string_length(str) == 0) return jfail("normalizer.Replace.pattern", "not {\"String\": non-empty s}");
        if (!json_is_string(ct)) return jfail("normalizer.Replace.content", "not a string");
        t->norm_al[k] = json_string_length(str);
        t->norm_a[k] = bt_xmalloc(t->norm_al[k] + 1);
        memcpy(t->norm_a[k], json_string_value(str), t->norm_al[k] + 1);
        t->norm_bl[k] = json_string_length(ct);
        t->norm_b[k] = bt_xmalloc(t->norm_bl[k] + 1);
        memcpy(t->norm_b[k], json_string_value(ct), t->norm_bl[k] + 1);
    }
    t->norm[t->n_norm++] = kind;
    return 0;
}

typedef struct {
    int known_split; /* 1 llama3 pattern, 2 qwen2 pattern, -1 other */
} fam_t;

static int parse_pre(bt_tokenizer *t, json_t *p, fam_t *fam) {
    if (!p || json_is_null(p)) return 0; /* no pre-tokenizer: each run is one word */
    const char *ty = type_of(p);
    if (!ty) return jfail("pre_tokenizer", "no \"type\"");
    if (strcmp(ty, "Sequence") == 0) {
        json_t *arr = json_object_get(p, "pretokenizers");
        if (!json_is_array(arr)) return jfail("pre_tokenizer.pretokenizers", "not an array");
        for (size_t i = 0; i < json_array_size(arr); i++) {
            int rc = parse_pre(t, json_array_get(arr, i), fam);
            if (rc < 0) return rc;
        }
        return 0;
    }
    if (t->n_pre >= BT_TOK_MAX_PRE) return bt_fail(BT_ERR_UNSUPPORTED, "tokenizer.json: more than %d pre-tokenizers", BT_TOK_MAX_PRE);
    if (t->n_pre > 0 && t->pre_steps[t->n_pre - 1].kind == PRE_BYTELEVEL)
        return bt_fail(BT_ERR_UNSUPPORTED, "tokenizer.json: pre-tokenizer \"%s\" after ByteLevel unsupported", ty);
    bt_pre_step *s = &t->pre_steps[t->n_pre];
    memset(s, 0, sizeof *s);
    int rc;
    if (strcmp(ty, "ByteLevel") == 0) {
        int use_regex;
        s->kind = PRE_BYTELEVEL;
        if ((rc = get_bool(p, "add_prefix_space", 1, &s->add_prefix_space)) < 0) return rc;
        if ((rc = get_bool(p, "use_regex", 1, &use_regex)) < 0) return rc;
        if (use_regex && (rc = bt_tok_step_regex(s, BT_TOK_GPT2_PATTERN, strlen(BT_TOK_GPT2_PATTERN), 0)) < 0)
            return rc;
        if (use_regex) s->pat = PAT_GPT2;
    } else if (strcmp(ty, "Metaspace") == 0) {
        /* HF pre_tokenizers/metaspace.rs (tokenizers 0.20.3; "add_prefix_space" of older files
         * means prepend_scheme always / never) */
        json_t *r = json_object_get(p, "replacement"), *ps = json_object_get(p, "prepend_scheme");
        s->kind = PRE_METASPACE;
        const char *rs = json_is_string(r) ? json_string_value(r) : "\xe2\x96\x81";
        size_t rl = strlen(rs), cl = 0;
        int32_t cp = rl ? bt_tok_utf8_next((const uint8_t *)rs, rl, &cl) : -1;
        if (cp < 0 || cl != rl || rl >= sizeof s->ms_rep) return jfail("Metaspace.replacement", "not one char");
        memcpy(s->ms_rep, rs, rl + 1);
        s->ms_rep_len = (uint8_t)rl;
        if (json_is_string(ps)) {
            const char *v = json_string_value(ps);
            s->ms_prepend = !strcmp(v, "always") ? MS_ALWAYS : !strcmp(v, "first") ? MS_FIRST : !strcmp(v, "never") ? MS_NEVER : -1;
            if (s->ms_prepend < 0) return jfail("Metaspace.prepend_scheme", "not always, first or never");
        } else {
            int ap;
            if ((rc = get_bool(p, "add_prefix_space", 1, &ap)) < 0) return rc;
            s->ms_prepend = ap ? MS_ALWAYS : MS_NEVER;
        }
        if ((rc = get_bool(p, "split", 1, &s->ms_split)) < 0) return rc;
        fam->known_split = -1;
    } else if (strcmp(ty, "Digits") == 0) {
        int ind;
        if ((rc = get_bool(p, "individual_digits", 0, &ind)) < 0) return rc;
        s->kind = PRE_DIGITS;
        s->behavior = ind ? BEH_ISOLATED : BEH_CONTIGUOUS;
        fam->known_split = -1 + (fam->known_split == 0 && t->n_pre == 0) * 11; /* 10: leading Digits */
    } else if (strcmp(ty, "Split") == 0) {
        static const char *const names[] = {"Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"};
        json_t *pat = json_object_get(p, "pattern"), *beh = json_object_get(p, "behavior");
        json_t *re = json_is_object(pat) ? json_object_get(pat, "Regex") : NULL;
        json_t *str = json_is_object(pat) ? json_object_get(pat, "String") : NULL;
        if (!json_is_string(re) && !json_is_string(str)) return jfail("Split.pattern", "not {\"Regex\": s} or {\"String\": s}");
        if (!json_is_string(beh)) return jfail("Split.behavior", "not a string");
        s->kind = PRE_SPLIT;
        s->behavior = -1;
        for (int k = 0; k < 5; k++)
            if (strcmp(json_string_value(beh), names[k]) == 0) s->behavior = k;
        if (s->behavior < 0)
            return bt_fail(BT_ERR_UNSUPPORTED, "tokenizer.json: Split behavior \"%s\" unknown", json_string_value(beh));
        if ((rc = get_bool(p, "invert", 0, &s->invert)) < 0) return rc;
        json_t *ps = re ? re : str;
        const char *src = json_string_value(ps);
        size_t len = json_string_length(ps);
        if ((rc = bt_tok_step_regex(s, src, len, str != NULL)) < 0) return rc;
        if (re && len == strlen(BT_TOK_LLAMA3_PATTERN) && memcmp(src, BT_TOK_LLAMA3_PATTERN, len) == 0)
            s->pat = PAT_LLAMA3;
        else if (re && len == strlen(BT_TOK_QWEN2_PATTERN) && memcmp(src, BT_TOK_QWEN2_PATTERN, len) == 0)
            s->pat = PAT_QWEN2;
        else if (re && len == strlen(BT_TOK_GPT2_PATTERN) && memcmp(src, BT_TOK_GPT2_PATTERN, len) == 0)
            s->pat = PAT_GPT2;
        int known = 0;
        if (!s->invert && s->behavior == BEH_ISOLATED) known = s->pat == PAT_LLAMA3 ? 1 : s->pat == PAT_QWEN2 ? 2 : 0;
        fam->known_split = fam->known_split == 0 && known ? known : -1;
    } else {
        return bt_fail(BT_ERR_UNSUPPORTED,
                       "tokenizer.json: pre-tokenizer \"%s\" unsupported (Sequence, Split, Digits, Metaspace, ByteLevel)", ty);
    }
    t->n_pre++;
    return 0;
}

/* bos/eos/pad given as "text", {"content": "text"} or null. */
static int32_t config_token(const bt_tokenizer *t, json_t *cfg, const char *key, int32_t def) {
    json_t *v = json_object_get(cfg, key);
    if (json_is_object(v)) v = json_object_get(v, "content");
    if (!json_is_string(v)) return def;
    int32_t id = bt_tokenizer_find(t, json_string_value(v));
    if (id < 0) bt_log(BT_LOG_WARN, LOGC, "tokenizer_config.json: %s \"%s\" is not a token: ignored", key, json_string_value(v));
    return id >= 0 ? id : def;
}

/* TemplateProcessing "single": special tokens before / after the $A sequence. */
static void post_processor_ids(json_t *pp, int32_t *bos, int32_t *eos) {
    if (!json_is_object(pp)) return;
    const char *ty = type_of(pp);
    if (!ty) return;
    if (strcmp(ty, "Sequence") == 0) {
        json_t *arr = json_object_get(pp, "processors");
        for (size_t i = 0; i < json_array_size(arr); i++) post_processor_ids(json_array_get(arr, i), bos, eos);
        return;
    }
    if (strcmp(ty, "TemplateProcessing") != 0) return;
    json_t *single = json_object_get(pp, "single"), *st = json_object_get(pp, "special_tokens");
    int seen_a = 0;
    for (size_t i = 0; i < json_array_size(single); i++) {
        json_t *e = json_array_get(single, i);
        if (json_object_get(e, "Sequence")) { seen_a = 1; continue; }
        json_t *sp = json_object_get(e, "SpecialToken");
        json_t *name = json_object_get(sp, "id");
        if (!json_is_string(name)) continue;
        json_t *ids = json_object_get(json_object_get(st, json_string_value(name)), "ids");
        json_t *id0 = json_array_get(ids, 0);
        if (!json_is_integer(id0) || json_integer_value(id0) < 0 || json_integer_value(id0) > INT32_MAX) continue;
        if (!seen_a && *bos < 0) *bos = (int32_t)json_integer_value(id0);
        if (seen_a && *eos < 0) *eos = (int32_t)json_integer_value(id0);
    }
}

static int str_of(json_t *v, bt_str *out) {
    if (!json_is_string(v)) return -1;
    out->ptr = json_string_value(v);
    out->len = json_string_length(v);
    return 0;
}

/* model: an object of type BPE (or untyped) without the options a byte-level BPE cannot honour
 * (dropout, byte_fallback, continuing_subword_prefix / end_of_word_suffix); reads fuse_unk and
 * ignore_merges into t. *model = root.model (borrowed). */
static int parse_model(bt_tokenizer *t, json_t *root, json_t **model) {
    *model = json_object_get(root, "model");
    if (!json_is_object(root) || !json_is_object(*model)) return jfail("model", "missing or not an object");
    const char *mty = type_of(*model);
    if (mty && strcmp(mty, "BPE") != 0)
        return bt_fail(BT_ERR_UNSUPPORTED, "tokenizer.json: model \"%s\" unsupported (only byte-level BPE)", mty);
    json_t *d = json_object_get(*model, "dropout");
    if (d && !json_is_null(d) && !(json_is_number(d) && json_number_value(d) == 0.0))
        return bt_fail(BT_ERR_UNSUPPORTED, "tokenizer.json: model.dropout unsupported (must be null)");
    static const char *const empty_keys[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int k = 0; k < 2; k++) {
        json_t *v = json_object_get(*model, empty_keys[k]);
        if (v && !json_is_null(v) && !(json_is_string(v) && json_string_length(v) == 0))
            return bt_fail(BT_ERR_UNSUPPORTED, "tokenizer.json: model.%s unsupported (must be null or \"\")", empty_keys[k]);
    }
    int rc;
    if ((rc = get_bool(*model, "byte_fallback", 0, &t->byte_fallback)) < 0) return rc;
    if ((rc = get_bool(*model, "fuse_unk", 0, &t->fuse_unk)) < 0) return rc;
    return get_bool(*model, "ignore_merges", 0, &t->ignore_merges);
}

/* A SentencePiece-style decoder (MODEL_CHARS) into t->dec_*: Replace("\u2581", " "),
 * ByteFallback, Fuse, Strip(" ", 1, 0) / Strip(" ", 0, 0), Metaspace, nested in Sequences. */
static int parse_chars_decoder(bt_tokenizer *t, json_t *d) {
    if (!d || json_is_null(d)) return 0;
    const char *ty = json_is_object(d) ? type_of(d) : NULL;
    if (!ty) return jfail("decoder", "no \"type\"");
    if (!strcmp(ty, "Sequence")) {
        json_t *arr = json_object_get(d, "decoders");
        if (!json_is_array(arr)) return jfail("decoder.decoders", "not an array");
        for (size_t i = 0; i < json_array_size(arr); i++) {
            int rc = parse_chars_decoder(t, json_array_get(arr, i));
            if (rc < 0) return rc;
        }
        return 0;
    }
    if (!strcmp(ty, "ByteFallback")) { t->dec_bytefb = 1; return 0; }
    if (!strcmp(ty, "Fuse")) return 0;
    if (!strcmp(ty, "Replace")) {
        json_t *pat = json_object_get(d, "pattern"), *ct = json_object_get(d, "content");
        json_t *str = json_is_object(pat) ? json_object_get(pat, "String") : NULL;
        if (json_is_string(str) && json_is_string(ct) && !strcmp(json_string_value(str), "\xe2\x96\x81") &&
            !strcmp(json_string_value(ct), " ")) {
            t->dec_replace = 1;
            return 0;
        }
    } else if (!strcmp(ty, "Strip")) {
        json_t *ct = json_object_get(d, "content"), *st = json_object_get(d, "start"), *sp = json_object_get(d, "stop");
        if (json_is_string(ct) && !strcmp(json_string_value(ct), " ") && json_is_integer(st) &&
            json_integer_value(st) >= 0 && json_integer_value(st) <= 1 && json_is_integer(sp) && json_integer_value(sp) == 0) {
            t->dec_strip = (int)json_integer_value(st);
            return 0;
        }
    } else if (!strcmp(ty, "Metaspace")) {
        json_t *ps = json_object_get(d, "prepend_scheme");
        t->dec_replace = 1;
        t->dec_strip = !(json_is_string(ps) && !strcmp(json_string_value(ps), "never"));
        return 0;
    }
    return bt_fail(BT_ERR_UNSUPPORTED, "tokenizer.json: decoder \"%s\" unsupported here (Replace \"\u2581\" -> \" \", "
                   "ByteFallback, Fuse, Strip \" \" 1 0, Metaspace, Sequence)", ty);
}

/* The text pipeline: normalizer, pre_tokenizer, decoder. With a ByteLevel step (which must come
 * last) the model is byte-level (decoder ByteLevel or null); without, a BPE over chars
 * (MODEL_CHARS; parse_chars_decoder). Records in *fam what the family detection of pre_family
 * needs. */
static int parse_pipeline(bt_tokenizer *t, json_t *root, fam_t *fam) {
    int rc;
    if ((rc = parse_normalizer(t, json_object_get(root, "normalizer"))) < 0) return rc;
    if ((rc = parse_pre(t, json_object_get(root, "pre_tokenizer"), fam)) < 0) return rc;
    json_t *dec = json_object_get(root, "decoder");
    if (t->n_pre == 0 || t->pre_steps[t->n_pre - 1].kind != PRE_BYTELEVEL) {
        const char *dty = json_is_object(dec) ? type_of(dec) : NULL;
        if (dty && !strcmp(dty, "ByteLevel"))
            return bt_fail(BT_ERR_UNSUPPORTED, "tokenizer.json: pre_tokenizer has no ByteLevel step (needed by a "
                           "byte-level BPE, which the ByteLevel decoder says this is)");
        t->model = MODEL_CHARS;
        return parse_chars_decoder(t, dec);
    }
    if (t->byte_fallback)
        return bt_fail(BT_ERR_UNSUPPORTED, "tokenizer.json: model.byte_fallback = true with a ByteLevel pre-tokenizer "
                       "unsupported (byte fallback belongs to SentencePiece-style vocabularies)");
    const char *dty = json_is_object(dec) ? type_of(dec) : NULL;
    if (dec && !json_is_null(dec) && (!dty || strcmp(dty, "ByteLevel") != 0))
        return bt_fail(BT_ERR_UNSUPPORTED, "tokenizer.json: decoder \"%s\" unsupported (ByteLevel)", dty ? dty : "?");
    return 0;
}

/* The id space: model.vocab (non-empty object) and added_tokens (array or absent/null), every
 * id an integer in [0, 2^30); *n = largest id + 1. */
static int id_space(json_t *vocab, json_t *added, int32_t *n) {
    if (!json_is_object(vocab) || json_object_size(vocab) == 0) return jfail("model.vocab", "missing or empty");
    if (added && !json_is_null(added) && !json_is_array(added)) return jfail("added_tokens", "not an array");
    int64_t max_id = -1;
    const char *key;
    size_t klen;
    json_t *val;
    json_object_keylen_foreach(vocab, key, klen, val) {
        if (!json_is_integer(val) || json_integer_value(val) < 0 || json_integer_value(val) >= INT32_MAX / 2)
            return bt_fail(BT_ERR_FORMAT, "tokenizer.json: model.vocab[\"%.*s\"]: id not an integer in [0, 2^30)",
                           (int)(klen > 64 ? 64 : klen), key);
        if (json_integer_value(val) > max_id) max_id = json_integer_value(val);
    }
    for (size_t i = 0; i < json_array_size(added); i++) {
        json_t *id = json_object_get(json_array_get(added, i), "id");
        if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) >= INT32_MAX / 2)
            return bt_fail(BT_ERR_FORMAT, "tokenizer.json: added_tokens[%zu].id not an integer in [0, 2^30)", i);
        if (json_integer_value(id) > max_id) max_id = json_integer_value(id);
    }
    if (max_id + 1 > (int64_t)BT_TOKENIZER_MAX_VOCAB) /* before the tables of that size are made */
        return bt_fail(BT_ERR_RANGE, "tokenizer.json: ids up to %lld: a vocabulary of more than the %u tokens "
                       "accepted (the largest real ones have ~262k)", (long long)max_id, BT_TOKENIZER_MAX_VOCAB);
    *n = (int32_t)max_id + 1;
    return 0;
}

/* added_tokens[i] = a into pieces/types and t->added[t->n_added++] (text normalized when
 * "normalized"). An existing vocabulary string keeps its id (HF AddedVocabulary::add_tokens). */
static int add_token(bt_tokenizer *t, json_t *vocab, json_t *a, size_t i, bt_str *pieces, uint8_t *types) {
    bt_str content;
    if (str_of(json_object_get(a, "content"), &content) < 0 || content.len == 0)
        return bt_fail(BT_ERR_FORMAT, "tokenizer.json: added_tokens[%zu].content missing or empty", i);
    bt_added *e = &t->added[t->n_added];
    int sp, lstrip, rstrip, sw, norm, rc;
    if ((rc = get_bool(a, "special", 0, &sp)) < 0 || (rc = get_bool(a, "lstrip", 0, &lstrip)) < 0 ||
        (rc = get_bool(a, "rstrip", 0, &rstrip)) < 0 || (rc = get_bool(a, "single_word", 0, &sw)) < 0 ||
        (rc = get_bool(a, "normalized", !sp, &norm)) < 0)
        return rc;
    int32_t id = (int32_t)json_integer_value(json_object_get(a, "id"));
    json_t *vv = json_object_getn(vocab, content.ptr, content.len);
    if (vv && json_integer_value(vv) != id) {
        bt_log(BT_LOG_WARN, LOGC, "tokenizer.json: added token \"%.*s\" has id %d but vocabulary id %d: using %d",
               (int)(content.len > 64 ? 64 : content.len), content.ptr, id, (int)json_integer_value(vv),
               (int)json_integer_value(vv));
        id = (int32_t)json_integer_value(vv);
    }
    if (pieces[id].ptr && !(pieces[id].len == content.len && memcmp(pieces[id].ptr, content.ptr, content.len) == 0))
        return bt_fail(BT_ERR_FORMAT, "tokenizer.json: added token \"%.*s\" id %d already holds \"%.*s\"",
                       (int)(content.len > 64 ? 64 : content.len), content.ptr, id,
                       (int)(pieces[id].len > 64 ? 64 : pieces[id].len), pieces[id].ptr);
    pieces[id] = content;
    types[id] = sp ? TT_CONTROL : TT_USER;
    e->id = id;
    e->special = (uint8_t)sp;
    e->lstrip = (uint8_t)lstrip;
    e->rstrip = (uint8_t)rstrip;
    e->single_word = (uint8_t)sw;
    e->normalized = (uint8_t)norm;
    char *nt = NULL;
    size_t nl = 0;
    if (norm && (rc = bt_tok_normalize(t, content.ptr, content.len, &nt, &nl)) < 0) return rc;
    if (!nt) {
        nt = bt_xmalloc(content.len + 1);
        memcpy(nt, content.ptr, content.len);
        nt[content.len] = 0;
        nl = content.len;
    }
    e->text = nt;
    e->len = (uint32_t)nl;
    t->n_added++;
    return 0;
}

/* The vocabulary: model.vocab ids (each id once), then the added tokens, into t
 * (bt_tok_set_vocab; ids used by neither are holes). */
static int build_vocab(bt_tokenizer *t, json_t *model, json_t *added) {
    json_t *vocab = json_object_get(model, "vocab");
    int32_t n = 0;
    int rc = id_space(vocab, added, &n);
    if (rc < 0) return rc;
    bt_str *pieces = bt_xcalloc((size_t)n, sizeof *pieces);
    uint8_t *types = bt_xmalloc((size_t)n), *in_model = bt_xcalloc((size_t)n, 1);
    memset(types, TT_NORMAL, (size_t)n);
    const char *key;
    size_t klen;
    json_t *val;
    json_object_keylen_foreach(vocab, key, klen, val) {
        int32_t id = (int32_t)json_integer_value(val);
        if (pieces[id].ptr) {
            rc = bt_fail(BT_ERR_FORMAT, "tokenizer.json: model.vocab: id %d given to two tokens", id);
            goto done;
        }
        pieces[id] = (bt_str){key, klen};
        in_model[id] = 1;
    }
    size_t n_add = json_array_size(added);
    t->added = bt_xcalloc(n_add + 1, sizeof *t->added);
    for (size_t i = 0; i < n_add; i++)
        if ((rc = add_token(t, vocab, json_array_get(added, i), i, pieces, types)) < 0) goto done;
    rc = bt_tok_set_vocab(t, n, pieces, types, in_model);
done:
    free(pieces);
    free(types);
    free(in_model);
    return rc;
}

/* model.merges: "a b" strings or ["a", "b"] pairs, rank = index (bt_tok_set_merges). */
static int parse_merges(bt_tokenizer *t, json_t *model) {
    json_t *merges = json_object_get(model, "merges");
    if (!json_is_array(merges)) return jfail("model.merges", "missing or not an array");
    size_t nm = json_array_size(merges);
    bt_str *ma = bt_xmalloc((nm + 1) * sizeof *ma), *mb = bt_xmalloc((nm + 1) * sizeof *mb);
    int rc = 0;
    for (size_t m = 0; m < nm && rc == 0; m++) {
        json_t *e = json_array_get(merges, m);
        if (json_is_array(e) && json_array_size(e) == 2 && str_of(json_array_get(e, 0), &ma[m]) == 0 &&
            str_of(json_array_get(e, 1), &mb[m]) == 0)
            continue;
        bt_str s;
        if (str_of(e, &s) == 0) { /* HF model/bpe/serialization.rs: split on the first space */
            const char *sp = memchr(s.ptr, ' ', s.len);
            if (sp && sp != s.ptr && sp + 1 < s.ptr + s.len && !memchr(sp + 1, ' ', s.len - (size_t)(sp - s.ptr) - 1)) {
                ma[m] = (bt_str){s.ptr, (size_t)(sp - s.ptr)};
                mb[m] = (bt_str){sp + 1, s.len - (size_t)(sp - s.ptr) - 1};
                continue;
            }
        }
        rc = bt_fail(BT_ERR_FORMAT, "tokenizer.json: model.merges[%zu] is neither \"a b\" nor [\"a\", \"b\"]", m);
    }
    if (rc == 0) rc = bt_tok_set_merges(t, nm, ma, mb);
    free(ma);
    free(mb);
    return rc;
}

/* model.unk_token (a string; must be in the vocabulary) into t->unk. */
static int parse_unk(bt_tokenizer *t, json_t *model) {
    json_t *unk = json_object_get(model, "unk_token");
    if (!json_is_string(unk)) return 0;
    t->unk = bt_tok_vocab_find(t, json_string_value(unk), json_string_length(unk));
    return t->unk < 0 ? jfail("model.unk_token", "not in the vocabulary") : 0;
}

/* bos/eos from the post-processor template (ids outside the vocabulary dropped), then
 * tokenizer_config.json bos_token / eos_token / pad_token (cfg may be NULL) over them. */
static void special_ids(bt_tokenizer *t, json_t *root, json_t *cfg) {
    post_processor_ids(json_object_get(root, "post_processor"), &t->bos, &t->eos);
    if (t->bos >= t->n_vocab) t->bos = -1;
    if (t->eos >= t->n_vocab) t->eos = -1;
    if (!cfg) return;
    t->bos = config_token(t, cfg, "bos_token", t->bos);
    t->eos = config_token(t, cfg, "eos_token", t->eos);
    t->pad = config_token(t, cfg, "pad_token", t->pad);
}

/* tokenizer_config.json chat_template: a string, or [{"name": "default", "template": s}, ...];
 * NULL when absent. Borrowed from cfg. */
static const char *chat_template(json_t *cfg) {
    json_t *tpl = json_object_get(cfg, "chat_template");
    if (json_is_array(tpl)) {
        json_t *pick = NULL;
        for (size_t i = 0; i < json_array_size(tpl); i++) {
            json_t *name = json_object_get(json_array_get(tpl, i), "name");
            if (json_is_string(name) && strcmp(json_string_value(name), "default") == 0) pick = json_array_get(tpl, i);
        }
        tpl = pick ? json_object_get(pick, "template") : NULL;
    }
    return json_is_string(tpl) ? json_string_value(tpl) : NULL;
}

/* The pre-tokenizer family (t->pre) whose dedicated pipeline bt_tok_pre_select may use: gpt2,
 * smollm, llama3, qwen2 when the steps are exactly theirs, else custom (the generic regex path). */
static const char *pre_family(const bt_tokenizer *t, const fam_t *fam) {
    if (t->model == MODEL_CHARS) return "sentencepiece";
    const bt_pre_step *last = &t->pre_steps[t->n_pre - 1];
    if (last->add_prefix_space || t->n_norm > (fam->known_split == 2)) return "custom";
    if (t->n_pre == 1 && last->re) return "gpt2";
    if (t->n_pre == 2 && last->re && fam->known_split == 10 && t->pre_steps[0].behavior == BEH_ISOLATED)
        return "smollm";
    if (t->n_pre == 2 && !last->re && fam->known_split == 1 && t->n_norm == 0) return "llama3";
    if (t->n_pre == 2 && !last->re && fam->known_split == 2 && t->n_norm == 1 && t->norm[0] == NORM_NFC)
        return "qwen2";
    return "custom";
}

/* Contract (id space, token types, bos/eos/pad, ownership, errors) in tokenizer.h; the format
 * is tokenizers 0.20.3's, as listed at the top of this file. Stages, in order: model options,
 * text pipeline, vocabulary + added tokens, merges, unk token, added-token match sets, special
 * ids, chat template, pre-tokenizer family; the first failing stage's error is returned. */
int bt_tokenizer_from_json(bt_tokenizer **out, const char *json, size_t len, const char *config, size_t config_len) {
    if (!out || (!json && len)) return bt_fail(BT_ERR_INVALID, "tokenizer_from_json: NULL argument");
    *out = NULL;
    json_t *root = NULL, *cfg = NULL, *model = NULL;
    if (bt_json_loadb(&root, json, len, JSON_ALLOW_NUL, "tokenizer.json")) return BT_ERR_FORMAT;
    /* integers as reals: transformers writes model_max_length = 1e30 (VERY_LARGE_INTEGER) as an
     * integer, past jansson's json_int_t; only strings are read from this file */
    if (config && config_len &&
        bt_json_loadb(&cfg, config, config_len, JSON_ALLOW_NUL | JSON_DECODE_INT_AS_REAL, "tokenizer_config.json")) {
        json_decref(root);
        return BT_ERR_FORMAT;
    }
    bt_tokenizer *t = bt_tok_new();
    fam_t fam = {0};
    int rc = parse_model(t, root, &model);
    if (rc >= 0) rc = parse_pipeline(t, root, &fam);
    if (rc >= 0) rc = build_vocab(t, model, json_object_get(root, "added_tokens"));
    if (rc >= 0) rc = parse_merges(t, model);
    if (rc >= 0) rc = parse_unk(t, model);
    if (rc >= 0) rc = bt_tok_build_added(t);
    if (rc >= 0) {
        special_ids(t, root, cfg);
        const char *tpl = cfg ? chat_template(cfg) : NULL;
        if (tpl) t->chat_template = bt_xstrdup(tpl);
        t->pre = bt_xstrdup(pre_family(t, &fam));
        bt_tok_pre_select(t);
    }
    json_decref(root);
    json_decref(cfg);
    if (rc < 0) {
        bt_tokenizer_free(t);
        return rc;
    }
    *out = t;
    return 0;
}

/* ---- file loading ---- */

/* Reads a whole file; zstd frames (magic 28 B5 2F FD) are decompressed. *out malloc'd. */
static int read_maybe_zstd(const char *path, char **out, size_t *out_len) {
    *out = NULL;
    *out_len = 0;
    struct {
        char *data;
        size_t size;
    } m; /* read(2), not mapped: a file truncated meanwhile is an error, never a SIGBUS */
    int rc = bt_read_file(path, (size_t)256 << 20, &m.data, &m.size); /* the largest real ones: ~35 MB */
    if (rc < 0) return rc;
    static const uint8_t zmagic[4] = {0x28, 0xB5, 0x2F, 0xFD};
    if (m.size >= 4 && memcmp(m.data, zmagic, 4) == 0) {
        ZSTD_DStream *ds = ZSTD_createDStream();
        if (!ds) { free(m.data); return bt_fail(BT_ERR_NOMEM, "tokenizer: zstd context"); }
        size_t cap = m.size * 4 + 4096, n = 0;
        char *buf = bt_xmalloc(cap);
        ZSTD_inBuffer in = {m.data, m.size, 0};
        size_t r = 1;
        while (in.pos < in.size || r != 0) {
            if (n == cap) {
                if (cap > ((size_t)1 << 31)) { r = (size_t)-1; break; }
                cap *= 2;
                buf = bt_xrealloc(buf, cap);
            }
            ZSTD_outBuffer ob = {buf, cap, n};
            size_t before = in.pos;
            r = ZSTD_decompressStream(ds, &ob, &in);
            if (ZSTD_isError(r)) break;
            int progress = ob.pos != n || in.pos != before;
            n = ob.pos;
            if (!progress && ob.pos < cap) { r = (size_t)-1; break; } /* truncated frame */
            if (r == 0 && in.pos == in.size) break;
        }
        ZSTD_freeDStream(ds);
        free(m.data);
        if (r != 0) {
            free(buf);
            return bt_fail(BT_ERR_FORMAT, "tokenizer: %s: corrupt or truncated zstd data", path);
        }
        *out = buf;
        *out_len = n;
        return 0;
    }
    *out = m.data; /* NUL-terminated by bt_read_file */
    *out_len = m.size;
    return 0;
}

/* Bytes of text in a tokenizer.json or tokenizer_config.json file (plain, or the content size
 * a zstd frame declares; 32 x the compressed size when it declares none). 0 when absent. */
static int json_text_bytes(const char *path, int must_exist, uint64_t *bytes) {
    *bytes = 0;
    struct stat st;
    int fd = bt_open_file(path, 0, &st);
    if (fd < 0) {
        if (!must_exist && errno == ENOENT) return 0;
        return bt_fail(BT_ERR_IO, "tokenizer: %s", bt_last_error());
    }
    uint8_t head[18];
    ssize_t got;
    do got = pread(fd, head, sizeof head, 0);
    while (got < 0 && errno == EINTR);
    close(fd);
    *bytes = (uint64_t)st.st_size;
    static const uint8_t zmagic[4] = {0x28, 0xB5, 0x2F, 0xFD};
    if (got >= 4 && memcmp(head, zmagic, 4) == 0) {
        unsigned long long c = ZSTD_getFrameContentSize(head, (size_t)got);
        *bytes = c != ZSTD_CONTENTSIZE_UNKNOWN && c != ZSTD_CONTENTSIZE_ERROR ? c : 32 * (uint64_t)st.st_size;
    }
    return 0;
}

int bt_tokenizer_load_estimate(const char *path, uint64_t *bytes) {
    if (!path || !bytes) return bt_fail(BT_ERR_INVALID, "tokenizer_load_estimate: NULL argument");
    *bytes = 0;
    struct stat st;
    if (stat(path, &st) != 0) return bt_fail(BT_ERR_IO, "tokenizer: %s: %s", path, strerror(errno));
    char file[PATH_MAX], cfgp[PATH_MAX];
    if ((size_t)snprintf(file, sizeof file, S_ISDIR(st.st_mode) ? "%s/tokenizer.json" : "%s", path) >= sizeof file)
        return bt_fail(BT_ERR_INVALID, "tokenizer: path too long");
    if (!S_ISDIR(st.st_mode)) {
        int fd = bt_open_ro(path);
        if (fd < 0) return bt_fail(BT_ERR_IO, "tokenizer: %s", bt_last_error());
        char magic[4] = {0};
        ssize_t got;
        do got = pread(fd, magic, 4, 0);
        while (got < 0 && errno == EINTR);
        close(fd);
        if (got == 4 && memcmp(magic, "GGUF", 4) == 0) {
            bt_gguf *g = NULL;
            int rc = bt_gguf_open(&g, path);
            if (rc < 0) return rc;
            rc = bt_gguf_check(g, bt_tok_gguf_estimate(g, bytes));
            bt_gguf_close(g);
            return rc;
        }
    }
    uint64_t jb = 0, cb = 0;
    int rc = json_text_bytes(file, 1, &jb);
    if (rc < 0) return rc;
    const char *slash = strrchr(file, '/');
    size_t dl = slash ? (size_t)(slash - file) + 1 : 0;
    if (dl + sizeof "tokenizer_config.json" <= sizeof cfgp) {
        memcpy(cfgp, file, dl);
        strcpy(cfgp + dl, "tokenizer_config.json");
        if ((rc = json_text_bytes(cfgp, 0, &cb)) < 0) return rc;
    }
    *bytes = 20 * (jb + cb) + ((uint64_t)1 << 20);
    return 0;
}

int bt_tokenizer_load(bt_tokenizer **out, const char *path) {
    if (!out || !path) return bt_fail(BT_ERR_INVALID, "tokenizer_load: NULL argument");
    *out = NULL;
    struct stat st;
    if (stat(path, &st) != 0) return bt_fail(BT_ERR_IO, "tokenizer: %s: %s", path, strerror(errno));
    char file[PATH_MAX], cfgp[PATH_MAX];
    if (S_ISDIR(st.st_mode)) {
        if ((size_t)snprintf(file, sizeof file, "%s/tokenizer.json", path) >= sizeof file)
            return bt_fail(BT_ERR_INVALID, "tokenizer: path too long");
    } else {
        if (strlen(path) >= sizeof file) return bt_fail(BT_ERR_INVALID, "tokenizer: path too long");
        strcpy(file, path);
        /* GGUF by magic */
        int fd = bt_open_ro(path); /* the one safe open: a regular file, never blocking */
        if (fd < 0) return bt_fail(BT_ERR_IO, "tokenizer: %s", bt_last_error());
        char magic[4] = {0};
        ssize_t got;
        do got = pread(fd, magic, 4, 0);
        while (got < 0 && errno == EINTR);
        close(fd);
        if (got == 4 && memcmp(magic, "GGUF", 4) == 0) {
            bt_gguf *g = NULL;
            int rc = bt_gguf_open(&g, path);
            if (rc < 0) return rc;
            rc = bt_gguf_check(g, bt_tokenizer_from_gguf(out, g));
            if (rc < 0 && *out) {
                bt_tokenizer_free(*out); /* built from a file that changed under us */
                *out = NULL;
            }
            bt_gguf_close(g);
            return rc;
        }
    }
    char *json = NULL, *cfg = NULL;
    size_t jl = 0, cl = 0;
    int rc = read_maybe_zstd(file, &json, &jl);
    if (rc < 0) return rc;
    /* tokenizer_config.json next to the tokenizer.json, if any */
    const char *slash = strrchr(file, '/');
    size_t dl = slash ? (size_t)(slash - file) + 1 : 0;
    if (dl + sizeof "tokenizer_config.json" <= sizeof cfgp) {
        memcpy(cfgp, file, dl);
        strcpy(cfgp + dl, "tokenizer_config.json");
        if (access(cfgp, R_OK) == 0 && (rc = read_maybe_zstd(cfgp, &cfg, &cl)) < 0) {
            free(json);
            return rc;
        }
    }
    rc = bt_tokenizer_from_json(out, json, jl, cfg, cl);
    if (rc < 0 && !bt_last_error()[0]) rc = bt_fail(rc, "tokenizer: %s: not a GGUF or tokenizer.json", file);
    free(json);
    free(cfg);
    return rc;
}
