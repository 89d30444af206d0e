"""llama.cpp itself as the reference for what users run our files in (`make test-llamacpp`).

llama.cpp b8929 (commit 9d34231b), the library of the pinned xllamacpp 2026.4.8929 wheel that
scripts/llamacpp-ref.sh installs into .llamacpp/, loaded with ctypes by llamacpp_ref.py. Checks:

  - the loader's ctypes layouts are the library's (the size and fields of what it returns);
  - LoRA: a tiny random Llama GGUF with SmolLM2's real vocabulary (F32 weights) plus a random
    non-zero PEFT adapter on all seven linears. Our `trainer export --format gguf-lora` file
    (f32, f16, q8_0), applied by llama.cpp (llama_adapter_lora_init / llama_set_adapters_lora),
    loads without a warning and gives the logits of bt_logits (our training forward with the
    PEFT adapter) within TOL, and the same 32-token greedy text as `trainer generate --adapter`;
  - merged: `trainer export --format gguf` (f32, f16, q8_0) read by llama.cpp gives our logits
    on the same file within TOL and the same greedy text as `trainer generate --model merged`;
  - tokenizers: llama.cpp's ids for every document of the tokenizer parity corpus
    (tests/fixtures/tokenizer/corpus.bin.zst, 2587 documents) equal ours (build/tools/bench_tok
    --special-flags) for each GGUF tokenizer: the real SmolLM2 GGUF (pre "smollm"), and GGUFs
    written here from the llama3 and qwen2 fixture tokenizer.json files the way llama.cpp's
    convert_hf_to_gguf.py writes them (pre "llama-bpe" / "qwen2"). Where llama.cpp is known to
    differ from Hugging Face (and so from us), the difference is named, counted and checked to be
    exactly that: invalid UTF-8 (llama.cpp tokenizes raw bytes; HF and we first replace them with
    U+FFFD, errors="replace"), and qwen2's NFC normaliser (llama.cpp has none);
  - Qwen3: a tiny random Qwen3 (F32) trained 8 steps by `trainer train`, its gguf-lora and merged
    f32 exports in llama.cpp give our logits within TOL f32 and our greedy text; Qwen2 and Phi-3
    exports against transformers' logits (fixtures of tests/reference); the Gemma 3 fixture's
    merged f32 export against transformers + PEFT's logits and ours (TOL f16: ggml-cpu's GELU is
    an F16 table);
  - a LoRA on a base whose Q4_K tensors llama.cpp repacks (CPU_REPACK), which b4965 crashed on;
  - the real SmolLM2 Q4_1 GGUF: the gap between our logits and llama.cpp's is measured and printed
    (run with -s), not asserted equal: llama.cpp's quantised matmuls round the activations to
    Q8_1 (ggml-cpu's vec_dot_type of Q4_1), we multiply them in fp32. A loose bound catches a
    broken loader or model.

Tolerances (TOL, max |logit difference|, logits of magnitude ~1 here): F32 weights: llama.cpp and
we differ only in summation order: 1e-4. F16 weights (merged f16, LoRA f16): ggml-cpu converts
the activations to F16 before an F16 matmul (vec_dot_type F16, 11-bit mantissa), we keep them fp32:
1e-2. Q8_0 weights: activations rounded to Q8_0 (8-bit, one scale per 32): 5e-2. The argmax must
agree wherever our best-two margin exceeds twice TOL. Greedy text: identical on F32 weights; on
F16 / Q8_0 weights identical, or parting only at a near tie (our margin there <= TOL).
"""
import json
import os
import re
import struct
import subprocess
import sys
import unicodedata

import pytest

from conftest import BUILD, MODEL, ROOT

np = pytest.importorskip("numpy")
gguf = pytest.importorskip("gguf")

sys.path.insert(0, os.path.dirname(__file__))
import llamacpp_ref  # noqa: E402
from test_export import st_read, st_write  # noqa: E402
from tok_fixtures import fnv1a64, read_corpus, read_ids, zstd_bytes  # noqa: E402

FIX = os.path.join(ROOT, "tests", "fixtures", "tokenizer")
MODS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# the tiny base: SmolLM2's vocabulary, 2 layers, hidden 128, 4 heads of 32 (2 KV heads: GQA and
# the q/k row permutation of the GGUF layout are exercised), FFN 256
TINY = {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "ffn": 256}
R, ALPHA = 8, 16
TOL = {"f32": 1e-4, "f16": 1e-2, "q8_0": 5e-2}
N_NEW = 32
PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return",
    "Ünïcödé, 国語は美しい, and emoji 😀 in one line",
]


# ---- the library ----

@pytest.fixture(scope="module")
def lc():
    d = llamacpp_ref.default_dir()
    lib = os.path.join(d, llamacpp_ref.LIB_NAME)
    if os.path.exists(lib):
        return llamacpp_ref.LlamaCpp(lib)
    skipped = os.path.join(d, "SKIPPED")
    if os.path.exists(skipped):
        with open(skipped) as f:
            pytest.skip("llama.cpp reference not installed: " + f.read().strip())
    pytest.fail(f"{lib} missing: run `make llamacpp-ref` (scripts/llamacpp-ref.sh) first")


def tool(name):
    p = os.path.join(BUILD, "tools", name)
    if not os.access(p, os.X_OK):
        pytest.fail(f"{p} not built (make all)")
    return p


# our tools single-threaded, like llama.cpp here: on a shared 2-core machine OpenMP barriers spin
TOOL_ENV = dict(os.environ, OMP_NUM_THREADS="1")


def run(args, **kw):
    p = subprocess.run(args, capture_output=True, timeout=600, cwd=ROOT, env=TOOL_ENV, **kw)
    assert p.returncode == 0, f"{args[:3]}: rc {p.returncode}\n{p.stderr.decode(errors='replace')}"
    return p


