"""loaderd against what an outside hostile test found (issue 10), one test per class:

- a tokenizer file truncated while an attach loads it, a shard truncated while it is read: that
  request / job fails (or counts the bad lines), loaderd and every other job go on (§1);
- 64+ clients trickling bare newlines: idle means "no complete request", slots are shared per
  uid, operators (root here) always get `status`, `metrics` and `drain` through (§2);
- every refusal for a path outside the roots reads the same whatever lies there (§3);
- refusals reach loaderctl and the client libraries (C and Python) even when their own send
  fails (§6);
- the global memory budget: an attach past it is refused with the figures; usage in status and
  metrics (§7).
Switching users needs root: those tests are skipped otherwise."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import BUILD, ROOT, PauseHook, chat_line, reachable_by_all, read_line, write_shard
from test_loaderd_server import attach, base_config, check_batch, dataset, job_spec, parse_batch  # noqa: F401

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
NOBODY, DAEMON = 65534, 1  # uids of Debian's nobody and daemon


@pytest.fixture
def open_dir(sock_path):
    """Let other users reach the socket's directory (the fixture makes it 0700)."""
    os.chmod(os.path.dirname(sock_path), 0o755)
    return sock_path


def wait_until(cond, timeout=60.0, what="condition"):
    end = time.time() + timeout
    while time.time() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached within {timeout}s")


