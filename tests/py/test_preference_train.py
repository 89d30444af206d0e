"""Preference training end to end (issue 25): a `preference` / `kto` shard -> loaderd -> the trainer's
preference step on a tiny random Llama (build/tools/mk_tiny_gguf, SmolLM2's vocabulary so
loaderd's tokenizer matches), CPU backend.

- DPO learns: the training loss falls, the held-out preference accuracy (rewards/accuracies) and
  margin rise; the progress line, metrics.jsonl (train and eval lines) and the held-out summary
  carry TRL's metric names.
- Exact resume after SIGKILL: a run killed mid-way resumes from its last checkpoint and gives the
  straight run's per-step losses and grad norms to the last of 17 digits, and its adapter bytes.
- KTO, ORPO and SimPO train and log their own metrics (kl; nll_loss, log_odds_ratio).
- Refusals name the key: a data format that does not match the objective, an unknown loss type,
  a parameter out of TRL's range, precompute_ref_log_probs without a reference model.
- device "cuda" (the emulated CUDA trainer of `make test-emu`) trains DPO as the CPU does: the same
  loss and gradient norm within bf16's tolerance.
The losses themselves are checked against TRL 1.16.0 in tests/unit/trainer/test_pref_step.c.
"""
import json
import os
import re
import signal
import subprocess
import time

import pytest

from conftest import BUILD, run_trainer, step_losses, tiny_model, tiny_model_hd64, write_shard

PAIRS = [{"prompt": f"Question {i}: what is {i} plus {i}?", "chosen": f"It is {2 * i}.",
          "rejected": f"Sorry, no idea about {i}. Ask later please."} for i in range(48)]


@pytest.fixture
def env(tmp_path, trainer_stack):
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "train.jsonl", [json.dumps(p) for p in PAIRS[:40]])
    write_shard(data / "eval.jsonl", [json.dumps(p) for p in PAIRS[40:]])
    kto = [{"prompt": p["prompt"], "completion": p["chosen"] if i % 2 == 0 else p["rejected"], "label": i % 2 == 0}
           for i, p in enumerate(PAIRS)]
    write_shard(data / "kto.jsonl", [json.dumps(k) for k in kto])
    tiny_model(tmp_path / "tiny.gguf", 7)
    ld = trainer_stack(data)
    return {"tmp": tmp_path, "data": data, "sock": ld.sock}


def job(env, name, **over):
    j = {
        "name": "pref",
        "model": str(env["tmp"] / "tiny.gguf"),
        "base_dtype": "fp32",
        "socket": str(env["sock"]),
        "objective": "dpo",
        "data": {"shards": [str(env["data"] / "train.jsonl")], "format": "preference",
                 "seq_len": 128, "micro_batch_size": 2, "seed": 5, "tokenizer_threads": 1},
        "eval": {"shards": [str(env["data"] / "eval.jsonl")]},
        "preference": {"beta": 0.1},
        "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
        "optim": {"lr": 2e-2, "warmup_steps": 0},
        "schedule": "constant",
        "steps": 8, "grad_accum": 2, "threads": 2, "seed": 11,
        "out_dir": str(env["tmp"] / f"{name}-adapter"),
        "checkpoint_dir": str(env["tmp"] / f"{name}-ckpt"),
        "report": {"dir": str(env["tmp"] / f"{name}-report"), "plot": False},
    }
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(j.get(k), dict):
            j[k] = {**j[k], **v}
        else:
            j[k] = v
    p = env["tmp"] / f"{name}.json"
    p.write_text(json.dumps(j))
    return str(p)


def metrics(env, name):
    lines = (env["tmp"] / f"{name}-report" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(l) for l in lines]


TRL = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected"]