def test_layouts_match_the_library(lc):
    """The ctypes layouts are the library's: the three functions that return a struct by value
    (llama_model_default_params, llama_context_default_params, llama_batch_init; x86-64 SysV
    returns them through a caller's buffer, the hidden first argument) write exactly
    sizeof(struct) bytes into a buffer filled with a sentinel, and every field then holds what
    llama.cpp b8929 sets at that offset (src/llama-model.cpp / src/llama-context.cpp defaults as
    llama.h documents them: 512-position context, 2048 batch, flash attention AUTO (-1), F16 K/V
    cache, KV offload, mmap and weight repacking on, no sampler chains...). A field added, removed
    or moved shifts the values or the size. The library is no cffi module any more (the earlier
    pin's type table is gone), so the prototypes are checked by use: every test below calls them."""
    import ctypes
    L = llamacpp_ref

    def by_value(name, cls, *args):
        fn = ctypes.cast(getattr(lc.lib, name), ctypes.c_void_p).value
        proto = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int32] * len(args))
        buf = (ctypes.c_uint8 * 512)(*[0xA5] * 512)
        assert proto(fn)(ctypes.addressof(buf), *args) == ctypes.addressof(buf), name
        touched = [i for i in range(512) if buf[i] != 0xA5]
        assert max(touched) + 1 == ctypes.sizeof(cls), (name, max(touched) + 1, ctypes.sizeof(cls))
        return cls.from_buffer_copy(bytes(buf[:ctypes.sizeof(cls)]))

    assert [ctypes.sizeof(c) for c in (L.llama_model_params, L.llama_context_params,
                                       L.llama_batch)] == [72, 136, 56]
    mp = by_value("llama_model_default_params", L.llama_model_params)
    assert (mp.devices, mp.tensor_buft_overrides, mp.n_gpu_layers, mp.split_mode, mp.main_gpu,
            bool(mp.tensor_split), mp.progress_callback, mp.kv_overrides) == \
        (None, None, -1, 1, 0, False, None, None)  # -1: all layers; split_mode LAYER
    assert [getattr(mp, n) for n in ("vocab_only", "use_mmap", "use_direct_io", "use_mlock",
                                     "check_tensors", "use_extra_bufts", "no_host", "no_alloc")] \
        == [False, True, False, False, False, True, False, False]
    cp = by_value("llama_context_default_params", L.llama_context_params)
    assert (cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max) == (512, 2048, 512, 1)
    assert (cp.rope_scaling_type, cp.pooling_type, cp.attention_type, cp.flash_attn_type) == \
        (-1, -1, -1, L.FLASH_ATTN_AUTO)  # UNSPECIFIED x 3, AUTO
    assert (cp.rope_freq_base, cp.rope_freq_scale, cp.yarn_ext_factor, cp.yarn_orig_ctx) == \
        (0.0, 0.0, -1.0, 0)  # 0 / negative: from the model
    assert (cp.cb_eval, cp.type_k, cp.type_v, cp.abort_callback) == \
        (None, L.GGML_TYPE_F16, L.GGML_TYPE_F16, None)
    assert [getattr(cp, n) for n in ("embeddings", "offload_kqv", "no_perf", "op_offload",
                                     "swa_full", "kv_unified")] == \
        [False, True, True, True, True, False]
    assert (cp.samplers, cp.n_samplers) == (None, 0)
    b = by_value("llama_batch_init", L.llama_batch, 4, 0, 1)
    assert b.n_tokens == 0 and not b.embd and all(
        bool(getattr(b, n)) for n in ("token", "pos", "n_seq_id", "seq_id", "logits"))
    assert bool(b.seq_id[0]) and not b.seq_id[4]  # n_tokens seq_id arrays, NULL-terminated
    lc.lib.llama_batch_free(b)


# ---- tokenizer corpus helpers ----

def our_ids(tokenizer, docs, tmp_path):
    """Our ids of docs [(special, bytes)]: build/tools/bench_tok --special-flags (bt_tokenize with
    parse_special = the document's flag), one pass."""
    corp, dump = str(tmp_path / "docs.bin"), str(tmp_path / "ids.bin")
    with open(corp, "wb") as f:
        f.write(b"BTTKCORP" + struct.pack("<I", len(docs)))
        for sp, d in docs:
            f.write(bytes([int(sp)]) + struct.pack("<I", len(d)) + d)
    run([tool("bench_tok"), "--min-seconds", "0", "--special-flags", "--dump", dump, tokenizer, corp])
    b, off, out = open(dump, "rb").read(), 0, []
    while off < len(b):
        (n,) = struct.unpack_from("<I", b, off)
        out.append(list(struct.unpack_from(f"<{n}i", b, off + 4)))
        off += 4 + 4 * n
    assert len(out) == len(docs)
    return out


# ---- tiny base, adapter, exports ----

