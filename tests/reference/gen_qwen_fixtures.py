#!/usr/bin/env python3
"""Qwen2 / Qwen3 reference fixtures for tests/unit/trainer/test_parity_qwen.c.

Uses the REAL reference libraries of the pinned stack python/requirements-torch.txt (torch 2.15.0,
transformers 5.23.0 -- Qwen3 needs transformers >= 4.51, which the older .venv-hf pin lacks --,
peft 0.21.2, gguf 0.19.0) on the CPU in fp32 and writes, per family, under
tests/fixtures/hf/qwen/<family>/:

  hf/            save_pretrained of a tiny random Qwen2ForCausalLM / Qwen3ForCausalLM (BF16
                 safetensors: the weights are rounded to bfloat16 first, so BF16 holds them
                 exactly and the fp32 reference runs on the same values)
  model.gguf     the same weights as llama.cpp's convert_hf_to_gguf.py writes a qwen2 / qwen3
                 model: general.architecture "qwen2" / "qwen3", the <arch>.* keys of
                 TextModel.set_gguf_parameters (key_length / value_length from head_dim when the
                 config has one), tensor names from gguf-py's TensorNameMap (the map_tensor_name
                 of convert_hf_to_gguf.py: token_embd, blk.N.attn_q / attn_q.bias /
                 attn_q_norm, output_norm, output, ...), q/k rows NOT permuted (Qwen2Model and
                 Qwen3Model inherit TextModel.modify_tensors; only LlamaModel permutes), 2-D
                 weights BF16 and 1-D tensors (norms, biases) F32
  adapter-init/  PEFT save_pretrained of a LoRA (r 4, alpha 8, all 7 projections) with a seeded
                 non-zero init (B != 0 so that A's gradients are non-zero)
  ref.safetensors  for the packed batch below: logits_base [M, V], loss_base [1] (no adapter),
                 logits [M, V], loss [1] (with the adapter), and d loss / d each LoRA tensor under
                 its PEFT key (base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight ...)
  batch.safetensors  input_ids, labels, position_ids [2, 24] I32; cu_seqlens [4] I32

Packed batch: row 0 holds two documents (10 + 14 tokens), row 1 one of 24; position_ids restart
per document. The reference runs each document as its own [1, len] sequence and concatenates the
logits (the packed batch's meaning: no attention across documents), so it does not depend on how
a transformers version masks packed rows; the loss is the mean CE over the labelled targets of
the whole batch, labels shifted within each document.

Usage (from the repo root; needs .venv-torch from `make venv-torch`):
    python3 tests/reference/gen_qwen_fixtures.py [--out tests/fixtures/hf/qwen]
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

reexec_in_venv_torch(__file__, "gen_qwen_fixtures")

import argparse  # noqa: E402

import gguf  # noqa: E402
import torch  # noqa: E402
import tiny_family as tf  # noqa: E402  (vocabulary, batch, reference run, GGUF tensors)
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

COMMON = dict(vocab_size=len(tf.TOKENS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              rms_norm_eps=1e-6, max_position_embeddings=512, hidden_act="silu",
              initializer_range=0.2, bos_token_id=len(tf.TOKENS) - 1, eos_token_id=len(tf.TOKENS) - 1)
FAMILIES = {
    # Qwen2: q/k/v biases, untied lm_head, rope_theta from the config; head_dim = 32 / 2 = 16
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, gguf.MODEL_ARCH.QWEN2,
              dict(COMMON, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                   use_sliding_window=False)),
    # Qwen3: QK-norm, no biases, tied embedding (as Qwen3-0.6B), head_dim 16 != 32 / 4
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, gguf.MODEL_ARCH.QWEN3,
              dict(COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   tie_word_embeddings=True, attention_bias=False, use_sliding_window=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def log(msg):
    print(f"[gen_qwen] {msg}", flush=True)


def write_gguf(model, cfg, arch, path):
    """The GGUF convert_hf_to_gguf.py would write for this checkpoint (see the module docstring)."""
    name = gguf.MODEL_ARCH_NAMES[arch]
    w = gguf.GGUFWriter(str(path), name)
    w.add_name(f"tiny-random-{name}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if "head_dim" in cfg.to_dict() and cfg.head_dim is not None and name == "qwen3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    tf.gguf_add_vocab(w)
    # tied: llama.cpp uses token_embd
    skip = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    tf.gguf_add_tensors(w, model, arch, cfg.num_hidden_layers, skip=skip)
    tf.gguf_finish(w)


def family(fam, out, batch):
    cfg_cls, model_cls, arch, kw = FAMILIES[fam]
    torch.manual_seed({"qwen2": 2, "qwen3": 3}[fam])
    cfg = cfg_cls(**kw)
    model = model_cls(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:  # not trivially 1
                p.copy_(1 + 0.1 * torch.randn(p.shape))
            elif n.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape))
            p.copy_(p.bfloat16().float())  # exact in the BF16 files
    if fam == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    else:
        assert model.model.layers[0].self_attn.q_norm.weight.shape == (16,)
    d = out / fam
    if d.exists():
        shutil.rmtree(d)
    (d / "hf").mkdir(parents=True)
    # a copy: .to(bfloat16) would also round the fp32 RoPE inv_freq buffer of the reference
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(d / "hf", safe_serialization=True)
    write_gguf(model, cfg, arch, d / "model.gguf")

    return tf.reference(model, d, batch, LORA_TARGETS, f"tests/fixtures/hf/qwen/{fam}/hf", 4242,
                        lambda m: log(f"{fam}: {m}"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / "tests/fixtures/hf/qwen"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    batch = tf.make_batch()
    tf.save_batch(batch, out / "batch.safetensors")
    man = tf.manifest(LORA_TARGETS)
    for fam in FAMILIES:
        man[fam] = family(fam, out, batch)
    tf.write_manifest(man, out / "manifest.json")


if __name__ == "__main__":
    main()
