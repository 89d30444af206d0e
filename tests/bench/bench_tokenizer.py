#!/usr/bin/env python3
"""Tokenizer throughput comparison, single thread, on the parity corpus (one run):
ours (bench_tok JSON lines + id dumps, produced by bench_tokenizer.sh), Hugging Face `tokenizers`
(encode_batch under RAYON_NUM_THREADS=1, special strings as text via encode_special_tokens) and
`tiktoken` (an Encoding built from the SmolLM2 vocabulary, encode_ordinary per document).

tiktoken cannot express SmolLM2's Digits(individual_digits) + GPT-2 pre-tokenizer as one regex;
its pattern here is the GPT-2 pattern with ` ?\\p{N}+` replaced by `\\p{N}` (single digits, no
leading space), so whitespace before digits may split differently; its mergeable ranks are
byte ranks 0-255 followed by the merge order, ids mapped back to SmolLM2 ids. Mismatching
documents are counted and reported, not fatal.

Usage: bench_tokenizer.py CORPUS RESULTS_DIR   (RESULTS_DIR holds <family>.json and <family>.ids
written by bench_tok, and <family>.tok = the tokenizer path). Prints a markdown table."""
import json
import os
import struct
import sys
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

GPT2_DIGITS_SINGLE = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def read_corpus(path):
    raw = open(path, "rb").read()
    if raw[:4] == b"\x28\xb5\x2f\xfd":
        import subprocess
        raw = subprocess.run(["zstd", "-dc", path], check=True, capture_output=True).stdout
    assert raw[:8] == b"BTTKCORP"
    n = struct.unpack_from("<I", raw, 8)[0]
    off, docs = 12, []
    for _ in range(n):
        _flags, ln = struct.unpack_from("<BI", raw, off)
        off += 5
        docs.append(raw[off:off + ln].decode("utf-8", errors="replace"))
        off += ln
    return docs


def read_ids(path):
    raw = open(path, "rb").read()
    off, out = 0, []
    while off < len(raw):
        n = struct.unpack_from("<I", raw, off)[0]
        off += 4
        out.append(list(struct.unpack_from(f"<{n}i", raw, off)))
        off += 4 * n
    return out


def timed(fn, min_s=2.0):
    """Runs fn() until min_s seconds have passed; returns (result of the first call, seconds/pass)."""
    t0 = time.perf_counter()
    res = fn()
    passes = 1
    while time.perf_counter() - t0 < min_s:
        fn()
        passes += 1
    return res, (time.perf_counter() - t0) / passes


def hf_tokenizer(path):
    from tokenizers import Tokenizer
    if path.endswith(".gguf"):
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
        import gen_tokenizer_fixtures as g
        tok, _plain, _t, _ty = g.build_tokenizers(path)
        return tok
    if path.endswith(".zst"):
        import subprocess
        return Tokenizer.from_str(subprocess.run(["zstd", "-dc", path], check=True, capture_output=True).stdout.decode())
    return Tokenizer.from_file(path)


def tiktoken_from(hf):
    import tiktoken
    d = json.loads(hf.to_str())
    vocab, merges = d["model"]["vocab"], d["model"]["merges"]
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, k = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + k)
            k += 1
    u2b = {chr(c): b for b, c in zip(bs, cs)}
    to_bytes = lambda s: bytes(u2b[ch] for ch in s)
    ranks, rank_to_id = {}, {}
    for b in range(256):
        ranks[bytes([b])] = b
        rank_to_id[b] = vocab.get(chr(cs[bs.index(b)]), -1)  # -1: byte without a token (HF drops it)
    for m in merges:
        a, b = m if isinstance(m, list) else m.split(" ")
        tb = to_bytes(a + b)
        if tb not in ranks:
            rank_to_id[len(ranks)] = vocab[a + b]
            ranks[tb] = len(ranks)
    enc = tiktoken.Encoding(name="smollm2-bench", pat_str=GPT2_DIGITS_SINGLE, mergeable_ranks=ranks,
                            special_tokens={})
    return enc, rank_to_id


def main():
    corpus, rdir = sys.argv[1], sys.argv[2]
    docs = read_corpus(corpus)
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    rows = []
    fams = [f[:-5] for f in sorted(os.listdir(rdir)) if f.endswith(".json")]
    for fam in fams:
        ours = json.load(open(os.path.join(rdir, fam + ".json")))
        our_ids = read_ids(os.path.join(rdir, fam + ".ids"))
        tok_path = open(os.path.join(rdir, fam + ".tok")).read().strip()
        rows.append((fam, "ours (C, bench_tok)", ours["mb_s"], ours["tok_s"], "reference"))
        hf = None
        try:
            hf = hf_tokenizer(tok_path)
            hf.encode_special_tokens = True
            encs, sec = timed(lambda: hf.encode_batch(docs, add_special_tokens=False))
            hf_ids = [e.ids for e in encs]
            bad = sum(1 for a, b in zip(hf_ids, our_ids) if a != b) + abs(len(hf_ids) - len(our_ids))
            ntok = sum(len(x) for x in hf_ids)
            rows.append((fam, "HF tokenizers 0.20.3", nbytes / sec / 1e6, ntok / sec, f"{bad} mismatching docs"))
        except Exception as e:  # noqa: BLE001 - reported as a row
            rows.append((fam, "HF tokenizers", None, None, f"skipped: {type(e).__name__}: {e}"))
        if fam == "smollm2" and hf is not None:
            try:
                enc, r2i = tiktoken_from(hf)
                out, sec = timed(lambda: [enc.encode_ordinary(d) for d in docs])
                tk_ids = [[r2i[r] for r in x if r2i[r] >= 0] for x in out]
                bad = sum(1 for a, b in zip(tk_ids, our_ids) if a != b)
                ntok = sum(len(x) for x in tk_ids)
                rows.append((fam, "tiktoken 0.8.0 (\\p{N} single-digit pattern)", nbytes / sec / 1e6, ntok / sec,
                             f"{bad} mismatching docs"))
            except Exception as e:  # noqa: BLE001
                rows.append((fam, "tiktoken", None, None, f"skipped: {type(e).__name__}: {e}"))
    print(f"Corpus: `{os.path.relpath(corpus)}`, {len(docs)} documents, {nbytes / 1e6:.2f} MB; one thread; "
          "special-token strings encoded as text.\n")
    print("| family | tokenizer | MB/s | tokens/s | ours / this | ids vs ours |")
    print("|---|---|---:|---:|---:|---|")
    ours_by = {r[0]: r[2] for r in rows if r[1].startswith("ours")}
    for fam, name, mbs, toks, note in rows:
        if mbs is None:
            print(f"| {fam} | {name} | - | - | - | {note} |")
            continue
        ratio = "1.00" if name.startswith("ours") else f"{ours_by[fam] / mbs:.2f}"
        print(f"| {fam} | {name} | {mbs:.2f} | {toks:,.0f} | {ratio} | {note} |")


if __name__ == "__main__":
    main()
