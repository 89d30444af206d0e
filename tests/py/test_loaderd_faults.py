"""Faults (issue 3 §8): a trainer killed mid-batch frees its job and ring; loaderd killed with
SIGKILL (or stopped) and restarted lets attached trainers (proto/client.c through the
tests/tools/ld_consume C tool) reconnect and continue with exactly the batches an uninterrupted
run would have given them."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import chat_line, write_shard
from test_loaderd_server import base_config, dataset, job_spec  # noqa: F401

SAN_ENV = {"ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0:exitcode=23",
           "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:exitcode=24"}


def ring_fds(pid):
    """memfd rings loaderd still holds: open descriptors plus live mappings."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:barq-ring"):
                n += 1
        except OSError:
            pass
    with open(f"/proc/{pid}/maps") as f:
        maps = sum("memfd:barq-ring" in line for line in f)
    return n, maps


def wait_until(pred, timeout=15.0, what="condition"):
    end = time.time() + timeout
    while True:
        v = pred()
        if v:
            return v
        assert time.time() < end, "timed out waiting for " + what
        time.sleep(0.05)


def consumer_tool(bins):
    asan = bins.have("tools/ld_consume", asan=True)
    if not bins.have("tools/ld_consume", asan):
        pytest.skip("build/tools/ld_consume not built")
    return bins.path("tools/ld_consume", asan)


def test_trainer_killed_mid_batch_frees_its_ring(loaderd, dataset, model_path, tmp_path):
    d = loaderd(base_config(dataset, model_path))
    assert ring_fds(d.proc.pid) == (0, 0)
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps(job_spec(dataset, model_path, ring_slots=4)))
    # a trainer in another process: attaches, maps the ring, takes one batch and holds it
    code = r"""
import json, mmap, os, socket, sys, time
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
s.sendall(json.dumps({"v": 1, "op": "attach", "job": json.load(open(sys.argv[2]))}).encode() + b"\n")
msg, fds, _, _ = socket.recv_fds(s, 65536, 1)
fd = fds[0]
mm = mmap.mmap(fd, os.fstat(fd).st_size)
while int.from_bytes(mm[64:72], "little") == 0: time.sleep(0.01)
print("holding", flush=True)
time.sleep(600)
"""
    p = subprocess.Popen([sys.executable, "-c", code, d.sock, str(spec)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "holding"
    st = json.loads(d.ctl("status", "--json").stdout)
    assert len(st["jobs"]) == 1 and st["jobs"][0]["peer"]["pid"] == p.pid
    wait_until(lambda: ring_fds(d.proc.pid)[1] == 1, what="the ring mapping")
    p.send_signal(signal.SIGKILL)
    p.wait()
    wait_until(lambda: json.loads(d.ctl("status", "--json").stdout)["jobs"] == [], what="the job to go")
    wait_until(lambda: ring_fds(d.proc.pid) == (0, 0), what="the ring to be unmapped and closed")
    assert "detached" in d.log_text()
    assert d.proc.poll() is None


def run_consumer(bins, sock, spec_path, n, env=None, **kw):
    e = dict(os.environ, **SAN_ENV)
    e.update(env or {})
    return subprocess.Popen([consumer_tool(bins), "--socket", sock, "--job", str(spec_path), "--batches", str(n),
                             *sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in kw.items()), [])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)


def batches_of(lines):
    """(step, checksum, n_real, n_docs, epoch) per batch line; the job id is left out."""
    out = []
    for line in lines:
        f = line.split()
        if f and f[0] == "batch":
            out.append((int(f[1]), f[2], f[4], f[5], f[6]))
    return out


@pytest.fixture
def big_dataset(tmp_path):
    data = tmp_path / "big"
    data.mkdir()
    lines = [chat_line(f"Question number {i}: what is {i} times {i % 7}?", f"The answer is {i * (i % 7)}.")
             for i in range(400)]
    write_shard(data / "train-000.jsonl.zst", lines[:200])
    write_shard(data / "train-001.jsonl", lines[200:])
    return data


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_loaderd_restart_trainer_continues_exactly(loaderd, big_dataset, model_path, tmp_path, bins, how):
    cfg = base_config(big_dataset, model_path, ring_slots=4)
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"name": "resume", "shards": [str(big_dataset / "train-*")], "format": "chat",
                                "tokenizer": model_path, "seq_len": 64, "micro_batch_size": 2, "seed": 11}))
    N, K = 40, 12
    d = loaderd(cfg)
    p = run_consumer(bins, d.sock, spec, N)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    want = batches_of(out.splitlines())
    assert [b[0] for b in want] == list(range(N))
    assert "reconnects 0" in out
    d.stop()

    # the same job again; loaderd dies after the trainer has taken batch K
    d2 = loaderd(cfg)
    p = run_consumer(bins, d2.sock, spec, N, env={"LOADERD_RECONNECT_S": "60"}, hold_ms=20)
    lines = []
    while True:
        line = p.stdout.readline()
        assert line, "consumer ended early: " + p.stderr.read()
        lines.append(line)
        if line.startswith("batch %d " % K):
            break
    if how == signal.SIGKILL:
        d2.proc.kill()
        d2.proc.wait()
    else:
        assert d2.stop(signal.SIGTERM) == 0
    time.sleep(0.5)  # the trainer drains what is left in its ring, then retries
    d3 = loaderd(cfg)
    rest, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    lines += rest.splitlines()
    got = batches_of(lines)
    assert got == want, "batches after the restart differ from the uninterrupted run"
    assert any(l.strip() == "reconnects 1" for l in lines), lines[-3:]
    assert "re-attached" in err
    # the new loaderd served the tail as a resumed job
    assert "attached" in d3.log_text()


def test_reconnect_gives_up_after_deadline(loaderd, big_dataset, model_path, tmp_path, bins):
    cfg = base_config(big_dataset, model_path, ring_slots=2)
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"name": "gone", "shards": [str(big_dataset / "train-*")], "format": "chat",
                                "tokenizer": model_path, "seq_len": 64, "micro_batch_size": 2}))
    d = loaderd(cfg)
    p = run_consumer(bins, d.sock, spec, 1000, env={"LOADERD_RECONNECT_S": "1.5"}, hold_ms=5)
    assert p.stdout.readline().startswith("attached")
    assert p.stdout.readline().startswith("batch 0 ")
    d.proc.kill()
    d.proc.wait()
    t0 = time.time()
    out, err = p.communicate(timeout=60)
    assert p.returncode == 1, err
    assert "did not come back within 2 s" in err or "did not come back within 1 s" in err, err
    assert time.time() - t0 < 20
    # LOADERD_RECONNECT_S=0: no reconnect at all
    d2 = loaderd(cfg)
    p = run_consumer(bins, d2.sock, spec, 1000, env={"LOADERD_RECONNECT_S": "0"}, hold_ms=5)
    assert p.stdout.readline().startswith("attached")
    d2.proc.kill()
    d2.proc.wait()
    out, err = p.communicate(timeout=60)
    assert p.returncode == 1 and "reconnecting disabled" in err, err
