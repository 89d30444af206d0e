"""The trainer against what an outside hostile test found (issue 10):

- its model file truncated while it loads: a clear error, exit 1, never SIGBUS (§1);
- a run whose loss becomes non-finite after some good steps: it stops at that step with exit
  status 3, writes nothing more, and out_dir / checkpoint_dir keep the last good adapter and
  checkpoint (§4); hyper-parameters out of range are refused up front, naming the key (§4);
- leftovers of saves killed mid-write are removed at the next start, and nothing else (§7): a
  directory of our temporary name is removed only when it carries BarqTrain's marker (every
  save writes it first: issue 21 §1) or is empty.
Set BT_TRAINER_ASAN=1 to run the ASan+UBSan trainer."""
import json
import os
import re
import struct
import subprocess

import numpy as np
import pytest

from conftest import BUILD, MODEL, SAN_ENV, PauseHook, write_shard

ASAN = os.environ.get("BT_TRAINER_ASAN") == "1"
TRAINER = os.path.join(BUILD, "asan", "trainer") if ASAN else os.path.join(BUILD, "trainer")
# `trainer train` with a fault injected through the run's test hooks (tests/tools/train_faults.c)
TRAIN_FAULTS = os.path.join(BUILD, "asan" if ASAN else "", "tools", "train_faults")


def tiny(path, tied=1, seed=7):
    subprocess.run([os.path.join(BUILD, "tools", "mk_tiny_gguf"), "--out", str(path), "--tokenizer-from", MODEL,
                    "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
                    "--seed", str(seed), "--tied", str(tied)], check=True)
    return path


def run(cfg_path, *args, env=None, timeout=600):
    e = dict(os.environ)
    e.update(SAN_ENV)
    e.update(env or {})
    return subprocess.run([TRAINER, "train", "--config", str(cfg_path), *args], capture_output=True, text=True,
                          env=e, timeout=timeout)


def write_job(tmp, **over):
    j = {"model": str(tmp / "tiny.gguf"), "base_dtype": "fp32", "socket": str(tmp / "no.sock"),
         "data": {"shards": [str(tmp / "data" / "*.jsonl")], "format": "text", "seq_len": 32,
                  "micro_batch_size": 8, "seed": 5, "tokenizer_threads": 1},
         "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0}, "optim": {"lr": 1e-3},
         "steps": 10, "threads": 1, "timeout_s": 120, "out_dir": str(tmp / "adapter"),
         "checkpoint_dir": str(tmp / "ckpt")}
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(j.get(k), dict):
            j[k].update(v)
        else:
            j[k] = v
    p = tmp / "job.json"
    p.write_text(json.dumps(j))
    return p


def dead_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# ---------------------------------------------------------------- §1

def test_model_truncated_while_loading(tmp_path, bins, model_path):
    if not bins.have("tools/mk_tiny_gguf"):
        pytest.skip("tools/mk_tiny_gguf not built")
    model = tiny(tmp_path / "tiny.gguf")
    size = model.stat().st_size
    mapped = []

    def cut_at_load(p):  # the first mapping is the memory check's header read (issue 21 §7)
        mapped.append(p)
        if len(mapped) == 2:
            os.truncate(p, size // 2)

    hook = PauseHook(tmp_path, "/tiny.gguf", cut_at_load)
    cfg = write_job(tmp_path)
    r = run(cfg, env=hook.env)
    hook.stop()
    assert hook.paths == [str(model)] * 2 and not hook.errors, (hook.paths, hook.errors)
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])  # not -SIGBUS
    assert "changed while being read" in r.stderr and "tiny.gguf" in r.stderr, r.stderr[-3000:]
    assert f"{size} bytes when opened, now {size // 2} bytes" in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "adapter").exists()


# ---------------------------------------------------------------- §4

