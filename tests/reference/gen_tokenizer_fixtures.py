#!/usr/bin/env python3
"""Reference fixtures for the C byte-level BPE tokenizer (common/tokenizer.c).

Builds a Hugging Face `tokenizers.Tokenizer` from the tokenizer.ggml.* metadata of the SmolLM2 GGUF,
exactly as SmolLM2's own tokenizer.json is configured:
  model         BPE(vocab, merges), no dropout, no unk token, byte_fallback false
  pre_tokenizer Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False,
                                                                   use_regex=True)]
  decoder       ByteLevel
  added tokens  the control tokens (token_type 3) as special tokens; user-defined tokens
                (token_type 4) as non-special added tokens
then encodes a corpus of varied strings and writes
  tests/fixtures/tokenizer/smollm2-tokenizer.json.zst (the tokenizer.json, zstd -19, for future
                                                      tokenizer.json loading; needs the zstd CLI)
  tests/fixtures/tokenizer/smollm2_cases.jsonl      one case a line:
      {"text": str, "ids": [int], "special": bool}            valid UTF-8 input
      {"hex": str, "text": str, "ids": [int], "special": bool} raw bytes (maybe invalid UTF-8):
           "hex" is the raw input, "text" its decoding with errors="replace"
  "special": true  -> encoded with special-token splitting (C: parse_special = 1)
  "special": false -> encoded by a tokenizer with no added tokens (C: parse_special = 0)

Multi-family parity fixtures (tokenizer.json loader, tests/unit/common/test_tokenizer_hf.c):
  corpus.bin.zst                  >= 1 MB mixed corpus (Shakespeare, alpaca, Python code, CJK,
                                  Arabic, emoji/ZWJ, NFC-relevant sequences, whitespace and digit
                                  runs, special-token strings, invalid UTF-8), format in write_corpus
  {smollm2,llama3,qwen2}_ids.bin.zst  HF ids + decode hash per document (write_family_fixtures)
  {llama3,qwen2}-tokenizer.json.zst   BPEs trained here (vocab 6000) with the real families'
                                  pipelines: Llama-3 (Split cl100k Isolated, ByteLevel no regex,
                                  ignore_merges, Llama-3.1 special tokens, TemplateProcessing BOS);
                                  Qwen2.5 (NFC, Split single-digit pattern, special tokens and
                                  non-special added tokens with normalized false)
  qwen2x-*                        qwen2 plus added tokens with lstrip/rstrip/single_word/normalized
  variants.jsonl                  other pipelines over the qwen2 vocabulary (every Split behaviour,
                                  invert, String patterns, Digits, ByteLevel options, regex
                                  constructs, NFD/NFKC/NFKD) with HF ids of hand strings
Special-token handling: "special" documents are encoded normally (C parse_special = 1); the
others with encode_special_tokens = True (special strings as text, non-special added tokens
still matched; C parse_special = 0).

Invalid UTF-8 rule (HF works on Rust &str, which cannot hold invalid bytes): the raw bytes are
decoded with Python's bytes.decode("utf-8", errors="replace") (one U+FFFD per maximal invalid
subpart, Unicode "substitution of maximal subparts") and the result is tokenized. The C tokenizer
applies the same rule.

Usage (from the repo root):
  python3 -m venv .venv-ref && .venv-ref/bin/pip install -r tests/reference/requirements-tokenizer.txt
  .venv-ref/bin/python tests/reference/gen_tokenizer_fixtures.py \
      [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--shared ../shared]
"""
import argparse
import json
import os
import random
import subprocess
import sys

import gguf
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers


def field_str(r, key):
    f = r.fields[key]
    return bytes(f.parts[f.data[0]]).decode("utf-8")


def field_str_arr(r, key):
    f = r.fields[key]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def field_int_arr(r, key):
    f = r.fields[key]
    return [int(f.parts[i][0]) for i in f.data]


