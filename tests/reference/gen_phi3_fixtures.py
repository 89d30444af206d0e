#!/usr/bin/env python3
"""Phi-3 reference fixtures for tests/unit/trainer/test_parity_phi3.c.

Uses the REAL reference libraries of the pinned stack python/requirements-torch.txt (torch 2.15.0,
transformers 5.23.0, peft 0.21.2, gguf 0.19.0) on the CPU in fp32 and writes under
tests/fixtures/hf/phi3/:

  hf/            save_pretrained of a tiny random Phi3ForCausalLM (BF16 safetensors; weights
                 rounded to bfloat16 first, so the fp32 reference runs on the same values), with
                 the fused self_attn.qkv_proj [Dq + 2 Dkv, D] and mlp.gate_up_proj [2 F, D]
  model.gguf     the same weights as llama.cpp's convert_hf_to_gguf.py Phi3MiniModel writes them:
                 general.architecture "phi3", the phi3.* keys of its set_gguf_parameters
                 (rope.dimension_count = head_dim, rope.scaling.original_context_length), tensor
                 names from gguf-py 0.19.0's TensorNameMap (tensor_mapping.py:
                 "model.layers.{bid}.self_attn.qkv_proj" -> MODEL_TENSOR.ATTN_QKV
                 "blk.N.attn_qkv", "model.layers.{bid}.mlp.gate_up_proj" -> MODEL_TENSOR.FFN_UP
                 "blk.N.ffn_up", i.e. gate and up fused), rows as HF holds them (no permutation),
                 2-D weights BF16 and norms F32
  adapter-init/  PEFT save_pretrained of a LoRA (r 4, alpha 8) on every Phi-3 linear as PEFT
                 names them: the fused qkv_proj (one lora_A [4, 32], one lora_B [64, 4] over
                 q | k | v rows) and gate_up_proj (lora_B [128, 4] over gate | up rows), o_proj,
                 down_proj -- with a seeded non-zero init
  ref.safetensors  logits_base [M, V], loss_base [1] (no adapter), logits [M, V], loss [1] (with
                 it), and d loss / d each LoRA tensor under its PEFT key
  batch.safetensors  the packed batch of tiny_family.py (as the Qwen and Gemma 3 fixtures)
  longrope.gguf  the phi3 header of model.gguf plus the two tables Phi3MiniModel.
                 generate_extra_tensors writes for rope_scaling "longrope" / "su"
                 (rope_factors_long / rope_factors_short [head_dim / 2] F32) and nothing else: the
                 trainer must refuse it by name before reading any weight

The packed batch, the loss, the byte-level vocabulary and the reference run are tiny_family.py's,
shared with gen_qwen_fixtures.py and gen_gemma3_fixtures.py.

Usage (from the repo root; needs .venv-torch from `make venv-torch`):
    python3 tests/reference/gen_phi3_fixtures.py [--out tests/fixtures/hf/phi3]
Deterministic: fixed seeds, fp32, CPU, 1 thread, torch.use_deterministic_algorithms(True).
"""
import copy
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from venv_torch import reexec_in_venv_torch  # noqa: E402

reexec_in_venv_torch(__file__, "gen_phi3_fixtures")

import argparse  # noqa: E402

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import tiny_family as tf  # noqa: E402  (vocabulary, batch, reference run, GGUF tensors)
import torch  # noqa: E402
from peft import get_peft_model_state_dict  # noqa: E402
from transformers import Phi3Config, Phi3ForCausalLM  # noqa: E402

# Phi-3: untied lm_head (as Phi-3-mini), GQA (4 heads, 2 kv heads, head_dim 8), no rope_scaling;
# sliding_window 512 = the whole context (Phi3MiniModel writes it, and llama.cpp's phi3 loader
# refuses a file without one; no document here comes near it, so attention is full causal)
CFG = dict(vocab_size=len(tf.TOKENS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
           max_position_embeddings=512, original_max_position_embeddings=512, hidden_act="silu",
           initializer_range=0.2, tie_word_embeddings=False, sliding_window=512,
           rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
           bos_token_id=len(tf.TOKENS) - 1, eos_token_id=len(tf.TOKENS) - 1, pad_token_id=0)
LORA_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def log(msg):
    print(f"[gen_phi3] {msg}", flush=True)


def write_gguf(model, cfg, path):
    """The GGUF convert_hf_to_gguf.py Phi3MiniModel writes for this checkpoint."""
    arch = gguf.MODEL_ARCH.PHI3
    name = gguf.MODEL_ARCH_NAMES[arch]
    assert name == "phi3"
    hd = cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), name)
    # not "...phi3...": llama.cpp's vocabulary loader (llama-vocab.cpp, b4965) sets strip
    # attributes on Phi-3's "</s>" / "<unk>" / "<s>" when general.name contains "phi3" / "phi-3",
    # tokens this byte-level vocabulary does not have
    w.add_name("tiny-random-phi-three")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_sliding_window(cfg.sliding_window)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    tf.gguf_add_vocab(w)
    names = tf.gguf_add_tensors(w, model, arch, cfg.num_hidden_layers)
    # the fused names, as gguf-py maps them (no separate q/k/v or gate tensor)
    assert "blk.0.attn_qkv.weight" in names and "blk.0.ffn_up.weight" in names, sorted(names)
    assert "blk.0.attn_q.weight" not in names and "blk.0.ffn_gate.weight" not in names
    tf.gguf_finish(w)


def write_longrope_gguf(cfg, path):
    hd = cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_context_length(131072)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_rope_scaling_attn_factors(1.19)
    w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_LONG] + ".weight",
                 np.linspace(1.0, 4.0, hd // 2, dtype=np.float32))
    w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT] + ".weight",
                 np.ones(hd // 2, dtype=np.float32))
    tf.gguf_finish(w)


def build(out, batch):
    torch.manual_seed(5)
    cfg = Phi3Config(**CFG)
    model = Phi3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:  # not trivially 1
                p.copy_(1 + 0.1 * torch.randn(p.shape))
            p.copy_(p.bfloat16().float())  # exact in the BF16 files
    at = model.model.layers[0].self_attn
    assert at.qkv_proj.weight.shape == (32 + 2 * 16, 32) and at.qkv_proj.bias is None
    assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (128, 32)
    d = out
    if d.exists():
        shutil.rmtree(d)
    (d / "hf").mkdir(parents=True)
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(d / "hf", safe_serialization=True)
    write_gguf(model, cfg, d / "model.gguf")
    write_longrope_gguf(cfg, d / "longrope.gguf")

    def check_peft(pm):
        sd = get_peft_model_state_dict(pm)  # the fused modules' names and shapes, as PEFT writes them
        assert sd["base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight"].shape == (4, 32)
        assert sd["base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"].shape == (64, 4)
        assert sd["base_model.model.model.layers.0.mlp.gate_up_proj.lora_B.weight"].shape == (128, 4)

    return tf.reference(model, d, batch, LORA_TARGETS, "tests/fixtures/hf/phi3/hf", 4242,
                        lambda m: log(f"phi3: {m}"), check_peft=check_peft)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / "tests/fixtures/hf/phi3"))
    a = ap.parse_args()
    out = Path(a.out)
    batch = tf.make_batch()
    man = tf.manifest(LORA_TARGETS)
    man["phi3"] = build(out, batch)
    tf.save_batch(batch, out / "batch.safetensors")
    tf.write_manifest(man, out / "manifest.json")


if __name__ == "__main__":
    main()
