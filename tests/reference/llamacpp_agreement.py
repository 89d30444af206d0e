#!/usr/bin/env python3
"""How closely llama.cpp reproduces BarqTrain on a real GGUF base, with and without a LoRA adapter:
the figures the README quotes (measured, not asserted; tests/py/test_llamacpp.py runs a short pass
with loose bounds).

    python3 tests/reference/llamacpp_agreement.py [--model models/SmolLM2-135M-Instruct.Q4_1.gguf]
        [--dequantize] [--prompts 7] [--n-new 32] [--no-greedy] [--json FILE]

llama.cpp: the library of scripts/llamacpp-ref.sh (tests/py/llamacpp_ref.py; llama.cpp b8929),
K/V cache in F32, 1 thread. Ours: build/trainer and build/tools/bt_logits (make all).
The adapter: a seeded random PEFT adapter on the seven linears of every layer (r 8, alpha 16,
A ~ U(-0.05, 0.05), B ~ N(0, 0.02)), given to us as the PEFT directory and to llama.cpp as our
`trainer export --format gguf-lora` file. --dequantize first writes the base as an F32 GGUF
(`trainer export --format gguf --dtype f32` with an all-zero adapter: the base's own values) and
measures on that instead.

Per prompt and condition (base, base + adapter):
  logits: llama.cpp's greedy continuation (n_new tokens) is appended to the prompt and that whole
          sequence is run through both (teacher forcing): max |logit difference| over every
          position, and at how many positions the two argmaxes agree;
  greedy: `trainer generate --temperature 0 --ignore-eos` against llama.cpp's own greedy loop,
          same text or not, and the new token at which they part.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "py"))
import llamacpp_ref  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colors are",
    "Photosynthesis is the process by which",
]
MODS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def run(args, env=None):
    p = subprocess.run(args, capture_output=True, cwd=ROOT, env=env, timeout=3600)
    if p.returncode != 0:
        sys.exit(f"{' '.join(args[:3])}: rc {p.returncode}\n{p.stderr.decode(errors='replace')}")
    return p.stdout


def dims(model):
    """Layer count and the seven linears' (out, in) of a Llama GGUF (gguf-py)."""
    import gguf
    r = gguf.GGUFReader(model)

    def kv(k):
        f = r.fields[k]
        return int(f.parts[f.data[0]][0])
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    H, F = kv(f"{arch}.embedding_length"), kv(f"{arch}.feed_forward_length")
    nh, nkv = kv(f"{arch}.attention.head_count"), kv(f"{arch}.attention.head_count_kv")
    hd = kv(f"{arch}.attention.key_length") if f"{arch}.attention.key_length" in r.fields else H // nh
    shapes = {"q_proj": (nh * hd, H), "k_proj": (nkv * hd, H), "v_proj": (nkv * hd, H),
              "o_proj": (H, nh * hd), "gate_proj": (F, H), "up_proj": (F, H), "down_proj": (H, F)}
    return kv(f"{arch}.block_count"), shapes


def write_peft(d, model, r=8, alpha=16, seed=1, zero=False):
    """A PEFT adapter directory for `model` (see the module doc); zero: B = 0 (no effect)."""
    import struct
    n_layers, shapes = dims(model)
    rng = np.random.default_rng(seed)
    hdr, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for layer in range(n_layers):
        for m in MODS:
            o, i = shapes[m]
            pre = f"base_model.model.model.layers.{layer}.{'self_attn' if m in MODS[:4] else 'mlp'}.{m}"
            a = rng.uniform(-0.05, 0.05, (r, i)).astype(np.float32)
            b = np.zeros((o, r), np.float32) if zero else rng.normal(0, 0.02, (o, r)).astype(np.float32)
            for name, t in ((pre + ".lora_A.weight", a), (pre + ".lora_B.weight", b)):
                hdr[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
                blobs.append(t.tobytes())
                off += t.nbytes
    h = json.dumps(hdr).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "adapter_model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
                   "target_modules": MODS, "lora_dropout": 0.0, "bias": "none"}, f)


def gguf_arch(model):
    import gguf
    return bytes(gguf.GGUFReader(model).fields["general.architecture"].parts[-1]).decode()


def unrepacked(model, tmp, every=False):
    """`model`, or a copy of it with some quantised tensors stored as their exact F32
    dequantisation (gguf-py's, bit-identical to ours): every=True (--dequantize for a family whose
    merged export is not written yet, Gemma 3) every quantised tensor; every=False the Q4_K ones
    only, the way around llama.cpp b4965, which crashed adding a LoRA to the Q4_K tensors it
    repacks on AVX2 machines. llama.cpp b8929 takes a LoRA on repacked Q4_K (it keeps the LoRA tensors of those
    weights in the plain CPU buffer: tests/py/test_llamacpp.py::test_lora_on_repacked_q4_k), so
    measure() and scripts/demo.sh give llama.cpp the file as is, as users run it."""
    import gguf
    r = gguf.GGUFReader(model)
    F = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
    conv = (lambda ty: ty not in F) if every else (lambda ty: ty == gguf.GGMLQuantizationType.Q4_K)
    if not any(conv(t.tensor_type) for t in r.tensors):
        return model
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    out = os.path.join(tmp, "base-f32.gguf" if every else "base-unrepacked.gguf")
    w = gguf.GGUFWriter(out, arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vt = f.types[0]
        sub = f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), vt, sub_type=sub)
    for t in r.tensors:
        shape = [int(x) for x in reversed(t.shape)]
        if conv(t.tensor_type):
            w.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
                         .reshape(shape))
        else:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def bt_logits(build, model, ids, tmp, adapter=None):
    out = os.path.join(tmp, "logits.bin")
    args = [os.path.join(build, "tools", "bt_logits"), "--model", model, "--ids",
            ",".join(map(str, ids)), "--pos0", "0", "--out", out]
    run(args + (["--adapter", adapter] if adapter else []))
    return np.fromfile(out, np.float32).reshape(len(ids), -1)


