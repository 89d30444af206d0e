"""`trainer export` end to end on the tiny Hugging Face fixture model
(tests/fixtures/hf/tiny-llama-tied, loaded by the trainer as a HF directory) with a random
non-zero PEFT adapter written here in pure Python.

Always (standard library only): exit codes and usage errors, the PEFT output's files, keys, shapes
and dtype, the merged safetensors' keys, shapes, dtypes, config.json, and its merged values
against W + (alpha/r) B A computed here; sanitizer-clean runs of the ASan build when it exists.

When the `gguf` package (gguf-py 0.19.0, with numpy) is importable: our GGUF files read back with
gguf.GGUFReader (architecture, general.type, adapter.type, alpha, tensor names / shapes / types),
lora_b un-permuted equals B, the merged GGUF equals permute(W + s B A), our Q8_0 bytes equal
gguf.quants.quantize of the F32 export, and (with $BT_MODEL) the real SmolLM2 GGUF's tokenizer
metadata is carried into the merged file. Skipped with a reason otherwise.

Full numerical cross-checks against transformers/peft live in tests/reference/check_exports.py.
"""
import array
import json
import math
import os
import random
import struct
import subprocess

import pytest

from conftest import ROOT, SAN_ENV

TINY = os.path.join(ROOT, "tests", "fixtures", "hf", "tiny-llama-tied")
MODS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GGUF_LIN = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
R, ALPHA = 4, 8

try:
    import numpy as np
    import gguf
    HAVE_GGUF = True
except ImportError:  # CI installs only pytest by default
    HAVE_GGUF = False
needs_gguf = pytest.mark.skipif(not HAVE_GGUF, reason="gguf-py (pip install gguf==0.19.0 numpy) "
                                "not installed")


# ---- pure-Python safetensors ----

