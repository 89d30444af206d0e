#!/usr/bin/env python3
"""A PEFT adapter written by BarqTrain, loaded the way PEFT users load it (scripts/gpu-run eval: the
adapter the GPU demo trained, on the lent GPU machine, whose image has torch, transformers and peft;
gguf-py travels in the payload).

  tests/gpu/check_adapter.py ADAPTER_DIR [--model models/SmolLM2-135M-Instruct.Q4_1.gguf]

The base model is what transformers itself reads from the GGUF (from_pretrained(gguf_file=...),
dequantised to fp32, on the CPU; a GGUF without output.weight gets its embedding tied as the file
means). Then peft.PeftModel.from_pretrained(base, ADAPTER_DIR) and three checks:
  1. every lora_A / lora_B tensor of adapter_model.safetensors is loaded, equal to the file, and
     none is left over on either side;
  2. the adapter is applied: the logits of a fixed token sequence (2 x 48 tokens, seed 0) move by
     more than 1e-4 of their largest magnitude against the base without it;
  3. they are finite.
Prints the figures; exit status 1 when a check fails, 2 when torch / transformers / peft / gguf are
missing. The held-out score of the same adapter is `trainer eval`'s (scripts/gpu-run eval)."""
import argparse
import json
import os
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("adapter")
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    a = ap.parse_args()
    try:
        import torch
        import gguf  # noqa: F401 (transformers' GGUF loader needs it)
        import peft
        import transformers
        from peft import PeftModel
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM
    except Exception as e:  # noqa: BLE001
        print(f"check_adapter: cannot import what it needs ({type(e).__name__}: {e})")
        return 2
    print(f"check_adapter: torch {torch.__version__}, transformers {transformers.__version__}, "
          f"peft {peft.__version__}, gguf from {os.path.dirname(gguf.__file__)}", flush=True)
    path = os.path.abspath(a.model)

    def base():
        m = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 torch_dtype=torch.float32)
        names = {t.name for t in gguf.GGUFReader(path).tensors}
        if "output.weight" not in names:  # a tied GGUF (SmolLM2): the head is the embedding
            m.config.tie_word_embeddings = True
            m.tie_weights()
        return m.eval()

    with open(os.path.join(a.adapter, "adapter_config.json")) as f:
        cfg = json.load(f)
    m0 = base()
    V = m0.config.vocab_size
    ids = torch.randint(0, V, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m0(input_ids=ids).logits.float()
    pm = PeftModel.from_pretrained(m0, a.adapter).eval()  # m0's reference logits are taken
    with torch.no_grad():
        got = pm(input_ids=ids).logits.float()
    sd = load_file(os.path.join(a.adapter, "adapter_model.safetensors"))
    loaded = {n.replace(".default", ""): p for n, p in pm.named_parameters() if "lora_" in n}
    ok = True
    missing, extra = set(sd) - set(loaded), set(loaded) - set(sd)
    unequal = [k for k in sd if k in loaded and not torch.equal(loaded[k].detach().float(), sd[k].float())]
    print(f"check_adapter: {len(sd)} LoRA tensors in the file (r {cfg.get('r')}, alpha {cfg.get('lora_alpha')}, "
          f"{len(cfg.get('target_modules') or [])} target modules); PEFT loaded {len(loaded)}; "
          f"not loaded {len(missing)}, not in the file {len(extra)}, unequal {len(unequal)}")
    if missing or extra or unequal or not sd:
        for k in sorted(missing)[:3] + sorted(extra)[:3] + unequal[:3]:
            print(f"    {k}")
        ok = False
    moved = float((got - ref).abs().max())
    scale = float(ref.abs().max())
    print(f"check_adapter: the adapter moves the logits by {moved:.4e} (max |logit| {scale:.3e}; "
          f"must exceed {1e-4 * scale:.3e})")
    if not moved > 1e-4 * scale:
        ok = False
    if not torch.isfinite(got).all():
        print("check_adapter: non-finite logits with the adapter")
        ok = False
    print(f"check_adapter: {'PASS' if ok else 'FAIL'}: {a.adapter} loads in PEFT {peft.__version__}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
