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

Packed batch: row 0 holds two documents (10 + 14 tokens), row 1 one of 24 (so the 6-token window
cuts every document); position_ids restart per document. The reference runs each document as its
own [1, len] sequence with attn_implementation "eager" and concatenates the logits; the loss is the
mean CE over the labelled targets of the whole batch, labels shifted within each document.

Usage (from the repo root; needs .venv-torch from `make venv-torch`):
    python3 tests/reference/gen_gemma3_fixtures.py [--out tests/fixtures/hf/gemma3]
Deterministic: fixed seeds, fp32, CPU, 1 thread, torch.use_deterministic_algorithms(True).
"""
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VENV_PY = REPO / ".venv-torch" / "bin" / "python"

if os.environ.get("BT_GEMMA3_IN_VENV") != "1":
    if not VENV_PY.exists():
        sys.exit("gen_gemma3_fixtures: .venv-torch is missing: run `make venv-torch` first")
    env = dict(os.environ, BT_GEMMA3_IN_VENV="1", PYTHONHASHSEED="0", CUDA_VISIBLE_DEVICES="",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    os.execve(str(VENV_PY), [str(VENV_PY), str(Path(__file__).resolve())] + sys.argv[1:], env)

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import warnings  # noqa: E402

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

import peft  # noqa: E402
import transformers  # noqa: E402
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict  # noqa: E402
from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402

transformers.logging.set_verbosity_error()

# a byte-level BPE vocabulary for `trainer generate` on the GGUFs: the 256 GPT-2 byte symbols
# (id = byte), three merges and an end-of-text control token
MERGES = ["Ġ t", "h e", "Ġt he"]
EOT = "<|endoftext|>"
PROMPT = "hello the cat"
GEN_TOKENS = 8


def bytes_to_unicode():
    """GPT-2's byte -> printable symbol map (openai/gpt-2 encoder.py), as byte-level BPE uses."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


BU = bytes_to_unicode()
TOKENS = [BU[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES] + [EOT]

B, T = 2, 24
DOCS = [[10, 14], [24]]
N_PROMPT = 3  # leading tokens of row 0's first document masked with -100
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_R, LORA_ALPHA = 4, 8


def log(msg):
    print(f"[gen_gemma3] {msg}", flush=True)


def make_batch():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, len(TOKENS) - 1, (B, T), generator=g, dtype=torch.int64)
    pos = torch.zeros(B, T, dtype=torch.int64)
    cu = [0]
    for r, docs in enumerate(DOCS):
        s = 0
        for n in docs:
            pos[r, s:s + n] = torch.arange(n)
            s += n
            cu.append(r * T + s)
    labels = ids.clone()
    labels[0, :N_PROMPT] = -100
    return dict(input_ids=ids, labels=labels, position_ids=pos,
                cu_seqlens=torch.tensor(cu, dtype=torch.int32))


def hf_loss(logits, labels, cu):
    """Mean CE over labelled targets, labels shifted within each document (what the trainer's
    bt_shift_targets does and what HF computes for one document per row)."""
    flat_l = logits.reshape(-1, logits.shape[-1])
    lab = labels.reshape(-1)
    tgt = torch.full_like(lab, -100)
    for a, b in zip(cu[:-1], cu[1:]):
        tgt[a:b - 1] = lab[a + 1:b]
    return torch.nn.functional.cross_entropy(flat_l, tgt, ignore_index=-100, reduction="mean")


def encode(text):
    """Byte-level BPE of TOKENS / MERGES on the words of `text` (enough for PROMPT: ' ?word')."""
    import re
    ids = []
    for piece in re.findall(r" ?[a-z]+", text):
        sym = [BU[b] for b in piece.encode()]
        while True:
            pairs = [(MERGES.index(f"{a} {b}"), i) for i, (a, b) in enumerate(zip(sym, sym[1:]))
                     if f"{a} {b}" in MERGES]
            if not pairs:
                break
            _, i = min(pairs)
            sym[i:i + 2] = [sym[i] + sym[i + 1]]
        ids += [TOKENS.index(x) for x in sym]
    return ids


def greedy(model, ids, n):
    """n greedy tokens after ids (full forward each step); the top-1 margin must be clear of
    fp32 noise so that the trainer's greedy choice is the same."""
    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(n):
            z = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            top = torch.topk(z, 2).values
            assert float(top[0] - top[1]) > 1e-3, "greedy near-tie: pick another PROMPT"
            nxt = int(z.argmax())
            ids.append(nxt)
            out.append(nxt)
    return out




