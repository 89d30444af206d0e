#!/usr/bin/env python3
"""Context-extension RoPE fixtures (rope_scaling "linear", "yarn", "dynamic") for
tests/unit/trainer/test_rope_extension.c.

Uses transformers' own code on the CPU in fp32 (modeling_rope_utils.ROPE_INIT_FUNCTIONS, the
LlamaRotaryEmbedding module and LlamaForCausalLM) and writes:
  tests/fixtures/hf/rope_ext.safetensors
      inv.<case>     F32 [D/2]  transformers' inv_freq for the case
      attn.<case>    F32 [1]    its attention factor (cos/sin multiplier; 1 except YaRN)
      params.<case>  F32 [8]    D, rope_theta, factor, max_position_embeddings (the original
                                context), beta_fast, beta_slow, attention_factor (0 = default),
                                seq_len (dynamic: max(position_ids) + 1 given to the rotary module;
                                0 otherwise)
      cos.<case>, sin.<case> F32 [P, D]  LlamaRotaryEmbedding(position_ids = pos.<case>) outputs
      pos.<case>     I32 [P]    those positions (beyond the original context for most cases)
      tiny.ids       I32 [T]    one token sequence
      tiny.pos       I32 [T]    its position_ids: 900 .. 900+T-1, far beyond the original 256
      tiny.pos_short I32 [T]    0 .. T-1 (inside the original context)
      tiny.logits.<m> F32 [T, V]  LlamaForCausalLM logits of the tiny model with rope_scaling
                                {rope_type m, factor 4} (m = linear, yarn, dynamic) at tiny.pos
      tiny.logits.dynamic_short  the dynamic model at tiny.pos_short (no scaling below 256)
      tiny.logits.none           no rope_scaling at tiny.pos (shows that the scaling matters)
  tests/fixtures/hf/tiny-llama-ctx256/{config.json, model.safetensors}: that tiny Llama without
      scaling (2 layers, hidden 64, 2 heads of 32, 1 KV head, vocab 64, rope_theta 10000,
      max_position_embeddings 256); the C test extends it to 1024 with each method.
Case names: <method>_<tag>. linear: factor 2 and 3 (a non-power of two, so that transformers'
inv_freq / factor rounding shows), yarn: SmolLM2-like (D 64, theta 1e5, 8192 -> 16384), Llama-like
(D 128, theta 5e5, factor 4), explicit beta_fast 16 / beta_slow 2 / attention_factor 1.2,
D 96; dynamic: seq_len below, at and beyond the original context, D 64 and 128.

transformers 4.46.3 (pinned in requirements-hf.txt) evaluates YaRN's correction range with
max_position_embeddings, transformers 5.x with rope_scaling.original_max_position_embeddings; the
cases keep max_position_embeddings = the original context so both agree.

Usage (repo root; `make fixtures` runs it after gen_hf_fixtures.py):
    python3 tests/reference/gen_rope_ext_fixtures.py [--out tests/fixtures/hf]
Re-executes itself inside .venv-hf (created by gen_hf_fixtures.py). Deterministic (fixed seed,
fp32, 1 thread).
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from venv_hf import reexec_in_venv_hf  # noqa: E402

reexec_in_venv_hf(__file__, "gen_rope_ext")

import argparse  # noqa: E402
import json  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

from gen_rope_fixtures import tiny_model  # noqa: E402  (same directory)

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
torch.set_default_dtype(torch.float32)

# name: (D, theta, max_position_embeddings, rope_scaling, seq_len for dynamic / None)
CASES = {
    "linear_f2": (64, 10000.0, 2048, dict(rope_type="linear", factor=2.0), None),
    "linear_f3": (128, 500000.0, 8192, dict(rope_type="linear", factor=3.0), None),
    "yarn_smollm2": (64, 100000.0, 8192, dict(rope_type="yarn", factor=2.0), None),
    "yarn_llama": (128, 500000.0, 4096, dict(rope_type="yarn", factor=4.0), None),
    "yarn_betas": (64, 10000.0, 2048, dict(rope_type="yarn", factor=8.0, beta_fast=16.0,
                                           beta_slow=2.0, attention_factor=1.2), None),
    "yarn_d96": (96, 1000000.0, 32768, dict(rope_type="yarn", factor=4.0), None),
    "dynamic_short": (64, 100000.0, 8192, dict(rope_type="dynamic", factor=2.0), 4096),
    "dynamic_at": (64, 100000.0, 8192, dict(rope_type="dynamic", factor=2.0), 8192),
    "dynamic_16k": (64, 100000.0, 8192, dict(rope_type="dynamic", factor=2.0), 16384),
    "dynamic_odd": (128, 500000.0, 4096, dict(rope_type="dynamic", factor=3.0), 12345),
}


def rotary(D, theta, max_pos, rs):
    cfg = LlamaConfig(hidden_size=D * 2, num_attention_heads=2, head_dim=D, rope_theta=theta,
                      rope_scaling=dict(rs), max_position_embeddings=max_pos)
    return LlamaRotaryEmbedding(config=cfg)


TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, rope_theta=10000.0,
            rms_norm_eps=1e-5, max_position_embeddings=256, hidden_act="silu",
            tie_word_embeddings=False, attention_bias=False, mlp_bias=False, rope_scaling=None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / "tests" / "fixtures" / "hf"))
    ap.add_argument("--no-venv", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t = {}
    for name, (D, theta, max_pos, rs, seq_len) in CASES.items():
        rot = rotary(D, theta, max_pos, rs)
        if seq_len is None:
            pos = (max_pos + torch.arange(0, 37) * (max_pos // 7 + 3)).view(1, -1)
        else:  # the rotary module picks the table from max(position_ids) + 1
            pos = torch.cat([torch.arange(0, 31) * (seq_len // 40), torch.tensor([seq_len - 1])])
            pos = pos.view(1, -1)
        x = torch.zeros(1, pos.shape[1], D)
        with torch.no_grad():
            cos, sin = rot(x, pos)
        inv = rot.inv_freq.detach().clone()
        att = float(rot.attention_scaling)
        t[f"inv.{name}"] = inv.float().contiguous()
        t[f"attn.{name}"] = torch.tensor([att], dtype=torch.float32)
        t[f"params.{name}"] = torch.tensor([D, theta, rs["factor"], max_pos, rs.get("beta_fast", 0.0),
                                            rs.get("beta_slow", 0.0),
                                            rs.get("attention_factor", 0.0), seq_len or 0],
                                           dtype=torch.float32)
        t[f"cos.{name}"] = cos[0].float().contiguous()
        t[f"sin.{name}"] = sin[0].float().contiguous()
        t[f"pos.{name}"] = pos[0].to(torch.int32).contiguous()
        print(f"[gen_rope_ext] {name}: attention factor {att:.6g}, inv_freq[0] {inv[0]:.6g} "
              f"inv_freq[-1] {inv[-1]:.6g}")

    base = tiny_model(TINY, seed=4321)
    T = 24
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, TINY["vocab_size"], (1, T), generator=g)
    pos = (900 + torch.arange(T)).view(1, T)
    pos_short = torch.arange(T).view(1, T)
    sd = base.state_dict()

    def logits_with(rs, p):
        m = LlamaForCausalLM(LlamaConfig(**dict(TINY, rope_scaling=rs))).eval()
        m.config._attn_implementation = "eager"
        m.load_state_dict(sd)
        with torch.no_grad():
            return m(input_ids=ids, position_ids=p).logits[0].float().contiguous()

    t["tiny.ids"] = ids[0].to(torch.int32).contiguous()
    t["tiny.pos"] = pos[0].to(torch.int32).contiguous()
    t["tiny.pos_short"] = pos_short[0].to(torch.int32).contiguous()
    t["tiny.logits.none"] = logits_with(None, pos)
    for meth in ("linear", "yarn", "dynamic"):
        t[f"tiny.logits.{meth}"] = logits_with(dict(rope_type=meth, factor=4.0), pos)
        d = (t[f"tiny.logits.{meth}"] - t["tiny.logits.none"]).abs().max().item()
        print(f"[gen_rope_ext] tiny {meth}: max|logits - unscaled| {d:.3g}")
    t["tiny.logits.dynamic_short"] = logits_with(dict(rope_type="dynamic", factor=4.0), pos_short)
    plain_short = logits_with(None, pos_short)
    d = (t["tiny.logits.dynamic_short"] - plain_short).abs().max().item()
    assert d == 0.0, f"dynamic below the original context should be unscaled ({d})"
    save_file(t, str(out / "rope_ext.safetensors"),
              metadata={"generator": "tests/reference/gen_rope_ext_fixtures.py",
                        "torch": torch.__version__, "transformers": transformers.__version__})

    d = out / "tiny-llama-ctx256"
    d.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items() if "rotary_emb" not in k},
              str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(TINY, architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="float32")
    (d / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
    for p in [out / "rope_ext.safetensors", d / "model.safetensors", d / "config.json"]:
        print(f"[gen_rope_ext] wrote {p} ({p.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
