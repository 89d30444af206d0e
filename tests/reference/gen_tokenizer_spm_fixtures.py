#!/usr/bin/env python3
"""Reference fixtures for the SentencePiece-family tokenizers (common/tokenizer_spm.c, the
MODEL_CHARS path of common/tokenizer.c), read by tests/unit/common/test_tokenizer_spm.c.

Real tokenizer files only (scripts/fetch-tokenizers, scripts/fetch-model gemma3-270m):
  GGUF vocabularies, reference llama.cpp b4965 (the pinned llama-cpp-cffi library loaded with
  ctypes, tests/py/llamacpp_ref.py; llama_tokenize with add_special = false on the raw bytes):
    llama-spm   ggml-vocab-llama-spm.gguf: Llama 2 (also TinyLlama's vocabulary), add_space_prefix
    phi-3       ggml-vocab-phi-3.gguf: Phi-3 (Llama 2's plus chat tokens, RSTRIP specials)
    gemma3      the real Gemma 3 270M GGUF: 262,144 pieces, no space prefix, 6,249 control and
                165 user-defined tokens (newline / space runs, HTML tags)
  tokenizer.json files, reference Hugging Face tokenizers 0.20.3 (encode(text,
  add_special_tokens=False), text = the raw bytes decoded with errors="replace"), converted from
  the models' own tokenizer.model by transformers 4.46.3 (LlamaTokenizerFast from_slow, the
  converter that made the files on the Hub; add_prefix_space=True):
    mistral-v0.1  legacy=True: normalizer Prepend("\u2581") + Replace(" ", "\u2581"), no
                  pre-tokenizer (Llama 2 / TinyLlama / Mistral v0.1 layout), byte_fallback
    mistral-v0.3  legacy=False: Metaspace(prepend_scheme "first", split false), 771 control tokens
  Cross-checks recorded in spm_references.json: the `sentencepiece` library on the Mistral
  models' own tokenizer.model against those tokenizer.json files (HF) and against llama.cpp on a
  GGUF converted from the same tokenizer.model as convert_hf_to_gguf.py does.

Writes into tests/fixtures/tokenizer/:
  stress.bin.zst                BTTKCORP: the stress strings (spaces, newlines, tabs, emoji, astral
                                chars, invalid bytes, very long words, every family's special
                                strings), each with and without special-token parsing
  <fam>_ids.bin.zst             BTTKIDS1 over corpus.bin.zst (gen_tokenizer_fixtures.py)
  <fam>_stress_ids.bin.zst      BTTKIDS1 over stress.bin.zst
  mistral-v0.1-tokenizer.json.zst, mistral-v0.3-tokenizer.json.zst (with tokenizer_config.json
                                inside the test: not needed, bos/eos come from the post-processor)
  spm_references.json           versions, sha256 of every input, counts, the cross-checks
BTTKIDS1: b"BTTKIDS1", u32 count, per document: u64 FNV-1a-64 of the reference decode (llama.cpp
llama_detokenize(special = true) / HF decode(skip_special_tokens = False)) read with
errors="replace", varint n, n varint ids.

Usage (repo root; .venv-ref from requirements-tokenizer.txt; make llamacpp-ref; the fetches):
  .venv-ref/bin/python tests/reference/gen_tokenizer_spm_fixtures.py
"""
import hashlib
import json
import os
import random
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "py"))
import llamacpp_ref  # noqa: E402

FIX = os.path.join(ROOT, "tests", "fixtures", "tokenizer")
TOKDIR = os.environ.get("BT_TOKENIZERS_DIR", os.path.join(ROOT, "models", "tokenizers"))
GEMMA = os.environ.get("BT_GEMMA", os.path.join(ROOT, "models", "gemma-3-270m-q4_k_m.gguf"))


