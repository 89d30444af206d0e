"""The data plane across processes (issue 14): N loaderds (N simulated nodes, each with its own
socket and configuration) and one token-cache directory shared by all of them, like a shared
filesystem between nodes. Each loaderd serves two ranks of a world of 2N; each shard must be
tokenized once in total (sum of the loaderds' token_cache.built), every rank must get exactly the
batches one loaderd without a cache gives it, a later job must tokenize nothing, and both ranks
of a node share one stream. Also: the cache keys in the configuration are checked."""
import json
import os
import struct
import time

import pytest

from conftest import chat_line, write_shard
from test_loaderd_server import attach

B, T = 2, 64


@pytest.fixture
def shards(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for k in range(4):
        lines = [chat_line(f"Question {k}-{i}: what follows {i * 7 + k}?",
                           " ".join(f"w{(i * j + k) % 97}" for j in range(3 + (i % 23))))
                 for i in range(150)]
        if k == 1:
            lines += ["{broken", ""]
        write_shard(data / f"part-{k}.jsonl{'.zst' if k % 2 else ''}", lines)
    return data


def spec(data, model_path):
    return {"name": "dp-job", "shards": [str(data / "part-*")], "format": "chat", "tokenizer": model_path,
            "seq_len": T, "micro_batch_size": B, "seed": 5, "epochs": 2, "tokenizer_threads": 2}


def consume(rings):
    """Round robin over the rings until every one delivered END; per ring the list of
    (step, arrays checksum, n_real, epoch, flags)."""
    out = [[] for _ in rings]
    done = [False] * len(rings)
    while not all(done):
        for i, r in enumerate(rings):
            if done[i]:
                continue
            slot = r.next(timeout=120)
            assert slot is not None, "ring closed before END"
            (_m, _v, _job, rank, step, _b, _t, n_real, _nl, _ncu, _nd, flags, epoch,
             checksum) = struct.unpack_from("<IIIIQIIIIIIIIQ", slot, 0)
            out[i].append((step, checksum, n_real, epoch, flags))
            r.release()
            done[i] = bool(flags & 1)
    return out


def run_job(daemons, data, model_path, world):
    """Attach ranks r to daemons[r // 2] (all before consuming), consume to END."""
    conns, rings = [], []
    for r in range(world):
        s, rep, ring = attach(daemons[r // 2], spec(data, model_path), rank=r, world=world)
        assert rep["ok"], rep
        conns.append(s)
        rings.append(ring)
    res = consume(rings)
    for s, ring in zip(conns, rings):
        s.close()
        ring.close()
    return res


def status(d):
    return json.loads(d.ctl("status", "--json").stdout)


def test_nodes_share_a_cache_and_tokenize_each_shard_once(loaderd, shards, model_path, tmp_path):
    n_nodes, world = 3, 6
    cache = tmp_path / "cache"
    base = {"data_roots": [str(shards)], "model_roots": [os.path.dirname(model_path)]}
    ref_d = loaderd(dict(base, socket=str(tmp_path / "ref.sock")))
    ref = run_job([ref_d] * world * 2, shards, model_path, world)  # one node, no cache: all ranks
    assert status(ref_d)["token_cache"] is None
    nodes = [loaderd(dict(base, socket=str(tmp_path / f"n{i}.sock"), token_cache_dir=str(cache)))
             for i in range(n_nodes)]
    got = run_job(nodes, shards, model_path, world)
    for r in range(world):
        assert got[r] == ref[r], f"rank {r}: batches differ from the single loaderd without a cache"
        assert len(got[r]) > 10 and got[r][-1][4] & 1
    sts = [status(d) for d in nodes]
    built = sum(s["token_cache"]["built"] for s in sts)
    assert built == 4, [s["token_cache"] for s in sts]  # 4 shards, once in total
    for s in sts:
        tc = s["token_cache"]
        assert tc["damaged"] == tc["stale"] == tc["bypassed"] == 0, tc
        assert tc["hits"] >= 4  # the second epoch at least comes from the cache
    for d in nodes:
        assert "sharing the job's stream" in d.log_text()  # the node's second rank joined the first's
    # a later job on any node tokenizes nothing
    again = run_job([nodes[2], nodes[0], nodes[1]], shards, model_path, world)
    assert again == ref
    assert sum(status(d)["token_cache"]["built"] for d in nodes) == 4
    human = nodes[0].ctl("status").stdout
    assert "token cache " + str(cache) in human and "shard(s) tokenized here" in human, human
    metrics = nodes[0].ctl("metrics").stdout
    assert "loaderd_token_cache_built_total" in metrics and "loaderd_streams" in metrics


def test_cache_config_errors(loaderd, bins, shards, model_path, tmp_path):
    import subprocess
    base = {"socket": str(tmp_path / "x.sock"), "data_roots": [str(shards)]}
    for bad, key in (({"token_cache_dir": "relative/dir"}, "token_cache_dir"),
                     ({"token_cache_dir": 5}, "token_cache_dir"),
                     ({"token_cache_max_bytes": 1024}, "token_cache_max_bytes"),
                     ({"token_cache_wait_s": -1}, "token_cache_wait_s")):
        p = tmp_path / "bad.json"
        p.write_text(json.dumps(dict(base, **bad)))
        out = subprocess.run([bins.path("loaderd"), "--config", str(p), "--check"], capture_output=True, text=True)
        assert out.returncode == 1 and key in out.stderr, out.stderr
    wide = tmp_path / "wide"
    wide.mkdir()
    os.chmod(wide, 0o777)
    p = tmp_path / "wide.json"
    p.write_text(json.dumps(dict(base, token_cache_dir=str(wide))))
    out = subprocess.run([bins.path("loaderd"), "--config", str(p)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "world-writable" in out.stderr, out.stderr


def test_stop_never_waits_for_a_window_nobody_will_use(loaderd, shards, model_path, tmp_path):
    """A job torn down while its window is still being built (here: every shard's token-cache
    entry locked by "another node", so the reader waits up to token_cache_wait_s) must not hold
    loaderd's stop (SIGTERM) or the job's teardown until that window exists: the window nobody
    will use is abandoned. Before the fix loaderd hung until token_cache_wait_s ran out."""
    import fcntl
    import glob
    cache = tmp_path / "cache"
    d = loaderd({"data_roots": [str(shards)], "model_roots": [os.path.dirname(model_path)],
                 "token_cache_dir": str(cache), "token_cache_wait_s": 3600})
    run_job([d], shards, model_path, 1)  # fills the cache (entries and their .lock files)
    locks = sorted(glob.glob(str(cache / "**" / "*.lock"), recursive=True))
    entries = glob.glob(str(cache / "**" / "*.btc"), recursive=True)
    assert len(locks) == 4 and len(entries) == 4, (locks, entries)
    for e in entries:
        os.unlink(e)
    held = []
    try:
        for p in locks:  # "another node" is tokenizing every shard
            fd = os.open(p, os.O_RDWR)
            fcntl.flock(fd, fcntl.LOCK_EX)
            held.append(fd)
        s, rep, ring = attach(d, spec(shards, model_path), rank=0, world=1)
        assert rep["ok"], rep
        end = time.time() + 120
        while "is being tokenized by another process or job: waiting" not in d.log_text():
            assert time.time() < end, d.log_text()
            time.sleep(0.05)
        assert ring.head.value == 0  # no batch: its window is waiting for the cache
        rc = d.stop()  # SIGTERM; raises "loaderd did not stop" after 30 s
        assert rc == 0, d.log_text()
        s.close()
        ring.close()
    finally:
        for fd in held:
            os.close(fd)