def make_peft(d, seed=5, shape=TINY):
    """A PEFT adapter for `shape` (TINY's keys): r=R, alpha=ALPHA on the seven linears,
    A ~ U(-0.1, 0.1), B ~ N(0, 0.05) (non-zero: the adapter changes the logits)."""
    H, F, L = shape["hidden"], shape["ffn"], shape["layers"]
    kv = shape["kv_heads"] * H // shape["heads"]
    shapes = {"q_proj": (H, H), "k_proj": (kv, H), "v_proj": (kv, H), "o_proj": (H, H),
              "gate_proj": (F, H), "up_proj": (F, H), "down_proj": (H, F)}
    rng = np.random.default_rng(seed)
    t = {}
    for layer in range(L):
        for m in MODS:
            o, i = shapes[m]
            pre = f"base_model.model.model.layers.{layer}.{'self_attn' if m in MODS[:4] else 'mlp'}.{m}"
            t[pre + ".lora_A.weight"] = ([R, i], rng.uniform(-0.1, 0.1, R * i).tolist())
            t[pre + ".lora_B.weight"] = ([o, R], rng.normal(0, 0.05, o * R).tolist())
    os.makedirs(d)
    st_write(os.path.join(d, "adapter_model.safetensors"), t)
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": R, "lora_alpha": ALPHA,
                   "target_modules": MODS, "lora_dropout": 0.0, "bias": "none"}, f)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{"base", "peft", "lora_<dt>", "merged_<dt>", "prompt_ids"} for the tiny F32 base."""
    if not os.path.exists(MODEL):
        pytest.skip(f"model {MODEL} not present (make model): its vocabulary is the tiny model's")
    d = tmp_path_factory.mktemp("llamacpp")
    out = {"base": str(d / "base.gguf"), "peft": str(d / "peft")}
    run([tool("mk_tiny_gguf"), "--out", out["base"], "--tokenizer-from", MODEL, "--seed", "3",
         *[a for k, v in TINY.items() for a in (f"--{k.replace('_', '-')}", str(v))]])
    make_peft(out["peft"])
    trainer = os.path.join(BUILD, "trainer")
    for dt in ("f32", "f16", "q8_0"):
        for fmt, key in (("gguf-lora", "lora"), ("gguf", "merged")):
            out[f"{key}_{dt}"] = str(d / f"{key}_{dt}.gguf")
            run([trainer, "export", "--model", out["base"], "--adapter", out["peft"], "--format", fmt,
                 "--dtype", dt, "--out", out[f"{key}_{dt}"]])
    out["prompt_ids"] = our_ids(out["base"], [(True, p.encode()) for p in PROMPTS], d)
    return out


def bt_logits(model, ids, tmp_path, adapter=None):
    """Our logits (build/tools/bt_logits: the training forward, fp32) [len(ids), vocab]."""
    f = str(tmp_path / "bt_logits.bin")
    args = [tool("bt_logits"), "--model", model, "--ids", ",".join(map(str, ids)), "--pos0", "0",
            "--out", f]
    if adapter:
        args += ["--adapter", adapter]
    run(args)
    return np.fromfile(f, np.float32).reshape(len(ids), -1)


def trainer_greedy(model, prompt, adapter=None):
    """`trainer generate` greedy text, N_NEW tokens, control tokens included (bytes)."""
    args = [os.path.join(BUILD, "trainer"), "generate", "--model", model, "--prompt", prompt,
            "--max-new-tokens", str(N_NEW), "--temperature", "0", "--ignore-eos", "--show-special"]
    if adapter:
        args += ["--adapter", adapter]
    out = run(args).stdout
    assert out.endswith(b"\n")
    return out[:-1]


def margin(logits):
    """Per row, best minus second-best logit."""
    s = np.sort(logits, axis=1)
    return s[:, -1] - s[:, -2]


def check_logits(name, got, want, tol):
    """Asserts max |got - want| <= tol; returns the measured maximum (printed with -s)."""
    diff = float(np.max(np.abs(got - want)))
    print(f"{name}: max |logit diff| {diff:.3g} (tol {tol:g}, logits up to {np.max(np.abs(want)):.3g})")
    assert diff <= tol, f"{name}: llama.cpp's logits differ from ours by {diff:g} > {tol:g}"
    # argmax equal wherever the decision is clear of the tolerance
    clear = margin(want) > 2 * tol
    assert np.array_equal(np.argmax(got, 1)[clear], np.argmax(want, 1)[clear]), name
    return diff


def check_greedy(name, lc_model, ctx, model_file, prompt, ids, tol, tmp_path, adapter=None,
                 strict=False):
    """`trainer generate`'s greedy text against llama.cpp's (N_NEW tokens). Equal, or (not strict)
    parting at a near tie: at the first llama.cpp token k whose text leaves ours, our logits
    (bt_logits on prompt + llama.cpp's first k tokens) prefer another token by at most tol, the
    logit tolerance of this weight type. Returns whether the texts were equal."""
    ours = trainer_greedy(model_file, prompt, adapter)
    new = ctx.greedy(ids, N_NEW)
    theirs = lc_model.detokenize(new, special=True)
    if theirs == ours:
        return True
    msg = f"{name}: greedy text differs\n ours:      {ours!r}\n llama.cpp: {theirs!r}"
    assert not strict, msg
    k, done = 0, b""
    while k < len(new) and ours.startswith(done + lc_model.detokenize([new[k]], special=True)):
        done += lc_model.detokenize([new[k]], special=True)
        k += 1
    assert k < len(new), msg
    lg = bt_logits(model_file, list(ids) + new[:k], tmp_path, adapter)[-1]
    best = int(np.argmax(lg))
    gap = float(lg[best] - lg[new[k]])
    assert best != new[k] and gap <= tol, f"{msg}\n at new token {k}: our margin {gap:g} > {tol:g}"
    print(f"{name}: greedy texts part at new token {k}, a near tie (our margin {gap:.3g} <= {tol:g})")
    return False


# ---- LoRA GGUF ----

@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0"])
def test_lora_gguf_in_llamacpp(lc, tiny, dtype, tmp_path):
    m = lc.load_model(tiny["base"])
    assert m.load_problems == [], m.load_problems
    a = m.lora(tiny[f"lora_{dtype}"])
    assert a.load_problems == [], f"llama.cpp warned on our LoRA GGUF: {a.load_problems}"
    ctx = m.context(256, adapter=a)
    plain = m.context(256)
    for prompt, ids in zip(PROMPTS, tiny["prompt_ids"]):
        assert m.tokenize(prompt, parse_special=True) == ids  # llama.cpp's ids are ours
        want = bt_logits(tiny["base"], ids, tmp_path, adapter=tiny["peft"])
        check_logits(f"lora {dtype} {prompt[:20]!r}", ctx.logits(ids), want, TOL[dtype])
        # the adapter moves the logits well past the tolerance, so the check above fails if
        # llama.cpp ignores it or applies it at a wrong scale (measured: about 1.2 here)
        assert np.max(np.abs(plain.logits(ids) - want)) > 4 * TOL[dtype]
        check_greedy(f"lora {dtype} {prompt[:20]!r}", m, ctx, tiny["base"], prompt, ids,
                     TOL[dtype], tmp_path, adapter=tiny["peft"], strict=dtype == "f32")
    m.close()


# ---- merged GGUF ----

@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0"])
def test_merged_gguf_in_llamacpp(lc, tiny, dtype, tmp_path):
    path = tiny[f"merged_{dtype}"]
    m = lc.load_model(path)
    assert m.load_problems == [], f"llama.cpp warned on our merged GGUF: {m.load_problems}"
    assert m.n_vocab == 49152 and m.meta("general.architecture") == "llama"
    ctx = m.context(256)
    for prompt, ids in zip(PROMPTS, tiny["prompt_ids"]):
        assert m.tokenize(prompt, parse_special=True) == ids  # the tokenizer travelled with it
        got = ctx.logits(ids)
        check_logits(f"merged {dtype} {prompt[:20]!r}", got, bt_logits(path, ids, tmp_path), TOL[dtype])
        if dtype == "f32":  # merged == base + adapter, within the f32 tolerance
            check_logits(f"merged f32 vs adapter {prompt[:20]!r}", got,
                         bt_logits(tiny["base"], ids, tmp_path, adapter=tiny["peft"]), TOL["f32"])
        check_greedy(f"merged {dtype} {prompt[:20]!r}", m, ctx, path, prompt, ids, TOL[dtype],
                     tmp_path, strict=dtype == "f32")
    m.close()


# ---- tokenizers ----

def looks_special(text):
    """convert_hf_to_gguf.py TextModel.does_token_look_special (llama.cpp): added tokens that
    ought to be control tokens although tokenizer.json says special=false."""
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
            or (text.startswith("<unused") and text.endswith(">")))


def gguf_from_tokenizer_json(tj_path, pre, out):
    """A tokenizer-only GGUF from a byte-level BPE tokenizer.json, as llama.cpp's
    convert_hf_to_gguf.py writes one (get_vocab_base + SpecialVocab): tokens by id (ids no entry
    names become "[PAD<id>]", user-defined), token types normal (1) for the model's vocabulary,
    control (3) for special added tokens and those that look special, user-defined (4) for the
    other added tokens; merges "a b"; tokenizer.ggml.model "gpt2" and the given pre."""
    tj = json.loads(zstd_bytes(tj_path))
    vocab = {i: t for t, i in tj["model"]["vocab"].items()}
    added = {a["id"]: a for a in tj["added_tokens"]}
    n = max([*vocab, *added]) + 1
    toks, types = [], []
    for i in range(n):
        if i in added:
            t = added[i]["content"]
            toks.append(t)
            types.append(3 if added[i]["special"] or looks_special(t) else 4)
        elif i in vocab:
            toks.append(vocab[i])
            types.append(1)
        else:
            toks.append(f"[PAD{i}]")
            types.append(4)
    w = gguf.GGUFWriter(out, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def is_nfc(b):
    t = b.decode("utf-8", "replace")
    return unicodedata.normalize("NFC", t) == t


# family: (tokenizer.json fixture or None for the real SmolLM2 GGUF, tokenizer.ggml.pre)
# qwen2x is left out: its subject, the lstrip / rstrip / single_word flags of added tokens, has
# no GGUF encoding.
FAMILIES = {"smollm2": (None, "smollm"), "llama3": ("llama3-tokenizer.json.zst", "llama-bpe"),
            "qwen2": ("qwen2-tokenizer.json.zst", "qwen2")}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tokenizer_matches_llamacpp(lc, family, tmp_path):
    """llama.cpp's ids of every document of the parity corpus equal ours on the same GGUF, with
    parse_special as the fixture says. Invalid UTF-8 is given to llama.cpp as the text our (and
    HF's) tokenizer sees, its errors="replace" decoding; qwen2's NFC normaliser, which llama.cpp
    does not have, likewise: a document that NFC changes is given to llama.cpp normalised, and the
    documents where that alone makes the difference are counted (printed with -s)."""
    tj, pre = FAMILIES[family]
    if tj is None:
        if not os.path.exists(MODEL):
            pytest.skip(f"model {MODEL} not present (make model)")
        model = MODEL
    else:
        src = str(tmp_path / "tok.gguf")
        gguf_from_tokenizer_json(os.path.join(FIX, tj), pre, src)
        model = str(tmp_path / "model.gguf")  # llama.cpp loads models, not bare vocabularies
        run([tool("mk_tiny_gguf"), "--out", model, "--tokenizer-from", src])
    docs = read_corpus(os.path.join(FIX, "corpus.bin.zst"))
    assert len(docs) == 2587
    ours = our_ids(model, docs, tmp_path)
    m = lc.load_model(model, vocab_only=True)
    assert m.meta("tokenizer.ggml.pre") == pre
    nfc = family == "qwen2"
    bad, raw_differs, nfc_differs = [], 0, 0
    for i, ((sp, d), want) in enumerate(zip(docs, ours)):
        text = d.decode("utf-8", "replace").encode()
        if text != d and m.tokenize(d, parse_special=sp) != want:
            raw_differs += 1  # llama.cpp's own reading of invalid bytes
        if nfc and not is_nfc(text):
            if m.tokenize(text, parse_special=sp) != want:
                nfc_differs += 1
            text = unicodedata.normalize("NFC", text.decode()).encode()
        if m.tokenize(text, parse_special=sp) != want:
            bad.append(i)
    n_invalid = sum(d.decode("utf-8", "replace").encode() != d for _, d in docs)
    print(f"tokenizer {family}: {len(docs)} documents, {sum(map(len, ours))} tokens, "
          f"{len(docs) - len(bad)} equal; raw invalid UTF-8 read differently by llama.cpp in "
          f"{raw_differs} of {n_invalid}; NFC-only differences {nfc_differs}")
    assert not bad, (f"{family}: llama.cpp's ids differ from ours in {len(bad)} documents, e.g. "
                     f"#{bad[0]} {docs[bad[0]][1][:80]!r}")
    if nfc:
        assert nfc_differs > 0  # the corpus does exercise the normaliser llama.cpp lacks
    # the file is read as written (llama.cpp re-types "control-looking" user-defined tokens and
    # says so; the converter above already made them control tokens, as convert_hf_to_gguf does)
    assert not [p for p in m.load_problems if "control-looking" in p], m.load_problems
    if family == "smollm2":
        # (llama3: llama.cpp's decode applies transformers' clean_up_tokenization_spaces for the
        # "llama-bpe" pre type, "before 's" -> "before's", which tokenizers' decode and ours do not)
        check_decode(m, family, docs)


# SentencePiece GGUF vocabularies (tokenizer.ggml.model "llama", common/tokenizer_spm.c): the real
# files of scripts/fetch-tokenizers and the real Gemma 3 270M GGUF (scripts/fetch-model gemma3-270m)
SPM_GGUFS = {"llama-spm": "ggml-vocab-llama-spm.gguf", "phi-3": "ggml-vocab-phi-3.gguf",
             "gemma3": os.path.join("..", "gemma-3-270m-q4_k_m.gguf")}


def vocab_with_types(src, ids, ttype, out):
    """`src` GGUF's header and metadata (every key, the model's name included: our tokenizer and
    llama.cpp read the name for Phi-3's rules) with the token type of every id in `ids` set to
    `ttype` (llama.h enum llama_token_type: 3 control), and no tensors (n_tensors 0). Walks the
    GGUF v3 key/value section itself (gguf-py's reader takes a minute on a 262,144-token vocabulary
    here), so only the int32 entries of tokenizer.ggml.token_type change."""
    with open(src, "rb") as f:
        b = bytearray(f.read(64 << 20))  # the metadata is at the front (Gemma 3's: 5.6 MB)
    assert b[:4] == b"GGUF" and struct.unpack_from("<I", b, 4)[0] == 3, src
    (n_kv,), off = struct.unpack_from("<Q", b, 16), 24
    fixed = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types

    def skip(t, off):
        if t in fixed:
            return off + fixed[t]
        if t == 8:  # string: u64 length + bytes
            return off + 8 + struct.unpack_from("<Q", b, off)[0]
        assert t == 9, t  # array: u32 element type, u64 count, elements
        et, n = struct.unpack_from("<IQ", b, off)
        off += 12
        if et in fixed:
            return off + n * fixed[et]
        for _ in range(n):
            off = skip(et, off)
        return off
    patched = False
    for _ in range(n_kv):
        (kl,) = struct.unpack_from("<Q", b, off)
        key = bytes(b[off + 8:off + 8 + kl])
        (t,) = struct.unpack_from("<I", b, off + 8 + kl)
        off += 12 + kl
        if key == b"tokenizer.ggml.token_type":
            et, n = struct.unpack_from("<IQ", b, off)
            assert t == 9 and et in (4, 5), (t, et)  # array of u32 / i32
            for i in ids:
                assert 0 <= i < n
                struct.pack_into("<i", b, off + 12 + 4 * i, ttype)
            patched = True
        off = skip(t, off)
    assert patched, f"{src}: no tokenizer.ggml.token_type"
    struct.pack_into("<Q", b, 8, 0)  # no tensors
    with open(out, "wb") as f:
        f.write(b[:off])


@pytest.mark.parametrize("family", sorted(SPM_GGUFS))
def test_spm_tokenizer_matches_llamacpp(lc, family, tmp_path):
    """llama.cpp's ids equal ours for every document of the parity corpus and the stress strings
    (stress.bin.zst), raw bytes as given to both (invalid UTF-8 included: llama.cpp's SPM tokenizer
    and ours read bytes alike, no replacement), with parse_special as the fixture says; and
    llama.cpp's own test strings (the .inp file next to the vocabulary, whose .out holds its
    expected ids with add_special, i.e. BOS first)."""
    tokdir = os.environ.get("BT_TOKENIZERS_DIR") or os.path.join(ROOT, "models", "tokenizers")
    path = os.path.normpath(os.path.join(tokdir, SPM_GGUFS[family]))
    if not os.path.exists(path):
        why = os.path.join(tokdir, "SKIPPED")
        if os.path.exists(why):
            pytest.skip(f"{path} not fetched: {open(why).read().strip()}")
        pytest.fail(f"{path} missing: run make tokenizers")
    docs = read_corpus(os.path.join(FIX, "corpus.bin.zst")) + read_corpus(os.path.join(FIX, "stress.bin.zst"))
    ours = our_ids(path, docs, tmp_path)
    m = lc.load_model(path, vocab_only=True)
    # llama.cpp (since after b4965) takes tokens whose text marks an end of generation ("</s>",
    # "<|endoftext|>", "<end_of_turn>", ...) for control tokens whatever the file's token type says,
    # and says so ("control-looking token: ... its type will be overridden"); Phi-3's and Gemma 3's
    # vocabularies have "</s>" user-defined, which Hugging Face, b4965 and we match in any text,
    # llama.cpp b8929 only with parse_special. That difference is the only one: our ids on a copy
    # of the vocabulary with those tokens typed control (3) equal llama.cpp's on every document.
    retyped = {int(i): t for p in m.load_problems for i, t in
               re.findall(r"control-looking token: +(\d+) '(.*)' was not control-type", p)}
    want_lc = ours
    if retyped:
        copy = str(tmp_path / "retyped.gguf")
        vocab_with_types(path, retyped, 3, copy)
        want_lc = our_ids(copy, docs, tmp_path)
    bad = [i for i, ((sp, d), want) in enumerate(zip(docs, want_lc))
           if m.tokenize(d, parse_special=sp) != want]
    n_retyped = sum(a != b for a, b in zip(ours, want_lc))
    print(f"spm tokenizer {family}: {len(docs)} documents, {sum(map(len, ours))} tokens, "
          f"{len(docs) - len(bad)} equal; llama.cpp retypes {sorted(retyped.values())} to control, "
          f"which changes {n_retyped} documents (parse_special false)")
    assert not bad, (f"{family}: llama.cpp's ids differ from ours in {len(bad)} documents, e.g. "
                     f"#{bad[0]} {docs[bad[0]][1][:80]!r}")
    assert set(retyped.values()) <= {"</s>"}, retyped  # a new retyping is looked at, not absorbed
    inp = path + ".inp"
    if os.path.exists(inp):  # llama.cpp's tests/test-tokenizer-0 files: cases end in "\n__ggml_vocab_test__\n",
        # the .out has one line of expected ids per case (add_special and parse_special false)
        cases = open(inp, encoding="utf-8").read().split("\n__ggml_vocab_test__\n")[:-1]
        outs = open(path + ".out", encoding="utf-8").read().split("\n")[:len(cases)]
        mine = our_ids(path, [(False, c.encode()) for c in cases], tmp_path)
        assert len(cases) >= 30 and len(outs) == len(cases)
        for c, o, got in zip(cases, outs, mine):
            assert got == [int(x) for x in o.split()], (c, got, o)
        print(f"spm tokenizer {family}: {len(cases)} of llama.cpp's own test strings equal")


def check_decode(m, family, docs):
    """llama_detokenize (control tokens rendered) of the fixture's ids, read with errors="replace",
    hashes to the fixture's FNV-1a-64 of Hugging Face's decode (skip_special_tokens=False): the
    ids are ours too (tests/unit/common/test_tokenizer_hf.c), so this is our decode as well."""
    want = read_ids(os.path.join(FIX, f"{family}_ids.bin.zst"))
    assert len(want) == len(docs)
    bad = []
    for i, (h, ids) in enumerate(want):
        text = m.detokenize(ids, special=True).decode("utf-8", "replace").encode()
        if fnv1a64(text) != h:
            bad.append(i)
    assert not bad, f"{family}: llama.cpp decodes {len(bad)} documents differently, e.g. #{bad[0]}"


# ---- the real quantised model: measured, reported ----

def test_quantised_base_measured(lc, tmp_path):
    """SmolLM2-135M Q4_1 with and without a LoRA adapter, 2 prompts teacher-forced through both
    (tests/reference/llamacpp_agreement.py --no-greedy; the README's figures come from its full
    run). llama.cpp multiplies Q4_1 blocks by activations rounded to Q8_1, we by fp32 ones, so
    the logits differ by about 1.5 here (of logits up to ~38) where on the same model in F32 they
    agree to 1e-4. The bounds only catch a broken reading of the model or the adapter: max
    difference < 4, argmaxes agreeing at >= 80% of positions."""
    if not os.path.exists(MODEL):
        pytest.skip(f"model {MODEL} not present (make model)")
    out = str(tmp_path / "agreement.json")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "reference", "llamacpp_agreement.py"),
                        "--model", MODEL, "--prompts", "2", "--n-new", "8", "--no-greedy", "--json", out],
                       capture_output=True, text=True, timeout=900, env=TOOL_ENV, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    print(p.stdout)
    res = json.load(open(out))
    for cond in ("base", "adapter"):
        for row in res[cond]:
            assert 0 < row["max_abs_diff"] < 4, (cond, row)
            assert row["argmax_agree"] >= 0.8 * row["tokens"], (cond, row)


def test_gemma3_270m_measured(lc, tmp_path):
    """The real Gemma 3 270M Q4_K_M (scripts/fetch-model gemma3-270m; Q5_0, Q4_K, Q6_K and Q8_0
    tensors, 640-wide rows), with and without a LoRA adapter on all seven linears (our gguf-lora
    export), one prompt teacher-forced through llama.cpp and bt_logits (dequantised base):
    llama.cpp rounds the activations to Q8_0 / Q8_K before its quantised matmuls, we multiply fp32
    ones, so the logits differ by up to ~3.5 (of logits up to ~30; our logits match transformers'
    on the dequantised weights to 2.2e-5, and llama.cpp's on an all-F32 copy to 0.1, its GELU being
    an fp16 table; README). llama.cpp gets the file as is and repacks its Q4_K tensors (b8929 takes
    the adapter on them; b4965 crashed there and was given them as F32), so every quantised matmul
    of it rounds the activations to 8 bits: this model amplifies that rounding (llama.cpp's own
    repacked and unrepacked runs of it differ by up to 4.0, argmaxes equal; measured 2026-11-27),
    and on the 13 positions here the argmaxes agreed at 12 (base) and 9 (adapter) with b8929
    (b4965, given the Q4_K tensors as F32: 32 / 34 and 30 / 34 over two prompts). The bounds
    catch a broken reading of gemma3 (norms, window, GeGLU, embedding scale give differences of
    tens): max difference < 6, argmaxes agreeing at >= 60% of positions (70% while llama.cpp got
    the Q4_K tensors as F32; 9 / 13 is 69%). About 40 s on an idle 2-core
    machine (200 s loaded): run by `make test-llamacpp-gemma3` (BT_LLAMACPP_GEMMA3=1), not by
    `make test`, whose 30-minute budget it does not fit."""
    if os.environ.get("BT_LLAMACPP_GEMMA3") != "1":
        pytest.skip("the Gemma 3 270M agreement takes 40-90 s: `make test-llamacpp-gemma3` runs it")
    model = os.path.join(ROOT, "models", "gemma-3-270m-q4_k_m.gguf")
    if not os.path.exists(model):
        pytest.skip(f"{model} not present (make model MODEL=gemma3-270m)")
    out = str(tmp_path / "agreement.json")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "reference", "llamacpp_agreement.py"),
                        "--model", model, "--prompts", "1", "--n-new", "8", "--no-greedy", "--json", out],
                       capture_output=True, text=True, timeout=900, env=TOOL_ENV, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    print(p.stdout)
    res = json.load(open(out))
    for cond in ("base", "adapter"):
        for row in res[cond]:
            assert 0 < row["max_abs_diff"] < 6, (cond, row)
            assert row["argmax_agree"] >= 0.6 * row["tokens"], (cond, row)  # see the docstring


# ---- Qwen2 (issue 24) ----

def test_qwen2_gguf_exports_in_llamacpp(lc, tmp_path):
    """The tiny Qwen2 of tests/reference/gen_qwen_fixtures.py (general.architecture "qwen2") in
    llama.cpp: our merged export (f32, q/k rows in HF order as Qwen2Model writes them, biases)
    gives transformers' logits of base + adapter (llama.cpp computes F32 weights in fp32), and
    llama.cpp's greedy tokens on the fixture GGUF itself equal transformers' (its BF16 matmuls
    round the activations to bf16, so its logits differ by ~0.04 there; the greedy picks have
    margins above 1e-3)."""
    import numpy as np
    fix = os.path.join(ROOT, "tests/fixtures/hf/qwen")

    def f32(path, name):
        t = st_read(path)[0][name]
        return np.frombuffer(t[2], dtype=np.float32 if t[0] == "F32" else np.int32).reshape(t[1])

    out = str(tmp_path / "merged.gguf")
    r = subprocess.run([os.path.join(BUILD, "trainer"), "export", "--model",
                        os.path.join(fix, "qwen2/model.gguf"), "--adapter",
                        os.path.join(fix, "qwen2/adapter-init"), "--format", "gguf", "--dtype",
                        "f32", "--out", out], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    ids = f32(os.path.join(fix, "batch.safetensors"), "input_ids").reshape(-1)[24:48].tolist()
    want = f32(os.path.join(fix, "qwen2/ref.safetensors"), "logits")[24:48]
    m = lc.load_model(out)
    assert m.meta("general.architecture") == "qwen2"
    err = float(np.abs(m.context(n_ctx=64).logits(ids) - want).max())
    print(f"llama.cpp: qwen2 merged f32 export, logits max abs err vs transformers {err:.3g}")
    assert err <= 1e-4
    with open(os.path.join(fix, "manifest.json")) as f:
        man = json.load(f)
    base = lc.load_model(os.path.join(fix, "qwen2/model.gguf"))
    assert base.context(n_ctx=64).greedy(man["generate"]["prompt_ids"], 8) == \
        man["qwen2"]["greedy_base"]


# ---- Phi-3 (issue 24) ----

def test_phi3_gguf_and_lora_in_llamacpp(lc, tmp_path):
    """The tiny Phi-3 of tests/reference/gen_phi3_fixtures.py (general.architecture "phi3", fused
    blk.N.attn_qkv / blk.N.ffn_up) in llama.cpp: its greedy tokens on the fixture GGUF equal
    transformers' (the picks have margins above 1e-3), and with our gguf-lora export of the
    fixture's PEFT adapter (every linear as PEFT names it for Phi-3: the fused qkv_proj /
    gate_up_proj as blk.N.attn_qkv / ffn_up lora_a / lora_b, the tensors llama.cpp's phi3 graph
    multiplies, plus attn_output / ffn_down) applied, equal transformers + PEFT's. The logits error
    is printed (llama.cpp's BF16 matmuls round the activations to bf16). And our merged f32 GGUF
    (attn_qkv / ffn_up re-fused, phi3.attention.sliding_window) gives transformers + PEFT's logits
    in llama.cpp within 1e-4 (F32 weights: fp32 arithmetic) and its greedy tokens."""
    import numpy as np
    fix = os.path.join(ROOT, "tests/fixtures/hf/phi3")
    with open(os.path.join(fix, "manifest.json")) as f:
        man = json.load(f)
    lora = str(tmp_path / "lora.gguf")
    r = subprocess.run([os.path.join(BUILD, "trainer"), "export", "--model",
                        os.path.join(fix, "model.gguf"), "--adapter",
                        os.path.join(fix, "adapter-init"), "--format", "gguf-lora", "--dtype",
                        "f32", "--out", lora], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    m = lc.load_model(os.path.join(fix, "model.gguf"))
    assert m.meta("general.architecture") == "phi3"
    prompt = man["generate"]["prompt_ids"]
    assert m.context(n_ctx=64).greedy(prompt, 8) == man["phi3"]["greedy_base"]
    a = m.lora(lora)
    assert m.context(n_ctx=64, adapter=a).greedy(prompt, 8) == man["phi3"]["greedy_lora"]
    t = st_read(os.path.join(fix, "batch.safetensors"))[0]["input_ids"]
    ids = np.frombuffer(t[2], dtype=np.int32).reshape(-1)[24:48].tolist()
    t = st_read(os.path.join(fix, "ref.safetensors"))[0]["logits"]
    want = np.frombuffer(t[2], dtype=np.float32).reshape(t[1])[24:48]
    err = float(np.abs(m.context(n_ctx=64, adapter=a).logits(ids) - want).max())
    print(f"llama.cpp: phi3 GGUF + our gguf-lora, logits max abs err vs transformers + PEFT "
          f"{err:.3g}")
    assert err <= 0.1  # bf16 activations (the Qwen2 GGUF shows ~0.04 the same way)
    merged = str(tmp_path / "merged.gguf")
    r = subprocess.run([os.path.join(BUILD, "trainer"), "export", "--model",
                        os.path.join(fix, "model.gguf"), "--adapter",
                        os.path.join(fix, "adapter-init"), "--format", "gguf", "--dtype", "f32",
                        "--out", merged], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    mm = lc.load_model(merged)
    assert mm.meta("general.architecture") == "phi3"
    err = float(np.abs(mm.context(n_ctx=64).logits(ids) - want).max())
    print(f"llama.cpp: phi3 merged f32 export, logits max abs err vs transformers + PEFT {err:.3g}")
    assert err <= 1e-4
    assert mm.context(n_ctx=64).greedy(prompt, 8) == man["phi3"]["greedy_lora"]


# ---- Gemma 3 (issue 24) ----

@pytest.mark.parametrize("fam", ["gemma3", "gemma3-linear"])
def test_gemma3_merged_gguf_in_llamacpp(lc, tmp_path, fam):
    """The tiny Gemma 3 of tests/reference/gen_gemma3_fixtures.py (6 layers, window 6, every 6th
    layer global, QK-norm, sandwich norms, GeGLU, tied) merged with the fixture's adapter by
    `trainer export --format gguf --dtype f32`: llama.cpp b8929 loads it without a warning as
    "gemma3" and, on the fixture's longest document (longer than the window, so the local layers'
    window counts), gives transformers + PEFT's logits and ours (bt_logits on the merged file)
    within TOL f16, not f32: ggml-cpu computes GELU (GeGLU's gate) from a table of F16 values
    (GGML_GELU_FP16: the input rounded to F16, the result an F16), so on F32 weights this model's
    logits (up to ~4.6) differ from the fp32 GELU's by ~3e-3 (measured 3.2e-3; with that table
    emulated in transformers, 3.1e-4). The adapter moves these logits by 5.1, the base alone is
    far outside the tolerance.
    gemma3-linear (gen_gemma3_fixtures.py --variant linear): the same weights and adapter with
    Gemma 3 4B+'s linear RoPE scaling (factor 8, global layer only); our merged GGUF carries it as
    gemma3.rope.scaling.type / .factor and llama.cpp, applying it to the global layers only
    (rope_freq_scale_train_swa 1), gives the scaled reference, which is far from the unscaled
    one: a dropped key fails here."""
    fix = os.path.join(ROOT, "tests/fixtures/hf", fam)
    merged = str(tmp_path / "merged.gguf")
    r = subprocess.run([os.path.join(BUILD, "trainer"), "export", "--model",
                        os.path.join(fix, "model.gguf"), "--adapter",
                        os.path.join(fix, "adapter-init"), "--format", "gguf", "--dtype", "f32",
                        "--out", merged], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    b = st_read(os.path.join(fix, "batch.safetensors"))[0]
    ids = np.frombuffer(b["input_ids"][2], dtype=np.int32).reshape(-1)
    cu = np.frombuffer(b["cu_seqlens"][2], dtype=np.int32).tolist()
    a, e = max(zip(cu[:-1], cu[1:]), key=lambda x: x[1] - x[0])
    assert e - a > 6  # past the window
    t = st_read(os.path.join(fix, "ref.safetensors"))[0]["logits"]
    want = np.frombuffer(t[2], dtype=np.float32).reshape(t[1])[a:e]
    mm = lc.load_model(merged)
    assert mm.meta("general.architecture") == "gemma3"
    assert mm.load_problems == [], f"llama.cpp warned on our merged Gemma 3 GGUF: {mm.load_problems}"
    got = mm.context(n_ctx=64).logits(ids[a:e].tolist())
    check_logits("gemma3 merged f32 vs transformers + PEFT", got, want, TOL["f16"])
    check_logits("gemma3 merged f32 vs ours", got, bt_logits(merged, ids[a:e].tolist(), tmp_path),
                 TOL["f16"])
    t = st_read(os.path.join(fix, "ref.safetensors"))[0]["logits_base"]
    base = np.frombuffer(t[2], dtype=np.float32).reshape(t[1])[a:e]
    assert float(np.abs(base - want).max()) > 10 * TOL["f16"]  # can fail: unmerged is far
    if fam == "gemma3-linear":
        assert mm.meta("gemma3.rope.scaling.type") == "linear"
        t = st_read(os.path.join(ROOT, "tests/fixtures/hf/gemma3/ref.safetensors"))[0]["logits"]
        unscaled = np.frombuffer(t[2], dtype=np.float32).reshape(t[1])[a:e]
        d = float(np.abs(unscaled - want).max())
        print(f"gemma3-linear: the unscaled model's logits are {d:.3g} away")
        assert d > 10 * TOL["f16"]  # can fail: llama.cpp without the scaling is far


# ---- Qwen3 (issue 24) ----

def f32_copy(src, dst):
    """`src` GGUF rewritten with every F16 / BF16 tensor as its exact F32 value (gguf-py's
    dequantisation, bit-identical to ours), metadata as is: a base on which llama.cpp's arithmetic
    is fp32 like ours (on BF16 weights ggml-cpu rounds the activations to bf16)."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, bytes(r.fields["general.architecture"].parts[-1]).decode())
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", "general.file_type"):
            continue
        vt = f.types[0]
        w.add_key_value(f.name, f.contents(), vt,
                        sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    half = (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
    for t in r.tensors:
        if t.tensor_type in half:
            w.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type)
                         .astype(np.float32).reshape([int(x) for x in reversed(t.shape)]))
        else:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_qwen3_trained_exports_in_llamacpp(lc, trainer_stack, tmp_path):
    """The tiny Qwen3 of tests/reference/gen_qwen_fixtures.py (general.architecture "qwen3":
    per-head RMSNorm on q and k, head_dim 16 apart from hidden / heads = 8, tied embedding), as F32,
    trained 8 steps by `trainer train` through loaderd (LoRA r 4 on the seven linears,
    tests/py/family_e2e.py), exported as `gguf-lora` and as a merged GGUF (f32): llama.cpp b8929
    loads both without a warning; with our LoRA GGUF on the base its logits equal ours (bt_logits
    with the trained PEFT adapter) within TOL f32, and the adapter moves them well past it; the
    merged GGUF gives the same logits within TOL f32; greedy texts equal `trainer generate`'s."""
    from family_e2e import train
    base = tmp_path / "model.gguf"  # inside trainer_stack's model_roots
    f32_copy(os.path.join(ROOT, "tests/fixtures/hf/qwen/qwen3/model.gguf"), str(base))
    peft_dir = str(train(trainer_stack, tmp_path, base, MODS, "qwen3 (llama.cpp)"))
    trainer = os.path.join(BUILD, "trainer")
    lora, merged = str(tmp_path / "lora.gguf"), str(tmp_path / "merged.gguf")
    for fmt, out in (("gguf-lora", lora), ("gguf", merged)):
        run([trainer, "export", "--model", str(base), "--adapter", peft_dir, "--format", fmt,
             "--dtype", "f32", "--out", out])
    m = lc.load_model(str(base))
    assert m.meta("general.architecture") == "qwen3" and m.n_vocab == 260
    assert m.load_problems == [], m.load_problems
    a = m.lora(lora)
    assert a.load_problems == [], f"llama.cpp warned on our Qwen3 LoRA GGUF: {a.load_problems}"
    mm = lc.load_model(merged)
    assert mm.meta("general.architecture") == "qwen3"
    assert mm.load_problems == [], f"llama.cpp warned on our merged Qwen3 GGUF: {mm.load_problems}"
    ctx, plain, mctx = m.context(128, adapter=a), m.context(128), mm.context(128)
    prompt = "The quick brown fox jumps"
    ids = m.tokenize(prompt, parse_special=True)
    assert ids == mm.tokenize(prompt, parse_special=True) and len(ids) >= 10
    want = bt_logits(str(base), ids, tmp_path, adapter=peft_dir)
    check_logits("qwen3 lora f32", ctx.logits(ids), want, TOL["f32"])
    assert np.max(np.abs(plain.logits(ids) - want)) > 4 * TOL["f32"]  # the adapter is applied
    check_logits("qwen3 merged f32", mctx.logits(ids), bt_logits(merged, ids, tmp_path), TOL["f32"])
    check_logits("qwen3 merged f32 vs adapter", mctx.logits(ids), want, TOL["f32"])
    check_greedy("qwen3 lora f32", m, ctx, str(base), prompt, ids, TOL["f32"], tmp_path,
                 adapter=peft_dir, strict=True)
    check_greedy("qwen3 merged f32", mm, mctx, merged, prompt, ids, TOL["f32"], tmp_path,
                 strict=True)
    mm.close()
    m.close()


