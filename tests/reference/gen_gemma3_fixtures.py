#!/usr/bin/env python3
"""Gemma 3 reference fixtures for tests/unit/trainer/test_parity_gemma3.c.

Uses the REAL reference libraries of the pinned stack python/requirements-torch.txt (torch 2.15.0,
transformers 5.23.0, peft 0.21.2, gguf 0.19.0) on the CPU in fp32 and writes under
tests/fixtures/hf/gemma3/:

  hf/            save_pretrained of a tiny random Gemma3ForCausalLM (gemma3_text): 6 layers (layers
                 0-4 sliding_attention with a window of 6 tokens, layer 5 full_attention: the
                 default sliding_window_pattern 6, which llama.cpp hard-codes), hidden 32, 2 query
                 heads over 1 KV head of head_dim 24 (not 32 / 2), query_pre_attn_scalar 24,
                 QK-norm, the four norms per layer, GeGLU (gelu_pytorch_tanh), tied embedding,
                 RoPE bases 1e6 (global) / 1e4 (local). BF16 safetensors: the weights are rounded
                 to bfloat16 first, so BF16 holds them exactly and the fp32 reference runs on the
                 same values. Norm weights (Gemma3RMSNorm multiplies by 1 + w) are N(0, 0.1).
  model.gguf     the same weights as llama.cpp's convert_hf_to_gguf.py Gemma3Model writes them:
                 general.architecture "gemma3", its keys (key_length / value_length = head_dim,
                 attention.sliding_window, rope.freq_base = the global base), tensor names from
                 gguf-py's TensorNameMap (attn_norm, post_attention_norm, ffn_norm, post_ffw_norm,
                 attn_q_norm, ...), every *norm.weight stored as w + 1 (Gemma3Model.modify_tensors;
                 transformers' GGUF loader subtracts 1 back), no output tensor (tied), 2-D weights
                 BF16 and 1-D tensors F32
  adapter-init/  PEFT save_pretrained of a LoRA (r 4, alpha 8, all 7 projections) with a seeded
                 non-zero init (B != 0 so that A's gradients are non-zero)
  ref.safetensors  for the packed batch below: logits_base [M, V], loss_base [1] (no adapter),
                 logits [M, V], loss [1] (with the adapter), and d loss / d each LoRA tensor under
                 its PEFT key
  batch.safetensors  input_ids, labels, position_ids [2, 24] I32; cu_seqlens [4] I32

tests/fixtures/hf/gemma3-linear/ (--variant linear): the same files for the same weights (same seed)
with linear RoPE scaling, factor 8, on the global layer only, as Gemma 3 4B and larger have it:
hf/config.json in the form google/gemma-3-4b-it's text_config has it (transformers 4.x keys:
"rope_scaling": {"rope_type": "linear", "factor": 8.0}, rope_theta, rope_local_base_freq,
sliding_window_pattern; transformers 5.23 maps rope_scaling onto rope_parameters["full_attention"]
only, Gemma3TextConfig.convert_rope_params_to_dict), and model.gguf with gemma3.rope.scaling.type
"linear" / gemma3.rope.scaling.factor 8 as convert_hf_to_gguf.py Gemma3Model.set_gguf_parameters
writes them (llama.cpp applies them to the global layers only: rope_freq_scale_train_swa 1). The
generator checks that both choices show in the logits: without the scaling, or with it on the
sliding layers too, they move by more than 1e-2.

Packed batch: row 0 holds two documents (10 + 14 tokens), row 1 one of 24 (so the 6-token window
cuts every document); position_ids restart per document. The reference runs each document as its
own [1, len] sequence with attn_implementation "eager" and concatenates the logits; the loss is the
mean CE over the labelled targets of the whole batch, labels shifted within each document.

Usage (from the repo root; needs .venv-torch from `make venv-torch`):
    python3 tests/reference/gen_gemma3_fixtures.py [--variant plain|linear|all] [--out DIR]
Deterministic: fixed seeds, fp32, CPU, 1 thread, torch.use_deterministic_algorithms(True).
"""
import copy
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from venv_torch import reexec_in_venv_torch  # noqa: E402

reexec_in_venv_torch(__file__, "gen_gemma3_fixtures")

import argparse  # noqa: E402

import gguf  # noqa: E402
import tiny_family as tf  # noqa: E402  (vocabulary, batch, reference run, GGUF tensors)
import torch  # noqa: E402
from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def log(msg):
    print(f"[gen_gemma3] {msg}", flush=True)


ROPE_FACTOR = 8.0  # Gemma 3 4B / 12B / 27B's linear factor


def make_config(linear=False):
    extra = {"rope_scaling": {"rope_type": "linear", "factor": ROPE_FACTOR}} if linear else {}
    return Gemma3TextConfig(
        vocab_size=len(tf.TOKENS), hidden_size=32, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, head_dim=24, query_pre_attn_scalar=24,
        sliding_window=6, rms_norm_eps=1e-6, max_position_embeddings=512,
        hidden_activation="gelu_pytorch_tanh", initializer_range=0.2, tie_word_embeddings=True,
        bos_token_id=len(tf.TOKENS) - 1, eos_token_id=len(tf.TOKENS) - 1, pad_token_id=0,
        attn_implementation="eager", **extra)