def test_hyperparameters_refused_up_front(tmp_path):
    cfg = write_job(tmp_path)
    for setting, needle in (("optim.lr=1e308", "optim.lr: expected a number in (0, 1], got 1e308"),
                            ("optim.weight_decay=5", "optim.weight_decay: expected a number in [0, 1]"),
                            ("optim.eps=0", "optim.eps: expected a number in (0, 1]")):
        r = run(cfg, "--set", setting)
        assert r.returncode == 2 and needle in r.stderr, (setting, r.stderr)


def st_tensors(path):
    raw = open(path, "rb").read()
    n = struct.unpack_from("<Q", raw, 0)[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        out[k] = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=np.float32)
    return out


def ckpt_step(d):
    raw = (d / "trainer_state.bin").read_bytes()
    assert raw[:6] == b"BTCKPT"
    return struct.unpack_from("<q", raw, 16)[0]


def test_divergence_stops_and_keeps_the_last_good_saves(tmp_path, trainer_stack):
    """A run whose gradients become non-finite at step 8 (injected as an overflow would make
    them, through the run's test hooks: tools/train_faults) after saves at steps 3 and 6: it stops
    at step 8 with exit status 3, writes nothing of steps 7-8, and the adapter and checkpoint of
    step 6 stay."""
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "a.jsonl", [json.dumps({"text": f"line {i} of the shard, with words"}) for i in range(400)])
    tiny(tmp_path / "tiny.gguf")
    ld = trainer_stack(data)
    cfg = write_job(tmp_path, socket=ld.sock, steps=50, save_every=3, checkpoint_every=3,
                    data={"micro_batch_size": 2})
    assert os.access(TRAIN_FAULTS, os.X_OK), f"{TRAIN_FAULTS} not built (make all builds tools/)"
    e = dict(os.environ)
    e.update(SAN_ENV)
    r = subprocess.run([TRAIN_FAULTS, "--nonfinite-grad-at-step", "8", "--config", str(cfg)],
                       capture_output=True, text=True, env=e, timeout=600)
    assert r.returncode == 3, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    assert re.search(r"trainer: training diverged at step 8: non-finite gradient norm nan \(learning rate [0-9.e-]+\): "
                     r"stopped without saving anything of this step or later", r.stderr), r.stderr[-4000:]
    steps = [int(s) for s in re.findall(r"^step (\d+)/50 \|", r.stdout, re.M)]
    assert steps == list(range(1, 8)), r.stdout[-2000:]
    assert f"the adapter in {tmp_path / 'adapter'} is the one saved at step 6" in r.stderr, r.stderr[-3000:]
    assert f"the checkpoint in {tmp_path / 'ckpt'} is the one of step 6" in r.stderr, r.stderr[-3000:]
    assert "update skipped" not in r.stderr and "Lower optim.lr" in r.stderr
    assert ckpt_step(tmp_path / "ckpt") == 6
    for d in (tmp_path / "adapter", tmp_path / "ckpt"):
        t = st_tensors(d / "adapter_model.safetensors")
        assert t and all(np.isfinite(v).all() for v in t.values())
    assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name or ".old" in p.name] == []
    # resuming from the last good checkpoint goes on from step 6
    r2 = run(cfg, "--resume", str(tmp_path / "ckpt"), "--set", "steps=50", "--set", "stop_at_step=9")
    assert r2.returncode == 0 and "resumed from" in r2.stderr, r2.stderr[-3000:]
    assert re.findall(r"^step (\d+)/50 \|", r2.stdout, re.M) == ["7", "8", "9"], r2.stdout


# ---------------------------------------------------------------- §7

