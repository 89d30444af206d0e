"""`trainer export` of Qwen2 / Qwen3 models, checked with the pinned transformers / peft / gguf-py
of python/requirements-torch.txt (`make pytest-torch` runs it with .venv-torch/bin/python).

Base: the tiny random fixtures of tests/reference/gen_qwen_fixtures.py (tests/fixtures/hf/qwen),
loaded from the Hugging Face directory and from the GGUF; adapter: the fixture's PEFT adapter.
Reference: the fixture's logits of base + adapter, which transformers + PEFT computed.
- safetensors (merged): transformers' AutoModelForCausalLM loads the directory unchanged
  (Qwen2ForCausalLM / Qwen3ForCausalLM) and gives the reference logits;
- peft: PeftModel.from_pretrained on the fixture base gives the reference logits;
- gguf (merged): general.architecture is the family's, tensors are named and laid out as the
  fixture GGUF (convert_hf_to_gguf.py's names, q/k rows not permuted) and hold the merged
  safetensors' values; Qwen2's is also loaded by transformers' own GGUF reader and gives the
  reference logits (transformers' GGUF reader takes no head_dim for qwen3, so the tiny Qwen3,
  head_dim 16, cannot go through it);
- gguf-lora: general.architecture is the family's (llama.cpp refuses an adapter of another
  architecture), lora_a / lora_b equal PEFT's lora_A / lora_B (q/k not permuted).
- generate: `trainer generate` on the GGUF (its byte-level BPE vocabulary) streams the greedy
  tokens transformers picks for the same prompt, with and without the adapter.
- end to end (issue 24): `trainer train` on the Qwen2 GGUF through loaderd, the loss falls, and
  the PEFT adapter it writes loads in peft with our logits (tests/py/family_e2e.py).
Tolerance: logits 1e-4 absolute (the fp32 parity tolerance of tests/reference/README.md).
"""
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

FIX = ROOT / "tests/fixtures/hf/qwen"
TRAINER = ROOT / os.environ.get("BT_BUILD", "build") / "trainer"
CASES = [(f, s) for f in ("qwen2", "qwen3") for s in ("hf", "model.gguf")]


