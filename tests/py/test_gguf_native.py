"""The GGUF-native base end to end (base_dtype "gguf", the default "auto" for a .gguf model).

A tiny random Llama whose seven linears are Q4_K blocks (build/tools/mk_tiny_gguf --type Q4_K,
token_embd Q8_0, the real SmolLM2 vocabulary so loaderd's tokenizer matches) is trained through
loaderd with no base_dtype in the job:
  - the trainer logs that it holds the base as the file's own Q4_K blocks at 4.50 bits per weight,
    and loaderd shows the same in `status --json` (trainer.base) and `loaderctl status` while it
    trains (the trainer's reports carry it); SIGTERM stops it and it saves the adapter;
  - `trainer export` writes the llama.cpp LoRA GGUF and the merged GGUF (f32) of that adapter;
    with gguf-py 0.19.0 (when importable) the merged file equals gguf-py's own dequantisation of
    the very base file plus (alpha / r) * lora_b @ lora_a of our LoRA GGUF, tensor by tensor
    (the C side of the same identity is tests/unit/trainer/test_gguf_native.c);
  - an explicit base_dtype "gguf" with a Hugging Face directory is refused naming the key.
"""
import json
import os
import re
import signal
import subprocess
import time

import pytest

from conftest import BUILD, MODEL, ROOT, chat_line, write_shard

try:
    import numpy as np
    import gguf
    HAVE_GGUF = True
except ImportError:
    HAVE_GGUF = False

GGUF_LIN = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]


@pytest.fixture
def env(tmp_path, trainer_stack):
    data = tmp_path / "data"
    data.mkdir()
    good = [chat_line(f"What is item {i}?", f"Item {i} is a thing with number {i * 7}.") for i in range(60)]
    write_shard(data / "train-000.jsonl.zst", good)
    model = tmp_path / "tiny-q4k.gguf"
    subprocess.run([os.path.join(BUILD, "tools", "mk_tiny_gguf"), "--out", str(model),
                    "--tokenizer-from", MODEL, "--layers", "2", "--hidden", "256", "--heads", "4",
                    "--kv-heads", "2", "--ffn", "512", "--seed", "11", "--type", "Q4_K",
                    "--embd-type", "Q8_0"], check=True)
    ld = trainer_stack(data)
    return {"tmp": tmp_path, "data": data, "model": model, "loaderd": ld}