def status(d):
    r = d.ctl("status", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# ---------------------------------------------------------------- §1 files changed under us

def test_tokenizer_truncated_while_attach_loads_it(loaderd, dataset, model_path, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    tok = models / "copy.gguf"
    shutil.copy(model_path, tok)
    hook = PauseHook(tmp_path, "/copy.gguf", lambda p: os.truncate(p, 1 << 20))
    d = loaderd(base_config(dataset, model_path, model_roots=[str(models), os.path.dirname(model_path)]),
                env=hook.env)
    s_ok, rep_ok, ring_ok = attach(d, job_spec(dataset, model_path))  # a job already running
    assert rep_ok["ok"], rep_ok
    s, rep, ring = attach(d, job_spec(dataset, model_path, tokenizer=str(tok)))
    s.close()
    hook.stop()
    assert hook.paths == [str(tok)] and not hook.errors, (hook.paths, hook.errors)
    assert rep["ok"] is False and "changed while being read" in rep["error"] and "copy.gguf" in rep["error"], rep
    assert d.proc.poll() is None
    # the other job is untouched; loaderd serves new attaches (the cut file is not cached)
    check_batch(parse_batch(ring_ok.next(), 2, 64), 2, 64, rep_ok["job_id"], 0)
    st = status(d)
    assert len(st["jobs"]) == 1 and st["tokenizers_cached"] == 1
    s2, rep2, ring2 = attach(d, job_spec(dataset, model_path))
    assert rep2["ok"], rep2
    for x in (s_ok, s2):
        x.close()
    for r in (ring_ok, ring2):
        r.close()


def test_shard_truncated_while_being_read(loaderd, model_path, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "a.jsonl", [chat_line(f"q{i}", f"a{i}") for i in range(20)])
    shrink = data / "b-shrink.jsonl"
    write_shard(shrink, [chat_line(f"question {i}", f"answer {i}") for i in range(400)])
    cut = 3 * len(chat_line("question 0", "answer 0")) + 17  # three lines and a partial one
    hook = PauseHook(tmp_path, "/b-shrink.jsonl", lambda p: os.truncate(p, cut))
    d = loaderd(base_config(data, model_path), env=hook.env)
    spec = job_spec(data, model_path, shards=[str(data / "*.jsonl")], epochs=1)
    s, rep, ring = attach(d, spec)
    assert rep["ok"], rep
    for _ in range(10000):  # the whole epoch, then END_OF_DATA (flag 1)
        b = parse_batch(ring.next(), 2, 64)
        ring.release()
        if b["flags"] & 1:
            break
    hook.stop()
    assert hook.paths == [str(shrink)] and not hook.errors, (hook.paths, hook.errors)
    st = status(d)
    job = st["jobs"][0]
    assert job["bad_lines"]["io"] == 1 and job["state"] == "done", job
    assert job["docs"] == 23, job  # 20 + the 3 whole lines before the cut
    log = d.log_text()
    assert "b-shrink.jsonl:4: io:" in log and "shrank while being read" in log, log[-3000:]
    assert d.proc.poll() is None
    s.close()
    ring.close()


AS_USER_RUN = r"""
import os, subprocess, sys
uid, groups = int(sys.argv[1]), [int(g) for g in sys.argv[2].split(",") if g]
os.setgroups(groups); os.setgid(uid); os.setuid(uid)
r = subprocess.run(sys.argv[3:], capture_output=True, text=True)
sys.stdout.write(str(r.returncode) + "\n" + r.stderr)
"""


def run_as(uid, *cmd, groups=()):
    """Run cmd as uid (primary gid = uid, supplementary `groups`); (exit code, stderr). cmd[0] is
    run from a copy that user can reach (reachable_by_all), from "/" (the clone may be out of its
    reach)."""
    exe = reachable_by_all(cmd[0])
    r = subprocess.run([sys.executable, "-c", AS_USER_RUN, str(uid), ",".join(map(str, groups)), exe, *cmd[1:]],
                       capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode == 0, r.stderr
    code, _, err = r.stdout.partition("\n")
    return int(code), err


# ---------------------------------------------------------------- §2 slots

TRICKLE = r"""
import json, os, socket, sys, time
uid, path, n, period, limit_s = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
os.setgroups([]); os.setgid(uid); os.setuid(uid)
socks, first, closed = [], {}, set()
for i in range(n):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.setblocking(False)
    socks.append(s)
bufs = [b""] * n
print(json.dumps({"connected": n}), flush=True)
end = time.time() + limit_s
while time.time() < end and len(closed) < n:
    for i, s in enumerate(socks):
        if i in closed:
            continue
        try:
            s.send(b"\n")  # a bare newline: never a complete request
        except OSError:
            pass
        try:
            while True:
                c = s.recv(4096)
                if not c:
                    closed.add(i)
                    break
                bufs[i] += c
        except BlockingIOError:
            pass
        except OSError:
            closed.add(i)
        if i not in first and b"\n" in bufs[i]:
            first[i] = json.loads(bufs[i].split(b"\n")[0])
    time.sleep(period)
print(json.dumps({"first": {str(k): v for k, v in first.items()}, "closed": sorted(closed)}), flush=True)
"""


def trickle(sock, uid, n, limit_s):
    """Start n connections of `uid` sending a bare newline every 0.2 s until loaderd closes them
    (or limit_s). Returns the Popen; its stdout says when all are connected, then the outcome."""
    p = subprocess.Popen([sys.executable, "-c", TRICKLE, str(uid), sock, str(n), "0.2", str(limit_s)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")  # out of the clone
    line = p.stdout.readline()
    assert line and json.loads(line)["connected"] == n, p.stderr.read()
    return p


def outcome(p):
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


@needs_root
def test_trickling_clients_cannot_hold_the_slots(loaderd, dataset, model_path, open_dir):
    d = loaderd(base_config(dataset, model_path, max_clients=64, max_clients_per_uid=48, client_timeout_s=2,
                            socket_mode="0666"))
    a = trickle(d.sock, NOBODY, 70, 60)   # 48 slots for this uid, 22 refused
    b = trickle(d.sock, DAEMON, 20, 60)   # 16 more fill max_clients, 4 refused
    # every slot is held now; an operator (root) still gets through, and is not counted
    wait_until(lambda: status(d)["refused"]["max_clients"] == 4, what="every slot held")
    st = status(d)
    assert st["refused"]["max_clients_per_uid"] == 22 and st["refused"]["max_clients"] == 4, st["refused"]
    r = d.ctl("metrics")
    assert r.returncode == 0 and "loaderd_clients" in r.stdout, r.stderr
    ra, rb = outcome(a), outcome(b)
    # the refused ones were told why at once; the held ones timed out although they kept
    # sending newlines (idle = no complete request), and were closed
    fa = sorted(v["error"].split(":")[0] for v in ra["first"].values())
    assert fa.count("too many connections from uid 65534") == 22 and fa.count("timed out") == 48, fa
    assert all("max_clients_per_uid 48" in v["error"] for v in ra["first"].values() if "uid" in v["error"])
    fb = [v["error"] for v in rb["first"].values()]
    assert sum("too many clients (max_clients 64)" in e for e in fb) == 4, fb
    assert sum(e.startswith("timed out: no complete request") for e in fb) == 16, fb
    assert len(ra["closed"]) == 70 and len(rb["closed"]) == 20
    st = status(d)
    assert st["refused"]["timeout"] == 64 and st["clients"] == 1, st
    # drain from an operator works while a hostile client is connected again
    c = trickle(d.sock, NOBODY, 5, 30)
    r = d.ctl("drain")
    assert r.returncode == 0 and "draining" in r.stdout, r.stderr
    assert d.proc.wait(timeout=30) == 0  # no jobs: drained, exits 0
    outcome(c)


@needs_root
def test_drain_is_for_operators(loaderd, dataset, model_path, open_dir):
    gid = 4242
    d = loaderd(base_config(dataset, model_path, operator_groups=[gid], socket_mode="0666"))
    ctl = os.path.join(BUILD, "loaderctl")
    code, err = run_as(NOBODY, ctl, "--socket", d.sock, "jobs")
    assert code == 0, err  # everyone may look
    code, err = run_as(NOBODY, ctl, "--socket", d.sock, "drain")
    assert code == 1 and "operators only" in err, err
    assert d.proc.poll() is None
    code, err = run_as(NOBODY, ctl, "--socket", d.sock, "drain", groups=[gid])  # operator_groups member
    assert code == 0, err
    assert d.proc.wait(timeout=30) == 0


# ---------------------------------------------------------------- §3 refusals outside the roots

def test_refusals_outside_the_roots_read_the_same(loaderd, dataset, model_path, tmp_path):
    os.symlink("/etc/shadow", dataset / "to-shadow.jsonl")
    os.symlink("/no-such-dir-xyz/x.jsonl", dataset / "dangling.jsonl")
    os.symlink("/dev/zero", dataset / "to-zero.jsonl")
    os.symlink("/etc", dataset / "etc")
    d = loaderd(base_config(dataset, model_path))
    toks = ["/etc/shadow", "/no/such/file.gguf", "/dev/zero", str(dataset / "to-shadow.jsonl"),
            str(dataset / "dangling.jsonl"), str(dataset / ".." / ".." / "etc" / "passwd")]
    shards = [str(dataset / "to-shadow.jsonl"), str(dataset / "dangling.jsonl"), str(dataset / "to-zero.jsonl"),
              str(dataset / "etc" / "shadow"), str(dataset / "etc" / "no-such-file"), "/etc/shadow",
              "/dev/zero", str(dataset / "nothing-*.jsonl")]
    for key, values in (("tokenizer", toks), ("shards", shards)):
        texts = set()
        for v in values:
            spec = job_spec(dataset, model_path, **{key: v if key == "tokenizer" else [v]})
            s, rep, _ = attach(d, spec)
            s.close()
            assert rep["ok"] is False, (v, rep)
            texts.add(rep["error"].replace(v, "P"))
        assert len(texts) == 1, texts
        assert "no file by that name inside" in texts.pop()
    log = d.log_text()  # the details are for the operator
    assert "leads to /etc/shadow" in log and "leads to /no-such-dir-xyz/x.jsonl" in log, log[-3000:]
    assert d.proc.poll() is None


# ---------------------------------------------------------------- §6 refusals reach the user



@needs_root
def test_refusals_reach_loaderctl_and_the_client(loaderd, dataset, model_path, open_dir):
    d = loaderd(base_config(dataset, model_path, allowed_users=["root"], socket_mode="0666"))
    for _ in range(20):  # used to print "send: Broken pipe" (20 of 20)
        code, err = run_as(NOBODY, os.path.join(BUILD, "loaderctl"), "--socket", d.sock, "status")
        assert code == 1 and "permission denied: uid 65534" in err and "Broken pipe" not in err, err
    # the client library (what the trainer uses): a request too large to be sent whole to a peer
    # that closed makes its send fail every time; the reason is read all the same
    job = os.path.join(os.path.dirname(open_dir), "job.json")  # a directory nobody can reach
    with open(job, "w") as f:
        json.dump(job_spec(dataset, model_path, name="x" * (4 << 20)), f)
    os.chmod(job, 0o644)
    for _ in range(5):
        code, err = run_as(NOBODY, os.path.join(BUILD, "tools", "ld_consume"), "--socket", d.sock, "--job",
                           str(job), "--batches", "1")
        assert code == 1 and "loaderd refused: permission denied: uid 65534" in err, err
    assert d.proc.poll() is None


def test_client_libraries_read_a_refusal_after_their_send_failed(sock_path, tmp_path):
    """A peer that writes a refusal and closes without reading, as loaderd does at accept: a
    request too large to fit the socket buffers makes the client's send fail (EPIPE) every time;
    the C library (ld_consume) and the Python one (barq_loaderd) still report loaderd's words."""
    import socket as so
    import threading
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import barq_loaderd as bl
    refusal = b'{"v":1,"ok":false,"error":"permission denied: uid 4242 (gid 4242) is not in allowed_users"}\n'
    srv = so.socket(so.AF_UNIX, so.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(8)
    stop = []

    def serve():
        while not stop:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            c.sendall(refusal)
            c.close()  # unread request bytes: the peer's send fails

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    spec = {"name": "x" * (4 << 20), "shards": ["/d/*.jsonl"], "format": "chat", "tokenizer": "/m/t.gguf",
            "seq_len": 64, "micro_batch_size": 2}
    job = tmp_path / "job.json"
    job.write_text(json.dumps(spec))
    try:
        for _ in range(3):
            with pytest.raises(bl.LoaderdRefused) as e:
                bl.LoaderdClient(spec, socket_path=sock_path)
            assert e.value.loaderd_message.startswith("permission denied: uid 4242"), e.value
            r = subprocess.run([os.path.join(BUILD, "tools", "ld_consume"), "--socket", sock_path, "--job", str(job),
                                "--batches", "1"], capture_output=True, text=True, timeout=60)
            assert r.returncode == 1 and "loaderd refused: permission denied: uid 4242" in r.stderr, r.stderr
    finally:
        stop.append(1)
        srv.close()


# ---------------------------------------------------------------- §7 memory budget

def test_memory_budget(loaderd, dataset, model_path):
    # one job of this shape needs ~97 MiB (ring + pipeline buffers at their limits, 1 thread)
    d = loaderd(base_config(dataset, model_path, memory_budget_bytes=150 << 20, tokenizer_threads=1))
    st = status(d)
    assert st["memory_budget_bytes"] == 150 << 20 and st["memory_used_bytes"] == 0
    s1, r1, ring1 = attach(d, job_spec(dataset, model_path))
    assert r1["ok"], r1
    job_mem = status(d)["jobs"][0]["memory_bytes"]
    assert 90 << 20 < job_mem < 110 << 20, job_mem
    s2, r2, _ = attach(d, job_spec(dataset, model_path))
    assert r2["ok"] is False and "memory budget" in r2["error"], r2
    e = r2["error"]
    assert "MiB of memory_budget_bytes 150.0 MiB are in use" in e and f"needs {job_mem / 1048576:.1f} MiB" in e, e
    st = status(d)
    tok = st["tokenizer_memory_bytes"]  # the job's tokenizer counts too (issue 21 §8)
    assert st["memory_used_bytes"] == job_mem + tok and tok > 0, st
    assert "memory: " in d.ctl("status").stdout
    m = d.ctl("metrics").stdout
    assert f"loaderd_memory_used_bytes {job_mem + tok}" in m and "loaderd_job_memory_bytes{" in m, m
    s1.close()
    ring1.close()
    wait_until(lambda: status(d)["memory_used_bytes"] == 0, what="memory released after detach")
    s3, r3, ring3 = attach(d, job_spec(dataset, model_path))
    assert r3["ok"], r3
    s2.close()
    s3.close()
    ring3.close()