def st_read(path):
    """{name: (dtype, shape, bytes)} and metadata of a safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        hdr = json.loads(f.read(n))
        data = f.read()
    meta = hdr.pop("__metadata__", {})
    out = {}
    for k, v in hdr.items():
        b, e = v["data_offsets"]
        out[k] = (v["dtype"], v["shape"], data[b:e])
    return out, meta


def st_write(path, tensors):
    """tensors: {name: (shape, list of floats)} written as F32."""
    hdr, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for k in sorted(tensors):
        shape, vals = tensors[k]
        b = array.array("f", vals).tobytes()
        hdr[k] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(hdr).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def f32(b):
    return array.array("f", b).tolist()


def hf_weights(d):
    """All F32 tensors of a (sharded) HF directory as {name: (shape, flat list)}."""
    out = {}
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".safetensors"):
            t, _ = st_read(os.path.join(d, fn))
            for k, (dt, shape, b) in t.items():
                assert dt == "F32"
                out[k] = (shape, f32(b))
    return out


def tiny_config():
    with open(os.path.join(TINY, "config.json")) as f:
        return json.load(f)


def make_adapter(d, mods=MODS, seed=5):
    """A PEFT adapter for the tiny model with random A and non-zero B; returns {key: (shape, vals)}."""
    cfg = tiny_config()
    H, F = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"q_proj": (q, H), "k_proj": (kv, H), "v_proj": (kv, H), "o_proj": (H, q),
              "gate_proj": (F, H), "up_proj": (F, H), "down_proj": (H, F)}
    rng = random.Random(seed)
    t = {}
    for layer in range(cfg["num_hidden_layers"]):
        for m in mods:
            out_f, in_f = shapes[m]
            blk = "self_attn" if m in MODS[:4] else "mlp"
            pre = f"base_model.model.model.layers.{layer}.{blk}.{m}"
            t[pre + ".lora_A.weight"] = ([R, in_f], [rng.uniform(-0.1, 0.1) for _ in range(R * in_f)])
            t[pre + ".lora_B.weight"] = ([out_f, R], [rng.gauss(0, 0.05) for _ in range(out_f * R)])
    os.makedirs(d, exist_ok=True)
    st_write(os.path.join(d, "adapter_model.safetensors"), t)
    conf = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": R, "lora_alpha": ALPHA,
            "lora_dropout": 0.0, "target_modules": list(mods), "bias": "none",
            "fan_in_fan_out": False, "base_model_name_or_path": TINY, "use_dora": False,
            "use_rslora": False, "megatron_core": "megatron.core", "loftq_config": {}}
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        json.dump(conf, f)
    return t


def merged_ref(w, a, b):
    """W[out,in] + (alpha/r) B[out,r] A[r,in] as a flat list (double accumulation)."""
    (out_f, in_f), wv = w
    av, bv = a[1], b[1]
    s = ALPHA / R
    res = []
    for o in range(out_f):
        brow = bv[o * R:(o + 1) * R]
        for c in range(in_f):
            res.append(wv[o * in_f + c] + s * sum(brow[k] * av[k * in_f + c] for k in range(R)))
    return res


def run_export(bins, *args, asan=False, check=True):
    exe = bins.path("trainer", asan)
    if not os.access(exe, os.X_OK):
        pytest.skip(f"{exe} not built")
    env = dict(os.environ)
    if asan:
        env.update(SAN_ENV)
    p = subprocess.run([exe, "export", *args], capture_output=True, text=True, env=env, timeout=300,
                       cwd=ROOT)
    if check:
        assert p.returncode == 0, f"rc {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}"
    return p


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("adapter") / "peft")
    return d, make_adapter(d)


# ---- always ----

def test_usage_errors(bins, adapter, tmp_path):
    d, _ = adapter
    p = run_export(bins, check=False)
    assert p.returncode == 2 and "--model" in p.stderr
    p = run_export(bins, "--help", check=False)
    assert p.returncode == 0 and "gguf-lora" in p.stdout
    p = run_export(bins, "--model", TINY, "--adapter", d, "--format", "onnx", "--out",
                   str(tmp_path / "x"), check=False)
    assert p.returncode == 2 and "onnx" in p.stderr
    p = run_export(bins, "--model", TINY, "--adapter", d, "--format", "safetensors", "--dtype", "q8_0",
                   "--out", str(tmp_path / "x"), check=False)
    assert p.returncode == 2 and "q8_0" in p.stderr
    p = run_export(bins, "--model", TINY, "--adapter", str(tmp_path / "none"), "--format", "gguf",
                   "--out", str(tmp_path / "x.gguf"), check=False)
    assert p.returncode == 1 and "adapter_config.json" in p.stderr
    assert not os.path.exists(tmp_path / "x.gguf")


def test_peft_output(bins, adapter, tmp_path):
    d, ref = adapter
    out = str(tmp_path / "peft")
    run_export(bins, "--model", TINY, "--adapter", d, "--format", "peft", "--out", out)
    with open(os.path.join(out, "adapter_config.json")) as f:
        conf = json.load(f)
    assert conf["peft_type"] == "LORA" and conf["r"] == R and conf["lora_alpha"] == ALPHA
    assert sorted(conf["target_modules"]) == sorted(MODS)
    assert conf["base_model_name_or_path"] == TINY
    assert conf["use_rslora"] is False and conf["use_dora"] is False and conf["bias"] == "none"
    for k in ("megatron_core", "loftq_config", "eva_config"):  # normalised to the core key set
        assert k not in conf
    t, meta = st_read(os.path.join(out, "adapter_model.safetensors"))
    assert meta == {"format": "pt"}
    assert set(t) == set(ref)
    for k, (dt, shape, b) in t.items():
        assert dt == "F32" and shape == ref[k][0]
        assert f32(b) == f32(array.array("f", ref[k][1]).tobytes())


def test_merged_safetensors(bins, adapter, tmp_path):
    d, ref = adapter
    base = hf_weights(TINY)
    cfg = tiny_config()
    for dtype in ("f32", "f16", "bf16"):
        out = str(tmp_path / dtype)
        run_export(bins, "--model", TINY, "--adapter", d, "--format", "safetensors", "--dtype", dtype,
                   "--out", out)
        t, meta = st_read(os.path.join(out, "model.safetensors"))
        assert meta == {"format": "pt"}
        assert set(t) == set(base)  # tied: no lm_head.weight, like the fixture
        want_dt = {"f32": "F32", "f16": "F16", "bf16": "BF16"}[dtype]
        for k, (dt, shape, _) in t.items():
            assert dt == want_dt and shape == base[k][0], k
        with open(os.path.join(out, "config.json")) as f:
            c = json.load(f)
        for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "vocab_size", "tie_word_embeddings", "rms_norm_eps",
                  "rope_theta", "head_dim", "model_type", "architectures"):
            assert c[k] == cfg[k], k
        assert c["torch_dtype"] == {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[dtype]
        if dtype == "f32":
            for layer, m in ((0, "v_proj"), (1, "down_proj"), (1, "q_proj")):
                blk = "self_attn" if m in MODS[:4] else "mlp"
                key = f"model.layers.{layer}.{blk}.{m}.weight"
                pre = f"base_model.model.{key[:-len('.weight')]}"
                want = merged_ref(base[key], ref[pre + ".lora_A.weight"], ref[pre + ".lora_B.weight"])
                got = f32(t[key][2])
                err = max(abs(x - y) for x, y in zip(got, want))
                assert err < 1e-5, (key, err)
                assert max(abs(x - y) for x, y in zip(base[key][1], want)) > 1e-3  # adapter matters
            assert f32(t["model.norm.weight"][2]) == base["model.norm.weight"][1]


def test_asan_runs(bins, adapter, tmp_path):
    if not bins.have("trainer", asan=True):
        pytest.skip("ASan trainer not built (make build/asan/trainer)")
    d, _ = adapter
    for fmt, out in (("gguf-lora", "l.gguf"), ("gguf", "m.gguf"), ("safetensors", "st"), ("peft", "p")):
        run_export(bins, "--model", TINY, "--adapter", d, "--format", fmt, "--dtype",
                   "f32", "--out", str(tmp_path / out), asan=True)


# ---- with gguf-py ----

def permute(w, n_head):
    """convert_hf_to_gguf.py LlamaModel.permute."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def kv(reader, key):
    f = reader.fields[key]
    v = f.parts[f.data[0]]
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(v).decode()
    return v[0].item() if hasattr(v[0], "item") else v[0]