def status_json(ld):
    r = ld.ctl("status", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_train_report_and_export(env):
    tmp, ld = env["tmp"], env["loaderd"]
    out = tmp / "adapter"
    job = {  # no base_dtype: "auto" = the GGUF's own blocks
        "model": str(env["model"]), "socket": str(ld.sock),
        "data": {"shards": [str(env["data"] / "train-*.jsonl.zst")], "format": "chat",
                 "seq_len": 64, "micro_batch_size": 2, "seed": 5},
        "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
        "optim": {"lr": 1e-3}, "steps": 100000, "threads": 1, "out_dir": str(out),
    }
    (tmp / "job.json").write_text(json.dumps(job))
    log = open(tmp / "trainer.log", "w+")
    p = subprocess.Popen([os.path.join(BUILD, "trainer"), "train", "--config", str(tmp / "job.json")],
                         stdout=log, stderr=subprocess.STDOUT)
    try:
        base, deadline = None, time.time() + 180
        while base is None:
            assert p.poll() is None, open(tmp / "trainer.log").read()
            assert time.time() < deadline, "no report with the base reached loaderd"
            for j in status_json(ld)["jobs"]:
                if isinstance(j.get("trainer"), dict) and j["trainer"].get("base"):
                    base = j["trainer"]["base"]
            if base is None:
                time.sleep(0.2)
        # Q4_K: 144 bytes per 256 weights = 4.5 bits; 2 layers x (q, o: 256x256; k, v: 128x256;
        # gate, up, down: 512x256) weights
        n = 2 * (2 * 256 * 256 + 2 * 128 * 256 + 3 * 512 * 256)
        assert base == {"dtype": "gguf", "types": "Q4_K", "bits_per_weight": 4.5, "bytes": n * 144 // 256}
        text = ld.ctl("status").stdout
        assert re.search(r"job \d+ base: gguf Q4_K, 4\.50 bits per weight, 0\.[0-9] MiB of linears", text), text
    finally:
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=120)
    log.seek(0)
    text = log.read()
    assert rc == 75, text  # interrupted (trainer/loop/train.h BT_EXIT_INTERRUPTED)
    assert "base linears gguf (Q4_K: 4.50 bits per weight" in text, text
    assert "interrupted by SIGTERM: stopped after step" in text and (out / "adapter_model.safetensors").exists(), text

    lora, merged = tmp / "lora.gguf", tmp / "merged.gguf"
    for fmt, dst in (("gguf-lora", lora), ("gguf", merged)):
        r = subprocess.run([os.path.join(BUILD, "trainer"), "export", "--model", str(env["model"]),
                            "--adapter", str(out), "--format", fmt, "--dtype", "f32", "--out", str(dst)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
    if not HAVE_GGUF:
        pytest.skip("gguf-py (pip install gguf==0.19.0 numpy) not installed: exports not cross-checked")
    base_r, lora_r, merged_r = (gguf.GGUFReader(str(f)) for f in (env["model"], lora, merged))
    bt = {t.name: t for t in base_r.tensors}
    lt = {t.name: t for t in lora_r.tensors}
    mt = {t.name: t for t in merged_r.tensors}
    alpha = float(lora_r.fields["adapter.lora.alpha"].parts[-1][0])
    worst = 0.0
    for layer in range(2):
        for g in GGUF_LIN:
            name = f"blk.{layer}.{g}.weight"
            tb = bt[name]
            assert tb.tensor_type == gguf.GGMLQuantizationType.Q4_K
            rows, cols = int(tb.shape[1]), int(tb.shape[0])
            W = gguf.quants.dequantize(tb.data, tb.tensor_type).reshape(rows, cols).astype(np.float64)
            ta, tl = lt[name + ".lora_a"], lt[name + ".lora_b"]
            A = np.asarray(ta.data, np.float32).reshape(int(ta.shape[1]), cols).astype(np.float64)
            B = np.asarray(tl.data, np.float32).reshape(rows, int(tl.shape[0])).astype(np.float64)
            ref = W + (alpha / A.shape[0]) * (B @ A)  # llama.cpp: W x + scale * B (A x)
            got = np.asarray(mt[name].data, np.float32).reshape(rows, cols)
            assert mt[name].tensor_type == gguf.GGMLQuantizationType.F32
            err = float(np.max(np.abs(got - ref)))
            worst = max(worst, err / float(np.max(np.abs(ref))))
            assert err <= 2e-6 * float(np.max(np.abs(ref))), (name, err)
            assert float(np.max(np.abs(B @ A))) > 0, name  # the adapter trained: not a no-op
    print(f"merged GGUF vs gguf-py dequant(base) + adapter: max relative error {worst:.2e}")


def test_gguf_base_dtype_for_hf_directory_refused(tmp_path, bins):
    if not bins.have("trainer"):
        pytest.skip("trainer not built")
    job = {"model": os.path.join(ROOT, "tests", "fixtures", "hf", "tiny-llama-tied"),
           "base_dtype": "gguf", "socket": str(tmp_path / "none.sock"),
           "data": {"shards": [str(tmp_path / "*.jsonl")]}}
    (tmp_path / "job.json").write_text(json.dumps(job))
    r = subprocess.run([os.path.join(BUILD, "trainer"), "estimate", "--config", str(tmp_path / "job.json")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "base_dtype" in r.stderr and "gguf" in r.stderr, r.stdout + r.stderr
