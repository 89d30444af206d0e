"""The PEFT adapter `trainer` writes for Gemma 3, loaded back by the pinned peft / transformers of
python/requirements-torch.txt (`make pytest-torch` runs it with .venv-torch/bin/python).

Base: the tiny random Gemma 3 of tests/reference/gen_gemma3_fixtures.py (tests/fixtures/hf/gemma3:
6 layers, 5 sliding-window (window 6) + 1 full attention, head_dim 24, QK-norm, pre/post norms,
GeGLU, tied 260-token embedding), loaded from the Hugging Face directory and from the gemma3 GGUF.
- export: `trainer export --format peft` of the fixture's adapter (r 4 on q/k/v/o/gate/up/down),
  loaded by peft.PeftModel.from_pretrained on transformers' Gemma3ForCausalLM unchanged, gives the
  fixture's reference logits of base + adapter (computed by transformers + PEFT) on the packed
  batch (documents longer than the 6-token window, so the windowed layers count);
- trained: `trainer train` through loaderd on the Gemma 3 GGUF (8 steps, seq_len 64, well past
  the window) writes an adapter that peft loads with every LoRA tensor taken and that gives our own
  logits with the adapter (build/tools/bt_logits) (tests/py/family_e2e.py).
- safetensors (merged): `trainer export --format safetensors` from either source loads in
  transformers unchanged as Gemma3ForCausalLM (gemma3_text config.json with layer_types,
  rope_parameters per attention type, query_pre_attn_scalar, sliding_window; norms written as HF's
  w, Gemma3RMSNorm's factor being 1 + w) and gives the reference logits of base + adapter;
- gguf (merged): general.architecture "gemma3", the fixture GGUF's tensor names (convert_hf_to_
  gguf.py's: post_attention_norm / post_ffw_norm, no output.weight), its gemma3.* keys, norms
  stored as 1 + w and every other tensor equal to the merged safetensors'; transformers' own GGUF
  reader loads it as Gemma3ForCausalLM (given query_pre_attn_scalar = key_length, which its GGUF
  mapping lacks) with the reference logits.
Tolerance: logits 1e-4 absolute (the fp32 parity tolerance of tests/reference/README.md).
Takes a few seconds."""
import json
import os
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
gguf = pytest.importorskip("gguf")
from safetensors.torch import load_file  # noqa: E402

from conftest import ROOT as _ROOT  # noqa: E402

ROOT = Path(_ROOT)

FIX = ROOT / "tests/fixtures/hf/gemma3"
TRAINER = ROOT / os.environ.get("BT_BUILD", "build") / "trainer"
TARGETS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def packed_logits(model):
    return packed_logits_of(model, FIX)


def packed_logits_of(model, fix):
    b = load_file(str(fix / "batch.safetensors"))
    ids = b["input_ids"].reshape(-1).long()
    cu = b["cu_seqlens"].tolist()
    with torch.no_grad():
        return torch.cat([model(input_ids=ids[a:e][None]).logits.float()[0]
                          for a, e in zip(cu[:-1], cu[1:])])