def write_gguf(model, cfg, path):
    """The GGUF convert_hf_to_gguf.py Gemma3Model would write (see the module docstring)."""
    arch = gguf.MODEL_ARCH.GEMMA3
    name = gguf.MODEL_ARCH_NAMES[arch]
    w = gguf.GGUFWriter(str(path), name)
    w.add_name(f"tiny-random-{name}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_sliding_window(cfg.sliding_window)
    full = cfg.rope_parameters["full_attention"]
    if full["rope_type"] == "linear":  # Gemma3Model.set_gguf_parameters: global layers only
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_head_count_kv(cfg.num_key_value_heads)
    tf.gguf_add_vocab(w)  # pre-tokeniser "qwen2", one loaderd serves (as the Qwen / Phi-3 fixtures)

    def plus_one(hf_name, a):
        # Gemma3Model.modify_tensors: the norms are stored as 1 + w
        return a + 1 if hf_name.endswith("norm.weight") else a
    # tied: llama.cpp uses token_embd
    tf.gguf_add_tensors(w, model, arch, cfg.num_hidden_layers, skip=("lm_head.weight",),
                        transform=plus_one)
    tf.gguf_finish(w)


def hf4_config(path):
    """Rewrite path (a save_pretrained config.json with rope_parameters) in the transformers 4.x
    form of google/gemma-3-4b-it's text_config: rope_scaling (the global layers' linear scaling),
    rope_theta, rope_local_base_freq, sliding_window_pattern, no layer_types."""
    c = json.loads(path.read_text())
    rp = c.pop("rope_parameters")
    c.pop("layer_types")
    c.pop("_sliding_window_pattern", None)
    full = dict(rp["full_attention"])
    c["rope_theta"] = full.pop("rope_theta")
    c["rope_local_base_freq"] = rp["sliding_attention"]["rope_theta"]
    c["rope_scaling"] = full
    c["sliding_window_pattern"] = 6
    path.write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")


def check_rope(model):
    """The linear variant's RoPE shows in the logits: without the scaling (the global table x 8)
    or with it on the sliding layers too (their table / 8) the logits move by more than 1e-2."""
    rot = model.model.rotary_emb
    full = rot.full_attention_inv_freq.clone()
    assert torch.allclose(full * ROPE_FACTOR,
                          rot.compute_default_rope_parameters(model.config, None, "full_attention")[0])
    slid = rot.sliding_attention_inv_freq.clone()
    assert torch.equal(slid, rot.compute_default_rope_parameters(model.config, None,
                                                                "sliding_attention")[0])

    def check(packed_logits, base_logits):
        for name, t, k in (("unscaled", rot.full_attention_inv_freq, ROPE_FACTOR),
                           ("sliding layers scaled too", rot.sliding_attention_inv_freq,
                            1 / ROPE_FACTOR)):
            keep = t.clone()
            t.mul_(k)
            d = float((packed_logits(model) - base_logits).abs().max())
            t.copy_(keep)
            log(f"linear RoPE: {name}: logits move by {d:.3g}")
            assert d > 1e-2, name
        assert float((packed_logits(model) - base_logits).abs().max()) == 0
    return check


def build(out, batch, linear=False):
    torch.manual_seed(33)
    cfg = make_config(linear)
    model = Gemma3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:  # Gemma3RMSNorm: 1 + w, w not trivially 0
                p.copy_(0.1 * torch.randn(p.shape))
            p.copy_(p.bfloat16().float())  # exact in the BF16 files
    assert model.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (24,)
    d = out
    for sub in ("hf", "adapter-init"):
        if (d / sub).exists():
            shutil.rmtree(d / sub)
    (d / "hf").mkdir(parents=True)
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(d / "hf", safe_serialization=True)
    write_gguf(model, cfg, d / "model.gguf")
    if linear:
        hf4_config(d / "hf" / "config.json")
        back = Gemma3TextConfig.from_pretrained(d / "hf")
        assert back.rope_parameters == cfg.rope_parameters and back.layer_types == cfg.layer_types
        return tf.reference(model, d, batch, LORA_TARGETS, "tests/fixtures/hf/gemma3-linear/hf",
                            4243, log, check_base=check_rope(model))

    def check_window(packed_logits, base_logits):
        # the window matters: a window longer than every document gives other logits
        model.config.sliding_window = 10 ** 6
        full = packed_logits(model)
        model.config.sliding_window = cfg.sliding_window = 6
        assert float((full - base_logits).abs().max()) > 1e-2
        assert float((packed_logits(model) - base_logits).abs().max()) == 0

    return tf.reference(model, d, batch, LORA_TARGETS, "tests/fixtures/hf/gemma3/hf", 4243, log,
                        check_base=check_window)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", choices=("plain", "linear", "all"), default="all")
    ap.add_argument("--out", default=str(REPO / "tests/fixtures/hf"),
                    help="parent of gemma3/ and gemma3-linear/")
    a = ap.parse_args()
    for name in ("plain", "linear"):
        if a.variant not in (name, "all"):
            continue
        out = Path(a.out) / ("gemma3" if name == "plain" else "gemma3-linear")
        out.mkdir(parents=True, exist_ok=True)
        batch = tf.make_batch()
        tf.save_batch(batch, out / "batch.safetensors")
        man = tf.manifest(LORA_TARGETS)
        man["gemma3"] = build(out, batch, linear=name == "linear")
        tf.write_manifest(man, out / "manifest.json")


if __name__ == "__main__":
    main()
