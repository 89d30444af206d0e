"""`trainer export` / `trainer generate` of a Phi-3 model, checked with the pinned transformers /
peft / gguf-py of python/requirements-torch.txt (`make pytest-torch` runs it with
.venv-torch/bin/python).

Base: the tiny random Phi-3 of tests/reference/gen_phi3_fixtures.py (tests/fixtures/hf/phi3),
loaded from the Hugging Face directory (fused qkv_proj / gate_up_proj) and from the phi3 GGUF;
adapter: the fixture's PEFT adapter on every Phi-3 linear as PEFT names them (the fused
qkv_proj / gate_up_proj with one lora_A each, o_proj, down_proj).
Reference: the fixture's logits of base + adapter, which transformers + PEFT computed.
- peft: PeftModel.from_pretrained on the fixture's Phi3ForCausalLM loads the adapter we write
  unchanged (PEFT's names: ...self_attn.qkv_proj.lora_A.weight [r, D], lora_B [Dq + 2 Dkv, r],
  ...mlp.gate_up_proj..., o_proj, down_proj) and gives the reference logits;
- gguf-lora: general.architecture "phi3" (llama.cpp refuses an adapter of another architecture),
  blk.N.attn_qkv / attn_output / ffn_up / ffn_down .lora_a / .lora_b equal PEFT's lora_A /
  lora_B (convert_lora_to_gguf.py's names through Phi3MiniModel, which keeps the fused tensors);
- safetensors (merged): transformers loads the directory unchanged (Phi3ForCausalLM, fused
  qkv_proj / gate_up_proj) and gives the reference logits;
- gguf (merged): the fixture GGUF's tensor names (attn_qkv, ffn_up fused), the phi3 keys
  convert_hf_to_gguf.py writes, and the merged safetensors' values; transformers' own GGUF reader
  loads it with the reference logits;
- generate: `trainer generate` on the GGUF streams transformers' greedy tokens, with and without
  the adapter.
- end to end: `trainer train` on the Phi-3 GGUF through loaderd with target_modules qkv_proj /
  gate_up_proj / o_proj / down_proj, the loss falls, and peft loads the fused adapter it writes
  with our logits (tests/py/family_e2e.py).
Tolerance: logits 1e-4 absolute (the fp32 parity tolerance of tests/reference/README.md).
"""
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

FIX = ROOT / "tests/fixtures/hf/phi3"
TRAINER = ROOT / os.environ.get("BT_BUILD", "build") / "trainer"
SOURCES = ["hf", "model.gguf"]


def run_export(src, fmt, out):
    return subprocess.run([str(TRAINER), "export", "--model", str(FIX / src), "--adapter",
                           str(FIX / "adapter-init"), "--format", fmt, "--dtype", "f32",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)


def export(src, fmt, out):
    r = run_export(src, fmt, out)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def packed_logits(model):
    b = load_file(str(FIX / "batch.safetensors"))
    ids = b["input_ids"].reshape(-1).long()
    cu = b["cu_seqlens"].tolist()
    with torch.no_grad():
        return torch.cat([model(input_ids=ids[a:e][None]).logits.float()[0]
                          for a, e in zip(cu[:-1], cu[1:])])


@pytest.mark.parametrize("src", SOURCES)
def test_peft_adapter_in_peft(tmp_path, src):
    d = export(src, "peft", tmp_path / "adapter")
    cfg = json.loads((d / "adapter_config.json").read_text())
    assert sorted(cfg["target_modules"]) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    base = transformers.AutoModelForCausalLM.from_pretrained(FIX / "hf", dtype=torch.float32)
    assert type(base).__name__ == "Phi3ForCausalLM"
    m = peft.PeftModel.from_pretrained(base, d)
    ref = load_file(str(FIX / "ref.safetensors"))
    err = float((packed_logits(m) - ref["logits"]).abs().max())
    print(f"export phi3: from {src}: PEFT adapter logits max abs err {err:.3g}")
    assert err <= 1e-4
    # can fail: the base alone is far from base + adapter
    assert float((ref["logits_base"] - ref["logits"]).abs().max()) > 1e-2


@pytest.mark.parametrize("src", SOURCES)
def test_gguf_lora(tmp_path, src):
    p = export(src, "gguf-lora", tmp_path / "lora.gguf")
    r = gguf.GGUFReader(str(p))
    assert bytes(r.fields["general.architecture"].parts[-1]).decode() == "phi3"
    ts = {t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
          for t in r.tensors}
    ad = load_file(str(FIX / "adapter-init" / "adapter_model.safetensors"))
    assert len(ts) == len(ad) == 16
    names = {"qkv_proj": "attn_qkv", "o_proj": "attn_output", "gate_up_proj": "ffn_up",
             "down_proj": "ffn_down"}
    for k, v in ad.items():
        parts = k.split(".")  # base_model.model.model.layers.L.<blk>.<mod>.lora_X.weight
        layer, mod, ab = parts[4], parts[6], parts[7]
        g = f"blk.{layer}.{names[mod]}.weight.{'lora_a' if ab == 'lora_A' else 'lora_b'}"
        assert torch.equal(ts[g].reshape(v.shape), v.float()), k


@pytest.mark.parametrize("src", SOURCES)
def test_merged_safetensors_in_transformers(tmp_path, src):
    d = export(src, "safetensors", tmp_path / "merged")
    m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert type(m).__name__ == "Phi3ForCausalLM"
    assert m.config.sliding_window == 512
    ref = load_file(str(FIX / "ref.safetensors"))
    err = float((packed_logits(m) - ref["logits"]).abs().max())
    print(f"export phi3: from {src}: merged safetensors logits max abs err {err:.3g}")
    assert err <= 1e-4
    names = set(load_file(str(d / "model.safetensors")))
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)