@needs_gguf
def test_gguf_lora_with_gguf_py(bins, adapter, tmp_path):
    d, ref = adapter
    cfg = tiny_config()
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for dtype, want in (("f32", {"a": "F32", "b": "F32"}), ("f16", {"a": "F16", "b": "F16"}),
                        ("q8_0", {"a": "Q8_0", "b": "F16"})):
        out = str(tmp_path / f"lora_{dtype}.gguf")
        run_export(bins, "--model", TINY, "--adapter", d, "--format", "gguf-lora", "--dtype", dtype,
                   "--out", out)
        r = gguf.GGUFReader(out)
        assert kv(r, "general.architecture") == "llama"
        assert kv(r, "general.type") == "adapter"
        assert kv(r, "adapter.type") == "lora"
        assert r.fields["adapter.lora.alpha"].types[0] == gguf.GGUFValueType.FLOAT32
        assert kv(r, "adapter.lora.alpha") == ALPHA
        tensors = {t.name: t for t in r.tensors}
        assert len(tensors) == 2 * len(MODS) * cfg["num_hidden_layers"]
        for layer in range(cfg["num_hidden_layers"]):
            for m, g in zip(MODS, GGUF_LIN):
                blk = "self_attn" if m in MODS[:4] else "mlp"
                pre = f"base_model.model.model.layers.{layer}.{blk}.{m}"
                A = np.array(ref[pre + ".lora_A.weight"][1], np.float32).reshape(ref[pre + ".lora_A.weight"][0])
                B = np.array(ref[pre + ".lora_B.weight"][1], np.float32).reshape(ref[pre + ".lora_B.weight"][0])
                ta, tb = tensors[f"blk.{layer}.{g}.weight.lora_a"], tensors[f"blk.{layer}.{g}.weight.lora_b"]
                # gguf-py reports ne order: lora_a (in, r), lora_b (r, out)
                assert list(ta.shape) == [A.shape[1], R] and list(tb.shape) == [R, B.shape[0]]
                assert ta.tensor_type.name == want["a"] and tb.tensor_type.name == want["b"]
                a = gguf.quants.dequantize(ta.data, ta.tensor_type).reshape(A.shape).astype(np.float32)
                b = gguf.quants.dequantize(tb.data, tb.tensor_type).reshape(B.shape).astype(np.float32)
                Bp = permute(B, nh if m == "q_proj" else nkv) if m in ("q_proj", "k_proj") else B
                tol = 0 if dtype == "f32" else 1e-3 if dtype == "f16" else 2e-3
                assert np.max(np.abs(b - Bp)) <= tol * max(1.0, np.max(np.abs(B)))
                assert np.max(np.abs(a - A)) <= tol * max(1.0, np.max(np.abs(A)))
                if dtype == "q8_0":  # our quantiser is gguf-py's, byte for byte
                    assert np.array_equal(np.asarray(ta.data).view(np.uint8).ravel(),
                                          gguf.quants.quantize(A, gguf.GGMLQuantizationType.Q8_0).ravel())