def build_tokenizers(model_path):
    r = gguf.GGUFReader(model_path)
    assert field_str(r, "tokenizer.ggml.model") == "gpt2"
    assert field_str(r, "tokenizer.ggml.pre") == "smollm"
    tokens = field_str_arr(r, "tokenizer.ggml.tokens")
    types = field_int_arr(r, "tokenizer.ggml.token_type")
    merges = field_str_arr(r, "tokenizer.ggml.merges")
    vocab = {t: i for i, t in enumerate(tokens)}
    assert len(vocab) == len(tokens), "duplicate token strings"
    pairs = []
    for m in merges:
        a, b = m.split(" ")
        pairs.append((a, b))

    def make(with_added):
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, unk_token=None,
                                   fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
        tok.decoder = decoders.ByteLevel()
        if with_added:
            specials = [AddedToken(t, special=True, normalized=False)
                        for t, ty in zip(tokens, types) if ty == 3]
            user = [AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == 4]
            tok.add_special_tokens(specials)
            if user:
                tok.add_tokens(user)
        return tok

    return make(True), make(False), tokens, types


def corpus(shared):
    """List of (bytes, special) cases."""
    hand = [
        "", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "a", "Hello world",
        "Hello, world! How are you?", "Hello  world", "Hello   world", "a  b", "a   b  c ",
        "trailing space ", "trailing spaces   ", "  leading", "\tindent\ttabs\t",
        "line1\nline2\n\nline4\n", "mixed \t\n whitespace \n\t ", "x\u00a0y", "x\u0085y",
        "x\u2028y\u2029z", "x\u3000y", "x\u1680y\u2000z\u200az", "x\u202fy\u205fz",
        "x\u200by\ufeffz\u180e", "a \u0085b", "a \u00a0b", "a \u180eb", "a \u2007b", "a \u200bb", "a\u0085\u0085 b", "word \u2028next",
        "a \u3000\u3000b", "tab\t\u0085 x", "\u0085", " \u0085", "\u0085 ", "x\u000by\u000cz", "  \u00a0 word", "\u00a0\u00a0\u00a0",
        "it's", "It's", "IT'S", "don't", "DON'T", "they're", "THEY'RE", "we've", "I'm", "I'M",
        "you'll", "he'd", "she'D", "'s", "'t", "'re", "''s", "rock'n'roll", "x 's y", "'S'T'RE",
        "0", "7", "12", "123", "1234567890", "3.14159", "1,000,000", "v1.2.3", "2024-01-15",
        "abc123def", "x = 42 + 17 * 3", "phone: +1 (555) 123-4567", " 99 bottles",
        "\u0661\u0662\u0663", "\u0968\u0966\u0968\u0969", "\u00bd \u00b2 \u2163 \u2460", "\uff11\uff12",
        "def foo(x):\n    return x * 2\n", "int main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
        "for (int i = 0; i < n; ++i) { a[i] += b[i]; }", "    if x:\n        pass\n",
        "<html><body class=\"main\">Hi &amp; bye</body></html>", "SELECT * FROM t WHERE id=3;",
        "#include <stdio.h>", "x->y && z || !w", "$HOME/.config/app.json", "https://example.com/a?b=c&d=e",
        "snake_case_name CamelCaseName kebab-case-name", "____", "----====****", "...", "!!!???",
        "\u4f60\u597d\uff0c\u4e16\u754c\uff01", "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3067\u3059\u3002",
        "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8", "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
        "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd", "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440!",
        "\u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u039a\u03cc\u03c3\u03bc\u03b5",
        "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
        "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e0a\u0e32\u0e27\u0e42\u0e25\u0e01",
        "Ti\u1ebfng Vi\u1ec7t", "na\u00efve caf\u00e9 r\u00e9sum\u00e9", "Stra\u00dfe \u00fcber \u00c4rger",
        "e\u0301 a\u0300 o\u0308", "Z\u0351\u036b\u0343a\u0310\u0357l\u0304g\u0344o\u0312",
        "\U0001F600", "\U0001F600\U0001F601 \U0001F602", "\U0001F44D\U0001F3FD",
        "\U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466", "\U0001F1EF\U0001F1F5\U0001F1FA\U0001F1F8",
        "\u2764\ufe0f", "I \u2764\ufe0f NY", "math: \u2200x\u2208\u211d, x\u00b2 \u2265 0", "\u2192 \u21d2 \u27f9",
        "\U0001D400\U0001D401\U0001D402", "\U00020000\U0002A6D6", "\ue000\uf8ff", "\ufffd", "a\ufffdb",
        "\u0000", "a\u0000b", "\u0001\u0002\u001f\u007f", "\u00ad soft\u00adhyphen",
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nHi<|im_end|>\n",
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
        "text<|endoftext|>more text", "<|im_start|><|im_end|>", "<|im_start", "im_start|>",
        "<<|im_end|>>", "<|im_start|x", "<repo_name>foo<filename>bar.py<file_sep>",
        "<jupyter_start><jupyter_code>print(1)<jupyter_output>1<empty_output>",
        "<|endoftext|><|endoftext|>", " <|im_end|> ", "<|IM_START|>", "<gh_stars>10-100",
        "a" * 300, "ab" * 150, " " * 100, "\n" * 50, "9" * 64, "x" + " " * 37 + "y",
        "supercalifragilisticexpialidocious", "antidisestablishmentarianism",
        "The quick brown fox jumps over the lazy dog.", "THE QUICK BROWN FOX",
        "\u0130stanbul \u0131\u015f\u0131k", "\u1e9e\u00df", "\ufb01\ufb02 ligatures",
    ]
    cases = []
    for s in hand:
        for sp in (True, False):
            cases.append((s.encode("utf-8"), sp))

    # Invalid UTF-8 (decoded with errors="replace" on both sides).
    bad = [
        b"\xff", b"\x80", b"abc\xffdef", b"\xc3", b"\xc3(", b"\xe2\x82", b"\xe2\x82(", b"\xe2\x82\xac",
        b"\xf0\x9f\x98", b"\xf0\x9f\x98\x80\xf0\x9f", b"\xed\xa0\x80", b"\xc0\x80", b"\xc1\xbf",
        b"\xe0\x80\x80", b"\xe0\x9f\xbf", b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xf8\x88\x80\x80\x80",
        b"\xfe\xfe\xff\xff", b"a\x80\x80\x80b", b"caf\xe9", b"12\xff34", b"  \xff  ", b"\xef\xbb\xbfBOM",
        b"<|im_start|>\xff<|im_end|>", b"\xf0\x90\x80", b"\xf0\x90\x80a", b"\xdf", b"x\xdf\xdf\xc2\xa0",
    ]
    for b in bad:
        for sp in (True, False):
            cases.append((b, sp))

    # Alpaca seed tasks: instructions, inputs, outputs.
    with open(os.path.join(shared, "data", "alpaca_seed_tasks.jsonl"), encoding="utf-8") as f:
        tasks = [json.loads(line) for line in f if line.strip()]
    rng = random.Random(1234)
    for t in tasks[:120]:
        cases.append((t["instruction"].encode("utf-8"), False))
        inst = t["instances"][0]
        if inst.get("input"):
            cases.append((inst["input"].encode("utf-8"), rng.random() < 0.5))
        if inst.get("output"):
            cases.append((inst["output"][:600].encode("utf-8"), rng.random() < 0.5))

    # Tiny Shakespeare: chunks of varying length (with newlines and blank lines).
    with open(os.path.join(shared, "data", "tinyshakespeare.txt"), encoding="utf-8") as f:
        shk = f.read()
    for _ in range(60):
        n = rng.choice([40, 100, 300, 800])
        off = rng.randrange(0, len(shk) - n)
        cases.append((shk[off:off + n].encode("utf-8"), rng.random() < 0.5))

    # Random mixes of pieces from all scripts (stress regex boundaries).
    alphabet = ["a", "Z", " ", "  ", "\t", "\n", "1", "23", "'s", "'", "-", "_", ".", "\u00e9", "\u4f60",
                "\u0645", "\U0001F600", "\u200d", "\u00a0", "\u0301", "<|im_end|>", "\u0661", "\u2028",
                "\r\n", "'ll", "X'", "(", ")", "\u00bd", "\u0085"]
    for _ in range(80):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        cases.append((s.encode("utf-8"), rng.random() < 0.5))
    return cases