def trainer_greedy(build, model, prompt, n_new, adapter=None):
    args = [os.path.join(build, "trainer"), "generate", "--model", model, "--prompt", prompt,
            "--max-new-tokens", str(n_new), "--temperature", "0", "--ignore-eos", "--show-special"]
    out = run(args + (["--adapter", adapter] if adapter else []))
    return out[:-1] if out.endswith(b"\n") else out


def part_at(m, new, ours):
    """Index of the first of llama.cpp's new tokens whose text leaves ours (len(new): none)."""
    k, done = 0, b""
    while k < len(new):
        piece = m.detokenize([new[k]], special=True)
        if not ours.startswith(done + piece):
            break
        done += piece
        k += 1
    return k


def measure(model, prompts, n_new, greedy, tmp, build, lib=None):
    """The figures for `model`: {"base": [...], "adapter": [...]}, one dict per prompt."""
    lc = llamacpp_ref.LlamaCpp(lib) if lib else llamacpp_ref.LlamaCpp.from_env()
    peft = os.path.join(tmp, "peft")
    write_peft(peft, model)
    lora = os.path.join(tmp, "lora.gguf")
    run([os.path.join(build, "trainer"), "export", "--model", model, "--adapter", peft,
         "--format", "gguf-lora", "--out", lora])
    m = lc.load_model(model)  # repacked where llama.cpp repacks (its default), as users run it
    res = {"llama.cpp": f"b{lc.build_number} ({lc.commit})", "model": os.path.basename(model),
           "n_new": n_new, "llama.cpp_base": "as is"}
    for cond in ("base", "adapter"):
        a = m.lora(lora) if cond == "adapter" else None
        ctx = m.context(512, adapter=a)
        rows = []
        for p in prompts:
            ids = m.tokenize(p, parse_special=True)
            new = ctx.greedy(ids, n_new)
            seq = ids + new
            theirs, ours = ctx.logits(seq), bt_logits(build, model, seq, tmp, peft if a else None)
            row = {"prompt": p, "tokens": len(seq),
                   "max_abs_diff": float(np.max(np.abs(theirs - ours))),
                   "max_abs_logit": float(np.max(np.abs(ours))),
                   "argmax_agree": int(np.sum(np.argmax(theirs, 1) == np.argmax(ours, 1)))}
            if greedy:
                text = trainer_greedy(build, model, p, n_new, peft if a else None)
                k = part_at(m, new, text)
                row.update(greedy_same=m.detokenize(new, special=True) == text,
                           parts_at=None if k == len(new) else k)
            rows.append(row)
            print(f"{cond:7s} {p[:40]!r:44s} max|diff| {row['max_abs_diff']:.3g}  argmax "
                  f"{row['argmax_agree']}/{row['tokens']}" +
                  (f"  greedy {'same' if row['greedy_same'] else 'parts at token %d' % row['parts_at']}"
                   if greedy else ""), flush=True)
        res[cond] = rows
        ctx.close()
    m.close()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--dequantize", action="store_true", help="measure on an F32 copy of the base")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--n-new", type=int, default=32)
    ap.add_argument("--no-greedy", action="store_true", help="logits only (no trainer generate)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--build", default=os.path.join(ROOT, os.environ.get("BT_BUILD", "build")))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bt-llamacpp-") as tmp:
        model = a.model
        if a.dequantize and gguf_arch(model) == "gemma3":  # as the README's gemma3 figures were measured
            model = unrepacked(model, tmp, every=True)
        elif a.dequantize:
            zero = os.path.join(tmp, "zero")
            write_peft(zero, model, zero=True)
            model = os.path.join(tmp, "base-f32.gguf")
            run([os.path.join(a.build, "trainer"), "export", "--model", a.model, "--adapter", zero,
                 "--format", "gguf", "--dtype", "f32", "--out", model])
        res = measure(model, PROMPTS[:a.prompts], a.n_new, not a.no_greedy, tmp, a.build)
        res["model"] = os.path.basename(a.model) + (" dequantized to F32" if a.dequantize else "")
    for cond in ("base", "adapter"):
        rows = res[cond]
        line = (f"{cond}: max |logit diff| {max(r['max_abs_diff'] for r in rows):.3g} "
                f"(logits up to {max(r['max_abs_logit'] for r in rows):.3g}); teacher-forced argmax "
                f"agrees at {sum(r['argmax_agree'] for r in rows)}/{sum(r['tokens'] for r in rows)} "
                f"positions")
        if not a.no_greedy:
            line += f"; greedy {a.n_new}-token text identical on {sum(r['greedy_same'] for r in rows)}/{len(rows)} prompts"
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