@needs_gguf
def test_merged_gguf_with_gguf_py(bins, adapter, tmp_path):
    d, ref = adapter
    cfg = tiny_config()
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    base = hf_weights(TINY)
    files = {}
    for dtype in ("f32", "f16", "q8_0"):
        out = str(tmp_path / f"merged_{dtype}.gguf")
        p = run_export(bins, "--model", TINY, "--adapter", d, "--format", "gguf", "--dtype", dtype,
                       "--out", out)
        assert "tokenizer" in p.stderr  # warned: a HF base has no tokenizer metadata to copy
        files[dtype] = gguf.GGUFReader(out)
    r32 = files["f32"]
    assert kv(r32, "general.architecture") == "llama" and kv(r32, "general.file_type") == 0
    assert kv(files["f16"], "general.file_type") == 1 and kv(files["q8_0"], "general.file_type") == 7
    assert kv(r32, "llama.block_count") == cfg["num_hidden_layers"]
    assert kv(r32, "llama.attention.head_count_kv") == nkv
    assert kv(r32, "llama.rope.dimension_count") == cfg["head_dim"]
    assert abs(kv(r32, "llama.attention.layer_norm_rms_epsilon") - cfg["rms_norm_eps"]) < 1e-12
    t32 = {t.name: t for t in r32.tensors}
    assert "output.weight" not in t32  # tied
    assert len(t32) == 2 + 9 * cfg["num_hidden_layers"]
    for layer in range(cfg["num_hidden_layers"]):
        for m, g in zip(MODS, GGUF_LIN):
            blk = "self_attn" if m in MODS[:4] else "mlp"
            key = f"model.layers.{layer}.{blk}.{m}.weight"
            pre = f"base_model.model.model.layers.{layer}.{blk}.{m}"
            W = np.array(base[key][1], np.float32).reshape(base[key][0])
            A = np.array(ref[pre + ".lora_A.weight"][1], np.float32).reshape(R, -1)
            B = np.array(ref[pre + ".lora_B.weight"][1], np.float32).reshape(-1, R)
            want = W + (ALPHA / R) * (B @ A)
            if m in ("q_proj", "k_proj"):
                want = permute(want, nh if m == "q_proj" else nkv)
            t = t32[f"blk.{layer}.{g}.weight"]
            assert list(t.shape) == [W.shape[1], W.shape[0]]
            got = np.asarray(t.data).reshape(want.shape)
            assert np.max(np.abs(got - want)) < 1e-5
            # F16 = float16(F32); Q8_0 = gguf-py's quantiser applied to the F32 export
            t16 = {x.name: x for x in files["f16"].tensors}[t.name]
            assert t16.tensor_type == gguf.GGMLQuantizationType.F16
            assert np.array_equal(np.asarray(t16.data).reshape(want.shape), got.astype(np.float16))
            tq = {x.name: x for x in files["q8_0"].tensors}[t.name]
            assert tq.tensor_type == gguf.GGMLQuantizationType.Q8_0
            assert np.array_equal(np.asarray(tq.data).view(np.uint8).ravel(),
                                  gguf.quants.quantize(got, gguf.GGMLQuantizationType.Q8_0).ravel())
    assert {x.name: x for x in files["q8_0"].tensors}["blk.0.attn_norm.weight"].tensor_type == \
        gguf.GGMLQuantizationType.F32


