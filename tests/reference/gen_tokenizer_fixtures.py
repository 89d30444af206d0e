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


if __name__ == "__main__":
    main()