def make_config():
    return Gemma3TextConfig(
        vocab_size=len(TOKENS), hidden_size=32, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, head_dim=24, query_pre_attn_scalar=24,
        sliding_window=6, rms_norm_eps=1e-6, max_position_embeddings=512,
        hidden_activation="gelu_pytorch_tanh", initializer_range=0.2, tie_word_embeddings=True,
        bos_token_id=len(TOKENS) - 1, eos_token_id=len(TOKENS) - 1, pad_token_id=0,
        attn_implementation="eager")


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
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")  # a pre-tokeniser loaderd serves (as the Qwen / Phi-3 fixtures)
    w.add_token_list(TOKENS)
    w.add_token_types([gguf.TokenType.NORMAL] * (len(TOKENS) - 1) + [gguf.TokenType.CONTROL])
    w.add_token_merges(MERGES)
    w.add_eos_token_id(len(TOKENS) - 1)
    w.add_add_bos_token(False)
    tmap = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue  # tied: llama.cpp uses token_embd
        new = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert new is not None, hf_name
        a = t.detach().float().numpy()
        if hf_name.endswith("norm.weight"):
            a = a + 1  # Gemma3Model.modify_tensors: the norms are stored as 1 + w
        if a.ndim == 2:
            w.add_tensor(new, gguf.quants.quantize(a, gguf.GGMLQuantizationType.BF16),
                         raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            w.add_tensor(new, a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def build(out, batch):
    torch.manual_seed(33)
    cfg = make_config()
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

    cu = batch["cu_seqlens"].tolist()
    flat_ids = batch["input_ids"].reshape(-1)

    def packed_logits(mdl):
        parts = [mdl(input_ids=flat_ids[a:b][None]).logits.float()[0]
                 for a, b in zip(cu[:-1], cu[1:])]
        return torch.cat(parts).reshape(B, T, -1)

    with torch.no_grad():
        base_logits = packed_logits(model)
        # the window matters: a window longer than every document gives other logits
        model.config.sliding_window = 10 ** 6
        full = packed_logits(model)
        model.config.sliding_window = cfg.sliding_window = 6
        assert float((full - base_logits).abs().max()) > 1e-2
        assert float((packed_logits(model) - base_logits).abs().max()) == 0
    gen_base = greedy(model, encode(PROMPT), GEN_TOKENS)
    base_loss = hf_loss(base_logits, batch["labels"], cu)

    lcfg = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                      target_modules=LORA_TARGETS, bias="none", task_type="CAUSAL_LM")
    pm = get_peft_model(model, lcfg)
    pm.eval()
    pm.peft_config["default"].base_model_name_or_path = "tests/fixtures/hf/gemma3/hf"
    g = torch.Generator().manual_seed(4243)
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
    assert len(trainable) == 2 * 7 * cfg.num_hidden_layers
    with torch.no_grad():
        gen_lora = greedy(pm, encode(PROMPT), GEN_TOKENS)
    out_logits = packed_logits(pm)
    loss = hf_loss(out_logits, batch["labels"], cu)
    loss.backward()
    grads = {key[n]: p.grad.detach().float().contiguous() for n, p in trainable}
    assert all(float(v.abs().max()) > 0 for v in grads.values()), "a LoRA gradient is all zero"
    ref = {"logits_base": base_logits.reshape(B * T, -1).contiguous(),
           "loss_base": base_loss.detach().reshape(1),
           "logits": out_logits.detach().reshape(B * T, -1).contiguous(),
           "loss": loss.detach().reshape(1)}
    ref.update(grads)
    save_file(ref, str(d / "ref.safetensors"))
    log(f"loss base {base_loss.item():.6f}, with LoRA {loss.item():.6f}")
    return dict(config=json.loads((d / "hf" / "config.json").read_text()),
                loss_base=float(np.float32(base_loss.item())), loss=float(np.float32(loss.item())),
                greedy_base=gen_base, greedy_lora=gen_lora)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / "tests/fixtures/hf/gemma3"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    batch = make_batch()
    save_file({k: v.to(torch.int32).contiguous() for k, v in batch.items()},
              str(out / "batch.safetensors"))
    man = {"versions": {"torch": torch.__version__.split("+")[0],
                        "transformers": transformers.__version__, "peft": peft.__version__,
                        "gguf": "0.19.0", "numpy": np.__version__},
           "batch": {"B": B, "T": T, "docs": DOCS, "n_prompt_masked": N_PROMPT},
           "lora": {"r": LORA_R, "alpha": LORA_ALPHA, "targets": LORA_TARGETS},
           "generate": {"prompt": PROMPT, "prompt_ids": encode(PROMPT), "new_tokens": GEN_TOKENS,
                        "tokens": TOKENS}}
    man["gemma3"] = build(out, batch)
    (out / "manifest.json").write_text(json.dumps(man, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