@needs_gguf
def test_real_model_metadata_carried(bins, model_path, tmp_path):
    """SmolLM2-135M GGUF base: a q_proj-only adapter merged into a Q8_0 GGUF keeps the base's
    tokenizer and general metadata; gguf-lora from the real base has the real shapes."""
    src = gguf.GGUFReader(model_path)
    nl = kv(src, "llama.block_count")
    D = kv(src, "llama.embedding_length")
    d = str(tmp_path / "adapter")
    rng = np.random.default_rng(0)
    t = {}
    for layer in range(nl):
        pre = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        t[pre + ".lora_A.weight"] = ([2, D], rng.uniform(-0.05, 0.05, 2 * D).tolist())
        t[pre + ".lora_B.weight"] = ([D, 2], rng.normal(0, 0.01, 2 * D).tolist())
    os.makedirs(d)
    st_write(os.path.join(d, "adapter_model.safetensors"), t)
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}, f)
    out = str(tmp_path / "lora.gguf")
    run_export(bins, "--model", model_path, "--adapter", d, "--format", "gguf-lora", "--out", out)
    r = gguf.GGUFReader(out)
    assert len(r.tensors) == 2 * nl
    assert list({x.name: x for x in r.tensors}["blk.3.attn_q.weight.lora_b"].shape) == [2, D]
    out = str(tmp_path / "merged.gguf")
    run_export(bins, "--model", model_path, "--adapter", d, "--format", "gguf", "--dtype", "q8_0",
               "--out", out)
    m = gguf.GGUFReader(out)
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "general.name",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        if key in src.fields:
            assert kv(m, key) == kv(src, key), key
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        if key in src.fields:
            assert len(m.fields[key].data) == len(src.fields[key].data), key
    if "tokenizer.chat_template" in src.fields:
        assert kv(m, "tokenizer.chat_template") == kv(src, "tokenizer.chat_template")
    assert kv(m, "general.file_type") == 7
    names = {x.name for x in m.tensors}
    assert names == {x.name for x in src.tensors}
    # untouched layers keep the (dequantised, requantised) base: k_proj matches closely
    ks = {x.name: x for x in src.tensors}["blk.0.attn_k.weight"]
    km = {x.name: x for x in m.tensors}["blk.0.attn_k.weight"]
    a = gguf.quants.dequantize(ks.data, ks.tensor_type)
    b = gguf.quants.dequantize(km.data, km.tensor_type)
    assert np.max(np.abs(a - b)) <= np.max(np.abs(a)) / 127
    assert math.isfinite(float(np.sum(b)))


# ---- LoRA+ (PEFT modules_to_save: trained embedding and norms) ----

def make_plus_adapter(d, seed=9):
    """make_adapter on q/v plus LoRA+ tensors (tied tiny model: lm_head == embed_tokens)."""
    t = make_adapter(d, mods=["q_proj", "v_proj"], seed=seed)
    cfg = tiny_config()
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    rng = random.Random(seed + 1)
    emb = [rng.gauss(0, 0.1) for _ in range(V * H)]
    t["base_model.model.model.embed_tokens.weight"] = ([V, H], emb)
    t["base_model.model.lm_head.weight"] = ([V, H], emb)
    for i in range(L):
        for n in ("input_layernorm", "post_attention_layernorm"):
            t[f"base_model.model.model.layers.{i}.{n}.weight"] = ([H], [1 + rng.gauss(0, 0.1) for _ in range(H)])
    t["base_model.model.model.norm.weight"] = ([H], [1 + rng.gauss(0, 0.1) for _ in range(H)])
    st_write(os.path.join(d, "adapter_model.safetensors"), t)
    with open(os.path.join(d, "adapter_config.json")) as f:
        conf = json.load(f)
    conf["modules_to_save"] = ["embed_tokens", "lm_head", "input_layernorm",
                               "post_attention_layernorm", "norm"]
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        json.dump(conf, f)
    return t