def test_dpo_learns_and_logs_trl_metrics(env):
    cfg = job(env, "dpo", eval={"every": 4}, report={"plot": True}, grad_accum=1)
    r = run_trainer("train", cfg)
    prog = re.findall(r"step (\d+)/8 \| loss (\S+) \| acc (\S+) \| margin (\S+) \|", r.stdout)
    assert len(prog) == 8, r.stdout
    assert abs(float(prog[0][1]) - 0.6931) < 2e-3  # log 2: the policy starts as the reference
    m = metrics(env, "dpo")
    tr = [x for x in m if x["type"] == "train"]
    ev = [x for x in m if x["type"] == "eval"]
    assert len(tr) == 8 and all(k in x for x in tr for k in TRL), tr[0]
    assert "kl" not in tr[0] and "log_odds_ratio" not in tr[0]
    assert tr[-1]["loss"] < tr[0]["loss"] - 0.05, [x["loss"] for x in tr]
    assert [e["step"] for e in ev] == [0, 4, 8] and ev[0]["records"] == 8 and all(k in e for e in ev for k in TRL)
    assert "perplexity" not in ev[0]
    assert re.search(r"step 4/8 \| held-out loss \S+ \| acc \S+ \| margin \S+ \| lp-acc \S+ \| 8 pairs", r.stdout), r.stdout
    assert ev[-1]["rewards/accuracies"] > ev[0]["rewards/accuracies"]
    assert ev[-1]["rewards/margins"] > ev[0]["rewards/margins"]
    assert ev[-1]["rewards/accuracies"] >= 0.75, ev
    assert re.search(r"held-out rewards/accuracies: before \S+ -> after \S+; rewards/margins", r.stdout), r.stdout
    # ours (not TRL's): the policy's own preference, chosen log-prob > rejected, in every line
    OURS = ["logps/accuracies", "logps/margins"]
    assert all(k in x for x in tr + ev for k in OURS), ev[0]
    for x in tr + ev:
        assert abs(x["logps/margins"] - (x["logps/chosen"] - x["logps/rejected"])) < 1e-3 * (1 + abs(x["logps/margins"])), x
    assert all(abs(e["logps/accuracies"] * 8 - round(e["logps/accuracies"] * 8)) < 1e-9 for e in ev), ev
    assert re.search(r"step \d+/8 \| loss \S+ \| acc \S+ \| margin \S+ \| lp-acc \S+", r.stdout), r.stdout
    lp = re.search(r"held-out logps/accuracies \(policy log-prob chosen > rejected\): before (\S+) -> after (\S+) "
                   r"\(\S+ points\); logps/margins: before (\S+) -> after (\S+) \(8 pairs\)", r.stdout)
    assert lp, r.stdout
    assert abs(float(lp.group(1)) - ev[0]["logps/accuracies"]) < 1e-4 and abs(float(lp.group(2)) - ev[-1]["logps/accuracies"]) < 1e-4
    assert abs(float(lp.group(3)) - ev[0]["logps/margins"]) < 1e-4 * (1 + abs(ev[0]["logps/margins"]))
    # the reference is fixed, so the policy margin's rise is the reward margin's rise over beta (0.1)
    rise = ev[-1]["logps/margins"] - ev[0]["logps/margins"]
    assert abs(0.1 * rise - (ev[-1]["rewards/margins"] - ev[0]["rewards/margins"])) < 1e-3 * (1 + abs(rise)), ev
    print(f"dpo tiny: held-out logps/accuracies {lp.group(1)} -> {lp.group(2)}, logps/margins {lp.group(3)} -> {lp.group(4)}")
    assert (env["tmp"] / "dpo-report" / "report.png").stat().st_size > 1000  # with its accuracy panel
    card = (env["tmp"] / "dpo-adapter" / "README.md").read_text()
    assert "| objective | dpo (loss_type sigmoid, beta 0.1) |" in card and "8 pairs from" in card
    assert "perplexity" not in card
    # `trainer eval` scores the adapter with the same metrics
    e = subprocess.run([os.path.join(BUILD, "trainer"), "eval", "--config", cfg, "--adapter",
                        str(env["tmp"] / "dpo-adapter")], capture_output=True, text=True, timeout=120)
    assert e.returncode == 0, e.stderr
    m = re.search(r"held-out dpo loss: (\S+), rewards/accuracies (\S+), rewards/margins (\S+)", e.stdout)
    assert m and abs(float(m.group(1)) - ev[-1]["loss"]) < 1e-6 and float(m.group(2)) == ev[-1]["rewards/accuracies"], e.stdout


