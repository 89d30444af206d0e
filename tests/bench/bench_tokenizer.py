#!/usr/bin/env python3
"""Tokenizer throughput per thread, side by side in one run (run by tests/bench/bench_tokenizer.sh,
which `make bench` calls): for each family (SmolLM2, Llama-3-style, Qwen2-style) on the parity
corpus, interleaved rounds of

  ours, dedicated pre-tokenizer      build/tools/bench_tok --wx --engine dedicated
  ours, PCRE2 interpreter            build/tools/bench_tok --wx --engine pcre2
  ours, PCRE2 with JIT (no W^X)      build/tools/bench_tok --engine pcre2          (context only)
  tiktoken (pinned, see tests/reference/requirements-tokenizer.txt)   in this process
  HF tokenizers (pinned)                                              in this process

Everything except the JIT row runs under W^X: bench_tok sets prctl(PR_SET_MDWE,
PR_MDWE_REFUSE_EXEC_GAIN) itself (--wx), and tiktoken/tokenizers are timed in a forked child
that sets it first (what systemd's MemoryDenyWriteExecute=yes does to loaderd). "Per thread"
= bytes / CPU time of the tokenizing thread (CLOCK_THREAD_CPUTIME_ID, Python time.thread_time),
so other load on a shared machine does not count; each figure is the median of ROUNDS rounds of
at least SECONDS wall seconds. Our piece cache is emptied after every pass over the corpus
(bench_tok), so repeating the corpus does not memorise it.

tiktoken cannot download its encodings here and has none of these vocabularies anyway: an
Encoding is built from the same tokenizer: mergeable ranks = the 256 bytes, then every merge's
result in merge order; pattern = the family's split pattern written as one regex (SmolLM2's
Digits(individual_digits) + GPT-2 ByteLevel becomes GPT-2 with `\\p{N}` single and the
whitespace lookahead `(?![^\\s\\p{N}])`, since a digit ends a Digits piece); non-special added
tokens (matched by HF even without special parsing) are tiktoken special tokens allowed in
encode; Qwen2's NFC normaliser is applied to tiktoken's input before timing. Ids are mapped back
and compared with ours per document; the count of mismatching documents is printed (tiktoken's
BPE merges by the rank of the merged bytes, HF's by the rank of the pair: they can differ on
rare pieces).

Usage: bench_tokenizer.py BUILD CORPUS FAMILY=TOKENIZER...   Prints a markdown section."""
import ctypes
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROUNDS = int(os.environ.get("BENCH_TOK_ROUNDS", "3"))
SECONDS = float(os.environ.get("BENCH_TOK_SECONDS", "1.0"))

GPT2_DIGITS = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
LLAMA3 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
          r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
PATTERNS = {"smollm2": GPT2_DIGITS, "llama3": LLAMA3, "qwen2": QWEN2}


def set_wx():
    """prctl(PR_SET_MDWE = 65, PR_MDWE_REFUSE_EXEC_GAIN = 1): no W+X pages from now on."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(65, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_MDWE) failed (needs Linux >= 6.3)")


def under_wx(fn):
    """fn() in a forked child that first sets W^X; returns its (JSON-able) result. The parent
    stays without W^X so that the JIT row's bench_tok child can still JIT."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            set_wx()
            out = json.dumps({"ok": fn()}).encode()
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()
        os.write(w, out)
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    res = json.loads(data)
    if "error" in res:
        raise RuntimeError(res["error"])
    return res["ok"]


def read_corpus(path, raw_bytes=False):
    raw = open(path, "rb").read()
    if raw[:4] == b"\x28\xb5\x2f\xfd":
        raw = subprocess.run(["zstd", "-dc", path], check=True, capture_output=True).stdout
    assert raw[:8] == b"BTTKCORP"
    n = struct.unpack_from("<I", raw, 8)[0]
    off, docs = 12, []
    for _ in range(n):
        _flags, ln = struct.unpack_from("<BI", raw, off)
        off += 5
        docs.append(raw[off:off + ln] if raw_bytes else raw[off:off + ln].decode("utf-8", errors="replace"))
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


def per_thread(fn, nbytes):
    """Runs fn() (one pass over the corpus) until SECONDS wall seconds passed; returns
    (first result, MB per CPU-second of this thread, passes)."""
    w0, c0 = time.perf_counter(), time.thread_time()
    res, passes = fn(), 1
    while time.perf_counter() - w0 < SECONDS:
        fn()
        passes += 1
    return res, nbytes * passes / (time.thread_time() - c0) / 1e6


