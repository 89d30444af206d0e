"""The trainer with loaderd's cached reference log-probs (issue 25 §2: preference.precompute_ref_log_probs,
job key ref_base, batch layout 3 seg_ref_ok / seg_ref_logp, op ref_put), end to end on a tiny random
Llama through a loaderd with token_cache_dir, CPU backend.

- A first DPO run computes every reference value (progress line `ref cached 0/N`) and hands the
  values back (accepted, none refused); loaderd keeps them in the cache (sidecars). Its evaluation
  before training skips the policy forward (the fresh adapter is the identity), the one after
  training does not.
- A second run with the same base takes every value from the cache (`ref cached N/N`: the
  reference forward is skipped) and prints the same losses, bit for bit (%.17g), as the first one
  and as a run that recomputes the reference every step (precompute_ref_log_probs false).
- A different base (another tiny model) gets none of them (its ref_base differs) and computes its own.
- ORPO has no reference model: precompute_ref_log_probs is refused by name.
"""
import glob
import json
import os
import re
import time

import pytest

from conftest import BUILD, run_trainer, step_losses, tiny_model, write_shard

PAIRS = [{"prompt": f"Question {i}: what is {i} plus {i}?", "chosen": f"It is {2 * i}.",
          "rejected": f"Sorry, no idea about {i}. Ask later please."} for i in range(30)]


@pytest.fixture
def env(tmp_path, trainer_stack, loaderd, model_path):
    for b in ("loaderd", "trainer", "tools/mk_tiny_gguf"):
        if not os.path.exists(os.path.join(BUILD, b)):
            pytest.skip(f"{b} not built")
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "train.jsonl", [json.dumps(p) for p in PAIRS[:24]])
    write_shard(data / "eval.jsonl", [json.dumps(p) for p in PAIRS[24:]])
    tiny_model(tmp_path / "tiny.gguf", 7)
    tiny_model(tmp_path / "other.gguf", 8)
    cache = tmp_path / "tcache"
    ld = loaderd({"data_roots": [str(data)], "model_roots": [str(tmp_path), os.path.dirname(model_path)],
                  "token_cache_dir": str(cache)}, asan=False, notify=False)
    return {"tmp": tmp_path, "data": data, "sock": ld.sock, "cache": cache, "ld": ld}


def job(env, name, model="tiny.gguf", **pref):
    j = {
        "name": "refc", "model": str(env["tmp"] / model), "base_dtype": "fp32", "socket": str(env["sock"]),
        "objective": pref.pop("objective", "dpo"),
        "data": {"shards": [str(env["data"] / "train.jsonl")], "format": "preference",
                 "seq_len": 128, "micro_batch_size": 2, "seed": 5, "tokenizer_threads": 1},
        "eval": {"shards": [str(env["data"] / "eval.jsonl")]},
        "preference": {"beta": 0.1, **pref},
        "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
        "optim": {"lr": 2e-2, "warmup_steps": 0}, "schedule": "constant",
        "steps": 4, "grad_accum": 1, "threads": 2, "seed": 11,
        "out_dir": str(env["tmp"] / f"{name}-adapter"), "checkpoint_dir": str(env["tmp"] / f"{name}-ckpt"),
        "report": {"dir": str(env["tmp"] / f"{name}-report"), "plot": False},
    }
    p = env["tmp"] / f"{name}.json"
    p.write_text(json.dumps(j))
    return str(p)


def cached(r):
    """[(cached, total)] of the progress lines."""
    return [(int(a), int(b)) for a, b in re.findall(r"\| ref cached (\d+)/(\d+)", r.stdout)]


def summary(r):
    m = re.search(r"reference log-probs \(rank 0\): training (\d+) from loaderd's cache, (\d+) computed; held-out "
                  r"(\d+) cached, (\d+) computed; put: (\d+) accepted, (\d+) refused, (\d+) failed puts", r.stderr)
    assert m, r.stderr[-3000:]
    return [int(x) for x in m.groups()]


