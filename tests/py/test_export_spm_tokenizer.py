"""The tokenizer of a merged `trainer export --format safetensors` from a SentencePiece GGUF base
(tokenizer.ggml.model "llama": Llama 2 / TinyLlama, Phi-3, Gemma 3), loaded by the pinned
transformers / tokenizers of python/requirements-torch.txt (`make pytest-torch` runs it with
.venv-torch/bin/python). Issue 24: every export must load in transformers unchanged.

For each real vocabulary (scripts/fetch-tokenizers: ggml-vocab-llama-spm.gguf, ggml-vocab-phi-3.gguf;
the Gemma 3 270M GGUF; skipped with fetch-tokenizers' reason where they could not be fetched):
a tiny random model carrying that vocabulary (build/tools/mk_tiny_gguf copies every tokenizer.*
key) and a LoRA adapter are exported; then
  - AutoTokenizer.from_pretrained(export) keeps tokenizer.json's pipeline unchanged (its backend
    serialises to the same JSON as tokenizers.Tokenizer.from_file);
  - its ids equal llama.cpp's (tests/fixtures/tokenizer/<family>_stress_ids.bin.zst, which
    bt_tokenize matches: tests/unit/common/test_tokenizer_spm.c) on every valid UTF-8 document of
    the stress corpus (leading / trailing / repeated spaces, newlines, tabs, emoji,
    astral chars, long words, every family's special strings in text), special-token strings
    parsed where the corpus says so (split_special_tokens otherwise: user-defined tokens are still
    split out, as llama.cpp does);
  - decode(ids, skip_special_tokens=False) equals llama.cpp's detokenize (the fixture's FNV-1a
    hash of it), and decode(encode(text)) gives text back on the stress strings (those without
    special-token parsing or U+2581, which SentencePiece reads as a space; Phi-3's RSTRIP tokens
    drop the whitespace after them by design);
  - the default encode adds BOS exactly as llama.cpp does (tokenizer.ggml.add_bos_token, true when
    absent for these vocabularies), and bos / eos / unk tokens are the GGUF's;
  - BarqTrain's own tokenizer reads the exported directory back with the GGUF's ids.
Before issue 24 the export wrote no tokenizer files for these bases: every check here failed."""
import json
import os
import subprocess
import time

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
from safetensors.numpy import save_file  # noqa: E402

from conftest import BUILD, ROOT  # noqa: E402
from tok_fixtures import fnv1a64, read_corpus, read_ids  # noqa: E402

TOKDIR = os.path.join(ROOT, os.environ.get("BT_TOKENIZERS_DIR", "models/tokenizers"))
GEMMA = os.path.join(ROOT, os.environ.get("BT_GEMMA", "models/gemma-3-270m-q4_k_m.gguf"))
FIX = os.path.join(ROOT, "tests", "fixtures", "tokenizer")
SOURCES = {"llama-spm": os.path.join(TOKDIR, "ggml-vocab-llama-spm.gguf"),
           "phi-3": os.path.join(TOKDIR, "ggml-vocab-phi-3.gguf"), "gemma3": GEMMA}
# general.name where llama.cpp reads tokenizer attributes from it (Phi-3: RSTRIP special tokens)
NAMES = {"phi-3": "Phi-3 tiny"}
# (bos, eos, unk, BOS added by default) as llama.cpp reads each GGUF
SPECIALS = {"llama-spm": ("<s>", "</s>", "<unk>", True), "phi-3": ("<s>", "<|endoftext|>", "<unk>", True),
            "gemma3": ("<bos>", "<eos>", "<unk>", True)}


def fetched(path):
    """path, or a skip with fetch-tokenizers' reason (a failure when it was simply never run)."""
    if os.path.exists(path):
        return path
    why = os.path.join(TOKDIR, "SKIPPED")
    if os.path.exists(why):
        pytest.skip(f"{path} not fetched: {open(why).read().strip()}")
    if path == GEMMA:
        pytest.skip(f"{path} not present (make model MODEL=gemma3-270m)")
    pytest.fail(f"{path} missing: run `make tokenizers` (scripts/fetch-tokenizers)")