# ---------------------------------------------------------------------------------------------
# Multi-family parity corpus (tokenizer.json loader): SmolLM2 (from the GGUF), and Llama-3-style
# and Qwen2-style byte-level BPEs trained here with exactly those families' pipelines.
# ---------------------------------------------------------------------------------------------

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Meta-Llama-3.1 special tokens (ids follow the trained vocabulary here instead of 128000+).
LLAMA3_SPECIALS = (["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
                    "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
                    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
                   + [f"<|reserved_special_token_{i}|>" for i in range(3, 20)])
# Qwen2.5: special tokens, then non-special added tokens (normalized false), as its tokenizer.json.
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
                  "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                  "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                  "<|image_pad|>", "<|video_pad|>"]
QWEN2_PLAIN = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
               "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]


def train_family(name, train_docs, vocab_size=6000):
    """Trains a byte-level BPE with the pipeline of the real family's tokenizer.json."""
    from tokenizers import Regex, normalizers, processors, trainers
    if name == "llama3":
        tok = Tokenizer(models.BPE(dropout=None, unk_token=None, fuse_unk=False, byte_fallback=False,
                                   ignore_merges=True))
        tok.normalizer = None
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    else:
        tok = Tokenizer(models.BPE(dropout=None, unk_token=None, fuse_unk=False, byte_fallback=False,
                                   continuing_subword_prefix="", end_of_word_suffix="",
                                   ignore_merges=False))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(train_docs, trainer=trainer)
    if name == "llama3":
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIALS])
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
            processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                          pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                          special_tokens=[("<|begin_of_text|>", bos)]),
        ])
    else:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN2_SPECIALS])
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN2_PLAIN])
        tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                                  use_regex=False)
    return tok