def test_resume_after_sigkill_is_exact(env):
    short = {"eval": {"shards": []}, "steps": 6, "grad_accum": 1}
    straight = step_losses((r := run_trainer("train", job(env, "straight", **short))).stdout + r.stderr)
    assert sorted(straight) == list(range(1, 7))
    cfg = job(env, "killed", checkpoint_every=2, **short)
    e = dict(os.environ)
    e["BT_LOG_LEVEL"] = "debug"
    log = env["tmp"] / "killed.log"
    with open(log, "w") as f:
        p = subprocess.Popen([os.path.join(BUILD, "trainer"), "train", "--config", cfg], stdout=f,
                             stderr=subprocess.STDOUT, env=e)
        deadline = time.time() + 120
        while time.time() < deadline and not re.search(r"step 4/6", log.read_text()):
            time.sleep(0.05)
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert p.returncode == -signal.SIGKILL
    before = step_losses(log.read_text())
    ck = env["tmp"] / "killed-ckpt"
    assert (ck / "trainer_state.bin").exists()
    r = run_trainer("train", job(env, "killed", checkpoint_every=2, **short), "--resume", str(ck))
    after = step_losses(r.stdout + r.stderr)
    start = int(re.search(r"resumed from \S+ at step (\d+)", r.stderr).group(1))
    assert start >= 2 and sorted(after) == list(range(start + 1, 7)), r.stderr
    for s in range(1, 7):
        got = after.get(s, before.get(s))
        assert got == straight[s], (s, got, straight[s])
    a = (env["tmp"] / "straight-adapter" / "adapter_model.safetensors").read_bytes()
    b = (env["tmp"] / "killed-adapter" / "adapter_model.safetensors").read_bytes()
    assert a == b


@pytest.mark.parametrize("objective,extra", [("kto", ["kl"]), ("orpo", ["nll_loss", "log_odds_ratio", "log_odds_chosen"]),
                                             ("simpo", ["nll_loss"])])
def test_other_objectives_train(env, objective, extra):
    over = {"objective": objective, "steps": 4, "eval": {"shards": []}}
    if objective == "kto":  # and its held-out evaluation (KL estimate over the eval batches)
        over["data"] = {"shards": [str(env["data"] / "kto.jsonl")], "format": "kto"}
        over["eval"] = {"shards": [str(env["data"] / "kto.jsonl")], "max_batches": 2}
    r = run_trainer("train", job(env, objective, **over))
    if objective == "kto":
        ev = [x for x in metrics(env, objective) if x["type"] == "eval"]
        assert len(ev) == 2 and ev[0]["records"] > 0 and ev[0]["kl"] is not None and ev[0]["rewards/accuracies"] is None
        assert ev[0]["loss"] is not None and ev[1]["rewards/margins"] > ev[0]["rewards/margins"], ev
    tr = [x for x in metrics(env, objective) if x["type"] == "train"]
    assert len(tr) == 4 and all(k in tr[0] for k in TRL + extra), tr[0]
    assert all(x["loss"] is not None for x in tr)
    short = "kl" if objective == "kto" else "acc"
    assert re.search(rf"step 4/4 \| loss \S+ \| {short} \S+ \| margin", r.stdout), r.stdout
    if objective == "kto":
        assert tr[0]["rewards/accuracies"] is None  # TRL's KTO logs no accuracy
        assert "logps/accuracies" not in tr[0] and "logps/margins" not in tr[0]  # ours: pairs only


