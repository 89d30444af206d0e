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
from safetensors.torch import load_file  # noqa: E402

from conftest import ROOT as _ROOT  # noqa: E402

ROOT = Path(_ROOT)

FIX = ROOT / "tests/fixtures/hf/gemma3"
TRAINER = ROOT / os.environ.get("BT_BUILD", "build") / "trainer"
TARGETS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def packed_logits(model):
    b = load_file(str(FIX / "batch.safetensors"))
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


def test_gemma3_lora_trains_through_loaderd_and_peft_loads_it(trainer_stack, tmp_path):
    from family_e2e import train_then_peft
    cfg = train_then_peft(trainer_stack, tmp_path, FIX / "model.gguf", FIX / "hf", TARGETS,
                          torch, transformers, peft)
    assert sorted(cfg["target_modules"]) == TARGETS