def add_exotic_tokens(tok):
    """Added-token flags beyond the real families (for the flag-semantics fixture)."""
    tok.add_tokens([
        AddedToken("caf\u00e9", special=False, normalized=True),        # matched after NFC
        AddedToken("<lstrip>", special=False, normalized=False, lstrip=True),
        AddedToken("<rstrip>", special=False, normalized=False, rstrip=True),
        AddedToken("word", special=False, normalized=False, single_word=True),
        AddedToken("\u00e9t\u00e9", special=False, normalized=True, single_word=True),
    ])
    tok.add_special_tokens([AddedToken("<|both|>", special=True, normalized=False, lstrip=True,
                                       rstrip=True)])
    return tok


def fnv1a64(b):
    h = 0xcbf29ce484222325
    for x in b:
        h = ((h ^ x) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


def build_corpus(shared, rng):
    """Mixed corpus of documents (bytes, maybe invalid UTF-8), >= 1 MB in total."""
    docs = []
    with open(os.path.join(shared, "data", "tinyshakespeare.txt"), encoding="utf-8") as f:
        shk = f.read()
    off = 0
    while off < 450_000:
        n = rng.choice([60, 200, 500, 1200, 3000])
        docs.append(shk[off:off + n])
        off += n
    with open(os.path.join(shared, "data", "alpaca_seed_tasks.jsonl"), encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            t = json.loads(line)
            inst = t["instances"][0]
            docs.append(t["instruction"] + "\n\n" + inst.get("input", "") + "\n\n" + inst.get("output", ""))
    # code: Python standard library sources (plain ASCII/UTF-8 text with indentation runs)
    import textwrap, json as _json, random as _random, argparse as _argparse
    for mod in (textwrap, _json.decoder, _json.encoder, _random, _argparse):
        src = open(mod.__file__, encoding="utf-8").read()
        for i in range(0, min(len(src), 60_000), 1500):
            docs.append(src[i:i + 1500])
    cjk = ("\u4eca\u5929\u5929\u6c14\u5f88\u597d\uff0c\u6211\u4eec\u53bb\u516c\u56ed\u6563\u6b65\u5427\u3002"
           "\u6a5f\u68b0\u5b66\u7fd2\u306f\u4eba\u5de5\u77e5\u80fd\u306e\u4e00\u5206\u91ce\u3067\u3059\u3002"
           "\ud55c\uad6d\uc5b4\ub294 \uc544\ub984\ub2f5\uc2b5\ub2c8\ub2e4. \u30ab\u30bf\u30ab\u30ca\u3068\u3072\u3089\u304c\u306a")
    arabic = ("\u0627\u0644\u0633\u0644\u0627\u0645 \u0639\u0644\u064a\u0643\u0645 \u0648\u0631\u062d\u0645\u0629 "
              "\u0627\u0644\u0644\u0647\u060c \u0643\u064a\u0641 \u062d\u0627\u0644\u0643\u061f \u0661\u0662\u0663\u0664 "
              "\u0645\u064e\u0631\u0652\u062d\u064e\u0628\u064b\u0627")
    emoji = ["\U0001F600", "\U0001F44D\U0001F3FD", "\U0001F468\u200d\U0001F469\u200d\U0001F467",
             "\U0001F1EF\U0001F1F5", "\u2764\ufe0f", "\U0001F3F3\ufe0f\u200d\U0001F308", "\U0001F9D1\u200d\U0001F4BB"]
    nfc = ["e\u0301", "a\u0300", "o\u0308", "A\u030a", "\u212b", "\u1e9b\u0323", "q\u0307\u0323",
           "\u1100\u1161\u11a8", "\u1100\u1161", "\u0915\u093c", "\u0b47\u0b3e", "\u00e9", "\u0041\u0301\u0328",
           "\u2126", "\u0344", "\u0340\u0341", "\u1e0a\u0323", "\u1ea0\u0306", "\uf900", "\u2000",
           "n\u0303", "u\u0308\u0301", "\u03b1\u0313\u0342", "\u05e9\u05bc\u05c1", "\uac00\u11a8"]
    ws = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\u00a0", "\u3000", "\u2028", "\u0085",
          "\u180e", "\u200b", "\x0b", "\x0c", "\r", " \t ", "\n   ", "        "]
    digits = ["1", "12", "123", "1234", "12345678901234", "3.14159", "1,000,000", "\u0661\u0662\u0663",
              "\uff11\uff12\uff13", "\u00bd", "\u2163", "\u00b2", "0x1F", "2024-01-15", "\u0967\u0968"]
    specials = (LLAMA3_SPECIALS[:11] + QWEN2_SPECIALS[:4] + QWEN2_PLAIN + ["<|endoftext|>", "<|im_start|>",
                "<|im_end|>", "<|begin_of_text|", "<|im_start", "<<|eot_id|>>", "<repo_name>", "<|both|>",
                "<lstrip>", "<rstrip>", "caf\u00e9", "cafe\u0301", "word", "\u00e9t\u00e9", "e\u0301te\u0301"])
    words = ["the", "The", "THE", "it's", "IT'S", "we'Re", "they'VE", "I'm", "you'LL", "he'd", "'s", "x'\u017f",
             "don't", "(abc", "[x]", "a.b", "foo_bar", "CamelCase", "na\u00efve", "\u00fcber", "\u0130stanbul",
             "Vi\u1ec7t", "\u0416\u0443\u043a", "\u03b1\u03b2\u03b3", "\u05e9\u05dc\u05d5\u05dd", "\u0928\u092e\u0938\u094d\u0924\u0947",
             "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35", "!!!", "...", "--", "->", "=>", "#include", "$x", "@user",
             "http://a.b/c?d=e", "\ufffd", "\u00ad", "\U0001D400", "\U00020000", "\ue000", "\x00", "\x01", "\x7f"]
    pools = [words] * 6 + [ws] * 3 + [digits] * 2 + [nfc] * 2 + [emoji, specials,
             list(cjk), list(arabic)]
    size = sum(len(d.encode("utf-8")) for d in docs)
    while size < 1_150_000:
        k = rng.choice([5, 20, 60, 200])
        parts = []
        for _ in range(k):
            pool = rng.choice(pools)
            parts.append(rng.choice(pool))
            if rng.random() < 0.5:
                parts.append(" ")
        d = "".join(parts)
        if rng.random() < 0.3:
            d = cjk[rng.randrange(len(cjk) - 10):] + d + arabic
        docs.append(d)
        size += len(d.encode("utf-8"))
    out = []
    for d in docs:
        b = d.encode("utf-8")
        if rng.random() < 0.03:  # invalid UTF-8 injected
            pos = rng.randrange(len(b) + 1)
            bad = rng.choice([b"\xff", b"\x80", b"\xc3", b"\xe2\x82", b"\xf0\x9f\x98", b"\xed\xa0\x80",
                              b"\xc0\x80", b"\xfe\xfe"])
            b = b[:pos] + bad + b[pos:]
        out.append(b)
    return out


def write_family_fixtures(outdir, name, tok, corpus, flags):
    """<name>_ids.bin.zst: b"BTTKIDS1", u32 count, then per document: u64 FNV-1a-64 of the HF
    decode (skip_special_tokens=False) in UTF-8, varint n, n varint ids (LEB128)."""
    import struct
    tok_sp = Tokenizer.from_str(tok.to_str())
    tok_plain = Tokenizer.from_str(tok.to_str())
    tok_plain.encode_special_tokens = True
    buf = bytearray(b"BTTKIDS1" + struct.pack("<I", len(corpus)))
    ntok = 0

    def varint(v):
        while True:
            b7 = v & 0x7F
            v >>= 7
            if v:
                buf.append(b7 | 0x80)
            else:
                buf.append(b7)
                return

    texts = [raw.decode("utf-8", errors="replace") for raw in corpus]
    enc_sp = tok_sp.encode_batch([t for t, f in zip(texts, flags) if f], add_special_tokens=False)
    enc_pl = tok_plain.encode_batch([t for t, f in zip(texts, flags) if not f], add_special_tokens=False)
    isp = ipl = 0
    for t, f in zip(texts, flags):
        if f:
            ids = enc_sp[isp].ids
            isp += 1
        else:
            ids = enc_pl[ipl].ids
            ipl += 1
        dec = tok_sp.decode(ids, skip_special_tokens=False).encode("utf-8")
        buf += struct.pack("<Q", fnv1a64(dec))
        varint(len(ids))
        for i in ids:
            varint(i)
        ntok += len(ids)
    path = os.path.join(outdir, f"{name}_ids.bin.zst")
    subprocess.run(["zstd", "-19", "-q", "-f", "-o", path], input=bytes(buf), check=True)
    js = tok.to_str(pretty=False).encode("utf-8")
    if name != "smollm2":
        subprocess.run(["zstd", "-19", "-q", "-f", "-o", os.path.join(outdir, f"{name}-tokenizer.json.zst")],
                       input=js, check=True)
    print(f"{name}: {len(corpus)} documents, {ntok} tokens -> {path} ({os.path.getsize(path)} bytes)",
          file=sys.stderr)


def write_corpus(outdir, corpus, flags):
    """corpus.bin.zst: b"BTTKCORP", u32 count, then per document: u8 flags (bit 0: encode with
    special-token splitting, C parse_special = 1), u32 length, raw bytes (maybe invalid UTF-8)."""
    import struct
    buf = bytearray(b"BTTKCORP" + struct.pack("<I", len(corpus)))
    for raw, f in zip(corpus, flags):
        buf += struct.pack("<BI", f, len(raw)) + raw
    path = os.path.join(outdir, "corpus.bin.zst")
    subprocess.run(["zstd", "-19", "-q", "-f", "-o", path], input=bytes(buf), check=True)
    print(f"corpus: {len(corpus)} documents, {len(buf)} bytes -> {path} ({os.path.getsize(path)} bytes)",
          file=sys.stderr)


def families(args, tok_smollm2):
    rng = random.Random(20240611)
    corpus = build_corpus(args.shared, rng)
    flags = []
    docs = []
    for raw in corpus:
        has_sp = b"<|" in raw or b"<tool" in raw or b"<lstrip" in raw or b"<rstrip" in raw
        if has_sp:
            docs += [raw, raw]
            flags += [1, 0]
        else:
            docs.append(raw)
            flags.append(0 if rng.random() < 0.1 else 1)
    write_corpus(args.out, docs, flags)
    train = [d.decode("utf-8", errors="replace") for i, d in enumerate(corpus) if i % 2 == 0]
    write_family_fixtures(args.out, "smollm2", tok_smollm2, docs, flags)
    for name in ("llama3", "qwen2"):
        tok = train_family(name, train)
        write_family_fixtures(args.out, name, tok, docs, flags)
        if name == "qwen2":
            # flag-semantics variant: only the documents holding special strings and a sample
            sel = [i for i, d in enumerate(docs) if i % 7 == 0 or b"<" in d or b"caf" in d or b"word" in d]
            sub = [docs[i] for i in sel][:3000]
            subf = [flags[i] for i in sel][:3000]
            write_corpus_named(args.out, "qwen2x_corpus.bin.zst", sub, subf)
            variants(args, tok)
            write_family_fixtures(args.out, "qwen2x", add_exotic_tokens(tok), sub, subf)



VARIANT_TEXTS = [
    "-a--b-c---", "a-b", "---", "x", "abc 123 4567 d", "a1b22c333 \u0663\u00b2\u00bd x",
    "Hello world  foo\tbar\nbaz", " leading space", "word word", "\u00e9t\u00e9 cafe\u0301 \u212b \ufb01 \u2460 \u1100\u1161",
    "xax bx\nab\nb a\u0301b x\u0301x", "aaa b aab", "ff 0x1F 12ab \x0b z", "'S 'ſ \u212a K k ſſ", "a\nb\rc\u2028d\u0085e",
    "\u00e9\u00e9\u00e9 e\u0301", "it's IT'S we'RE", "  \n  \n\n x  ", "\U0001F600\u200d\U0001F600 \u200c", "_a_ b_c",
    "<|im_start|>user\nhi<|im_end|>", "", "1234567", "\uff21\uff22 \u00b9\u00b2", "a\u00a0b\u3000c\u180ed",
]


def variants(args, base_tok):
    """variants.jsonl: pipelines over the trained Qwen2-style vocabulary with every Split behaviour,
    inversion, String patterns, Digits contiguous, ByteLevel add_prefix_space/use_regex, regex
    constructs whose Oniguruma meaning differs from PCRE2, and the other normalizers. One line:
    {"name", "normalizer", "pre_tokenizer", "ignore_merges", "cases": [{"text", "ids"}]}."""
    from tokenizers import Regex, normalizers
    P, BL = pre_tokenizers, pre_tokenizers.ByteLevel
    bl = BL(add_prefix_space=False, use_regex=False)
    specs = []
    for beh in ("removed", "isolated", "merged_with_previous", "merged_with_next", "contiguous"):
        for inv in (False, True):
            specs.append((f"split-string-{beh}-{int(inv)}", None, P.Sequence([P.Split("-", beh, invert=inv), bl]), False))
        specs.append((f"split-regex-{beh}", None, P.Sequence([P.Split(Regex(r"\s+|\d"), beh), bl]), False))
    specs += [
        ("digits-contiguous", None, P.Sequence([P.Digits(individual_digits=False), BL(add_prefix_space=False, use_regex=True)]), False),
        ("bytelevel-prefix", None, BL(add_prefix_space=True, use_regex=True), False),
        ("bytelevel-prefix-noregex", None, P.Sequence([P.Split(Regex(r"\s+"), "removed"), BL(add_prefix_space=True, use_regex=False)]), False),
        ("word", None, P.Sequence([P.Split(Regex(r"\w+|\W"), "isolated"), bl]), False),
        ("anchors", None, P.Sequence([P.Split(Regex(r"\bx|^a|b$|\Bb"), "isolated"), bl]), False),
        ("empty-matches", None, P.Sequence([P.Split(Regex(r"a*"), "isolated"), bl]), False),
        ("empty-pattern", None, P.Sequence([P.Split(Regex(r""), "merged_with_next"), bl]), False),
        ("hex-v", None, P.Sequence([P.Split(Regex(r"\h+|\d+|\v|\H"), "isolated"), bl]), False),
        ("interval", None, P.Sequence([P.Split(Regex(r"[^\s]{,2}"), "merged_with_next"), bl]), False),
        ("caseless", None, P.Sequence([P.Split(Regex(r"(?i)\u017f+|k|'s"), "isolated"), bl]), False),
        ("dot", None, P.Sequence([P.Split(Regex(r"."), "removed", invert=True), bl]), False),
        ("uescape", None, P.Sequence([P.Split(Regex(r"\u00e9+|\x41"), "isolated"), bl]), False),
        ("llama3-ignore-merges-off", None, P.Sequence([P.Split(Regex(LLAMA3_PATTERN), "isolated"), bl]), False),
        ("qwen2-ignore-merges", normalizers.NFC(), P.Sequence([P.Split(Regex(QWEN2_PATTERN), "isolated"), bl]), True),
        ("nfd", normalizers.NFD(), P.Sequence([P.Split(Regex(LLAMA3_PATTERN), "isolated"), bl]), False),
        ("nfkc", normalizers.NFKC(), P.Sequence([P.Split(Regex(LLAMA3_PATTERN), "isolated"), bl]), False),
        ("nfkd", normalizers.NFKD(), P.Sequence([P.Split(Regex(LLAMA3_PATTERN), "isolated"), bl]), False),
        ("seq-nfd-nfc", normalizers.Sequence([normalizers.NFD(), normalizers.NFC()]),
         P.Sequence([P.Split(Regex(LLAMA3_PATTERN), "isolated"), bl]), False),
    ]
    path = os.path.join(args.out, "variants.jsonl")
    with open(path, "w", encoding="utf-8") as out:
        for name, norm, pre, ign in specs:
            d = json.loads(base_tok.to_str())
            tmp = Tokenizer.from_str(base_tok.to_str())
            tmp.normalizer = norm
            tmp.pre_tokenizer = pre
            d2 = json.loads(tmp.to_str())
            d2["model"]["ignore_merges"] = ign
            tok = Tokenizer.from_str(json.dumps(d2))
            cases = [{"text": t, "ids": tok.encode(t, add_special_tokens=False).ids} for t in VARIANT_TEXTS]
            out.write(json.dumps({"name": name, "normalizer": d2["normalizer"], "pre_tokenizer": d2["pre_tokenizer"],
                                  "ignore_merges": ign, "cases": cases}, ensure_ascii=True) + "\n")
    print(f"wrote {len(specs)} pipeline variants to {path}", file=sys.stderr)

def write_corpus_named(outdir, fname, corpus, flags):
    import struct
    buf = bytearray(b"BTTKCORP" + struct.pack("<I", len(corpus)))
    for raw, f in zip(corpus, flags):
        buf += struct.pack("<BI", f, len(raw)) + raw
    subprocess.run(["zstd", "-19", "-q", "-f", "-o", os.path.join(outdir, fname)], input=bytes(buf), check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.environ.get("BT_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--shared", default=os.environ.get("BT_SHARED", "../shared"))
    ap.add_argument("--out", default="tests/fixtures/tokenizer")
    args = ap.parse_args()

    tok_sp, tok_plain, tokens, types = build_tokenizers(args.model)
    os.makedirs(args.out, exist_ok=True)
    # The tokenizer.json is 3.5 MB; it is stored zstd-compressed (about 0.5 MB) to keep the
    # fixtures small. Decompress with `zstd -d` (or libzstd) before loading.
    js = tok_sp.to_str(pretty=False).encode("utf-8")
    zpath = os.path.join(args.out, "smollm2-tokenizer.json.zst")
    subprocess.run(["zstd", "-19", "-q", "-f", "-o", zpath], input=js, check=True)

    # Sanity: the byte alphabet is fully in the vocabulary, known ids.
    assert tok_sp.token_to_id("<|im_start|>") == 1 and tok_sp.token_to_id("<|im_end|>") == 2

    n = 0
    path = os.path.join(args.out, "smollm2_cases.jsonl")
    with open(path, "w", encoding="utf-8") as out:
        for raw, sp in corpus(args.shared):
            text = raw.decode("utf-8", errors="replace")
            tok = tok_sp if sp else tok_plain
            ids = tok.encode(text, add_special_tokens=False).ids
            rec = {}
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                rec["hex"] = raw.hex()
            rec["text"] = text
            rec["ids"] = ids
            rec["special"] = sp
            out.write(json.dumps(rec, ensure_ascii=True) + "\n")
            n += 1
    print(f"wrote {n} cases to {path} ({os.path.getsize(path)} bytes)", file=sys.stderr)
    families(args, tok_sp)


if __name__ == "__main__":
    main()