def test_lora_plus_exports(bins, tmp_path):
    d = str(tmp_path / "plus")
    t = make_plus_adapter(d)
    L = tiny_config()["num_hidden_layers"]
    # merged safetensors: the trained embedding and norms, bit-exact in f32
    run_export(bins, "--model", TINY, "--adapter", d, "--format", "safetensors", "--dtype", "f32",
               "--out", str(tmp_path / "st"))
    got, _ = st_read(str(tmp_path / "st" / "model.safetensors"))
    assert "lm_head.weight" not in got  # still tied
    assert f32(got["model.embed_tokens.weight"][2]) == f32(array.array("f", t["base_model.model.model.embed_tokens.weight"][1]).tobytes())
    for k in ["model.norm.weight"] + [f"model.layers.{i}.{n}.weight" for i in range(L)
                                      for n in ("input_layernorm", "post_attention_layernorm")]:
        want = f32(array.array("f", t["base_model.model." + k][1]).tobytes())
        assert f32(got[k][2]) == want, k
    # peft: the modules_to_save tensors and config carried over
    run_export(bins, "--model", TINY, "--adapter", d, "--format", "peft", "--out", str(tmp_path / "p"))
    pt, _ = st_read(str(tmp_path / "p" / "adapter_model.safetensors"))
    assert set(pt) == set(t)
    src, _ = st_read(os.path.join(d, "adapter_model.safetensors"))
    for k in t:
        assert pt[k][2] == src[k][2], k
    with open(tmp_path / "p" / "adapter_config.json") as f:
        assert json.load(f)["modules_to_save"] == ["embed_tokens", "lm_head", "input_layernorm",
                                                   "post_attention_layernorm", "norm"]
    # gguf-lora cannot carry them: refused, nothing written
    out = tmp_path / "l.gguf"
    p = run_export(bins, "--model", TINY, "--adapter", d, "--format", "gguf-lora", "--out", str(out),
                   check=False)
    assert p.returncode == 1 and "gguf-lora cannot carry a LoRA+" in p.stderr, p.stderr
    assert not out.exists()
    # a tied lm_head that differs from the embedding is refused with a clear message
    t["base_model.model.lm_head.weight"] = (t["base_model.model.lm_head.weight"][0],
                                            [0.5] * len(t["base_model.model.lm_head.weight"][1]))
    st_write(os.path.join(d, "adapter_model.safetensors"), t)
    p = run_export(bins, "--model", TINY, "--adapter", d, "--format", "safetensors", "--out",
                   str(tmp_path / "st2"), check=False)
    assert p.returncode == 1 and "differs from" in p.stderr, p.stderr


