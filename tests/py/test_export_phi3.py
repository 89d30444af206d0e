"""`trainer export` / `trainer generate` of a Phi-3 model, checked with the pinned transformers /
peft / gguf-py of python/requirements-torch.txt (`make pytest-torch` runs it with
.venv-torch/bin/python).

Base: the tiny random Phi-3 of tests/reference/gen_phi3_fixtures.py (tests/fixtures/hf/phi3),
loaded from the Hugging Face directory (fused qkv_proj / gate_up_proj) and from the phi3 GGUF;
adapter: the fixture's PEFT adapter on o_proj / down_proj (the Phi-3 modules the trainer adapts).
Reference: the fixture's logits of base + adapter, which transformers + PEFT computed.
- peft: PeftModel.from_pretrained on the fixture's Phi3ForCausalLM loads the adapter we write
  unchanged (PEFT's names: ...self_attn.o_proj.lora_A.weight, ...mlp.down_proj...) and gives the
  reference logits;
- gguf-lora: general.architecture "phi3" (llama.cpp refuses an adapter of another architecture),
  blk.N.attn_output / ffn_down .lora_a / .lora_b equal PEFT's lora_A / lora_B;
- merged formats (safetensors, gguf): refused naming Phi-3, nothing written;
- generate: `trainer generate` on the GGUF streams transformers' greedy tokens, with and without
  the adapter.
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
    assert sorted(cfg["target_modules"]) == ["down_proj", "o_proj"]
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
    assert len(ts) == len(ad) == 8
    names = {"o_proj": "attn_output", "down_proj": "ffn_down"}
    for k, v in ad.items():
        parts = k.split(".")  # base_model.model.model.layers.L.<blk>.<mod>.lora_X.weight
        layer, mod, ab = parts[4], parts[6], parts[7]
        g = f"blk.{layer}.{names[mod]}.weight.{'lora_a' if ab == 'lora_A' else 'lora_b'}"
        assert torch.equal(ts[g].reshape(v.shape), v.float()), k


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_merged_refused(tmp_path, fmt):
    out = tmp_path / "merged"
    r = run_export("hf", fmt, out)
    assert r.returncode != 0
    assert "Phi-3" in r.stderr, r.stderr[-2000:]
    assert not out.exists()


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
