#!/usr/bin/env python3
"""RoPE scaling reference fixtures (rope_scaling "llama3") for tests/unit/trainer/test_rope_scaling.c.

Uses transformers' own code (modeling_rope_utils.ROPE_INIT_FUNCTIONS, LlamaForCausalLM) on the CPU
in fp32 and writes:
  tests/fixtures/hf/rope_llama3.safetensors
      inv_freq.<case>   F32 [D/2]  transformers' inv_freq for the case (ROPE_INIT_FUNCTIONS[type])
      params.<case>     F32 [6]    D, rope_theta, factor, low_freq_factor, high_freq_factor,
                                   original_max_position_embeddings of the case
      rope_freqs.<case> F32 [D/2]  llama.cpp's rope_freqs.weight for the case, computed as
                                   convert_hf_to_gguf.py LlamaModel.generate_extra_tensors does
                                   (inv_freq = default inv_freq / rope_freqs; original context taken
                                   from rope_scaling), only for llama3 cases
      tiny.ids          I32 [T]    token ids of one sequence
      tiny.pos          I32 [T]    its position_ids (9000 + 613 i: beyond original_max_position_embeddings)
      tiny.logits       F32 [T, V] LlamaForCausalLM(position_ids=tiny.pos) logits of the tiny model
      tiny.logits_norope_scaling F32 [T, V] the same model with rope_scaling null (to show the
                                   scaling matters)
  tests/fixtures/hf/tiny-llama-llama3/{config.json, model.safetensors}: that tiny Llama (2 layers,
      hidden 64, 2 heads of 32, 1 KV head, vocab 64, untied, rope_theta 500000, rope_scaling llama3 8/1/4/8192).
Cases: d64_f8 / d128_f8 (theta 500000, llama3 factor 8, low 1, high 4, original 8192: Llama 3.1),
d64_f32 / d128_f32 (factor 32: Llama 3.2), d96_odd (theta 1e6, factor 6.5, low 1.5, high 3.7,
original 4000: exercises the fp32 rounding of every step), d128_default (no scaling).

Usage (repo root; `make fixtures` runs it after gen_hf_fixtures.py):
    python3 tests/reference/gen_rope_fixtures.py [--out tests/fixtures/hf]
Re-executes itself inside .venv-hf (created by gen_hf_fixtures.py; torch 2.5.1, transformers
4.46.3). `--no-venv` runs in the current interpreter. Deterministic (fixed seed, fp32, 1 thread).
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from venv_hf import reexec_in_venv_hf  # noqa: E402

reexec_in_venv_hf(__file__, "gen_rope")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
torch.set_default_dtype(torch.float32)

CASES = {  # name: (D, theta, rope_scaling or None)
    "d64_f8": (64, 500000.0, dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "d128_f8": (128, 500000.0, dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                    high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "d64_f32": (64, 500000.0, dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "d128_f32": (128, 500000.0, dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "d96_odd": (96, 1000000.0, dict(rope_type="llama3", factor=6.5, low_freq_factor=1.5,
                                    high_freq_factor=3.7, original_max_position_embeddings=4000)),
    "d128_default": (128, 500000.0, None),
}


def hf_inv_freq(D, theta, rs):
    cfg = LlamaConfig(hidden_size=D * 2, num_attention_heads=2, head_dim=D, rope_theta=theta,
                      rope_scaling=rs, max_position_embeddings=131072)
    ty = "default" if rs is None else rs["rope_type"]
    inv, att = ROPE_INIT_FUNCTIONS[ty](cfg, torch.device("cpu"))
    assert att == 1.0 and inv.dtype == torch.float32 and inv.shape == (D // 2,)
    return inv


def llamacpp_rope_freqs(D, theta, rs):
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors (llama.cpp), verbatim logic; the
    original context comes from rope_scaling (the converter reads a top-level key that Llama 3.x
    configs lack, falling back to 8192, the same value for every real Llama 3.x)."""
    base = theta
    freqs = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    factor = rs.get("factor", 8.0)
    low_freq_factor = rs.get("low_freq_factor", 1.0)
    high_freq_factor = rs.get("high_freq_factor", 4.0)
    old_context_len = rs.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(rope_factors, dtype=torch.float32)


TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, rope_theta=500000.0,
            rms_norm_eps=1e-5, max_position_embeddings=65536, hidden_act="silu",
            tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
            rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                              high_freq_factor=4.0, original_max_position_embeddings=8192))


def tiny_model(cfg_dict, seed=1234):
    """A LlamaForCausalLM with unit-scale random weights (also used by gen_rope_ext_fixtures.py)."""
    cfg = LlamaConfig(**cfg_dict)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # unit-scale activations so RoPE visibly matters (HF init is std 0.02)
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[1]))
    return m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / "tests" / "fixtures" / "hf"))
    ap.add_argument("--no-venv", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t = {}
    for name, (D, theta, rs) in CASES.items():
        inv = hf_inv_freq(D, theta, rs)
        t[f"inv_freq.{name}"] = inv.contiguous()
        r = rs or dict(factor=0.0, low_freq_factor=0.0, high_freq_factor=0.0,
                       original_max_position_embeddings=0)
        t[f"params.{name}"] = torch.tensor([D, theta, r["factor"], r["low_freq_factor"],
                                            r["high_freq_factor"],
                                            r["original_max_position_embeddings"]],
                                           dtype=torch.float32)
        if rs is not None:
            t[f"rope_freqs.{name}"] = llamacpp_rope_freqs(D, theta, rs)
            base = hf_inv_freq(D, theta, None)
            rel = ((base / t[f"rope_freqs.{name}"] - inv).abs() / inv).max().item()
            print(f"[gen_rope] {name}: llama.cpp base/rope_freqs vs HF inv_freq max rel {rel:.3g}")

    m = tiny_model(TINY)
    T = 12
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, TINY["vocab_size"], (1, T), generator=g)
    pos = (9000 + torch.arange(T) * 613).view(1, T)  # beyond original_max_position_embeddings
    with torch.no_grad():
        logits = m(input_ids=ids, position_ids=pos).logits[0].float()
    plain = dict(TINY, rope_scaling=None)
    m2 = LlamaForCausalLM(LlamaConfig(**plain)).eval()
    m2.load_state_dict(m.state_dict())
    with torch.no_grad():
        logits2 = m2(input_ids=ids, position_ids=pos).logits[0].float()
    print(f"[gen_rope] tiny: max|logits(llama3) - logits(no scaling)| "
          f"{(logits - logits2).abs().max().item():.3g}")
    t["tiny.ids"] = ids[0].to(torch.int32).contiguous()
    t["tiny.pos"] = pos[0].to(torch.int32).contiguous()
    t["tiny.logits"] = logits.contiguous()
    t["tiny.logits_norope_scaling"] = logits2.contiguous()
    save_file(t, str(out / "rope_llama3.safetensors"),
              metadata={"generator": "tests/reference/gen_rope_fixtures.py",
                        "torch": torch.__version__, "transformers": transformers.__version__})

    d = out / "tiny-llama-llama3"
    d.mkdir(exist_ok=True)
    sd = {k: v.contiguous() for k, v in m.state_dict().items() if "rotary_emb" not in k}
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(TINY, architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="float32")
    (d / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
    for p in [out / "rope_llama3.safetensors", d / "model.safetensors", d / "config.json"]:
        print(f"[gen_rope] wrote {p} ({p.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