@pytest.mark.parametrize("src", ["hf", "model.gguf"])
def test_peft_adapter_in_peft(tmp_path, src):
    out = tmp_path / "adapter"
    r = subprocess.run([str(TRAINER), "export", "--model", str(FIX / src), "--adapter",
                        str(FIX / "adapter-init"), "--format", "peft", "--dtype", "f32",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert sorted(cfg["target_modules"]) == TARGETS
    base = transformers.AutoModelForCausalLM.from_pretrained(FIX / "hf", dtype=torch.float32,
                                                             attn_implementation="eager")
    assert type(base).__name__ == "Gemma3ForCausalLM"
    m = peft.PeftModel.from_pretrained(base, out)
    ours = load_file(str(out / "adapter_model.safetensors"))
    state = {k.replace(".default", ""): v for k, v in m.named_parameters() if "lora_" in k}
    assert set(ours) == set(state), sorted(set(ours) ^ set(state))[:6]  # every tensor taken
    ref = load_file(str(FIX / "ref.safetensors"))
    err = float((packed_logits(m) - ref["logits"]).abs().max())
    print(f"export gemma3: from {src}: PEFT adapter logits max abs err {err:.3g}")
    assert err <= 1e-4
    # can fail: the base alone is far from base + adapter
    assert float((ref["logits_base"] - ref["logits"]).abs().max()) > 1e-2


def export(src, fmt, out):
    r = subprocess.run([str(TRAINER), "export", "--model", str(FIX / src), "--adapter",
                        str(FIX / "adapter-init"), "--format", fmt, "--dtype", "f32",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


@pytest.mark.parametrize("src", ["hf", "model.gguf"])
def test_merged_safetensors_in_transformers(tmp_path, src):
    d = export(src, "safetensors", tmp_path / "merged")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["architectures"] == ["Gemma3ForCausalLM"]
    m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                          attn_implementation="eager")
    assert type(m).__name__ == "Gemma3ForCausalLM"
    fc = json.loads((FIX / "hf" / "config.json").read_text())
    for k in ("layer_types", "sliding_window", "head_dim", "query_pre_attn_scalar",
              "rope_parameters", "tie_word_embeddings", "hidden_activation"):
        assert getattr(m.config, k) == fc[k], k
    names = set(load_file(str(d / "model.safetensors")))
    base = set(load_file(str(FIX / "hf" / "model.safetensors")))
    assert names == base, sorted(names ^ base)[:6]  # the fixture's names, no lm_head (tied)
    ref = load_file(str(FIX / "ref.safetensors"))
    err = float((packed_logits(m) - ref["logits"]).abs().max())
    print(f"export gemma3: from {src}: merged safetensors logits max abs err {err:.3g}")
    assert err <= 1e-4


def gguf_tensors(path):
    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        shape = [int(x) for x in reversed(t.shape.tolist())]
        data = gguf.quants.dequantize(t.data, t.tensor_type)  # BF16 comes as raw bytes
        out[t.name] = torch.from_numpy(data.copy()).float().reshape(shape)
    return r, out


def field(r, k):
    f = r.fields[k]
    v = f.parts[-1]
    return bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING else v[0].item()


@pytest.mark.parametrize("src", ["hf", "model.gguf"])
def test_merged_gguf(tmp_path, src):
    p = export(src, "gguf", tmp_path / "merged.gguf")
    r, ts = gguf_tensors(p)
    assert field(r, "general.architecture") == "gemma3"
    fr, fixture = gguf_tensors(FIX / "model.gguf")
    assert set(ts) == set(fixture)  # convert_hf_to_gguf.py's names, no output.weight (tied)
    for k in fr.fields:  # Gemma3Model's keys, as the fixture (converted) has them
        if k.startswith("gemma3."):
            assert field(r, k) == pytest.approx(field(fr, k), rel=1e-6), k
    # the values: the merged safetensors' (norms as 1 + w, as Gemma3Model writes them)
    hf = load_file(str(export(src, "safetensors", tmp_path / "st") / "model.safetensors"))
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, 6)
    for k, v in hf.items():
        g = tmap.get_name(k, try_suffixes=(".weight",))
        if "norm" in k:
            assert torch.allclose(ts[g].reshape(v.shape), v.float() + 1, rtol=0, atol=1e-6), k
        else:
            assert torch.equal(ts[g].reshape(v.shape), v.float()), k
    # transformers' GGUF reader has no key for query_pre_attn_scalar and leaves Gemma3TextConfig's
    # 256 (Gemma 3's real head_dim; llama.cpp scales by 1/sqrt(key_length)): this 24-wide fixture
    # gives it, as it does the fixture GGUF itself
    m = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="merged.gguf", dtype=torch.float32, attn_implementation="eager",
        query_pre_attn_scalar=field(r, "gemma3.attention.key_length"))
    assert type(m).__name__ == "Gemma3ForCausalLM"
    err = float((packed_logits(m) - load_file(str(FIX / "ref.safetensors"))["logits"]).abs().max())
    print(f"export gemma3: from {src}: merged GGUF in transformers, logits max abs err {err:.3g}")
    assert err <= 1e-4


def test_gemma3_lora_trains_through_loaderd_and_peft_loads_it(trainer_stack, tmp_path):
    from family_e2e import train_then_peft
    cfg = train_then_peft(trainer_stack, tmp_path, FIX / "model.gguf", FIX / "hf", TARGETS,
                          torch, transformers, peft)
    assert sorted(cfg["target_modules"]) == TARGETS


# ---- linear RoPE scaling (Gemma 3 4B and larger) ----

LIN = ROOT / "tests/fixtures/hf/gemma3-linear"


def test_linear_rope_exports(tmp_path):
    """tests/fixtures/hf/gemma3-linear (gen_gemma3_fixtures.py --variant linear): the fixture's
    weights with linear RoPE scaling, factor 8, on the global layer only (Gemma 3 4B+), its HF
    config in the transformers 4.x form (rope_scaling, rope_local_base_freq) and its GGUF with
    gemma3.rope.scaling.type / factor. Every export keeps the scaling where transformers and
    llama.cpp apply it:
    - merged safetensors (from the GGUF): config.json rope_parameters {full_attention: linear,
      factor 8, sliding_attention: default} loads in transformers with the fixture config's own
      rope_parameters and gives the reference logits of base + adapter;
    - merged GGUF (from the HF directory): gemma3.rope.scaling.type "linear" / .factor 8 and every
      other gemma3.* key as the fixture GGUF (convert_hf_to_gguf.py's) has them (transformers' GGUF
      reader has no gemma3 rope.scaling key, so llama.cpp checks its logits:
      test_llamacpp.py::test_gemma3_merged_gguf_in_llamacpp[gemma3-linear]; our loader reads both
      merged files back with the same RoPE tables: test_export.c test_gemma3_merged);
    - the PEFT adapter carries no RoPE: exported from the scaled GGUF it is the fixture's adapter
      tensor for tensor (test_peft_adapter_in_peft loads that adapter in peft).
    The reference logits are 0.36 away from the unscaled model's and 2.8 from the model with the
    sliding layers scaled too (the generator asserts > 1e-2), so a dropped or misplaced scaling
    fails each check."""
    ref = load_file(str(LIN / "ref.safetensors"))

    def exp(src, fmt, out):
        r = subprocess.run([str(TRAINER), "export", "--model", str(LIN / src), "--adapter",
                            str(LIN / "adapter-init"), "--format", fmt, "--dtype", "f32",
                            "--out", str(out)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return out

    fixture_cfg = transformers.AutoConfig.from_pretrained(LIN / "hf")
    assert fixture_cfg.rope_parameters["full_attention"]["rope_type"] == "linear"
    d = exp("model.gguf", "safetensors", tmp_path / "st")
    rp = json.loads((d / "config.json").read_text())["rope_parameters"]
    assert rp == {"full_attention": {"factor": 8.0, "rope_theta": 1000000.0, "rope_type": "linear"},
                  "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}, rp
    m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                          attn_implementation="eager")
    assert m.config.rope_parameters == fixture_cfg.rope_parameters
    err = float((packed_logits_of(m, LIN) - ref["logits"]).abs().max())
    print(f"export gemma3-linear: merged safetensors in transformers, logits max abs err {err:.3g}")
    assert err <= 1e-4

    p = exp("hf", "gguf", tmp_path / "merged.gguf")
    r, fr = gguf.GGUFReader(str(p)), gguf.GGUFReader(str(LIN / "model.gguf"))
    assert field(r, "gemma3.rope.scaling.type") == "linear"
    assert field(r, "gemma3.rope.scaling.factor") == 8.0
    for k in fr.fields:
        if k.startswith("gemma3."):
            assert field(r, k) == pytest.approx(field(fr, k), rel=1e-6), k

    a = exp("model.gguf", "peft", tmp_path / "adapter")
    assert "rope" not in (a / "adapter_config.json").read_text()
    got, src = (load_file(str(x / "adapter_model.safetensors")) for x in (a, LIN / "adapter-init"))
    assert set(got) == set(src) and all(torch.equal(got[k], src[k].float()) for k in src)