def export(family, tmp_path):
    """A tiny random Llama GGUF with the family's vocabulary, a q_proj LoRA, merged to safetensors."""
    tiny = tmp_path / "tiny.gguf"
    subprocess.run([os.path.join(BUILD, "tools", "mk_tiny_gguf"), "--out", str(tiny), "--tokenizer-from",
                    fetched(SOURCES[family]), "--layers", "1", "--hidden", "32", "--heads", "2",
                    "--kv-heads", "1", "--ffn", "64", "--name", NAMES.get(family, "barq-tiny-llama")],
                   check=True, capture_output=True)
    ad = tmp_path / "adapter"
    ad.mkdir()
    rng = np.random.default_rng(1)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
               rng.normal(0, 0.2, (1, 32)).astype(np.float32),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
               rng.normal(0, 0.01, (32, 1)).astype(np.float32)}, str(ad / "adapter_model.safetensors"))
    (ad / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 1, "lora_alpha": 2, "target_modules": ["q_proj"]}))
    out = tmp_path / "hf"
    t0 = time.time()
    r = subprocess.run([os.path.join(BUILD, "trainer"), "export", "--model", str(tiny), "--adapter", str(ad),
                        "--format", "safetensors", "--out", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tokenizer" not in r.stderr.lower() or "warn" not in r.stderr.lower(), r.stderr[-2000:]
    print(f"{family}: export {time.time() - t0:.2f} s")
    return tiny, out


# To keep `make test` within its budget the parity corpus (2,512 valid UTF-8 documents, 1 MB) is not
# run here: on it, when this was written (2026-11-27, transformers 5.23.0, tokenizers 0.23.3), the
# exports of all three vocabularies gave llama.cpp's ids and decode on every document (0 of 2,512
# differ); BT_SPM_EXPORT_CORPUS=1 runs it. Gemma 3 (a 20 MB tokenizer.json) runs lean: ids and
# decode, not the Python-API checks.
SKIP_CORPUS = {} if os.environ.get("BT_SPM_EXPORT_CORPUS") == "1" else {"llama-spm": 1, "phi-3": 1, "gemma3": 1}
LEAN = {"gemma3"}


@pytest.mark.parametrize("family", ["llama-spm", "phi-3", "gemma3"])
def test_spm_export_tokenizer_in_transformers(family, tmp_path):
    skip_corpus, lean = SKIP_CORPUS.get(family, 0), family in LEAN
    tiny, out = export(family, tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / f).exists(), f
    t0 = time.time()
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    print(f"{family}: AutoTokenizer {type(tok).__name__} loaded in {time.time() - t0:.2f} s")
    backend = tok.backend_tokenizer
    m = backend.model
    assert type(m).__name__ == "BPE" and m.byte_fallback and m.fuse_unk and m.unk_token == SPECIALS[family][2]
    if not lean:  # the pipeline is tokenizer.json's, unchanged
        assert json.loads(backend.to_str()) == json.loads(
            tokenizers.Tokenizer.from_file(str(out / "tokenizer.json")).to_str())
    bos, eos, unk, add_bos = SPECIALS[family]
    assert (tok.bos_token, tok.eos_token, tok.unk_token) == (bos, eos, unk)

    t0 = time.time()
    total = 0
    for cname, iname in (("corpus.bin.zst", family), ("stress.bin.zst", family + "_stress"))[skip_corpus:]:
        docs, want = read_corpus(os.path.join(FIX, cname)), read_ids(os.path.join(FIX, f"{iname}_ids.bin.zst"))
        assert len(docs) == len(want)
        valid = [(i, f, raw.decode("utf-8")) for i, (f, raw) in enumerate(docs) if is_utf8(raw)]
        got = {}
        for flag in (0, 1):  # one batch per special-token mode (the backend of the AutoTokenizer)
            backend.encode_special_tokens = not flag
            sel = [(i, text) for i, f, text in valid if f == flag]
            for (i, _), enc in zip(sel, backend.encode_batch([t for _, t in sel], add_special_tokens=False)):
                got[i] = enc.ids
        bad = [i for i, _, _ in valid if got[i] != want[i][1]]
        assert not bad, (family, cname, len(bad), [(docs[i][1][:80], got[i][:20], want[i][1][:20])
                                                   for i in bad[:3]])
        dec = [i for i, _, _ in valid if fnv1a64(backend.decode(want[i][1], skip_special_tokens=False).encode()) != want[i][0]]
        assert not dec, (family, cname, "decode differs from llama.cpp", [docs[i][1][:80] for i in dec[:3]])
        total += len(valid)
        if cname == "stress.bin.zst" and not lean:  # the Python API as users call it, round trip
            for i, f, text in valid:
                tok.split_special_tokens = not f
                assert tok(text, add_special_tokens=False)["input_ids"] == want[i][1], text
                # no round trip for U+2581 (the space's spelling) nor around Phi-3's RSTRIP tokens
                if not f and "\u2581" not in text and family not in NAMES:
                    assert tok.decode(want[i][1]) == text, (text, tok.decode(want[i][1]))
    print(f"{family}: {total} documents equal to llama.cpp in {time.time() - t0:.2f} s")

    tok.split_special_tokens = False
    backend.encode_special_tokens = False
    ids = tok("Hello world")["input_ids"]
    plain = tok("Hello world", add_special_tokens=False)["input_ids"]
    assert ids == ([tok.bos_token_id] if add_bos else []) + plain
    if lean:
        return
    # BarqTrain's own tokenizer reads the exported directory back with the GGUF's ids
    text = "  Hello  world\t<start_of_turn>user 😀 𝔘nicode <s>x</s>\n"
    tk = [subprocess.run([os.path.join(BUILD, "loaderctl"), "tokenize", "--tokenizer", str(src), "--ids"],
                         input=text, capture_output=True, text=True, check=True).stdout for src in (tiny, out)]
    assert tk[0] == tk[1] and tk[0].strip(), tk


def is_utf8(b):
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