def test_lora_plus_generate(bins, model_path, tmp_path):
    """`trainer generate --adapter` accepts a LoRA+ adapter of the real model (embedding only)."""
    exe = bins.path("trainer")
    if not os.access(exe, os.X_OK):
        pytest.skip(f"{exe} not built")
    H, V, L = 576, 49152, 30  # SmolLM2-135M
    d = tmp_path / "plus"
    d.mkdir()
    blob = array.array("f", [0.0]).tobytes() * (V * H)  # all-zero embedding: a constant prompt
    hdr = {"__metadata__": {"format": "pt"}}
    parts, off = [], 0
    for i in range(L):
        for m, (o, n) in (("q_proj", (H, H)), ("v_proj", (192, H))):
            for ab, shape in (("A", [R, n]), ("B", [o, R])):
                b = array.array("f", [0.0]).tobytes() * (shape[0] * shape[1])
                hdr[f"base_model.model.model.layers.{i}.self_attn.{m}.lora_{ab}.weight"] = {
                    "dtype": "F32", "shape": shape, "data_offsets": [off, off + len(b)]}
                parts.append(b)
                off += len(b)
    hdr["base_model.model.model.embed_tokens.weight"] = {"dtype": "F32", "shape": [V, H],
                                                         "data_offsets": [off, off + len(blob)]}
    parts.append(blob)
    h = json.dumps(hdr).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(d / "adapter_model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in parts:
            f.write(b)
    with open(d / "adapter_config.json", "w") as f:
        json.dump({"peft_type": "LORA", "r": R, "lora_alpha": ALPHA, "target_modules": ["q_proj", "v_proj"],
                   "modules_to_save": ["embed_tokens", "lm_head"]}, f)
    args = [exe, "generate", "--model", model_path, "--prompt", "The capital of France is",
            "--max-new-tokens", "4", "--temperature", "0"]
    base = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert base.returncode == 0, base.stderr
    p = subprocess.run(args + ["--adapter", str(d)], capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    # the lm_head entry is absent from the file: refused by name
    assert p.returncode != 0 and "lm_head" in p.stderr, p.stderr
    with open(d / "adapter_config.json", "w") as f:
        json.dump({"peft_type": "LORA", "r": R, "lora_alpha": ALPHA, "target_modules": ["q_proj", "v_proj"],
                   "modules_to_save": ["embed_tokens"]}, f)
    p = subprocess.run(args + ["--adapter", str(d)], capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr
    # a zero embedding (and tied lm_head) makes every logit 0: the output changes
    assert p.stdout != base.stdout


# ---- the merged Hugging Face directory: sharding, tokenizer and generation files ----

def hub_shards(sizes, limit):
    """huggingface_hub split_state_dict_into_shards_factory on [(name, nbytes)] in order:
    {name: shard index}, shard count."""
    shards, cur, cur_size = [], [], 0
    for name, n in sizes:
        if n > limit:
            shards.append([name])
            continue
        if cur_size + n > limit:
            shards.append(cur)
            cur, cur_size = [], 0
        cur.append(name)
        cur_size += n
    if cur:
        shards.append(cur)
    return {n: i for i, s in enumerate(shards) for n in s}, len(shards)


def state_dict_order(cfg):
    keys = ["model.embed_tokens.weight"]
    for layer in range(cfg["num_hidden_layers"]):
        for m in MODS:
            keys.append(f"model.layers.{layer}.{'self_attn' if m in MODS[:4] else 'mlp'}.{m}.weight")
        keys += [f"model.layers.{layer}.input_layernorm.weight",
                 f"model.layers.{layer}.post_attention_layernorm.weight"]
    return keys + ["model.norm.weight"] + ([] if cfg["tie_word_embeddings"] else ["lm_head.weight"])


def dot_natural_key(s):
    """transformers 5.x core_model_loading.dot_natural_key (copied): save_pretrained sorts the
    state dict by it before cutting shards (revert_weight_conversion)."""
    parts = []
    for part in s.split("."):
        if part.isdigit():
            parts.append((0, int(part)))
        else:
            text_part = part.rstrip("0123456789")
            trailing_digits = part[len(text_part):]
            if trailing_digits != "":
                parts.append((1, text_part, int(trailing_digits)))
            else:
                parts.append((1, text_part))
    return parts


def test_merged_safetensors_sharded(bins, adapter, tmp_path):
    """--max-shard-size cuts model-0000k-of-0000n.safetensors + index exactly as save_pretrained
    (transformers 5.x + huggingface_hub) would: tensors walked in dot_natural_key order (layer 2
    before layer 10), a new shard when the next one would pass the limit; the weights equal the
    single-file export; re-exporting unsharded into the same directory removes the stale shards
    and index; the base directory's generation_config.json is carried over."""
    d, _ = adapter
    one, out = str(tmp_path / "one"), str(tmp_path / "sharded")
    run_export(bins, "--model", TINY, "--adapter", d, "--format", "safetensors", "--dtype", "f32",
               "--out", one)
    single, _ = st_read(os.path.join(one, "model.safetensors"))
    limit = 20000
    run_export(bins, "--model", TINY, "--adapter", d, "--format", "safetensors", "--dtype", "f32",
               "--max-shard-size", "20KB", "--out", out)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        idx = json.load(f)
    order = sorted(state_dict_order(tiny_config()), key=dot_natural_key)
    sizes = [(k, 4 * math.prod(single[k][1])) for k in order]
    want, n = hub_shards(sizes, limit)
    assert n > 2
    names = {k: f"model-{want[k] + 1:05d}-of-{n:05d}.safetensors" for k in order}
    assert idx["weight_map"] == names
    assert idx["metadata"]["total_size"] == sum(s for _, s in sizes)
    got = {}
    for fn in sorted(set(names.values())):
        t, meta = st_read(os.path.join(out, fn))
        assert meta == {"format": "pt"}
        assert sum(len(b) for _, _, b in t.values()) <= limit or len(t) == 1
        got.update(t)
    assert got == single
    assert not os.path.exists(os.path.join(out, "model.safetensors"))
    with open(os.path.join(TINY, "generation_config.json"), "rb") as f1, \
            open(os.path.join(out, "generation_config.json"), "rb") as f2:
        assert f1.read() == f2.read()
    # unsharded again into the same directory: shards and index of the first export go
    run_export(bins, "--model", TINY, "--adapter", d, "--format", "safetensors", "--dtype", "f32",
               "--out", out)
    left = sorted(f for f in os.listdir(out) if "safetensors" in f)
    assert left == ["model.safetensors"], left


def test_max_shard_size_refusals(bins, adapter, tmp_path):
    d, _ = adapter
    for bad in ("0", "-5GB", "5XB", "GB", "5 GB", "1e30"):
        p = run_export(bins, "--model", TINY, "--adapter", d, "--format", "safetensors",
                       "--max-shard-size", bad, "--out", str(tmp_path / "x"), check=False)
        assert p.returncode == 2 and "--max-shard-size" in p.stderr, (bad, p.stderr)
    p = run_export(bins, "--model", TINY, "--adapter", d, "--format", "gguf", "--max-shard-size",
                   "1GB", "--out", str(tmp_path / "x.gguf"), check=False)
    assert p.returncode == 2 and "safetensors only" in p.stderr
    assert not os.path.exists(tmp_path / "x.gguf")


def tokenize(bins, tok, text):
    p = subprocess.run([bins.path("loaderctl"), "tokenize", "--tokenizer", tok, "--ids"],
                       input=text, capture_output=True, text=True, timeout=120, check=True)
    return p.stdout


def test_merged_safetensors_tokenizer_real_model(bins, model_path, tmp_path):
    """From the SmolLM2 GGUF: tokenizer.json, tokenizer_config.json (chat template, special
    tokens), special_tokens_map.json and generation_config.json; our tokenizer reads the exported
    directory back and encodes exactly like the GGUF (digits, specials, whitespace, CJK). The
    comparison with Hugging Face's own AutoTokenizer / pipeline is test_hf_reference_check."""
    cfg = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
           "num_key_value_heads": 3, "num_hidden_layers": 30}
    d = str(tmp_path / "adapter")
    t = {}
    for layer in range(cfg["num_hidden_layers"]):
        pre = f"base_model.model.model.layers.{layer}.self_attn.v_proj"
        t[pre + ".lora_A.weight"] = ([2, 576], [0.01] * 1152)
        t[pre + ".lora_B.weight"] = ([192, 2], [0.001] * 384)
    os.makedirs(d)
    st_write(os.path.join(d, "adapter_model.safetensors"), t)
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["v_proj"]}, f)
    out = str(tmp_path / "hf")
    run_export(bins, "--model", model_path, "--adapter", d, "--format", "safetensors", "--dtype",
               "bf16", "--out", out)
    files = set(os.listdir(out))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json"} <= files, files
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        tc = json.load(f)
    assert tc["bos_token"] == "<|im_start|>" and tc["eos_token"] == "<|im_end|>"
    assert tc["pad_token"] == "<|im_end|>" and tc["unk_token"] == "<|endoftext|>"
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast" and tc["model_max_length"] == 8192
    assert "<|im_start|>" in tc["chat_template"] and tc["added_tokens_decoder"]["2"]["special"]
    assert "<repo_name>" in tc["additional_special_tokens"]
    with open(os.path.join(out, "generation_config.json")) as f:
        assert json.load(f) == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    with open(os.path.join(out, "config.json")) as f:
        c = json.load(f)
    assert (c["bos_token_id"], c["eos_token_id"], c["pad_token_id"]) == (1, 2, 2)
    with open(os.path.join(out, "tokenizer.json")) as f:
        tj = json.load(f)
    assert [p["type"] for p in tj["pre_tokenizer"]["pretokenizers"]] == ["Digits", "ByteLevel"]
    assert len(tj["model"]["vocab"]) == 49152 and len(tj["model"]["merges"]) == 48900
    text = ("Hello 12345 world<|im_start|>user\n  x = [1,2,3]  # comment\t\tend\n"
            "国語は美しい. Ünïcödé 'll 've don't   \n\n\n<|im_end|>\n")
    assert tokenize(bins, out, text) == tokenize(bins, model_path, text)