def hf_tokenizer(path):
    from tokenizers import Tokenizer
    if path.endswith(".gguf"):
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
        import gen_tokenizer_fixtures as g
        tok, _plain, _t, _ty = g.build_tokenizers(path)
        return tok
    if path.endswith(".zst"):
        return Tokenizer.from_str(subprocess.run(["zstd", "-dc", path], check=True, capture_output=True).stdout.decode())
    return Tokenizer.from_file(path)


def tiktoken_from(hf, fam):
    """(Encoding, rank -> our id, allowed special strings, normaliser) built from HF tokenizer hf."""
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
    b2u = {b: chr(c) for b, c in zip(bs, cs)}
    ranks, rank_to_id = {}, {}
    for b in range(256):
        ranks[bytes([b])] = b
        rank_to_id[b] = vocab.get(b2u[b], -1)  # -1: a byte without a token (HF drops it)
    for m in merges:
        a, b = m if isinstance(m, list) else m.split(" ")
        tb = bytes(u2b[ch] for ch in a + b)
        if tb not in ranks:
            rank_to_id[len(ranks)] = vocab[a + b]
            ranks[tb] = len(ranks)
    special = {}
    for t in d.get("added_tokens", []):
        if not t["special"]:
            special[t["content"]] = len(ranks) + len(special)
            rank_to_id[special[t["content"]]] = t["id"]
    enc = tiktoken.Encoding(name=f"{fam}-bench", pat_str=PATTERNS[fam], mergeable_ranks=ranks,
                            special_tokens=special)
    norm = None
    if (d.get("normalizer") or {}).get("type") == "NFC":
        import unicodedata
        norm = lambda s: unicodedata.normalize("NFC", s)  # noqa: E731
    return enc, rank_to_id, set(special), norm