def test_cached_reference_gives_the_same_losses_and_skips_the_reference(env):
    r1 = run_trainer("train", job(env, "first", precompute_ref_log_probs=True))
    base = re.search(r"ref_base (btm1-[0-9a-f]{32})", r1.stderr)
    assert base, r1.stderr[-3000:]
    c1 = cached(r1)
    assert len(c1) == 4 and all(h == 0 and n > 0 for h, n in c1), r1.stdout
    s1 = summary(r1)
    # training: all computed; held-out: the evaluation before training computes, the one after
    # takes the values it put
    assert s1[0] == 0 and s1[1] == sum(n for _, n in c1) and s1[3] > 0 and s1[2] == s1[3], s1
    assert s1[4] == s1[1] + s1[3]  # every computed value accepted
    assert s1[5] == 0 and s1[6] == 0, r1.stderr[-3000:]  # nothing refused, no failed put
    # the evaluation before training runs one forward per batch (the fresh adapter is the identity:
    # policy = reference), the one after training its policy forward; both print wall and CPU time
    ho = re.findall(r"held-out: .*\(\S+ s, CPU \S+ s(; the adapter is the identity)?", r1.stderr)
    assert [bool(x) for x in ho] == [True, False], r1.stderr[-3000:]
    assert re.search(r"4 steps in \S+ s \(CPU \S+ s\)", r1.stderr), r1.stderr[-3000:]
    # loaderd wrote the completed shards' values next to their token cache entries
    end = time.monotonic() + 30  # written on loaderd's thread pool after the last put
    while not glob.glob(str(env["cache"] / "v1" / "*" / "*.ref")) and time.monotonic() < end:
        time.sleep(0.05)
    assert glob.glob(str(env["cache"] / "v1" / "*" / "*.ref")), os.listdir(env["cache"])

    # the same base again: every value from the cache, no reference forward, the same losses
    r2 = run_trainer("train", job(env, "second", precompute_ref_log_probs=True))
    assert f"ref_base {base.group(1)}" in r2.stderr
    c2 = cached(r2)
    assert [n for _, n in c2] == [n for _, n in c1] and all(h == n for h, n in c2), r2.stdout
    s2 = summary(r2)
    assert s2[1] == 0 and s2[3] == 0 and s2[0] == s1[1] and s2[2] == 2 * s1[3], (s1, s2)
    assert s2[4] == 0 and s2[5] == 0
    l1, l2 = step_losses(r1.stdout + r1.stderr), step_losses(r2.stdout + r2.stderr)
    assert len(l1) == 4 and l1 == l2, (l1, l2)
    ev = re.compile(r"held-out rewards/accuracies: before .*")
    assert ev.findall(r1.stdout) == ev.findall(r2.stdout), (r1.stdout, r2.stdout)

    # recomputed every step (no cache): bit for bit the cached run
    r3 = run_trainer("train", job(env, "recomputed"))
    assert "ref cached" not in r3.stdout and "ref_base" not in r3.stderr
    assert step_losses(r3.stdout + r3.stderr) == l1
    assert ev.findall(r3.stdout) == ev.findall(r1.stdout)

    # another base: its own ref_base, none of the first base's values
    r4 = run_trainer("train", job(env, "other", model="other.gguf", precompute_ref_log_probs=True))
    b4 = re.search(r"ref_base (btm1-[0-9a-f]{32})", r4.stderr)
    assert b4 and b4.group(1) != base.group(1)
    assert all(h == 0 for h, _ in cached(r4)), r4.stdout
    s4 = summary(r4)
    assert s4[0] == 0 and s4[2] == s4[3] and s4[5] == 0, s4  # held-out: only what it put itself


def test_objective_without_reference_refuses_the_key(env):
    r = run_trainer("train", job(env, "orpo", objective="orpo", precompute_ref_log_probs=True), ok=False)
    assert r.returncode != 0
    assert 'preference.precompute_ref_log_probs: objective "orpo" has no reference model' in r.stderr + r.stdout