@pytest.mark.parametrize("over,msg", [
    ({"objective": "dpo", "data": {"format": "chat"}}, 'data.format: objective "dpo" trains on {prompt, chosen, rejected}'),
    ({"objective": "kto"}, 'data.format: objective "kto" trains on {prompt, completion, label} records, so data.format must be "kto"'),
    ({"objective": "sft"}, 'objective: "sft" trains on demonstrations, but data.format is "preference"'),
    ({"preference": {"loss_type": "kto"}}, 'preference.loss_type: "kto" is not a loss type of objective "dpo"'),
    ({"preference": {"loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0]}}, "preference.loss_weights: 1 weights for 2 loss types"),
    ({"preference": {"beta": 0}}, "preference.beta"),
    ({"preference": {"loss_type": "robust", "label_smoothing": 0.5}}, "preference: "),
    ({"objective": "simpo", "preference": {"precompute_ref_log_probs": True}},
     'preference.precompute_ref_log_probs: objective "simpo" has no reference model'),
    ({"objective": "ipo"}, "objective"),
])
def test_refusals_name_the_key(env, over, msg):
    r = subprocess.run([os.path.join(BUILD, "trainer"), "config", "--check", job(env, "bad", **over)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and msg in r.stderr, r.stderr


def test_gpu_trainer_trains_dpo_like_the_cpu(env):
    """device "cuda" has the log-prob passes (trainer/cuda/cuda_logprobs.cu; it was refused by name
    before): the emulated CUDA trainer of `make test-emu` runs the same DPO job as the CPU trainer,
    reference from the adapter-off pass, and follows it: step 1's loss is log 2 on both (the policy
    starts as the reference) and its gradient norm within 2e-2 (bf16 activations vs fp32; 1e-3
    seen). The tiny model has head_dim 64 (the GPU attention's)."""
    emu = os.path.join(BUILD, "emu", "trainer")
    if not os.access(emu, os.X_OK):
        pytest.skip(f"{emu} not built (make test-emu)")
    model = str(tiny_model_hd64(env["tmp"] / "hd64.gguf"))
    over = {"model": model, "steps": 1, "grad_accum": 1, "eval": {"shards": []}}
    cpu = step_losses((r := run_trainer("train", job(env, "dpo-cpu", **over))).stdout + r.stderr)
    e = dict(os.environ)
    e["BT_LOG_LEVEL"] = "debug"
    g = subprocess.run([emu, "train", "--config", job(env, "dpo-gpu", device="cuda", **over)], capture_output=True,
                       text=True, timeout=300, env=e)
    assert g.returncode == 0, g.stdout + g.stderr
    gpu = step_losses(g.stdout + g.stderr)
    assert sorted(cpu) == sorted(gpu) == [1], (cpu, gpu)
    print(f"dpo cpu {cpu} gpu {gpu}")
    assert abs(float(cpu[1][0]) - 0.6931) < 2e-3 and abs(float(gpu[1][0]) - 0.6931) < 2e-3, (cpu, gpu)
    assert abs(float(gpu[1][1]) - float(cpu[1][1])) <= 2e-2 * float(cpu[1][1]), (cpu, gpu)


def test_gpu_ranks_refuse_a_reference_cache_over_a_cut_base(env):
    """precompute_ref_log_probs keys loaderd's cache by the base's hash (bt_model_ref_id over the
    linears); with dist.shard_base over 2 GPU ranks of a GGUF base each rank reads only its cut, so
    the run is refused naming both keys, before the model loads (two emulated CUDA ranks)."""
    emu = os.path.join(BUILD, "emu", "trainer")
    if not os.access(emu, os.X_OK):
        pytest.skip(f"{emu} not built (make test-emu)")
    import socket
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    cfg = job(env, "cut", device="cuda", model=str(tiny_model_hd64(env["tmp"] / "hd64.gguf")), base_dtype="gguf",
              dist={"shard_base": True}, preference={"beta": 0.1, "precompute_ref_log_probs": True})
    base = {k: v for k, v in os.environ.items() if k not in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")}
    secret = os.urandom(16).hex()  # the job's, the same on both ranks
    procs = [subprocess.Popen([emu, "train", "--config", cfg, "--set", "dist.timeout_s=60"],
                              env={**base, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NCCL_EMU_TIMEOUT_S": "60",
                                   "BT_DIST_SECRET": secret},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    for r, (p, o) in enumerate(zip(procs, outs)):
        assert p.returncode != 0, f"rank {r}:\n{o}"
    assert "preference.precompute_ref_log_probs: with dist.shard_base over 2 ranks" in outs[0], outs[0]