def fnv1a64(b):
    h = 0xcbf29ce484222325
    for x in b:
        h = ((h ^ x) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


def sha256(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def zstd_write(path, data):
    subprocess.run(["zstd", "-19", "-q", "-f", "-o", path], input=data, check=True)


def read_corpus(path):
    b = subprocess.run(["zstd", "-dc", path], capture_output=True, check=True).stdout
    assert b[:8] == b"BTTKCORP"
    (n,), off, docs = struct.unpack_from("<I", b, 8), 12, []
    for _ in range(n):
        (ln,) = struct.unpack_from("<I", b, off + 1)
        docs.append((bool(b[off] & 1), b[off + 5:off + 5 + ln]))
        off += 5 + ln
    return docs


def write_corpus(path, docs):
    buf = bytearray(b"BTTKCORP" + struct.pack("<I", len(docs)))
    for sp, raw in docs:
        buf += struct.pack("<BI", int(sp), len(raw)) + raw
    zstd_write(path, bytes(buf))


def write_ids(path, ids_list, decodes):
    buf = bytearray(b"BTTKIDS1" + struct.pack("<I", len(ids_list)))

    def varint(v):
        while True:
            b7 = v & 0x7F
            v >>= 7
            buf.append(b7 | 0x80 if v else b7)
            if not v:
                return
    for ids, dec in zip(ids_list, decodes):
        buf += struct.pack("<Q", fnv1a64(dec))
        varint(len(ids))
        for i in ids:
            varint(i)
    zstd_write(path, bytes(buf))
    return os.path.getsize(path)


SPECIAL_STRINGS = ["<s>", "</s>", "<unk>", "<pad>", "<bos>", "<eos>", "<mask>", "[INST]", "[/INST]",
                   "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "<start_of_turn>", "<end_of_turn>", "<unused0>",
                   "<unused6241>", "[multimodal]", "<table>", "</td>", "<h1>", "<|user|>", "<|assistant|>",
                   "<|system|>", "<|end|>", "<|endoftext|>", "<|placeholder1|>", "<0x41>", "<0x0A>",
                   "\u2581", "\u2581\u2581", "<start_of_image>", "<|im_start|>", "<eos"]


def stress_strings():
    rng = random.Random(24)
    s = ["", " ", "  ", "   ", "a", " a", "  a", "a ", "a  ", " a ", "Hello world", " Hello world",
         "Hello  world", "Hello   world  ", "\n", "\n\n", "\n\n\n", " \n", "\n ", "a\nb", "a\n\nb",
         "a\n \nb", "\r\n", "line1\r\nline2", "\t", "\t\t", "\ttab\tbed\t", " \t \t ", "x\u00a0y",
         "x\u3000y", "\u2028\u2029", "\U0001F600", "\U0001F600\U0001F601 \U0001F602",
         "\U0001F468\u200d\U0001F469\u200d\U0001F467", "\U0001F1EF\U0001F1F5", "\u2764\ufe0f",
         "\U0001D400\U0001D401", "\U00020000\U0002A6D6", "\U0010FFFD", "\ue000\uf8ff", "\ufffd",
         "\u0000", "a\u0000b", "\u0001\u001f\u007f", "e\u0301", "caf\u00e9 na\u00efve",
         "\u4f60\u597d\uff0c\u4e16\u754c", "\u0645\u0631\u062d\u0628\u0627", "\u0928\u092e\u0938\u094d\u0924\u0947",
         "a" * 3000, "ab" * 1500, "x" * 10000, "9" * 500, " " * 300, "\n" * 100, "\t" * 64,
         "supercalifragilisticexpialidocious" * 20, "https://example.com/" + "a/b?c=d&" * 200,
         "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(4000)),
         "def f(x):\n    return x  # comment\n\n\n", "  leading and trailing  ", "\u2581already\u2581escaped",
         "<s><s></s></s>", "text<s>more</s>", "  <s>  x  </s>  ", "<|user|>\nHi<|end|>\n<|assistant|>\nHello<|end|>\n",
         "<|user|>  spaced  <|end|>  x", "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n",
         "[INST] What? [/INST] This.</s>[INST] Next [/INST]", "<unused0><unused1>x", "<table><tr><td>1</td></tr></table>",
         "a\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\nb", "x" + " " * 40 + "y",
         "<0x41><0x0A>", "<<s>>", "<s", "s>", "</s", "[INST", "<start_of_turn", "<end_of_turn>>"]
    s += SPECIAL_STRINGS
    for _ in range(60):
        s.append("".join(rng.choice(SPECIAL_STRINGS + [" ", "  ", "\n", "\t", "a", "Hello", "\U0001F600",
                                                       "\u00e9", "\u4f60", "12", "\u2581", "\n\n", "   "])
                         for _ in range(rng.randint(1, 30))))
    raw = [x.encode("utf-8") for x in s]
    raw += [b"\xff", b"\x80", b"abc\xffdef", b"\xc3", b"\xc3(", b"\xe2\x82", b"\xf0\x9f\x98", b"\xed\xa0\x80",
            b"\xc0\x80", b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80", b"\xfe\xfe\xff\xff", b"a\x80\x80\x80b",
            b"caf\xe9", b"  \xff  ", b"\xef\xbb\xbfBOM", b"<s>\xff</s>", b"\xf0abc", b"\xe0a", b"\xc2 x",
            b"\xf0\x90\x80a", bytes(range(256)), bytes(range(255, -1, -1)) * 4]
    return [(sp, r) for r in raw for sp in (True, False)]


def gguf_family(lc, path, docs):
    m = lc.load_model(path, vocab_only=True)
    # The committed fixtures come from llama.cpp b4965, which reads token types as the file gives
    # them (as Hugging Face and we do). Later llama.cpp (b8929, the pin of scripts/llamacpp-ref.sh
    # now) retypes end-of-generation-looking user-defined tokens ("</s>" in Phi-3's and Gemma 3's
    # vocabularies) to control, which would change the fixtures' ids for them without
    # parse_special: refuse rather than write that (tests/py/test_llamacpp.py checks b8929 against
    # us with the retyping accounted for).
    retyped = [p for p in m.load_problems if "control-looking token" in p]
    if retyped:
        sys.exit(f"{path}: this llama.cpp (b{lc.build_number}) retypes tokens the file types "
                 f"otherwise ({retyped[0]}); the fixtures follow the file's types (b4965)")
    ids = [m.tokenize(d, parse_special=sp) for sp, d in docs]
    dec = [m.detokenize(i, special=True).decode("utf-8", "replace").encode() for i in ids]
    return ids, dec, m


def hf_family(tj, docs):
    from tokenizers import Tokenizer
    t_sp, t_pl = Tokenizer.from_file(tj), Tokenizer.from_file(tj)
    t_pl.encode_special_tokens = True
    ids = [(t_sp if sp else t_pl).encode(d.decode("utf-8", "replace"), add_special_tokens=False).ids
           for sp, d in docs]
    dec = [t_sp.decode(i, skip_special_tokens=False).encode() for i in ids]
    return ids, dec


def convert(model_path, legacy, out_dir):
    """tokenizer.json of a sentencepiece model as transformers 4.46.3 converts it (the Hub files)."""
    from transformers import LlamaTokenizerFast
    tok = LlamaTokenizerFast(vocab_file=model_path, legacy=legacy, add_prefix_space=True, from_slow=True,
                             add_bos_token=True, add_eos_token=False)
    tok.save_pretrained(out_dir)
    return os.path.join(out_dir, "tokenizer.json")


def gguf_from_spm(model_path, out):
    """A vocabulary-only GGUF from a tokenizer.model, as llama.cpp's convert_hf_to_gguf.py
    _create_vocab_sentencepiece writes it (tokens, scores, token types; add_space_prefix from
    the model's normalizer_spec.add_dummy_prefix; bos/eos/unk ids)."""
    import gguf
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb
    sp = spm.SentencePieceProcessor(model_file=model_path)
    proto = pb.ModelProto()
    proto.ParseFromString(open(model_path, "rb").read())
    toks, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        toks.append(sp.id_to_piece(i).encode("utf-8"))
        scores.append(sp.get_score(i))
        ty = gguf.TokenType.NORMAL
        if sp.is_unknown(i):
            ty = gguf.TokenType.UNKNOWN
        elif sp.is_control(i):
            ty = gguf.TokenType.CONTROL
        elif sp.is_unused(i):
            ty = gguf.TokenType.UNUSED
        elif sp.is_byte(i):
            ty = gguf.TokenType.BYTE
        types.append(ty)
    w = gguf.GGUFWriter(out, "llama")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_add_space_prefix(proto.normalizer_spec.add_dummy_prefix)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sp


def main():
    import tokenizers
    import transformers
    import sentencepiece
    lc = llamacpp_ref.LlamaCpp.from_env()
    corpus = read_corpus(os.path.join(FIX, "corpus.bin.zst"))
    stress = stress_strings()
    write_corpus(os.path.join(FIX, "stress.bin.zst"), stress)
    ref = {"versions": {"llama.cpp": f"b{lc.build_number} ({lc.commit})", "tokenizers": tokenizers.__version__,
                        "transformers": transformers.__version__, "sentencepiece": sentencepiece.__version__},
           "corpus_documents": len(corpus), "stress_documents": len(stress), "families": {}, "cross_checks": {}}
    sets = {"": corpus, "_stress": stress}
    ggufs = {"llama-spm": os.path.join(TOKDIR, "ggml-vocab-llama-spm.gguf"),
             "phi-3": os.path.join(TOKDIR, "ggml-vocab-phi-3.gguf"), "gemma3": GEMMA}
    for fam, path in ggufs.items():
        info = {"source": os.path.basename(path), "sha256": sha256(path), "reference": "llama.cpp"}
        for suffix, docs in sets.items():
            ids, dec, m = gguf_family(lc, path, docs)
            size = write_ids(os.path.join(FIX, f"{fam}{suffix}_ids.bin.zst"), ids, dec)
            info[f"documents{suffix}"] = len(docs)
            info[f"tokens{suffix}"] = sum(map(len, ids))
            info[f"bytes{suffix}"] = size
            m.close()
        ref["families"][fam] = info
        print(fam, info, file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        for fam, (model, legacy) in {"mistral-v0.1": ("mistral-v0.1.model", True),
                                     "mistral-v0.3": ("mistral-v0.3.model", False)}.items():
            mp = os.path.join(TOKDIR, model)
            tj = convert(mp, legacy, os.path.join(tmp, fam))
            js = json.dumps(json.load(open(tj, encoding="utf-8")), ensure_ascii=False, separators=(",", ":"))
            zstd_write(os.path.join(FIX, f"{fam}-tokenizer.json.zst"), js.encode())
            info = {"source": model, "sha256": sha256(mp), "reference": "tokenizers", "legacy": legacy,
                    "tokenizer_json_sha256": hashlib.sha256(js.encode()).hexdigest()}
            for suffix, docs in sets.items():
                ids, dec = hf_family(tj, docs)
                size = write_ids(os.path.join(FIX, f"{fam}{suffix}_ids.bin.zst"), ids, dec)
                info[f"documents{suffix}"] = len(docs)
                info[f"tokens{suffix}"] = sum(map(len, ids))
                info[f"bytes{suffix}"] = size
            ref["families"][fam] = info
            print(fam, info, file=sys.stderr)
            # cross-checks with the sentencepiece library on the model's own tokenizer.model
            gg = os.path.join(tmp, fam + ".gguf")
            sp = gguf_from_spm(mp, gg)
            m = lc.load_model(gg, vocab_only=True)
            plain = [(s, d) for s, d in corpus + stress if not s]  # sentencepiece parses no special strings
            valid = [(s, d.decode("utf-8", "replace")) for s, d in plain]
            sp_ids = [sp.encode(t) for _, t in valid]
            hf_ids, _ = hf_family(tj, plain)
            lc_ids = [m.tokenize(t.encode(), parse_special=False) for _, t in valid]
            agree_hf = sum(a == b for a, b in zip(sp_ids, hf_ids))
            agree_lc = sum(a == b for a, b in zip(sp_ids, lc_ids))
            ref["cross_checks"][fam] = {
                "documents": len(valid), "note": "parse_special false; invalid UTF-8 decoded with errors=replace",
                "sentencepiece_eq_tokenizers": agree_hf, "sentencepiece_eq_llama.cpp": agree_lc,
                "examples_sentencepiece_ne_tokenizers": [t[:60] for (_, t), a, b in zip(valid, sp_ids, hf_ids)
                                                         if a != b][:5],
                "examples_sentencepiece_ne_llama.cpp": [t[:60] for (_, t), a, b in zip(valid, sp_ids, lc_ids)
                                                        if a != b][:5]}
            print(fam, ref["cross_checks"][fam], file=sys.stderr)
            m.close()
    with open(os.path.join(FIX, "spm_references.json"), "w", encoding="utf-8") as f:
        json.dump(ref, f, indent=1, ensure_ascii=True)
        f.write("\n")


if __name__ == "__main__":
    main()
