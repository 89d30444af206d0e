"""The trainer under faults and signals, through loaderd, on a tiny random Llama.

- loaderd SIGKILLed mid-run with LOADERD_RECONNECT_S=0: the trainer exits non-zero but first
  saves the adapter and a checkpoint of the last completed step, and says so.
- SIGTERM while the trainer waits for a batch (loaderd SIGSTOPped): it stops within a couple of
  seconds (the wait is sliced; the client itself retries EINTR) and saves adapter + checkpoint.
- SIGTERM or SIGUSR1 (Slurm's early warning) in the middle of a long step (grad_accum 150): the
  step is dropped mid-way (the message says in which micro-batch), the adapter and a checkpoint
  of the last completed step are saved although checkpoint_every is 0, exit status 75.
- SIGINT during `trainer eval`: the held-out loss is marked partial, not printed as complete;
  exit status 75 (interrupted).
Set BT_TRAINER_ASAN=1 to run the ASan+UBSan trainer."""
import contextlib
import json
import os
import re
import signal
import subprocess
import time

import pytest

from conftest import BUILD, SAN_ENV, chat_line, ckpt_step, tiny_model, write_shard

ASAN = os.environ.get("BT_TRAINER_ASAN") == "1"
TRAINER = os.path.join(BUILD, "asan", "trainer") if ASAN else os.path.join(BUILD, "trainer")


@pytest.fixture
def env(tmp_path, trainer_stack, loaderd, model_path):
    data = tmp_path / "data"
    data.mkdir()
    lines = [chat_line(f"What is item {i}?", f"Item {i} is a thing with number {i * 7}.")
             for i in range(3000)]
    write_shard(data / "train.jsonl", lines[:60])
    write_shard(data / "eval.jsonl", lines)

    tiny_model(tmp_path / "tiny.gguf", 7)
    # trainer_stack's loaderd, with the shallowest ring: while loaderd is SIGSTOPped each step
    # the trainer still has batches for blocks ~5 s in its progress report
    ld = loaderd({"data_roots": [str(data)], "ring_slots": 2,
                  "model_roots": [str(tmp_path), os.path.dirname(model_path)]},
                 asan=False, notify=False)
    return {"tmp": tmp_path, "data": data, "sock": ld.sock, "loaderd": ld}


def job(env, **over):
    j = {
        "model": str(env["tmp"] / "tiny.gguf"),
        "base_dtype": "nf4",
        "socket": str(env["sock"]),
        "data": {"shards": [str(env["data"] / "train.jsonl")], "format": "chat",
                 "seq_len": 64, "micro_batch_size": 2, "seed": 5, "tokenizer_threads": 1},
        "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
        "steps": 100000, "threads": 1, "log_every": 1, "timeout_s": 120,
        "checkpoint_every": 50000,
        "out_dir": str(env["tmp"] / "adapter"),
        "checkpoint_dir": str(env["tmp"] / "ckpt"),
    }
    j.update(over)
    p = env["tmp"] / "job.json"
    p.write_text(json.dumps(j))
    return str(p)


def start(env, cmd, cfg, extra_env=None):
    e = dict(os.environ)
    e.update(SAN_ENV)
    e["BT_LOG_LEVEL"] = "debug"
    e.update(extra_env or {})
    out, err = env["tmp"] / "trainer.out", env["tmp"] / "trainer.err"
    p = subprocess.Popen([TRAINER, cmd, "--config", cfg], stdout=open(out, "wb"),
                         stderr=open(err, "wb"), env=e)
    return p, out, err


@contextlib.contextmanager
def running(env, cmd, cfg, extra_env=None):
    """start() for a with-block: (p, out, err); the trainer is killed if it still runs at the end."""
    p, out, err = start(env, cmd, cfg, extra_env)
    try:
        yield p, out, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def wait_for(p, path, pattern, timeout=120):
    end = time.time() + timeout
    while time.time() < end:
        text = path.read_text(errors="replace")
        if re.search(pattern, text, re.M):
            return text
        assert p.poll() is None, f"trainer exited {p.returncode} before {pattern!r}:\n{text}"
        time.sleep(0.05)
    raise AssertionError(f"no {pattern!r} within {timeout}s")


def wait_quiet(path, quiet=1.0, timeout=30):
    """Wait until path stops growing for `quiet` seconds (the trainer drained the ring)."""
    end, size, since = time.time() + timeout, -1, time.time()
    while time.time() < end:
        n = path.stat().st_size
        if n != size:
            size, since = n, time.time()
        elif time.time() - since >= quiet:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} kept growing")


def last_step(stdout):
    steps = [int(s) for s in re.findall(r"^step (\d+)/100000 \|", stdout, re.M)]
    assert steps and steps == list(range(1, len(steps) + 1)), stdout[-2000:]
    return steps[-1]


