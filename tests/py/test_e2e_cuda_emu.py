"""End to end with device "cuda" on the CPU emulator: loaderd -> trainer --device cuda.

$BT_EMU_TRAINER is build/emu/trainer (`make test-emu` builds it and runs this file): the real
trainer/train.c CUDA paths (model and LoRA upload, the GPU step, clip + AdamW on the device,
held-out evaluation, adapter download and save) with every kernels/cuda and trainer/cuda kernel
running on the emulator of tests/emu. The same job runs on the CPU trainer (build/trainer), and
the GPU run must follow it: per-step and held-out losses within 0.2% (bf16 activations vs fp32;
about 2e-5 seen), and a PEFT adapter of the same layout whose lora_A agree within rel_l2 1e-2
(2.4e-3 seen) and lora_B, trained from zero, within 1e-1 (4.7e-2 seen). Both kernel sets run: the
defaults (wmma attention, dequantise + cuBLAS) and cuda.attention "mma" + cuda.nf4_matmul "fused".
The tiny model has head_dim 64 (the GPU attention supports 64 and 128): hidden 128, 2 heads, 1 KV
head, the real SmolLM2 vocabulary.

Collected only when $BT_EMU_TRAINER is set (conftest.py)."""
import json
import os
import re
import struct
import subprocess

import pytest

from conftest import BUILD, MODEL, chat_line, write_shard

EMU_TRAINER = os.environ.get("BT_EMU_TRAINER", "")


def read_safetensors(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        assert meta["dtype"] == "F32", (name, meta)
        a, b = meta["data_offsets"]
        count = (b - a) // 4
        out[name] = (meta["shape"], struct.unpack(f"<{count}f", raw[8 + n + a:8 + n + b]))
    return out


@pytest.fixture
def env(tmp_path, trainer_stack):
    if not EMU_TRAINER or not os.access(EMU_TRAINER, os.X_OK):
        pytest.skip(f"BT_EMU_TRAINER={EMU_TRAINER!r} is not an executable (make test-emu builds it)")
    data = tmp_path / "data"
    data.mkdir()
    good = [chat_line(f"What is item {i}?", f"Item {i} is a thing with number {i * 7}.") for i in range(40)]
    write_shard(data / "train-000.jsonl.zst", good)
    write_shard(data / "eval.jsonl.zst", good[:8])
    model = tmp_path / "tiny64.gguf"
    subprocess.run([os.path.join(BUILD, "tools", "mk_tiny_gguf"), "--out", str(model),
                    "--tokenizer-from", MODEL, "--layers", "2", "--hidden", "128", "--heads", "2",
                    "--kv-heads", "1", "--ffn", "256", "--seed", "11"], check=True)
    ld = trainer_stack(data)
    return {"tmp": tmp_path, "data": data, "model": model, "sock": ld.sock, "loaderd": ld}


def run_job(env, name, binary, device, extra=None):
    tmp = env["tmp"]
    out = tmp / f"adapter-{name}"
    job = {
        "name": name,
        "model": str(env["model"]),
        "base_dtype": "nf4",
        "socket": str(env["sock"]),
        "data": {"shards": [str(env["data"] / "train-*.jsonl.zst")], "format": "chat",
                 "seq_len": 64, "micro_batch_size": 2, "seed": 5},
        "eval": {"shards": [str(env["data"] / "eval.jsonl.zst")], "max_batches": 2},
        "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
        "optim": {"lr": 1e-3, "warmup_steps": 1},
        "steps": 3, "grad_accum": 1, "threads": 1, "device": device,
        "out_dir": str(out),
    }
    if extra:
        job.update(extra)
    (tmp / f"{name}.json").write_text(json.dumps(job))
    r = subprocess.run([binary, "train", "--config", str(tmp / f"{name}.json")],
                       capture_output=True, text=True, timeout=600)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text
    losses = [float(l) for _, l in re.findall(r"step (\d+)/3 \| loss ([0-9.]+) \| lr ", text)]
    assert len(losses) == 3, text
    m = re.search(r"held-out loss: before ([0-9.]+) -> after ([0-9.]+)", text)
    assert m, text
    return {"text": text, "losses": losses, "before": float(m.group(1)), "after": float(m.group(2)),
            "adapter": read_safetensors(out / "adapter_model.safetensors")}


@pytest.mark.parametrize("kernels", [None, {"attention": "mma", "nf4_matmul": "fused"}],
                         ids=["wmma+dequant", "mma+fused"])
def test_cuda_trainer_on_emulator_follows_cpu(env, kernels):
    cpu = run_job(env, "cpu", os.path.join(BUILD, "trainer"), "cpu")
    tag = "gpu-" + ("default" if kernels is None else "mma-fused")
    gpu = run_job(env, tag, EMU_TRAINER, "cuda", {"cuda": kernels} if kernels else None)
    assert "CUDA device CPU emulator" in gpu["text"], gpu["text"]
    want = "attention mma, NF4 matmul fused" if kernels else "attention wmma, NF4 matmul dequant+cuBLAS"
    assert want in gpu["text"], gpu["text"]
    print(f"\n{tag}: losses cpu {cpu['losses']} gpu {gpu['losses']}; held-out before "
          f"{cpu['before']}/{gpu['before']} after {cpu['after']}/{gpu['after']}")
    for step, (c, g) in enumerate(zip(cpu["losses"], gpu["losses"]), 1):
        assert abs(g - c) <= 2e-3 * c, f"step {step}: cpu {c} gpu {g}\n{gpu['text']}"
    assert abs(gpu["before"] - cpu["before"]) <= 2e-3 * cpu["before"], (cpu["before"], gpu["before"])
    assert abs(gpu["after"] - cpu["after"]) <= 2e-3 * cpu["after"], (cpu["after"], gpu["after"])
    # the adapter saved from the device: same tensors and shapes, values close to the CPU run's
    assert set(gpu["adapter"]) == set(cpu["adapter"]) and len(cpu["adapter"]) == 2 * 7 * 2
    # lora_A starts random and moves little; lora_B starts at zero and is all training: judged apart
    err = {}
    for part in ("lora_A", "lora_B"):
        num = den = 0.0
        for name, (shape, cvals) in cpu["adapter"].items():
            if part not in name:
                continue
            gshape, gvals = gpu["adapter"][name]
            assert gshape == shape, name
            num += sum((a - b) ** 2 for a, b in zip(gvals, cvals))
            den += sum(b * b for b in cvals)
        assert den > 0, part
        err[part] = (num / den) ** 0.5
    print(f"{tag}: adapter rel_l2 lora_A {err['lora_A']:.3e} lora_B {err['lora_B']:.3e}")
    assert err["lora_A"] <= 1e-2 and err["lora_B"] <= 1e-1, err
