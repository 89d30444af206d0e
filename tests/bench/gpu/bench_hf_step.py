#!/usr/bin/env python3
"""Training-step baseline for tests/bench/gpu/bench_step_gpu.cu: transformers + PEFT LoRA (r, alpha
32, dropout 0.05, all seven linears), bf16, SDPA attention, (+ bitsandbytes NF4 double-quantised
base when importable, as QLoRA), fused AdamW, grad clip 1.0; B x T tokens of one document per row.
Prints one markdown row
  | trainer | model | B x T | r | ckpt | tokens/s | step ms | peak GiB | card |
(peak = torch.cuda.max_memory_reserved, i.e. without the CUDA context, which our tool includes;
max_memory_allocated goes to stderr). Models: --model smollm2 (real weights from the GGUF via
transformers gguf_file= when the `gguf` package is present, else random weights of the same shape;
timing does not depend on the values) or --model llama2-7b (random weights, Llama-2-7B config).
Prints 'skipped: reason' and exits 0 when torch/transformers/peft or a GPU is missing."""
import argparse
import os
import sys
import time


def skip(why):
    print(f"bench_hf_step: skipped: {why}")
    sys.exit(0)


try:
    import torch
except Exception as e:  # noqa: BLE001
    skip(f"torch not importable ({e})")
try:
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
except Exception as e:  # noqa: BLE001
    skip(f"transformers not importable ({e})")
try:
    import peft
    from peft import LoraConfig, get_peft_model
except Exception as e:  # noqa: BLE001
    skip(f"peft not importable ({e})")

SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                    max_position_embeddings=8192),
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      max_position_embeddings=4096),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def to_nf4(model, log):
    """Replace every decoder nn.Linear by bnb Linear4bit (nf4, double quant, bf16 compute)."""
    try:
        import bitsandbytes as bnb
    except Exception as e:  # noqa: BLE001
        log(f"bitsandbytes not importable ({e}): bf16 base (LoRA, not QLoRA)")
        return False
    for name, mod in list(model.named_modules()):
        for cname, child in list(mod.named_children()):
            if isinstance(child, torch.nn.Linear) and cname in TARGETS:
                new = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                        compute_dtype=torch.bfloat16, compress_statistics=True,
                                        quant_type="nf4")
                new.weight = bnb.nn.Params4bit(child.weight.data.to("cpu"), requires_grad=False,
                                               quant_type="nf4", compress_statistics=True)
                new = new.to("cuda")
                setattr(mod, cname, new)
    torch.cuda.empty_cache()
    log(f"bitsandbytes {bnb.__version__}: NF4 base")
    return True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", choices=sorted(SHAPES))
    ap.add_argument("--gguf", default=os.environ.get("BT_MODEL", ""))
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--ckpt", type=int, default=0)
    ap.add_argument("--no-nf4", action="store_true")
    a = ap.parse_args()
    log = lambda s: print(f"bench_hf_step: {s}", file=sys.stderr, flush=True)  # noqa: E731
    if not torch.cuda.is_available():
        skip("torch.cuda.is_available() is False")
    torch.manual_seed(0)
    model = None
    what = a.model
    if a.model == "smollm2" and a.gguf and os.path.exists(a.gguf):
        try:
            model = LlamaForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(a.gguf)),
                                                     gguf_file=os.path.basename(a.gguf),
                                                     torch_dtype=torch.bfloat16).to("cuda")
            what = "smollm2 (GGUF weights)"
        except Exception as e:  # noqa: BLE001
            log(f"could not load the GGUF ({type(e).__name__}: {e}); random weights of the same shape")
    if model is None:
        cfg = LlamaConfig(**SHAPES[a.model], hidden_act="silu", attention_bias=False)
        cfg._attn_implementation = "sdpa"
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg)
        torch.set_default_dtype(torch.float32)
        what = f"{a.model} (random)"
    model.config.use_cache = False
    nf4 = False if a.no_nf4 else to_nf4(model, log)
    for p in model.parameters():
        p.requires_grad_(False)
    if a.ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    lcfg = LoraConfig(r=a.r, lora_alpha=32, lora_dropout=0.05, target_modules=TARGETS,
                      task_type="CAUSAL_LM")
    model = get_peft_model(model, lcfg)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()  # fp32 LoRA master weights (as ours; PEFT autocasts in forward)
    try:
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    except Exception:  # noqa: BLE001
        opt = torch.optim.AdamW(params, lr=1e-4)
    M = a.B * a.T
    V = model.config.vocab_size
    ids = torch.randint(0, V, (a.B, a.T), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    tt = 0.0
    loss = float("nan")
    for s in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if s >= a.warmup:
            tt += time.perf_counter() - t0
        loss = out.loss.item()
    tps = M * a.steps / tt if a.steps else 0
    peak = torch.cuda.max_memory_reserved() / 2**30
    log(f"{what}: transformers {transformers.__version__}, peft {peft.__version__}, torch "
        f"{torch.__version__}; last loss {loss:.4f}; max allocated "
        f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, reserved {peak:.2f} GiB")
    impl = "HF+PEFT" + (" +bnb NF4" if nf4 else " (bf16 base)")
    print(f"| {impl} | {what} | {a.B} x {a.T} | {a.r} | {'yes' if a.ckpt else 'no'} | {tps:.0f} | "
          f"{1e3 * tt / max(a.steps, 1):.1f} | {peak:.2f} | {torch.cuda.get_device_name(0)} |", flush=True)


if __name__ == "__main__":
    main()
