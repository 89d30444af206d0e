"""Checkpoints and exact resume through loaderd.

A tiny random Llama (build/tools/mk_tiny_gguf, the SmolLM2 vocabulary so loaderd's tokenizer
matches) trains 6 steps straight; a second run stops after 3 (stop_at_step 3, schedule still
6 steps) with checkpoint_every 3, and a third resumes from the checkpoint to 6. The per-step
losses, printed at full precision (BT_LOG_LEVEL=debug: "step N loss %.17g grad norm %.17g"), must
be bit-identical, and so must the final adapters. Determinism: every CPU reduction has a fixed
summation order for a given OpenMP team size, so both runs use the same `threads` (2); dropout
masks are counter-based on (seed, step), so they need no saved RNG stream.
Also: a corrupt checkpoint (checksum) and mismatched ones (lora.r, data.seq_len, model) are
refused with a message naming the problem; the LoRA+ variant (trainable embed_tokens + norm)
resumes exactly too."""
import json

import pytest

from conftest import chat_line, run_trainer, step_losses, tiny_model, write_shard


@pytest.fixture
def env(tmp_path, trainer_stack):
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "train.jsonl",
                [chat_line(f"What is item {i}?", f"Item {i} is a thing with number {i * 7}, colour {i % 5}.")
                 for i in range(60)])
    tiny_model(tmp_path / "tiny.gguf", 7)
    tiny_model(tmp_path / "other.gguf", 8)
    ld = trainer_stack(data)
    return {"tmp": tmp_path, "data": data, "sock": ld.sock}


def job(env, name, **over):
    j = {
        "name": "resume",
        "model": str(env["tmp"] / "tiny.gguf"),
        "base_dtype": "nf4",
        "socket": str(env["sock"]),
        "data": {"shards": [str(env["data"] / "train.jsonl")], "format": "chat",
                 "seq_len": 64, "micro_batch_size": 2, "seed": 5, "tokenizer_threads": 1},
        "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.1},
        "optim": {"lr": 1e-2, "warmup_steps": 2, "weight_decay": 0.01},
        "steps": 6, "grad_accum": 2, "threads": 2, "seed": 11,
        "out_dir": str(env["tmp"] / f"{name}-adapter"),
        "checkpoint_dir": str(env["tmp"] / "ckpt"),
    }
    j.update(over)
    p = env["tmp"] / f"{name}.json"
    p.write_text(json.dumps(j))
    return str(p)


@pytest.mark.parametrize("variant", ["lora", "lora_plus"])
def test_resume_is_bit_identical(env, variant):
    extra = {"trainable_modules": ["embed_tokens", "norm"]} if variant == "lora_plus" else {}
    straight = run_trainer("train", job(env, "straight", **extra))
    full = step_losses(straight.stdout + straight.stderr)
    assert sorted(full) == [1, 2, 3, 4, 5, 6], straight.stdout + straight.stderr

    first = run_trainer("train", job(env, "first", checkpoint_every=3, stop_at_step=3, **extra))
    part1 = step_losses(first.stdout + first.stderr)
    assert sorted(part1) == [1, 2, 3]
    ck = env["tmp"] / "ckpt"
    assert (ck / "trainer_state.bin").exists() and (ck / "adapter_model.safetensors").exists()
    assert json.loads((ck / "adapter_config.json").read_text())["peft_type"] == "LORA"

    second = run_trainer("train", job(env, "second", **extra), "--resume", str(ck))
    part2 = step_losses(second.stdout + second.stderr)
    assert sorted(part2) == [4, 5, 6], second.stdout + second.stderr
    assert "resumed from" in second.stderr
    # bit-identical: the same 17-digit strings for every step
    assert {**part1, **part2} == full
    # ... and the same final adapter bytes
    a = (env["tmp"] / "straight-adapter" / "adapter_model.safetensors").read_bytes()
    b = (env["tmp"] / "second-adapter" / "adapter_model.safetensors").read_bytes()
    assert a == b


def test_refuses_corrupt_and_mismatched_checkpoints(env):
    run_trainer("train", job(env, "first", checkpoint_every=2, stop_at_step=2))
    ck = env["tmp"] / "ckpt"
    base = job(env, "again")
    # mismatches, each named
    r = run_trainer("train", base, "--resume", str(ck), "--set", "lora.r=8", ok=False)
    assert r.returncode == 1 and "lora.r: checkpoint 4, config 8" in r.stderr, r.stderr
    r = run_trainer("train", base, "--resume", str(ck), "--set", "data.seq_len=32", ok=False)
    assert r.returncode == 1 and "data.seq_len: checkpoint 64, config 32" in r.stderr, r.stderr
    r = run_trainer("train", base, "--resume", str(ck), "--set", f"model={env['tmp'] / 'other.gguf'}", ok=False)
    assert r.returncode == 1 and "base model weights differ" in r.stderr, r.stderr
    # missing
    r = run_trainer("train", base, "--resume", str(env["tmp"] / "nope"), ok=False)
    assert r.returncode == 1 and "cannot read" in r.stderr, r.stderr
    # corrupt: flip one byte in the middle of the optimiser state
    st = ck / "trainer_state.bin"
    raw = bytearray(st.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    st.write_bytes(bytes(raw))
    r = run_trainer("train", base, "--resume", str(ck), ok=False)
    assert r.returncode == 1 and "checksum mismatch" in r.stderr, r.stderr
    # truncated
    st.write_bytes(bytes(raw[:100]))
    r = run_trainer("train", base, "--resume", str(ck), ok=False)
    assert r.returncode == 1 and "truncated" in r.stderr, r.stderr


def test_lora_plus_adapter_is_peft_modules_to_save(env):
    run_trainer("train", job(env, "plus", trainable_modules=["embed_tokens", "norm"], steps=2))
    out = env["tmp"] / "plus-adapter"
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["modules_to_save"] == ["embed_tokens", "lm_head", "input_layernorm",
                                      "post_attention_layernorm", "norm"]
    raw = (out / "adapter_model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    emb = header["base_model.model.model.embed_tokens.weight"]
    assert emb["dtype"] == "F32" and emb["shape"][1] == 64
    assert header["base_model.model.lm_head.weight"]["shape"] == emb["shape"]
    assert header["base_model.model.model.norm.weight"]["shape"] == [64]
    for i in range(2):
        assert header[f"base_model.model.model.layers.{i}.input_layernorm.weight"]["shape"] == [64]
        assert header[f"base_model.model.model.layers.{i}.post_attention_layernorm.weight"]["shape"] == [64]
    # the trained embedding differs from... itself tied: both tensors hold the same bytes
    e0, e1 = emb["data_offsets"]
    l0, l1 = header["base_model.model.lm_head.weight"]["data_offsets"]
    assert raw[8 + n + e0:8 + n + e1] == raw[8 + n + l0:8 + n + l1]
