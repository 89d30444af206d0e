#!/usr/bin/env python3
"""Cross-check `trainer export` against the real reference libraries (transformers, peft, gguf-py).

Run inside .venv-hf (torch 2.5.1, transformers 4.46.3, peft 0.13.2, gguf 0.17.1; see
requirements-hf.txt), from the repository root, after `make build/trainer`:

    .venv-hf/bin/python tests/reference/check_exports.py --base-hf HF_DIR --adapter PEFT_DIR \
        [--base-model BASE.gguf|HF_DIR] [--work DIR]
    .venv-hf/bin/python tests/reference/check_exports.py --demo [--work DIR] [--steps 30]

`check_peft_adapter(base_hf_dir, adapter_dir, base_model=None)`:
  1. peft.PeftModel.from_pretrained(LlamaForCausalLM(base_hf_dir), adapter_dir) gives the
     reference logits on a fixed token sequence (fp32, CPU); every LoRA weight PEFT loaded is
     compared with the file (nothing silently dropped).
  2. `trainer export --format peft`: PEFT loads the normalised copy; logits vs the reference.
  3. `--format safetensors --dtype f32|f16|bf16`: transformers loads the merged directory;
     logits vs the reference; f32 weights vs PeftModel.merge_and_unload().
  4. `--format gguf --dtype f32|q8_0`: gguf-py reads it; tensors un-permuted with transformers'
     own GGUF reverse-permutation equal the merge_and_unload weights (f32) / their Q8_0 rounding;
     and transformers loads the f32 GGUF (from_pretrained(gguf_file=...)) with the reference logits.
  5. `--format gguf-lora --dtype f32`: gguf-py reads it; general.type / adapter.type / alpha;
     lora_a == A; lora_b == LlamaModel.permute(B) for q/k (convert_lora_to_gguf.py's layout).
Returns a dict of the measured differences and raises AssertionError past the tolerances.

`--demo` makes everything itself: a tiny random Llama GGUF with the SmolLM2 tokenizer
(build/tools/mk_tiny_gguf), trains a LoRA on it with OUR trainer through loaderd (fp32 base, all 7
modules, lr 1e-2), converts the GGUF to a Hugging Face directory with transformers' own GGUF loader
(independent of our code), then runs check_peft_adapter on the trained adapter.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAINER = REPO / "build" / "trainer"
MODS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GGUF_LIN = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]


def export(base_model, adapter, fmt, out, dtype=None):
    cmd = [str(TRAINER), "export", "--model", str(base_model), "--adapter", str(adapter),
           "--format", fmt, "--out", str(out)]
    if dtype:
        cmd += ["--dtype", dtype]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} -> {r.returncode}\n{r.stdout}{r.stderr}")


def hf_permute(w, n_head):
    """convert_hf_to_gguf.py LlamaModel.permute (HF -> GGUF row order)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def check_peft_adapter(base_hf_dir, adapter_dir, base_model=None, work=None, seq_len=48, seed=0):
    import numpy as np
    import torch
    import gguf
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING  # noqa: F401 (gguf support present)
    from transformers.modeling_gguf_pytorch_utils import reverse_permute_weights

    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    base_model = base_model or base_hf_dir
    work = Path(work or tempfile.mkdtemp(prefix="bt-check-exports-"))
    work.mkdir(parents=True, exist_ok=True)
    res = {}

    def base():
        return AutoModelForCausalLM.from_pretrained(base_hf_dir, torch_dtype=torch.float32).eval()

    cfg = base().config
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    ids = torch.randint(0, cfg.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(seed))

    def logits(model):
        with torch.no_grad():
            return model(input_ids=ids).logits.float()

    # 1. the reference: PEFT on the base
    pm = PeftModel.from_pretrained(base(), adapter_dir).eval()
    ref = logits(pm)
    res["logits_absmax"] = float(ref.abs().max())
    sd = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    loaded = {n.replace(".default", ""): p for n, p in pm.named_parameters() if "lora_" in n}
    assert set(loaded) == set(sd), f"PEFT loaded {len(loaded)} LoRA tensors, file has {len(sd)}"
    for k, v in sd.items():
        assert torch.equal(loaded[k].detach(), v.float()), k
    with open(Path(adapter_dir) / "adapter_config.json") as f:
        acfg = json.load(f)
    r, alpha = acfg["r"], float(acfg["lora_alpha"])
    scale = alpha / (r ** 0.5 if acfg.get("use_rslora") else r)
    res["base_vs_adapter_logits_maxdiff"] = float((logits(base()) - ref).abs().max())
    merged_sd = {k: v.detach().clone() for k, v in pm.merge_and_unload().state_dict().items()}

    # 2. peft -> peft
    export(base_model, adapter_dir, "peft", work / "peft")
    d = float((logits(PeftModel.from_pretrained(base(), work / "peft").eval()) - ref).abs().max())
    res["peft_export_logits_maxdiff"] = d
    assert d <= 1e-5 * max(1.0, res["logits_absmax"]), d

    # 3. merged safetensors
    for dt, tol in (("f32", 1e-4), ("f16", 5e-2), ("bf16", 2e-1)):
        out = work / f"merged-st-{dt}"
        export(base_model, adapter_dir, "safetensors", out, dt)
        m = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
        d = float((logits(m) - ref).abs().max())
        res[f"safetensors_{dt}_logits_maxdiff"] = d
        assert d <= tol * max(1.0, res["logits_absmax"]), (dt, d)
        if dt == "f32":
            wd = max(float((v - merged_sd[k]).abs().max()) for k, v in m.state_dict().items()
                     if k in merged_sd)
            res["safetensors_f32_weights_vs_merge_and_unload_maxdiff"] = wd
            assert wd <= 1e-5, wd

    # 4. merged GGUF
    lin = {}
    for layer in range(cfg.num_hidden_layers):
        for mname, g in zip(MODS, GGUF_LIN):
            blk = "self_attn" if mname in MODS[:4] else "mlp"
            lin[f"blk.{layer}.{g}.weight"] = (f"model.layers.{layer}.{blk}.{mname}.weight", mname)
    for dt in ("f32", "q8_0"):
        out = work / f"merged-{dt}.gguf"
        export(base_model, adapter_dir, "gguf", out, dt)
        rd = gguf.GGUFReader(str(out))
        worst = 0.0
        for t in rd.tensors:
            if t.name not in lin:
                continue
            key, mname = lin[t.name]
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(merged_sd[key].shape)
            if mname in ("q_proj", "k_proj"):  # transformers' own GGUF un-permutation
                w = reverse_permute_weights(w, nh, nh if mname == "q_proj" else nkv)
            want = merged_sd[key].numpy()
            if dt == "q8_0":
                want = gguf.quants.dequantize(gguf.quants.quantize(
                    hf_permute(want, nh if mname == "q_proj" else nkv) if mname in ("q_proj", "k_proj")
                    else want, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)
                if mname in ("q_proj", "k_proj"):
                    want = reverse_permute_weights(want, nh, nh if mname == "q_proj" else nkv)
            worst = max(worst, float(np.abs(w - want).max()))
        res[f"gguf_{dt}_weights_maxdiff"] = worst
        assert worst <= 1e-5, (dt, worst)
        if dt == "f32":
            try:
                m = AutoModelForCausalLM.from_pretrained(str(work), gguf_file=out.name,
                                                         torch_dtype=torch.float32).eval()
                if cfg.tie_word_embeddings:
                    m.lm_head.weight = m.model.embed_tokens.weight
                d = float((logits(m) - ref).abs().max())
                res["gguf_f32_transformers_logits_maxdiff"] = d
                assert d <= 1e-4 * max(1.0, res["logits_absmax"]), d
            except (ValueError, KeyError, NotImplementedError, OSError) as e:
                res["gguf_f32_transformers_load"] = f"skipped: {type(e).__name__}: {e}"[:200]

    # 5. llama.cpp LoRA GGUF
    out = work / "lora-f32.gguf"
    export(base_model, adapter_dir, "gguf-lora", out, "f32")
    rd = gguf.GGUFReader(str(out))

    def kv(key):
        f = rd.fields[key]
        v = f.parts[f.data[0]]
        return bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING else v[0].item()
    assert kv("general.architecture") == "llama" and kv("general.type") == "adapter"
    assert kv("adapter.type") == "lora"
    assert rd.fields["adapter.lora.alpha"].types[0] == gguf.GGUFValueType.FLOAT32
    assert abs(kv("adapter.lora.alpha") / r - scale) <= 1e-6 * scale
    tens = {t.name: t for t in rd.tensors}
    worst = 0.0
    for gname, (key, mname) in lin.items():
        pa = "base_model.model." + key.replace(".weight", ".lora_A.weight")
        if pa not in sd:
            assert gname + ".lora_a" not in tens
            continue
        A, B = sd[pa].float().numpy(), sd[pa.replace("lora_A", "lora_B")].float().numpy()
        a, b = tens[gname + ".lora_a"], tens[gname + ".lora_b"]
        assert list(a.shape) == [A.shape[1], A.shape[0]] and list(b.shape) == [B.shape[1], B.shape[0]]
        if mname in ("q_proj", "k_proj"):
            B = hf_permute(B, nh if mname == "q_proj" else nkv)
        worst = max(worst, float(np.abs(np.asarray(a.data).reshape(A.shape) - A).max()),
                    float(np.abs(np.asarray(b.data).reshape(B.shape) - B).max()))
    res["gguf_lora_f32_vs_adapter_maxdiff"] = worst
    assert worst == 0.0, worst
    return res


# ---- --demo: an adapter trained by our trainer ----

def make_trained_adapter(work, steps):
    import gguf  # noqa: F401
    smol = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tiny = work / "tiny.gguf"
    subprocess.run([str(REPO / "build" / "tools" / "mk_tiny_gguf"), "--out", str(tiny),
                    "--tokenizer-from", str(smol), "--layers", "2", "--hidden", "64", "--heads", "4",
                    "--kv-heads", "2", "--ffn", "128", "--seed", "7"], check=True)
    data = work / "data"
    data.mkdir(exist_ok=True)
    lines = [json.dumps({"messages": [{"role": "user", "content": f"What is item {i}?"},
                                      {"role": "assistant", "content": f"Item {i} is {i * 7}."}]})
             for i in range(64)]
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    sock = work / "ld.sock"
    (work / "loaderd.json").write_text(json.dumps({"socket": str(sock), "data_roots": [str(data)],
                                                   "model_roots": [str(work), str(smol.parent)]}))
    log = open(work / "loaderd.log", "wb")
    ld = subprocess.Popen([str(REPO / "build" / "loaderd"), "--config", str(work / "loaderd.json"),
                           "--foreground"], stderr=log)
    try:
        for _ in range(200):
            if sock.exists():
                break
            time.sleep(0.05)
        job = {"model": str(tiny), "base_dtype": "fp32", "socket": str(sock),
               "data": {"shards": [str(data / "train.jsonl")], "format": "chat", "seq_len": 64,
                        "micro_batch_size": 2, "seed": 5},
               "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
               "optim": {"lr": 1e-2, "warmup_steps": 1}, "steps": steps, "threads": 1,
               "out_dir": str(work / "adapter")}
        (work / "job.json").write_text(json.dumps(job))
        subprocess.run([str(TRAINER), "train", "--config", str(work / "job.json")], check=True,
                       cwd=REPO)
    finally:
        ld.send_signal(signal.SIGTERM)
        ld.wait(timeout=20)
        log.close()
    return tiny, work / "adapter"


def gguf_to_hf(gguf_path, out_dir):
    """The GGUF base as a HF directory, converted by transformers' own GGUF loader."""
    import torch
    from transformers import AutoModelForCausalLM
    gguf_path = Path(gguf_path)
    import gguf
    m = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                             torch_dtype=torch.float32)
    # transformers 4.46 leaves lm_head random when the GGUF has no output.weight (tied)
    if not any(t.name == "output.weight" for t in gguf.GGUFReader(str(gguf_path)).tensors):
        m.config.tie_word_embeddings = True
        m.tie_weights()
        assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    m.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-hf")
    ap.add_argument("--adapter")
    ap.add_argument("--base-model", help="what `trainer export --model` gets (default: --base-hf)")
    ap.add_argument("--work", help="scratch directory (default: a new temp dir)")
    ap.add_argument("--demo", action="store_true")
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="bt-check-exports-"))
    work.mkdir(parents=True, exist_ok=True)
    if a.demo:
        tiny, adapter = make_trained_adapter(work, a.steps)
        base_hf = gguf_to_hf(tiny, work / "base-hf")
        results = {"with_gguf_base": check_peft_adapter(base_hf, adapter, tiny, work / "from-gguf"),
                   "with_hf_base": check_peft_adapter(base_hf, adapter, base_hf, work / "from-hf")}
    else:
        if not (a.base_hf and a.adapter):
            ap.error("--base-hf and --adapter are required (or --demo)")
        results = check_peft_adapter(a.base_hf, a.adapter, a.base_model, work)
    print(json.dumps(results, indent=2))
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