def export(fam, src, fmt, out):
    r = subprocess.run([str(TRAINER), "export", "--model", str(FIX / fam / src), "--adapter",
                        str(FIX / fam / "adapter-init"), "--format", fmt, "--dtype", "f32",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def packed_logits(model):
    """Logits of the fixture batch: each cu_seqlens document alone, concatenated [48, 260]."""
    b = load_file(str(FIX / "batch.safetensors"))
    ids = b["input_ids"].reshape(-1).long()
    cu = b["cu_seqlens"].tolist()
    with torch.no_grad():
        return torch.cat([model(input_ids=ids[a:e][None]).logits.float()[0]
                          for a, e in zip(cu[:-1], cu[1:])])


def ref(fam):
    return load_file(str(FIX / fam / "ref.safetensors"))


@pytest.mark.parametrize("fam,src", CASES)
def test_merged_safetensors_in_transformers(tmp_path, fam, src):
    d = export(fam, src, "safetensors", tmp_path / "merged")
    m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert type(m).__name__ == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[fam]
    err = float((packed_logits(m) - ref(fam)["logits"]).abs().max())
    print(f"export qwen: {fam} from {src}: merged safetensors logits max abs err {err:.3g}")
    assert err <= 1e-4
    # can fail: the base alone is far from base + adapter
    assert float((ref(fam)["logits_base"] - ref(fam)["logits"]).abs().max()) > 1e-2


@pytest.mark.parametrize("fam,src", CASES)
def test_peft_adapter_in_peft(tmp_path, fam, src):
    d = export(fam, src, "peft", tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(FIX / fam / "hf", dtype=torch.float32)
    m = peft.PeftModel.from_pretrained(base, d)
    err = float((packed_logits(m) - ref(fam)["logits"]).abs().max())
    print(f"export qwen: {fam} from {src}: PEFT adapter logits max abs err {err:.3g}")
    assert err <= 1e-4


def gguf_tensors(path):
    r = gguf.GGUFReader(str(path))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    out = {}
    for t in r.tensors:
        shape = [int(x) for x in reversed(t.shape.tolist())]
        data = gguf.quants.dequantize(t.data, t.tensor_type)  # BF16 comes as raw bytes
        out[t.name] = torch.from_numpy(data.copy()).float().reshape(shape)
    return r, arch, out


@pytest.mark.parametrize("fam,src", CASES)
def test_merged_gguf(tmp_path, fam, src):
    p = export(fam, src, "gguf", tmp_path / "merged.gguf")
    r, arch, ts = gguf_tensors(p)
    assert arch == fam
    _, _, fixture = gguf_tensors(FIX / fam / "model.gguf")
    assert set(ts) == set(fixture)  # convert_hf_to_gguf.py's names, nothing more or less
    if fam == "qwen3":
        assert int(r.fields["qwen3.attention.key_length"].parts[-1][0]) == 16
    # the values are the merged safetensors' (same names through gguf-py's TensorNameMap)
    hf = load_file(str(export(fam, src, "safetensors", tmp_path / "st") / "model.safetensors"))
    tmap = gguf.get_tensor_name_map({"qwen2": gguf.MODEL_ARCH.QWEN2,
                                     "qwen3": gguf.MODEL_ARCH.QWEN3}[fam], 2)
    for k, v in hf.items():
        g = tmap.get_name(k, try_suffixes=(".weight", ".bias"))
        assert torch.equal(ts[g].reshape(v.shape), v.float()), k
    if fam == "qwen2":
        m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="merged.gguf",
                                                              dtype=torch.float32)
        err = float((packed_logits(m) - ref(fam)["logits"]).abs().max())
        print(f"export qwen: {fam} from {src}: merged GGUF in transformers, logits max abs err "
              f"{err:.3g}")
        assert err <= 1e-4


@pytest.mark.parametrize("fam,src", CASES)
def test_gguf_lora(tmp_path, fam, src):
    p = export(fam, src, "gguf-lora", tmp_path / "lora.gguf")
    _, arch, ts = gguf_tensors(p)
    assert arch == fam
    ad = load_file(str(FIX / fam / "adapter-init" / "adapter_model.safetensors"))
    assert len(ts) == len(ad) == 28
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    for k, v in ad.items():
        parts = k.split(".")  # base_model.model.model.layers.L.<blk>.<mod>.lora_X.weight
        layer, mod, ab = parts[4], parts[6], parts[7]
        g = f"blk.{layer}.{names[mod]}.weight.{'lora_a' if ab == 'lora_A' else 'lora_b'}"
        assert torch.equal(ts[g].reshape(v.shape), v.float()), k


@pytest.mark.parametrize("fam", ["qwen2", "qwen3"])
@pytest.mark.parametrize("with_adapter", [False, True])
def test_generate_greedy_equals_transformers(fam, with_adapter):
    """`trainer generate` on the family's GGUF (its byte-level BPE vocabulary, fp32 base) streams
    the tokens that transformers' greedy decoding of the same prompt ids picks (the generator
    checks each step's top-1 margin is > 1e-3, clear of fp32 noise)."""
    import json
    man = json.loads((FIX / "manifest.json").read_text())
    g = man["generate"]
    want_ids = man[fam]["greedy_lora" if with_adapter else "greedy_base"]
    # expected bytes: each token's GPT-2 byte symbols mapped back (the control token prints nothing)
    inv = {}
    for b in range(256):
        inv[g["tokens"][b]] = b
    eot = len(g["tokens"]) - 1
    want = bytes(inv[c] for i in want_ids if i != eot for c in g["tokens"][i])
    cmd = [str(TRAINER), "generate", "--model", str(FIX / fam / "model.gguf"), "--base-dtype",
           "fp32", "--prompt", g["prompt"], "--max-new-tokens", str(g["new_tokens"]),
           "--ignore-eos"]
    if with_adapter:
        cmd += ["--adapter", str(FIX / fam / "adapter-init")]
    r = subprocess.run(cmd, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-2000:]
    assert r.stdout.rstrip(b"\n") == want.rstrip(b"\n"), (r.stdout, want, want_ids)


def test_qwen2_trains_through_loaderd_and_peft_loads_it(trainer_stack, tmp_path):
    from family_e2e import train_then_peft
    cfg = train_then_peft(trainer_stack, tmp_path, FIX / "qwen2" / "model.gguf", FIX / "qwen2" / "hf",
                          ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj"], torch, transformers, peft)
    assert sorted(cfg["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj",
                                                    "gate_proj", "up_proj", "down_proj"])
