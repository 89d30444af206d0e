"""Faults (issue 3 §8): a trainer killed mid-batch frees its job and ring; loaderd killed with
SIGKILL (or stopped) and restarted lets attached trainers (proto/client.c through the
tests/tools/ld_consume C tool) reconnect and continue with exactly the batches an uninterrupted
run would have given them."""
import json
import re
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import PauseHook, chat_line, write_shard
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


def test_oversized_document_is_skipped_not_fatal(loaderd, model_path, tmp_path):
    """Issue 22 §4: a document larger than memory allows is skipped and counted as a bad line
    ("memory", file and line), never an abort of loaderd. The plain loaderd (ASan reserves the
    address space its own way) runs with one malloc arena; once the job's reader has opened the
    shard (the pause hook) its address space is capped 40 MiB above what it holds: room for the
    6 MiB line's copies, not for its 6 Mi tokens (one per digit: 48 MiB of ids and mask). The
    documents around it are packed, the job ends, loaderd serves on."""
    import resource

    from test_loaderd_server import F_END, attach, check_batch, parse_batch

    data = tmp_path / "data"
    data.mkdir()
    digits = ("0123456789" * ((6 << 20) // 10))
    (data / "big.jsonl").write_text(json.dumps({"text": "the first small document"}) + "\n" +
                                    json.dumps({"text": digits}) + "\n" +
                                    json.dumps({"text": "the last small document"}) + "\n")
    held = {}

    def cap_memory(path):
        pid = held["pid"]
        vm_kb = int(re.search(r"VmSize:\s+(\d+) kB", open(f"/proc/{pid}/status").read()).group(1))
        held["limit"] = vm_kb * 1024 + (40 << 20)
        resource.prlimit(pid, resource.RLIMIT_AS, (held["limit"], held["limit"]))

    hook = PauseHook(tmp_path, "big.jsonl", cap_memory)
    try:
        d = loaderd({"data_roots": [str(data)], "model_roots": [os.path.dirname(model_path)]}, asan=False,
                    env={**hook.env, "MALLOC_ARENA_MAX": "1", "OPENBLAS_NUM_THREADS": "1"})
        held["pid"] = d.proc.pid
        spec = {"name": "big", "shards": [str(data / "big.jsonl")], "format": "text", "tokenizer": model_path,
                "seq_len": 64, "micro_batch_size": 1, "epochs": 1, "tokenizer_threads": 1}
        s, rep, ring = attach(d, spec)
        assert rep["ok"], rep
        steps = 0
        while True:
            slot = ring.next(timeout=120)
            assert slot is not None, "producer closed without an END_OF_DATA batch: " + d.log_text()[-2000:]
            hdr = parse_batch(slot, 1, 64)
            ring.release()
            if hdr["flags"] & F_END:
                break
            check_batch(hdr, 1, 64, rep["job_id"], steps)
            steps += 1
        assert hook.paths and not hook.errors and held.get("limit"), (hook.paths, hook.errors)
        assert d.proc.poll() is None, d.log_text()[-2000:]
        st = d.request({"op": "status"})
        job = st["jobs"][0]
        assert job["state"] == "done" and job["docs"] == 2 and job["bad_lines"]["memory"] == 1, job
        assert f"{data / 'big.jsonl'}:2: memory: out of memory" in d.log_text(), d.log_text()[-2000:]
        s.close()
        ring.close()
    finally:
        hook.stop()
