"""Long context through the real processes (loaderd -> trainer), on a tiny random Llama GGUF
(trained context 128, the real SmolLM2 vocabulary) and long text documents:

- `trainer train` with context_extension (YaRN to 256) and S2-Attn (groups of 64) logs both,
  reports held-out perplexity per length (eval.lengths 64 and 256) before and after, and the
  adapter records the extension; `trainer eval` reports the same lengths with the number of
  whole windows each length cut from the held-out document; `trainer eval --adapter` applies
  the adapter's extension (the perplexities training reported after its last step);
- the merged safetensors export of that adapter carries the extension in config.json (YaRN with
  max_position_embeddings = the original context), the LoRA GGUF in llama.rope.scaling.*;
- `trainer estimate --max-seq-len-for` answers for both backends; a target that does not extend
  the context is refused naming the key.
(tests/py/test_export_hf.py runs check_exports.py --context-extension: the extended exports in
transformers.)"""
import json
import os
import re
import subprocess

import pytest

from conftest import BUILD, MODEL, write_shard

TRAINER = os.path.join(BUILD, "trainer")


def run(*args, timeout=300):
    return subprocess.run([TRAINER, *args], capture_output=True, text=True, timeout=timeout)


def doc(i, n_items):
    return json.dumps({"text": " ".join(f"Line {i * 1000 + j}: the value is {(i * 1000 + j) * 7}."
                                        for j in range(n_items))})


def test_long_context_end_to_end(tmp_path, trainer_stack, bins):
    tiny = tmp_path / "tiny.gguf"
    subprocess.run([bins.path("tools/mk_tiny_gguf"), "--out", str(tiny), "--tokenizer-from", MODEL,
                    "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                    "--ffn", "128", "--seed", "3", "--ctx", "128"], check=True)
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "train.jsonl", [doc(i, 60) for i in range(4)])
    write_shard(data / "eval.jsonl", [doc(9, 45)])
    ld = trainer_stack(data)
    job = {"name": "long", "model": str(tiny), "socket": ld.sock, "base_dtype": "fp32",
           "data": {"shards": [str(data / "train.jsonl")], "format": "text", "seq_len": 256,
                    "micro_batch_size": 1},
           "eval": {"shards": [str(data / "eval.jsonl")], "lengths": [64, 256]},
           "context_extension": {"target_length": 256, "method": "yarn"},
           "attention": {"s2": {"group_fraction": 0.25}},
           "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
                    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
           "optim": {"lr": 1e-2}, "steps": 2, "threads": 2, "out_dir": str(tmp_path / "adapter")}
    p = tmp_path / "job.json"
    p.write_text(json.dumps(job))
    r = run("train", "--config", str(p))
    assert r.returncode == 0, r.stdout + r.stderr
    trained = r.stdout
    assert "context extension: 128 -> 256 tokens, yarn RoPE scaling, factor 2" in r.stderr
    assert "S2-Attn in training: groups of 64 tokens" in r.stderr
    for L in (64, 256):
        m = re.search(rf"held-out perplexity at {L} tokens: before ([0-9.]+) -> after ([0-9.]+)",
                      r.stdout)
        assert m and float(m[1]) > 1 and float(m[2]) > 1, r.stdout
    note = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    ce = note["barqtrain_context_extension"]
    assert ce["method"] == "yarn" and ce["target_length"] == 256 and ce["original_length"] == 128
    assert ce["rope_scaling"]["rope_type"] == "yarn" and ce["max_position_embeddings"] == 128

    r = run("eval", "--config", str(p))
    assert r.returncode == 0, r.stderr
    got = {int(a): (int(b), int(c)) for a, b, c in re.findall(
        r"held-out at (\d+) tokens: (\d+) windows, (\d+) labelled tokens", r.stderr)}
    # the held-out document (its text's tokens + EOS, + BOS if the tokenizer adds one) gives
    # n // L whole windows of L - 1 labelled tokens each; shorter remainders and padding rows
    # count nowhere
    n = len(subprocess.run([bins.path("loaderctl"), "tokenize", "--tokenizer", str(tiny), "--ids"],
                           input=json.loads(doc(9, 45))["text"], capture_output=True,
                           text=True, check=True).stdout.split())
    ok = [all(got[L] == ((n + k) // L, (n + k) // L * (L - 1)) for L in (64, 256)) for k in (1, 2)]
    assert any(ok), (n, got, r.stderr)
    assert re.search(r"held-out perplexity at 64 tokens: [0-9.]+ \(loss", r.stdout), r.stdout

    # `trainer eval --adapter` with a job that does not extend: the adapter's note decides the
    # positions, so the held-out perplexity is the one training reported after its last step
    plain = {k: v for k, v in job.items() if k not in ("context_extension", "attention")}
    q = tmp_path / "plain.json"
    q.write_text(json.dumps(plain))
    r = run("eval", "--config", str(q), "--adapter", str(tmp_path / "adapter"))
    assert r.returncode == 0, r.stderr
    assert "the base's context is extended 128 -> 256 (yarn RoPE scaling, factor 2)" in r.stderr
    for L in (64, 256):
        after = re.search(rf"held-out perplexity at {L} tokens: before [0-9.]+ -> after ([0-9.]+)",
                          trained)[1]
        got = re.search(rf"held-out perplexity at {L} tokens: ([0-9.]+) \(loss", r.stdout)
        assert got and abs(float(got[1]) - float(after)) <= 2e-3 * float(after), (after, r.stdout)

    out = tmp_path / "merged"
    r = run("export", "--model", str(tiny), "--adapter", str(tmp_path / "adapter"), "--format",
            "safetensors", "--dtype", "f32", "--out", str(out))
    assert r.returncode == 0, r.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_scaling"] == {"factor": 2.0, "original_max_position_embeddings": 128,
                                   "rope_type": "yarn"}
    assert cfg["max_position_embeddings"] == 128
    r = run("export", "--model", str(tiny), "--adapter", str(tmp_path / "adapter"), "--format",
            "gguf-lora", "--out", str(tmp_path / "lora.gguf"))
    assert r.returncode == 0, r.stderr
    raw = (tmp_path / "lora.gguf").read_bytes()
    assert b"llama.rope.scaling.type" in raw and b"yarn" in raw

    r = run("estimate", "--config", str(p), "--max-seq-len-for", "2")
    assert r.returncode == 0, r.stderr
    m = re.search(r"longest seq_len for 2 GiB .*: CPU (\d+) tokens, CUDA (\d+) tokens", r.stdout)
    assert m and int(m[1]) > 256 and int(m[2]) > 0, r.stdout
    r = run("estimate", "--config", str(p), "--max-seq-len-for", "lots")
    assert r.returncode == 2 and "--max-seq-len-for" in r.stderr
    r = run("train", "--config", str(p), "--set", "context_extension.target_length=100")
    assert r.returncode != 0 and "context_extension.target_length" in r.stderr, r.stderr

