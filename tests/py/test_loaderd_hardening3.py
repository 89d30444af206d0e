"""loaderd against the third outside hardening run (issue 21), one test per class:

- the token cache reads shards through the one safe open: a shard swapped after the attach check
  for a link out of the roots is never read (not even hashed), one swapped for a FIFO blocks
  nothing (the job ends, its memory comes back, SIGTERM stops loaderd) (§3);
- the cache tree is loaderd's alone: another owner, group- or world-writable levels (sticky or
  not), a link in the tree, a parent others may rewrite are refused at start with the reason,
  and a level found so later is bypassed, saying why (§3);
- temporary files of builders that died are removed at start and counted; those of live
  builders count against token_cache_max_bytes (§4);
- no file loaderd reads blocks it: SIGHUP while the config path is a FIFO (§5);
- tokenizers count in memory_budget_bytes (once however many jobs share one), the budget is
  checked before one is loaded, vocabularies are bounded (§8);
- client strings with control characters are refused, and what reaches loaderctl status / jobs /
  metrics and the log from files is escaped (§10);
- a procfs or sysfs file in a data root is refused at attach, not read as an empty shard (§11;
  doubled log prefixes: the conftest fixture checks every loaderd's log).
Tests that need another user's files run as root (chown); they are skipped otherwise."""
import fcntl
import glob
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import time

import pytest

from conftest import BUILD, MODEL, PauseHook, chat_line, tiny_model, write_shard
from test_loaderd_server import attach, base_config, dataset, job_spec, parse_batch  # noqa: F401

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another user needs root")
NOBODY = 65534