def bench_tok(build, tok, corpus, engine, wx, dump=None):
    cmd = [os.path.join(build, "tools", "bench_tok"), "--min-seconds", str(SECONDS)]
    if engine:
        cmd += ["--engine", engine]
    if wx:
        cmd.append("--wx")
    if dump:
        cmd += ["--dump", dump]
    out = subprocess.run(cmd + [tok, corpus], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def mismatches(a, b):
    return sum(1 for x, y in zip(a, b) if x != y) + abs(len(a) - len(b))


def llamacpp_rows(tok, corpus, nbytes, our_ids):
    """llama.cpp's own tokenizer on a GGUF vocabulary (llama_tokenize, add_special and
    parse_special false), through tests/py/llamacpp_ref.py; (name, runner, note) or a skip note."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "py"))
    import llamacpp_ref
    lc = llamacpp_ref.LlamaCpp.from_env()
    m = lc.load_model(tok, vocab_only=True)
    bdocs = read_corpus(corpus, raw_bytes=True)  # the raw bytes, as bench_tok reads them

    def run(m=m, bdocs=bdocs):
        return [m.tokenize(d) for d in bdocs]
    ids = run()
    return f"llama.cpp b{lc.build_number} (W^X)", run, f"{mismatches(ids, our_ids)} mismatching docs"


def spm_rows(build, fam, tok, corpus, docs, nbytes, dump):
    """SentencePiece-family tokenizers (no pre-tokenizer engine to choose): ours under W^X,
    against HF tokenizers (tokenizer.json) or llama.cpp (GGUF), interleaved rounds."""
    first = bench_tok(build, tok, corpus, None, True, dump)
    our_ids = read_ids(dump)
    ntok = sum(len(x) for x in our_ids)
    name0 = f"ours, {first['engine']} (W^X)"
    engines = {name0: lambda: bench_tok(build, tok, corpus, None, True)}
    notes = {name0: "reference"}
    try:
        if tok.endswith(".gguf"):
            name, run, note = llamacpp_rows(tok, corpus, nbytes, our_ids)
        else:
            import tokenizers
            hf = hf_tokenizer(tok)
            hf.encode_special_tokens = True
            name = f"HF tokenizers {tokenizers.__version__} (W^X)"

            def run(hf=hf):
                return [e.ids for e in hf.encode_batch(docs, add_special_tokens=False)]
            note = f"{mismatches(run(), our_ids)} mismatching docs"
        notes[name] = note
        engines[name] = lambda f=run: under_wx(lambda: per_thread(f, nbytes)[1])
    except Exception as e:  # noqa: BLE001 - reported as a row
        notes["reference"] = f"skipped: {type(e).__name__}: {e}"
    res = {k: [] for k in engines}
    for _ in range(ROUNDS):
        for k, f in engines.items():
            r = f()
            res[k].append(r["mb_s_cpu"] if isinstance(r, dict) else r)
    med = {k: statistics.median(v) for k, v in res.items()}
    rows = [(fam, k, med[k], med[k] * 1e6 * ntok / nbytes, med[name0] / med[k], notes[k]) for k in engines]
    rows += [(fam, k, None, None, None, v) for k, v in notes.items() if k not in engines]
    return rows


def main():
    build, corpus = sys.argv[1], sys.argv[2]
    fams = [a.split("=", 1) for a in sys.argv[3:]]
    docs = read_corpus(corpus)
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    tmp = tempfile.mkdtemp()
    rows = []
    for fam, tok in fams:
        dump = os.path.join(tmp, fam + ".ids")
        if bench_tok(build, tok, corpus, None, True)["engine"] in ("spm", "none"):
            rows += spm_rows(build, fam, tok, corpus, docs, nbytes, dump)
            continue
        first = bench_tok(build, tok, corpus, "dedicated", True, dump)
        jit = bench_tok(build, tok, corpus, "pcre2", False)["jit"]
        our_ids = read_ids(dump)
        ntok = sum(len(x) for x in our_ids)
        engines = {"ours, dedicated pre-tokenizer (W^X)": lambda: bench_tok(build, tok, corpus, "dedicated", True),
                   "ours, PCRE2 interpreter (W^X)": lambda: bench_tok(build, tok, corpus, "pcre2", True),
                   "ours, PCRE2 JIT (no W^X)": lambda: bench_tok(build, tok, corpus, "pcre2", False)}
        notes = {"ours, dedicated pre-tokenizer (W^X)": f"reference ({first['engine']})",
                 "ours, PCRE2 interpreter (W^X)": "same code, regex pre-tokenizer",
                 "ours, PCRE2 JIT (no W^X)": "same code, regex pre-tokenizer" + ("" if jit else "; JIT UNAVAILABLE")}
        try:
            import tokenizers
            hf = hf_tokenizer(tok)
            hf.encode_special_tokens = True
            name = f"HF tokenizers {tokenizers.__version__} (W^X)"

            def run_hf(hf=hf):
                return [e.ids for e in hf.encode_batch(docs, add_special_tokens=False)]
            ids = run_hf()
            notes[name] = f"{mismatches(ids, our_ids)} mismatching docs"
            engines[name] = lambda f=run_hf: under_wx(lambda: per_thread(f, nbytes)[1])
        except Exception as e:  # noqa: BLE001 - reported as a row
            hf = None
            notes["HF tokenizers"] = f"skipped: {type(e).__name__}: {e}"
        if hf is not None:
            try:
                import tiktoken
                enc, r2i, allowed, norm = tiktoken_from(hf, fam)
                tdocs = [norm(d) for d in docs] if norm else docs
                name = f"tiktoken {tiktoken.__version__} (W^X)"

                def run_tk(enc=enc, tdocs=tdocs, allowed=allowed):
                    return [enc.encode(d, allowed_special=allowed, disallowed_special=()) for d in tdocs]
                ids = [[r2i[r] for r in x if r2i[r] >= 0] for x in run_tk()]
                notes[name] = f"{mismatches(ids, our_ids)} mismatching docs" + (" (input NFC-normalised)" if norm else "")
                engines[name] = lambda f=run_tk: under_wx(lambda: per_thread(f, nbytes)[1])
            except Exception as e:  # noqa: BLE001
                notes["tiktoken"] = f"skipped: {type(e).__name__}: {e}"
        res = {k: [] for k in engines}
        for _ in range(ROUNDS):
            for k, f in engines.items():
                r = f()
                res[k].append(r["mb_s_cpu"] if isinstance(r, dict) else r)
        med = {k: statistics.median(v) for k, v in res.items()}
        ded = med["ours, dedicated pre-tokenizer (W^X)"]
        for k in engines:
            rows.append((fam, k, med[k], med[k] * 1e6 * ntok / nbytes, ded / med[k], notes[k]))
        for k, v in notes.items():
            if k not in engines:
                rows.append((fam, k, None, None, None, v))
    print(f"Corpus: `{os.path.relpath(corpus)}`, {len(docs)} documents, {nbytes / 1e6:.2f} MB; one thread; "
          f"special-token strings as text; median of {ROUNDS} interleaved rounds of >= {SECONDS:g} s; "
          "MB/s = bytes / CPU-seconds of the tokenizing thread.\n")
    print("| family | tokenizer | MB/s per thread | tokens/s per thread | dedicated / this | ids vs ours |")
    print("|---|---|---:|---:|---:|---|")
    for fam, name, mbs, toks, ratio, note in rows:
        if mbs is None:
            print(f"| {fam} | {name} | - | - | - | {note} |")
        else:
            print(f"| {fam} | {name} | {mbs:.2f} | {toks:,.0f} | {ratio:.2f} | {note} |")


if __name__ == "__main__":
    main()