def test_merged_safetensors_from_hf_base_copies_tokenizer(bins, adapter, tmp_path):
    """A Hugging Face base directory's tokenizer and generation files are carried over byte for
    byte (the model's own tokenizer); config.json gets the ids our tokenizer reads from them."""
    import shutil
    d, _ = adapter
    base = tmp_path / "base"
    shutil.copytree(TINY, base)
    tok = subprocess.run(["zstd", "-dc", os.path.join(ROOT, "tests", "fixtures", "tokenizer",
                                                      "qwen2-tokenizer.json.zst")],
                         capture_output=True, check=True).stdout
    (base / "tokenizer.json").write_bytes(tok)
    tc = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
          "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
          "tokenizer_class": "Qwen2TokenizerFast"}
    (base / "tokenizer_config.json").write_text(json.dumps(tc))
    (base / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    out = tmp_path / "out"
    run_export(bins, "--model", str(base), "--adapter", d, "--format", "safetensors", "--out",
               str(out))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json"):
        assert (out / f).read_bytes() == (base / f).read_bytes(), f
    c = json.loads((out / "config.json").read_text())
    ids = json.loads(tok)
    added = {a["content"]: a["id"] for a in ids["added_tokens"]}
    assert c["eos_token_id"] == added["<|im_end|>"] and c["pad_token_id"] == added["<|endoftext|>"]
    assert "bos_token_id" not in c