def test_loaderd_killed_mid_run_saves_completed_steps(env):
    with running(env, "train", job(env), {"LOADERD_RECONNECT_S": "0"}) as (p, out, err):
        wait_for(p, out, r"^step 3/100000 ", 120)
        env["loaderd"].proc.send_signal(signal.SIGKILL)
        env["loaderd"].proc.wait()
        rc = p.wait(timeout=120)
    stdout, stderr = out.read_text(), err.read_text()
    assert rc == 1, stdout[-2000:] + stderr[-4000:]
    n = last_step(stdout)
    assert n >= 3
    m = re.search(r"trainer: .*; adapter for step (\d+) of 100000 saved to (\S+), checkpoint "
                  r"to (\S+)\n", stderr)
    assert m, stderr[-4000:]
    assert int(m.group(1)) == n and m.group(2) == str(env["tmp"] / "adapter")
    assert (env["tmp"] / "adapter" / "adapter_model.safetensors").exists()
    assert (env["tmp"] / "adapter" / "adapter_config.json").exists()
    assert ckpt_step(env["tmp"] / "ckpt") == n
    assert "LeakSanitizer" not in stderr and "runtime error" not in stderr


def test_sigterm_while_waiting_for_a_batch_stops_promptly_and_saves(env):
    ld = env["loaderd"].proc
    p, out, err = start(env, "train", job(env))
    try:
        wait_for(p, out, r"^step 2/100000 ", 120)
        ld.send_signal(signal.SIGSTOP)
        # the ring is drained (a report to the stopped loaderd blocks <= 5 s, then the step's
        # progress line follows): the trainer now waits for a batch
        wait_quiet(out, quiet=6.0, timeout=60)
        t0 = time.time()
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=60)
        took = time.time() - t0
    finally:
        ld.send_signal(signal.SIGCONT)
        if p.poll() is None:
            p.kill()
            p.wait()
    stdout, stderr = out.read_text(), err.read_text()
    assert rc == 75, stdout[-2000:] + stderr[-4000:]
    # promptly = without waiting out the batch wait (timeout_s 120; the wait is cut into 1 s
    # slices that ask for a stop): a bound far from both, so that a loaded machine cannot fail it
    assert took < 120 / 4, f"took {took:.1f} s to stop: the wait for a batch was not cut short"
    n = last_step(stdout)
    assert f"interrupted by SIGTERM: stopping before step {n + 1}'s forward" in stderr, stderr[-4000:]
    tmp = env["tmp"]
    assert (f"trainer: interrupted by SIGTERM: stopped after step {n} of 100000; adapter saved to "
            f"{tmp}/adapter, checkpoint to {tmp}/ckpt (continue with --resume {tmp}/ckpt)") in stderr, stderr[-4000:]
    assert ckpt_step(env["tmp"] / "ckpt") == n
    assert (env["tmp"] / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_signal_mid_step_keeps_the_last_completed_step(env, sig):
    """Steps of 150 micro-batches: the signal lands in step 2's forward/backward, which is dropped;
    with checkpoint_every 0 the checkpoint is still written, for --resume."""
    with running(env, "train", job(env, grad_accum=150, checkpoint_every=0)) as (p, out, err):
        wait_for(p, out, r"^step 1/100000 ", 300)
        p.send_signal(sig)
        rc = p.wait(timeout=120)
    stdout, stderr = out.read_text(), err.read_text()
    assert rc == 75, stdout[-2000:] + stderr[-4000:]
    assert last_step(stdout) == 1, stdout
    name = signal.Signals(sig).name
    m = re.search(rf"interrupted by {name}: stopping mid-step 2 \(in micro-batch (\d+) of 150\)", stderr)
    assert m and int(m.group(1)) < 150, stderr[-4000:]
    assert "stopped after step 1 of 100000; adapter saved to" in stderr, stderr[-4000:]
    assert ckpt_step(env["tmp"] / "ckpt") == 1
    assert (env["tmp"] / "adapter" / "adapter_model.safetensors").exists()
    assert "LeakSanitizer" not in stderr and "runtime error" not in stderr


def test_sigint_during_heldout_eval_is_marked_partial(env):
    ld = env["loaderd"].proc
    cfg = job(env, eval={"shards": [str(env["data"] / "eval.jsonl")], "max_batches": 0})
    p, out, err = start(env, "eval", cfg)
    try:
        wait_for(p, err, r"held-out batch 1:", 120)
        # the held-out set is far larger than the ring: it cannot end while loaderd is stopped
        ld.send_signal(signal.SIGSTOP)
        time.sleep(1.0)
        p.send_signal(signal.SIGINT)
        rc = p.wait(timeout=30)
    finally:
        ld.send_signal(signal.SIGCONT)
        if p.poll() is None:
            p.kill()
            p.wait()
    stdout, stderr = out.read_text(), err.read_text()
    assert rc == 75, stdout + stderr[-4000:]
    assert "trainer: interrupted by SIGINT: the held-out evaluation is partial" in stderr, stderr[-2000:]
    assert re.search(r"^held-out loss \(partial, interrupted\): [0-9.]+, perplexity [0-9.]+ "
                     r"\(\d+ tokens\)$", stdout, re.M), stdout + stderr[-2000:]
    assert "held-out loss:" not in stdout
    assert "held-out (partial, interrupted):" in stderr