def test_stale_temporaries_removed_at_start(tmp_path):
    dead = dead_pid()
    cfg = write_job(tmp_path, model=str(tmp_path / "missing.gguf"), checkpoint_every=5)
    leftovers = [tmp_path / f"adapter.tmp-{dead}", tmp_path / f"ckpt.tmp-{dead}",
                 tmp_path / f"ckpt.tmp-{dead}.tmp-{dead}", tmp_path / f"adapter.old-{dead}"]
    keep = [tmp_path / "adapter.tmp-notapid", tmp_path / "adapter.backup", tmp_path / f"other.tmp-{dead}",
            tmp_path / f"adapter.tmp-{dead + 5000000}"]  # our name, but not marked: a user's directory
    for p in leftovers + keep:
        p.mkdir()
        (p / "adapter_model.safetensors").write_bytes(b"partial")
        if p in leftovers:  # as a save leaves it: the marker is its first file
            (p / ".barqtrain").write_text('{"written_by": "BarqTrain", "kind": "adapter"}\n')
    r = run(cfg)
    assert r.returncode == 1 and "missing.gguf" in r.stderr, r.stderr  # fails after cleaning
    for p in leftovers:
        assert not p.exists(), p
        assert f"removed {p}: the temporary of a save killed mid-write (process {dead})" in r.stderr, r.stderr
    for p in keep:
        assert p.exists(), p
    # exports too: the next export removes what a killed one left next to its output
    out = tmp_path / "merged.gguf"
    stale = tmp_path / f"merged.gguf.tmp.{dead}.1"
    stale.write_bytes(b"partial")
    e = subprocess.run([TRAINER, "export", "--model", str(tmp_path / "missing.gguf"), "--adapter",
                        str(tmp_path / "adapter.backup"), "--format", "gguf", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert e.returncode != 0 and not stale.exists(), e.stderr


@pytest.mark.parametrize("match", ["/ckpt.tmp-", "/adapter.tmp-"])
def test_save_killed_mid_write_is_cleaned_at_next_start(tmp_path, trainer_stack, match):
    """The issue's case itself: a trainer SIGKILLed while its checkpoint (or adapter) save is
    being written (paused by the bt_test_pause_point hook just before the rename) leaves its
    temporary directory; the next run removes it, says so, and trains on."""
    import signal
    import threading
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "a.jsonl", [json.dumps({"text": f"line {i} of the shard, with words"}) for i in range(200)])
    tiny(tmp_path / "tiny.gguf")
    ld = trainer_stack(data)
    cfg = write_job(tmp_path, socket=ld.sock, steps=6, save_every=3, checkpoint_every=3,
                    data={"micro_batch_size": 2})
    e = dict(os.environ)
    e.update(SAN_ENV)
    proc = {}
    killed = threading.Event()

    def kill(path):
        if os.path.basename(path).count(".tmp-") != 1:
            return  # the checkpoint's own adapter files, written inside ckpt.tmp-<pid>.tmp-<pid>
        proc["p"].send_signal(signal.SIGKILL)
        proc["p"].wait(60)
        killed.set()

    hook = PauseHook(tmp_path, match, kill)
    e.update(hook.env)
    proc["p"] = subprocess.Popen([TRAINER, "train", "--config", str(cfg)], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True, env=e)
    try:
        _, err = proc["p"].communicate(timeout=600)
    finally:
        if proc["p"].poll() is None:
            proc["p"].kill()
    assert killed.wait(60) and proc["p"].returncode == -signal.SIGKILL, (proc["p"].returncode, err[-3000:])
    # the hook's thread now waits for the killed trainer to read "resume": stand in for it
    fd = os.open(hook.resume, os.O_RDONLY | os.O_NONBLOCK)
    try:
        import select
        select.select([fd], [], [], 60)
    finally:
        os.close(fd)
    hook.stop()
    assert len(hook.paths) == (2 if match == "/ckpt.tmp-" else 1) and not hook.errors, (hook.paths, hook.errors)
    left = hook.paths[-1]
    assert os.path.basename(left) == f"{match[1:]}{proc['p'].pid}", left
    assert os.path.isdir(left) and os.listdir(left), left  # the killed save's temporary
    pid = proc["p"].pid
    r = run(cfg, "--set", "stop_at_step=1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"removed {left}: the temporary of a save killed mid-write (process {pid})" in r.stderr, r.stderr[-3000:]
    assert not os.path.exists(left)
    assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name or ".old" in p.name] == []