# ---- a LoRA on a base whose Q4_K tensors llama.cpp repacks ----

def test_lora_on_repacked_q4_k(lc, tmp_path):
    """llama.cpp repacks Q4_K tensors into its CPU_REPACK buffer (q4_K_8x8 on AVX2 machines, rows
    a multiple of 8), as users' llama.cpp does by default (use_extra_bufts). b4965 crashed in
    llama_adapter_lora_init on such a base; b8929 puts the LoRA tensors of those weights in the
    plain CPU buffer, saying so per tensor ("cannot use buft 'CPU_REPACK', fallback to CPU"). A
    tiny Llama (hidden 256, FFN 512: Q4_K rows are multiples of 256) with Q4_K linears and our
    gguf-lora (f32) of a random adapter: the repacked base takes the adapter, and its logits equal
    ours (bt_logits, fp32 activations on the dequantised Q4_K weights) within TOL q8_0 (llama.cpp
    rounds the activations to Q8_K before a Q4_K matmul; measured ~0.015 of logits up to ~1.1),
    as do those of the same file loaded without repacking; the adapter moves them far more."""
    base = str(tmp_path / "q4k.gguf")
    shape = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "ffn": 512}
    run([tool("mk_tiny_gguf"), "--out", base, "--tokenizer-from",
         os.path.join(ROOT, "tests/fixtures/hf/qwen/qwen3/model.gguf"), "--type", "Q4_K",
         "--seed", "3", *[a for k, v in shape.items() for a in (f"--{k.replace('_', '-')}", str(v))]])
    peft_dir = str(tmp_path / "peft")
    make_peft(peft_dir, shape=shape)
    lora = str(tmp_path / "lora.gguf")
    run([os.path.join(BUILD, "trainer"), "export", "--model", base, "--adapter", peft_dir,
         "--format", "gguf-lora", "--dtype", "f32", "--out", lora])
    ids = [257, 108, 108, 111, 258, 32, 99, 97, 116, 100, 101, 102]
    want = bt_logits(base, ids, tmp_path, adapter=peft_dir)
    for repack in (True, False):
        since = len(lc.log)
        m = lc.load_model(base, repack=repack)
        repacked = any("CPU_REPACK model buffer size" in t for _, t in lc.log[since:])
        if repack and not repacked:  # ggml-cpu repacks Q4_K on AVX2 (and ARM NEON) CPUs only
            pytest.skip("llama.cpp does not repack Q4_K on this CPU (no AVX2)")
        assert repacked == repack, lc.log[since:]
        a = m.lora(lora)
        fallback = [p for p in a.load_problems if "cannot use buft 'CPU_REPACK', fallback to CPU" in p]
        assert len(fallback) == (14 if repack else 0) and fallback == a.load_problems, a.load_problems
        got = m.context(64, adapter=a).logits(ids)
        check_logits(f"q4_k lora, repacked {repack}", got, want, TOL["q8_0"])
        assert np.max(np.abs(m.context(64).logits(ids) - want)) > 4 * TOL["q8_0"]
        m.close()
