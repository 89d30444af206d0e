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
  batch.safetensors  the packed batch of gen_qwen_fixtures.py (same seeds, same layout)
  longrope.gguf  the phi3 header of model.gguf plus the two tables Phi3MiniModel.
                 generate_extra_tensors writes for rope_scaling "longrope" / "su"
                 (rope_factors_long / rope_factors_short [head_dim / 2] F32) and nothing else: the
                 trainer must refuse it by name before reading any weight

The packed batch, the loss and the byte-level vocabulary are gen_qwen_fixtures.py's (imported).

Usage (from the repo root; needs .venv-torch from `make venv-torch`):
    python3 tests/reference/gen_phi3_fixtures.py [--out tests/fixtures/hf/phi3]
Deterministic: fixed seeds, fp32, CPU, 1 thread, torch.use_deterministic_algorithms(True).
"""
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VENV_PY = REPO / ".venv-torch" / "bin" / "python"

if os.environ.get("BT_QWEN_IN_VENV") != "1":
    if not VENV_PY.exists():
        sys.exit("gen_phi3_fixtures: .venv-torch is missing: run `make venv-torch` first")
    env = dict(os.environ, BT_QWEN_IN_VENV="1", PYTHONHASHSEED="0", CUDA_VISIBLE_DEVICES="",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    os.execve(str(VENV_PY), [str(VENV_PY), str(Path(__file__).resolve())] + sys.argv[1:], env)

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402

sys.path.insert(0, str(HERE))
import gen_qwen_fixtures as q  # noqa: E402  (same venv, seeds, batch and vocabulary)
import gguf  # noqa: E402
import numpy as np  # noqa: E402
import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import Phi3Config, Phi3ForCausalLM  # noqa: E402

# Phi-3: untied lm_head (as Phi-3-mini), GQA (4 heads, 2 kv heads, head_dim 8), no rope_scaling;
# sliding_window 512 = the whole context (Phi3MiniModel writes it, and llama.cpp's phi3 loader
# refuses a file without one; no document here comes near it, so attention is full causal)
CFG = dict(vocab_size=len(q.TOKENS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
           max_position_embeddings=512, original_max_position_embeddings=512, hidden_act="silu",
           initializer_range=0.2, tie_word_embeddings=False, sliding_window=512,
           rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
           bos_token_id=len(q.TOKENS) - 1, eos_token_id=len(q.TOKENS) - 1, pad_token_id=0)
LORA_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
LORA_R, LORA_ALPHA = 4, 8


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
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(q.TOKENS)
    w.add_token_types([gguf.TokenType.NORMAL] * (len(q.TOKENS) - 1) + [gguf.TokenType.CONTROL])
    w.add_token_merges(q.MERGES)
    w.add_eos_token_id(len(q.TOKENS) - 1)
    w.add_add_bos_token(False)
    tmap = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    names = set()
    for hf_name, t in model.state_dict().items():
        new = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert new is not None, hf_name
        names.add(new)
        a = t.detach().float().numpy()
        if a.ndim == 2:
            w.add_tensor(new, gguf.quants.quantize(a, gguf.GGMLQuantizationType.BF16),
                         raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            w.add_tensor(new, a.astype(np.float32))
    # the fused names, as gguf-py maps them (no separate q/k/v or gate tensor)
    assert "blk.0.attn_qkv.weight" in names and "blk.0.ffn_up.weight" in names, sorted(names)
    assert "blk.0.attn_q.weight" not in names and "blk.0.ffn_gate.weight" not in names
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


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
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


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

    cu = batch["cu_seqlens"].tolist()
    flat_ids = batch["input_ids"].reshape(-1)

    def packed_logits(mdl):
        parts = [mdl(input_ids=flat_ids[a:b][None]).logits.float()[0]
                 for a, b in zip(cu[:-1], cu[1:])]
        return torch.cat(parts).reshape(q.B, q.T, -1)

    with torch.no_grad():
        base_logits = packed_logits(model)
    gen_base = q.greedy(model, q.encode(q.PROMPT), q.GEN_TOKENS)
    base_loss = q.hf_loss(base_logits, batch["labels"], cu)

    lcfg = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                      target_modules=LORA_TARGETS, bias="none", task_type="CAUSAL_LM")
    pm = get_peft_model(model, lcfg)
    pm.eval()
    pm.peft_config["default"].base_model_name_or_path = "tests/fixtures/hf/phi3/hf"
    g = torch.Generator().manual_seed(4242)
    with torch.no_grad():
        for n, p in sorted(pm.named_parameters()):
            if "lora_A" in n:
                p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) / math.sqrt(p.shape[1]))
            elif "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    pm.save_pretrained(d / "adapter-init")
    (d / "adapter-init" / "README.md").unlink(missing_ok=True)
    trainable = [(n, p) for n, p in pm.named_parameters() if p.requires_grad]
    key = {n: n.replace(".default", "") for n, _ in trainable}
    assert set(key.values()) == set(get_peft_model_state_dict(pm).keys())
    assert len(trainable) == 2 * len(LORA_TARGETS) * cfg.num_hidden_layers
    sd = get_peft_model_state_dict(pm)  # the fused modules' names and shapes, as PEFT writes them
    assert sd["base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight"].shape == (4, 32)
    assert sd["base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"].shape == (64, 4)
    assert sd["base_model.model.model.layers.0.mlp.gate_up_proj.lora_B.weight"].shape == (128, 4)
    with torch.no_grad():
        gen_lora = q.greedy(pm, q.encode(q.PROMPT), q.GEN_TOKENS)
    out_logits = packed_logits(pm)
    loss = q.hf_loss(out_logits, batch["labels"], cu)
    loss.backward()
    grads = {key[n]: p.grad.detach().float().contiguous() for n, p in trainable}
    assert all(float(v.abs().max()) > 0 for v in grads.values()), "a LoRA gradient is all zero"
    ref = {"logits_base": base_logits.reshape(q.B * q.T, -1).contiguous(),
           "loss_base": base_loss.detach().reshape(1),
           "logits": out_logits.detach().reshape(q.B * q.T, -1).contiguous(),
           "loss": loss.detach().reshape(1)}
    ref.update(grads)
    save_file(ref, str(d / "ref.safetensors"))
    q.log(f"phi3: loss base {base_loss.item():.6f}, with LoRA {loss.item():.6f}")
    return dict(config=json.loads((d / "hf" / "config.json").read_text()),
                loss_base=float(np.float32(base_loss.item())), loss=float(np.float32(loss.item())),
                greedy_base=gen_base, greedy_lora=gen_lora)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / "tests/fixtures/hf/phi3"))
    a = ap.parse_args()
    out = Path(a.out)
    batch = q.make_batch()
    man = {"versions": {"torch": torch.__version__.split("+")[0],
                        "transformers": transformers.__version__, "peft": peft.__version__,
                        "gguf": "0.19.0", "numpy": np.__version__},
           "batch": {"B": q.B, "T": q.T, "docs": q.DOCS, "n_prompt_masked": q.N_PROMPT},
           "lora": {"r": LORA_R, "alpha": LORA_ALPHA, "targets": LORA_TARGETS},
           "generate": {"prompt": q.PROMPT, "prompt_ids": q.encode(q.PROMPT),
                        "new_tokens": q.GEN_TOKENS, "tokens": q.TOKENS}}
    man["phi3"] = build(out, batch)
    save_file({k: v.to(torch.int32).contiguous() for k, v in batch.items()},
              str(out / "batch.safetensors"))
    (out / "manifest.json").write_text(json.dumps(man, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
