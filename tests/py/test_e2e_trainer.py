"""Process-level end to end: loaderd feeds the trainer through the ring.

A tiny random Llama (2 layers, hidden 64, the real SmolLM2 vocabulary so loaderd's tokenizer
matches) is written by build/tools/mk_tiny_gguf; loaderd serves chat shards, some with bad
lines; the trainer runs 3 steps, reports to loaderd, saves a PEFT adapter; loaderctl shows the
job and the bad-line counts."""
import json
import os
import re
import struct
import subprocess

import pytest

from conftest import BUILD, chat_line, tiny_model, write_shard


@pytest.fixture
def env(tmp_path, trainer_stack):
    data = tmp_path / "data"
    data.mkdir()
    good = [chat_line(f"What is item {i}?", f"Item {i} is a thing with number {i * 7}.") for i in range(40)]
    bad = ['{"messages": [', "not json at all", json.dumps({"messages": "oops"}),
           json.dumps({"text": "wrong field"})]
    write_shard(data / "train-000.jsonl.zst", good[:20] + bad + good[20:])
    write_shard(data / "train-001.jsonl", [b"\xff\xfe bad utf8 line", *good[:10]])
    write_shard(data / "eval.jsonl.zst", good[:8])
    model = tiny_model(tmp_path / "tiny.gguf", 7)
    ld = trainer_stack(data)
    return {"tmp": tmp_path, "data": data, "model": model, "sock": ld.sock, "loaderd": ld}


def test_trainer_three_steps_through_loaderd(env):
    tmp = env["tmp"]
    out = tmp / "adapter"
    job = {
        "model": str(env["model"]),
        "base_dtype": "nf4",
        "socket": str(env["sock"]),
        "data": {"shards": [str(env["data"] / "train-*.jsonl*")], "format": "chat",
                 "seq_len": 64, "micro_batch_size": 2, "seed": 5},
        "eval": {"shards": [str(env["data"] / "eval.jsonl.zst")], "max_batches": 4},
        "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
        "optim": {"lr": 1e-3, "warmup_steps": 1},
        "steps": 3, "grad_accum": 1, "save_every": 2, "threads": 1,
        "out_dir": str(out),
    }
    (tmp / "job.json").write_text(json.dumps(job))
    r = subprocess.run([os.path.join(BUILD, "trainer"), "train", "--config", str(tmp / "job.json")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    text = r.stdout + r.stderr
    steps = re.findall(r"step (\d+)/3 \| loss ([0-9.]+) \| lr ", text)
    assert [s for s, _ in steps] == ["1", "2", "3"], text
    assert all(0.0 < float(l) < 20.0 for _, l in steps)
    assert re.search(r"held-out loss: before [0-9.]+ -> after [0-9.]+", text), text

    # the adapter: PEFT layout, keys and shapes
    cfgj = json.loads((out / "adapter_config.json").read_text())
    assert cfgj["peft_type"] == "LORA" and cfgj["r"] == 4 and cfgj["lora_alpha"] == 8
    assert set(cfgj["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj",
                                            "gate_proj", "up_proj", "down_proj"}
    raw = (out / "adapter_model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    a = header["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    b = header["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    assert a["dtype"] == "F32" and a["shape"] == [4, 64]
    assert b["shape"] == [64, 4]
    assert len([k for k in header if k != "__metadata__"]) == 2 * 7 * 2

    # loaderd skipped the bad lines, counted them by reason and reported each with file and line
    log = env["loaderd"].log_text()
    assert re.search(r"train-000\.jsonl\.zst:21: json: ", log), log
    assert re.search(r"train-000\.jsonl\.zst:22: json: ", log), log
    assert re.search(r"train-000\.jsonl\.zst:23: field: ", log), log
    assert re.search(r"train-000\.jsonl\.zst:24: field: ", log), log
    assert re.search(r"train-001\.jsonl:1: utf8: ", log), log
    assert env["loaderd"].proc.poll() is None, "loaderd died"