def status(d):
    r = d.ctl("status", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def wait_log(d, needle, timeout=30):
    end = time.time() + timeout
    while needle not in d.log_text():
        assert time.time() < end, f"{needle!r} not in the log\n" + d.log_text()[-4000:]
        assert d.proc.poll() is None, d.log_text()[-4000:]
        time.sleep(0.05)


def to_end(ring, B=2, T=64, timeout=60):
    """Consume batches until END_OF_DATA; returns how many."""
    n = 0
    while True:
        slot = ring.next(timeout=timeout)
        assert slot is not None, "no batch: the job is stuck"
        b = parse_batch(slot, B, T)
        ring.release()
        n += 1
        if b["flags"] & 1:
            return n


def cache_config(data, model_path, cache, **extra):
    cfg = {"data_roots": [str(data)], "model_roots": [os.path.dirname(model_path)], "token_cache_dir": str(cache)}
    cfg.update(extra)
    return cfg


def start_fails(bins, tmp_path, cfg):
    """Run loaderd with cfg (socket under tmp_path); it must exit 1. Returns its stderr."""
    p = tmp_path / "fails.json"
    p.write_text(json.dumps(dict(cfg, socket=str(tmp_path / "fails.sock"))))
    r = subprocess.run([bins.path("loaderd"), "--config", str(p)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    return r.stderr


@pytest.fixture
def shards(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for n in ("a", "b", "c"):
        write_shard(data / f"{n}.jsonl", [chat_line(f"{n} question {i}", f"{n} answer {i}") for i in range(40)])
    return data


# ---------------------------------------------------------------- §3 the one safe open

def test_cache_never_reads_a_shard_swapped_after_the_attach(loaderd, shards, model_path, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = write_shard(outside / "secret.jsonl", [chat_line("secret " + "x" * 2000, "s") for _ in range(600)])
    swapped = {}

    def swap(path):  # the first shard opened to be tokenized: swap the two others
        if swapped:
            return
        others = sorted(str(p) for p in shards.glob("*.jsonl") if str(p) != path)
        os.unlink(others[0])
        os.symlink(secret, others[0])  # leads out of the data roots
        os.unlink(others[1])
        os.mkfifo(others[1])  # nobody will ever write it
        swapped.update(link=others[0], fifo=others[1])

    hook = PauseHook(tmp_path, "/data/", swap)
    d = loaderd(cache_config(shards, model_path, tmp_path / "cache"), env=hook.env)
    s, rep, ring = attach(d, job_spec(shards, model_path, shards=[str(shards / "*.jsonl")], epochs=1))
    assert rep["ok"], rep
    to_end(ring)  # before the fix: the reader thread blocked in open(FIFO) forever, no END
    hook.stop()
    assert swapped and not hook.errors, hook.errors
    st = status(d)
    job, tc = st["jobs"][0], st["token_cache"]
    assert job["state"] == "done" and job["docs"] == 40 and job["bad_lines"]["io"] == 2, job
    # the link's target was not even hashed (it used to be read to its end)
    assert tc["hashed_bytes"] < os.path.getsize(secret), tc
    assert tc["bypassed"] == 2 and tc["built"] == 1, tc
    log = d.log_text()
    assert "not a regular file (a FIFO)" in log and "a symbolic link on the way" in log, log[-3000:]
    s.close()
    ring.close()
    end = time.time() + 30  # the job's reservation comes back after the detach
    while status(d)["memory_used_bytes"] != 0:
        assert time.time() < end, status(d)
        time.sleep(0.05)
    assert d.stop() == 0  # SIGTERM answered at once


# ---------------------------------------------------------------- §3 the cache tree's trust

def test_cache_tree_must_be_loaderds_alone(loaderd, bins, shards, model_path, tmp_path):
    def tree(name):
        c = tmp_path / name
        (c / "v1" / "ab").mkdir(parents=True)
        for p in (c, c / "v1", c / "v1" / "ab"):
            os.chmod(p, 0o750)
        return c

    cases = []
    c = tree("group-writable")
    os.chmod(c, 0o770)
    cases.append((c, f"{c} is group-writable (mode 0770)"))
    c = tree("sticky")
    os.chmod(c, 0o1777)
    cases.append((c, f"{c} is world-writable (mode 1777, sticky bit or not)"))
    c = tree("open-subdir")
    os.chmod(c / "v1" / "ab", 0o777)
    cases.append((c, f"{c}/v1/ab is world-writable"))
    c = tree("linked-v1")
    shutil.rmtree(c / "v1")
    os.symlink(tree("elsewhere") / "v1", c / "v1")
    cases.append((c, f"{c}/v1 is a symbolic link"))
    if os.geteuid() == 0:
        c = tree("foreign")
        os.chown(c, NOBODY, NOBODY)
        cases.append((c, f"{c} is owned by uid {NOBODY}, not by loaderd's user"))
        parent = tmp_path / "foreign-parent"
        parent.mkdir()
        os.chown(parent, NOBODY, NOBODY)
        cases.append((parent / "cache", f"{parent} (a parent of the cache) is owned by uid {NOBODY}"))
    for cache, why in cases:
        err = start_fails(bins, tmp_path, cache_config(shards, model_path, cache))
        assert why in err and "token cache" in err, (why, err)
    # found later, before a use: that lookup does without the cache and says why; fixed, in use again
    cache = tmp_path / "cache"
    d = loaderd(cache_config(shards, model_path, cache))
    spec = job_spec(shards, model_path, shards=[str(shards / "*.jsonl")], epochs=1)
    for _ in range(2):
        s, rep, ring = attach(d, spec)
        assert rep["ok"], rep
        to_end(ring)
        s.close()
        ring.close()
    tc = status(d)["token_cache"]
    assert tc["built"] == 3 and tc["untrusted"] == 0, tc
    subs = sorted(glob.glob(str(cache / "v1" / "??")))
    os.chmod(subs[0], 0o777)
    s, rep, ring = attach(d, spec)
    assert rep["ok"], rep
    to_end(ring)
    s.close()
    ring.close()
    tc = status(d)["token_cache"]
    assert tc["untrusted"] >= 1 and tc["bypassed"] >= 1 and tc["built"] == 3, tc
    wait_log(d, f"token cache: not used while its directory fails the check: {subs[0]} is world-writable")
    os.chmod(subs[0], 0o750)
    s, rep, ring = attach(d, spec)
    to_end(ring)
    s.close()
    ring.close()
    wait_log(d, "passes the ownership check again")


# ---------------------------------------------------------------- §4 temporaries of killed builders

def test_stale_cache_temporaries_are_removed_and_counted(loaderd, shards, model_path, tmp_path):
    cache = tmp_path / "cache"
    cfg = cache_config(shards, model_path, cache)
    d = loaderd(cfg)
    s, rep, ring = attach(d, job_spec(shards, model_path, shards=[str(shards / "*.jsonl")], epochs=1))
    to_end(ring)
    s.close()
    ring.close()
    entries = sorted(glob.glob(str(cache / "v1" / "??" / "*.btc")))
    assert len(entries) == 3 and d.stop() == 0
    # what a builder killed mid-entry leaves (bt_atomic_open's name), and one still being written
    stale = entries[0] + ".tmp.4194301.1"
    live = entries[1] + ".tmp.4194302.1"
    for p, n in ((stale, 1 << 20), (live, 3 << 20)):
        with open(p, "wb") as f:
            f.write(b"\0" * n)
    past = time.time() - 60
    os.utime(stale, (past, past))
    os.utime(live, (past, past))
    held = os.open(live, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # a live builder (another node, say) holds its lock
    try:
        d2 = loaderd(cfg)
        tc = status(d2)["token_cache"]
        assert not os.path.exists(stale) and os.path.exists(live)
        assert tc["temps_removed"] == 1, tc
        assert tc["bytes"] == sum(os.path.getsize(e) for e in entries) + (3 << 20), tc
        log = d2.log_text()
        assert f"removed {stale} (1.0 MiB): temporary file of a writer that was killed" in log, log
        assert "1 stale temporary file(s) of killed builders removed" in log, log
        m = d2.ctl("metrics").stdout
        assert "loaderd_token_cache_temps_removed_total 1" in m, m
    finally:
        os.close(held)


def test_reference_sidecars_count_against_the_cache_bound(loaderd, shards, model_path, tmp_path):
    """The reference log-prob sidecars and part files beside the entries (loaderd/refstore.h) are
    counted in token_cache_max_bytes and evicted least recently used like entries; their writers'
    stale temporaries are removed like builders'."""
    cache = tmp_path / "cache"
    cfg = cache_config(shards, model_path, cache, token_cache_max_bytes=16 << 20)
    d = loaderd(cfg)
    s, rep, ring = attach(d, job_spec(shards, model_path, shards=[str(shards / "*.jsonl")], epochs=1))
    to_end(ring)
    s.close()
    ring.close()
    entries = sorted(glob.glob(str(cache / "v1" / "??" / "*.btc")))
    assert len(entries) == 3 and d.stop() == 0
    k = os.path.basename(entries[0])[:32]
    ref = os.path.join(os.path.dirname(entries[0]), f"{k}-{'ab' * 16}.ref")
    part = ref + ".part-0123456789abcdef"
    stale = ref + ".tmp.4194301.1"
    for p, n in ((ref, 20 << 20), (part, 1 << 20), (stale, 1 << 20)):
        with open(p, "wb") as f:
            f.truncate(n)
    past = time.time() - 3600
    for p in (ref, stale):
        os.utime(p, (past, past))
    d2 = loaderd(cfg)
    tc = status(d2)["token_cache"]
    assert not os.path.exists(stale) and tc["temps_removed"] == 1, tc
    assert tc["bytes"] == sum(os.path.getsize(e) for e in entries) + (21 << 20), tc
    # a new entry takes the cache over its bound: the least recently used file, the sidecar, goes
    write_shard(shards / "d.jsonl", [chat_line(f"d question {i}", f"d answer {i}") for i in range(40)])
    s, rep, ring = attach(d2, job_spec(shards, model_path, shards=[str(shards / "d.jsonl")], epochs=1))
    to_end(ring)
    s.close()
    ring.close()
    wait_log(d2, f"token cache: evicted {ref} (20.0 MiB, least recently used)")
    tc = status(d2)["token_cache"]
    assert not os.path.exists(ref) and os.path.exists(part) and all(os.path.exists(e) for e in entries)
    assert tc["evicted"] == 1 and tc["bytes"] < (16 << 20), tc


# ---------------------------------------------------------------- §5 nothing blocks the event loop

def test_sighup_with_a_fifo_config_blocks_nothing(loaderd, bins, dataset, model_path, tmp_path):
    d = loaderd(base_config(dataset, model_path))
    os.unlink(d.cfg_path)
    os.mkfifo(d.cfg_path)  # nobody will write it
    d.proc.send_signal(signal.SIGHUP)
    wait_log(d, "keeping the running configuration", timeout=10)
    assert "not a regular file (a FIFO)" in d.log_text()
    t0 = time.time()
    r = d.ctl("status", "--json", timeout=10)
    assert r.returncode == 0 and time.time() - t0 < 5, r.stderr
    s, rep, ring = attach(d, job_spec(dataset, model_path))
    assert rep["ok"], rep
    s.close()
    ring.close()
    assert d.stop(timeout=15) == 0
    # at start too: refused at once with the reason
    r = subprocess.run([bins.path("loaderd"), "--config", d.cfg_path, "--check"], capture_output=True, text=True,
                       timeout=10)
    assert r.returncode == 1 and "not a regular file (a FIFO)" in r.stderr, r.stderr


# ---------------------------------------------------------------- §11 one part, named once

def test_cache_write_errors_name_their_part_once(loaderd, model_path, tmp_path):
    """An entry that cannot be written (here: RLIMIT_FSIZE, EFBIG, as ENOSPC would) is read raw
    and logged once per shard, naming "token cache" once: it used to log "token cache: token
    cache: ..." (the conftest fixture fails any loaderd log that names a part twice)."""
    import resource
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "big.jsonl", [chat_line(f"q{i}", " ".join(f"w{(i * j) % 9973}" for j in range(60)))
                                     for i in range(3000)])

    def limit():  # files this process writes stop at 128 KiB; the write fails instead of killing it
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (128 << 10, 128 << 10))

    d = loaderd(cache_config(data, model_path, tmp_path / "cache"), preexec=limit)
    s, rep, ring = attach(d, job_spec(data, model_path, shards=[str(data / "*.jsonl")], epochs=1))
    assert rep["ok"], rep
    to_end(ring)
    st = status(d)
    s.close()
    ring.close()
    assert st["jobs"][0]["docs"] == 3000 and st["token_cache"]["bypassed"] == 1, st
    log = d.log_text()
    assert "token cache: token cache" not in log
    assert re.search(r"warn loaderd: token cache: \S+\.btc\.tmp\.\d+\.\d+: write: File too large: \S+/big\.jsonl not "
                     r"cached, read raw", log), log[-3000:]


# ---------------------------------------------------------------- §8 tokenizers in the budget

def write_vocab_gguf(path, n):
    """A GGUF with only a byte-level BPE tokenizer of n tokens (gguf.md v3: header, KVs)."""
    def s(b):
        return struct.pack("<Q", len(b)) + b
    kv = [s(b"tokenizer.ggml.model") + struct.pack("<I", 8) + s(b"gpt2"),
          s(b"tokenizer.ggml.pre") + struct.pack("<I", 8) + s(b"gpt2"),
          s(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, n) + b"".join(s(b"t%07x" % i) for i in range(n)),
          s(b"tokenizer.ggml.merges") + struct.pack("<IIQ", 9, 8, 1) + s(b"t t")]
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv)) + b"".join(kv)
    with open(path, "wb") as f:
        f.write(data + b"\0" * (-len(data) % 32))  # the (empty) data section starts aligned


def test_tokenizers_count_in_the_memory_budget(loaderd, bins, dataset, model_path, tmp_path):
    if not bins.have("tools/mk_tiny_gguf"):
        pytest.skip("tools/mk_tiny_gguf not built")
    models = tmp_path / "models"
    models.mkdir()
    t1, t2 = tiny_model(models / "t1.gguf"), tiny_model(models / "t2.gguf")
    roots = dict(model_roots=[str(models)], tokenizer_threads=1)
    d = loaderd(base_config(dataset, model_path, **roots))
    conns = []
    s, rep, ring = attach(d, job_spec(dataset, model_path, tokenizer=str(t1)))
    assert rep["ok"], rep
    conns.append((s, ring))
    st = status(d)
    job_mem, tok = st["jobs"][0]["memory_bytes"], st["tokenizer_memory_bytes"]
    assert 2 << 20 < tok < 32 << 20, st  # the SmolLM2 vocabulary's tables: a few MiB
    assert st["memory_used_bytes"] == job_mem + tok, st  # used to be job_mem alone
    s, rep, ring = attach(d, job_spec(dataset, model_path, tokenizer=str(t1)))  # shared: counted once
    conns.append((s, ring))
    st = status(d)
    assert st["tokenizers_cached"] == 1 and st["memory_used_bytes"] == 2 * job_mem + tok, st
    s, rep, ring = attach(d, job_spec(dataset, model_path, tokenizer=str(t2)))  # another file: counted again
    conns.append((s, ring))
    st = status(d)
    assert st["tokenizers_cached"] == 2 and st["memory_used_bytes"] == 3 * job_mem + 2 * tok, st
    assert f"loaderd_tokenizer_memory_bytes {2 * tok}" in d.ctl("metrics").stdout
    assert "MiB of tokenizers" in d.ctl("status").stdout
    for s, ring in conns:
        s.close()
        ring.close()
    end = time.time() + 30
    while status(d)["memory_used_bytes"] != 0:  # tokenizers leave with their last job
        assert time.time() < end, status(d)
        time.sleep(0.05)
    assert status(d)["tokenizers_cached"] == 0
    # checked before loading: a job that fits, with a tokenizer that would not
    d2 = loaderd(base_config(dataset, model_path, memory_budget_bytes=job_mem + (1 << 20), socket=str(tmp_path / "b.sock"),
                             **roots))
    s, rep, _ = attach(d2, job_spec(dataset, model_path, tokenizer=str(t1)))
    s.close()
    assert rep["ok"] is False and "memory budget to load tokenizer" in rep["error"] and "needs up to" in rep["error"], rep
    assert "loaded tokenizer" not in d2.log_text()
    # a vocabulary past the bound: refused from the file's counts, nothing loaded
    big = models / "big-vocab.gguf"
    write_vocab_gguf(big, (1 << 20) + 1)
    s, rep, _ = attach(d, job_spec(dataset, model_path, tokenizer=str(big)))
    s.close()
    assert rep["ok"] is False and "1048577 tokens, more than the 1048576 accepted" in rep["error"], rep
    assert status(d)["memory_used_bytes"] == 0


# ---------------------------------------------------------------- §10 names that forge output

FORGED = "2099-01-01T00:00:00.000Z info loaderd: job 9 attached"
NASTY = ["evil\x1b]0;owned\x07\x1b[2J\n" + FORGED, "rtl\u202egpj.exe", "c1\u009b31m", "bell\x07", "tab\tname"]
RAW = ("\x1b", "\x07", "\u009b", "\u202e")


def log_lines_are_events(text):
    """Every line of a loaderd log is one event: it starts with a timestamp and a level."""
    for line in text.splitlines():
        assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (debug|info|warn|error) \w+: ", line), line
        assert not any(c in line for c in RAW), repr(line)


def test_control_characters_never_reach_operators(loaderd, dataset, model_path, tmp_path):
    if not os.access(os.path.join(BUILD, "tools", "mk_tiny_gguf"), os.X_OK):
        pytest.skip("tools/mk_tiny_gguf not built")
    models = tmp_path / "models"
    models.mkdir()
    weird = tiny_model(models / "\x1b[31mred\n2099-01-01T00:00:00.000Z warn loaderd: forged.gguf")
    os.symlink(weird, models / "plain.gguf")  # a clean name leading to the hostile one
    d = loaderd(base_config(dataset, model_path, model_roots=[str(models), os.path.dirname(model_path)]))
    for bad in NASTY:
        for key, spec in (("job.name", job_spec(dataset, model_path, name=bad)),
                          ("job.shards[0]", job_spec(dataset, model_path, shards=[str(dataset / bad)])),
                          ("job.tokenizer", job_spec(dataset, model_path, tokenizer="/m/" + bad))):
            s, rep, _ = attach(d, spec)
            s.close()
            assert rep["ok"] is False and f'"{key}" holds a control character' in rep["error"], (bad, rep)
            assert not any(c in rep["error"] for c in RAW + ("\n",)), rep
    # in a key, in the op itself: refused, and the op is not echoed back
    rep = d.request({"op": "attach", "job": {"na\x1bme": "x"}})
    assert rep["ok"] is False and 'a key inside "job" holds a control character (U+001B' in rep["error"], rep
    rep = d.request({"op": "status\x1b[2J"})
    assert rep["ok"] is False and "op" not in rep and "control character" in rep["error"], rep
    # a clean name leading to a file whose name holds them: refused saying so, the log escapes it
    s, rep, _ = attach(d, job_spec(dataset, model_path, tokenizer=str(models / "plain.gguf"), name="fine"))
    s.close()
    assert rep["ok"] is False and "resolves to a file whose name holds a control character" in rep["error"], rep
    (dataset / "sub").mkdir()
    (dataset / "wsub").mkdir()
    hostile = write_shard(dataset / "wsub" / ("\x1b[31mred\n" + FORGED + ".jsonl"), [chat_line("q", "a")])
    os.symlink(hostile, dataset / "sub" / "clean.jsonl")
    for pat in (str(dataset / "sub" / "*.jsonl"), str(dataset / "wsub" / "*")):
        s, rep, _ = attach(d, job_spec(dataset, model_path, shards=[pat]))
        s.close()
        assert rep["ok"] is False and "a file whose name holds a control character" in rep["error"], rep
        assert not any(c in rep["error"] for c in RAW + ("\n",)), rep
    for out in (d.ctl("status"), d.ctl("jobs"), d.ctl("metrics"), d.ctl("status", "--json")):
        assert out.returncode == 0 and not any(c in out.stdout for c in RAW), out.stdout
    log_lines_are_events(d.log_text())
    assert "\\x1b[31mred\\n2099-01-01T00:00:00.000Z warn loaderd: forged.gguf" in d.log_text()


HOSTILE_JOB = {"job_id": 1, "name": NASTY[0], "rank": 0, "world_size": 1, "state": "failed\x1b[2J", "peer_pid": 1,
               "batches": 0, "consumed": 0, "error": "boom\n" + FORGED + "\x07", "run": "r\u202e",
               "bad_lines": {"io\x1b": 1}, "trainer": None}


def fake_loaderd(path, replies):
    """A server answering each request with replies[op] (one connection after another)."""
    import threading
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(8)

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            buf = b""
            while b"\n" not in buf:
                chunk = c.recv(4096)
                if not chunk:
                    break
                buf += chunk
            op = json.loads(buf.split(b"\n")[0])["op"]
            c.sendall(json.dumps(dict(replies[op], v=1, op=op)).encode() + b"\n")
            c.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv


def test_loaderctl_escapes_what_it_prints(bins, sock_path):
    """loaderctl shows whatever a reply holds (file names, a library's error) as visible text:
    status, jobs, metrics and --json, whoever answered."""
    replies = {
        "status": {"ok": True, "jobs": [HOSTILE_JOB], "socket": "/s\x1b]0;t\x07", "uptime_s": 1, "pid": 1,
                   "clients": 1, "token_cache": {"dir": "/c\n" + FORGED}, "memory_budget_bytes": 1,
                   "memory_used_bytes": 0},
        "jobs": {"ok": True, "jobs": [HOSTILE_JOB]},
        "metrics": {"ok": True, "text": 'loaderd_jobs{job="' + NASTY[0].replace("\n", "\\n") + '"} 1\n'},
    }
    srv = fake_loaderd(sock_path, replies)
    try:
        for args, lines in ((("status",), None), (("jobs",), 2), (("metrics",), 1), (("status", "--json"), 1)):
            r = subprocess.run([bins.path("loaderctl"), "--socket", sock_path, *args], capture_output=True,
                               text=True, timeout=30)
            assert r.returncode == 0, r.stderr
            assert not any(c in r.stdout for c in RAW), (args, r.stdout)
            assert FORGED not in r.stdout.splitlines(), r.stdout  # never a line of its own
            if lines:
                assert len(r.stdout.splitlines()) == lines, (args, r.stdout)
        replies["status"] = {"ok": False, "error": "no\x1b[2J\n" + FORGED}
        r = subprocess.run([bins.path("loaderctl"), "--socket", sock_path, "status"], capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 1 and len(r.stderr.splitlines()) == 1 and "\x1b" not in r.stderr, r.stderr
    finally:
        srv.close()


# ---------------------------------------------------------------- §11 pseudo files

def test_pseudo_files_are_not_shards(loaderd, dataset, model_path):
    roots = [str(dataset), "/proc/sys/kernel"]
    pseudo = [("/proc/sys/kernel/hostname", "procfs")]
    if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        roots.append("/sys/kernel/mm/transparent_hugepage")
        pseudo.append(("/sys/kernel/mm/transparent_hugepage/enabled", "sysfs"))
    d = loaderd(base_config(dataset, model_path, data_roots=roots))
    for path, fs in pseudo:
        s, rep, _ = attach(d, job_spec(dataset, model_path, shards=[path]))
        s.close()
        assert rep["ok"] is False and f"not a regular file (on {fs}, a pseudo filesystem" in rep["error"], rep
        s, rep, _ = attach(d, job_spec(dataset, model_path, tokenizer=path))
        s.close()
        assert rep["ok"] is False and f"not a regular file (on {fs}" in rep["error"], rep
    assert status(d)["jobs"] == []