def gguf_tensors(path):
    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        shape = [int(x) for x in reversed(t.shape.tolist())]
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        out[t.name] = torch.from_numpy(data.copy()).float().reshape(shape)
    return r, out


@pytest.mark.parametrize("src", SOURCES)
def test_merged_gguf(tmp_path, src):
    p = export(src, "gguf", tmp_path / "merged.gguf")
    r, ts = gguf_tensors(p)
    assert bytes(r.fields["general.architecture"].parts[-1]).decode() == "phi3"
    fr, fixture = gguf_tensors(FIX / "model.gguf")
    assert set(ts) == set(fixture)  # convert_hf_to_gguf.py's names (attn_qkv, ffn_up fused)
    for k in ("phi3.attention.sliding_window", "phi3.rope.scaling.original_context_length",
              "phi3.context_length", "phi3.block_count", "phi3.rope.dimension_count"):
        assert int(r.fields[k].parts[-1][0]) == int(fr.fields[k].parts[-1][0]), k
    hf = load_file(str(export(src, "safetensors", tmp_path / "st") / "model.safetensors"))
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI3, 2)
    for k, v in hf.items():
        g = tmap.get_name(k, try_suffixes=(".weight", ".bias"))
        assert torch.equal(ts[g].reshape(v.shape), v.float()), k
    # transformers' GGUF reader leaves Phi3Config's default token ids (eos / pad 32000, Phi-3-mini's
    # vocabulary), outside this 260-token one: the fixture config's ids are given
    m = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="merged.gguf", dtype=torch.float32, pad_token_id=0, eos_token_id=259,
        bos_token_id=259)
    err = float((packed_logits(m) - load_file(str(FIX / "ref.safetensors"))["logits"]).abs().max())
    print(f"export phi3: from {src}: merged GGUF in transformers, logits max abs err {err:.3g}")
    assert err <= 1e-4


@pytest.mark.parametrize("with_adapter", [False, True])
def test_generate_greedy_equals_transformers(with_adapter):
    man = json.loads((FIX / "manifest.json").read_text())
    g = man["generate"]
    want_ids = man["phi3"]["greedy_lora" if with_adapter else "greedy_base"]
    inv = {g["tokens"][b]: b for b in range(256)}
    eot = len(g["tokens"]) - 1
    want = bytes(inv[c] for i in want_ids if i != eot for c in g["tokens"][i])
    cmd = [str(TRAINER), "generate", "--model", str(FIX / "model.gguf"), "--base-dtype", "fp32",
           "--prompt", g["prompt"], "--max-new-tokens", str(g["new_tokens"]), "--ignore-eos"]
    if with_adapter:
        cmd += ["--adapter", str(FIX / "adapter-init")]
    r = subprocess.run(cmd, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-2000:]
    assert r.stdout.rstrip(b"\n") == want.rstrip(b"\n"), (r.stdout, want, want_ids)


def test_phi3_fused_lora_trains_through_loaderd_and_peft_loads_it(trainer_stack, tmp_path):
    from family_e2e import train_then_peft
    cfg = train_then_peft(trainer_stack, tmp_path, FIX / "model.gguf", FIX / "hf",
                          ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], torch, transformers,
                          peft)
    assert sorted(cfg["target_modules"]) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
