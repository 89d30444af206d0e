"""The Python client of loaderd (python/barq_loaderd, issue 15 point 1), NumPy side, run from the
source tree with the system python (no torch): its byte layouts equal the C headers
(build/tools/proto_layout); it reads the very batches the C client (proto/client.c through
build/tools/ld_consume) reads, with the same checksums; a resumed client yields the batches of an
uninterrupted one; loaderd's refusals arrive as exceptions carrying loaderd's message; reports
show in `loaderctl status`; hostile rings and batches are refused with the violation named;
loaderd restarts are survived like the C client does. The torch / transformers side is
tests/py/test_python_client_hf.py (.venv-torch)."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT, chat_line, write_shard
from test_loaderd_faults import batches_of, run_consumer
from test_loaderd_server import base_config, dataset, job_spec  # noqa: F401

sys.path.insert(0, os.path.join(ROOT, "python"))
import barq_loaderd as bl  # noqa: E402
from barq_loaderd import layout as L  # noqa: E402
from barq_loaderd.batch import read_batch, validate  # noqa: E402
from barq_loaderd.ring import Ring  # noqa: E402


def client(d, spec, **kw):
    kw.setdefault("verify_checksum", True)
    return bl.LoaderdClient(spec, socket_path=d.sock, **kw)


def take(c, n):
    """n batches as owned copies (so they outlive the ring slot)."""
    out = []
    for _ in range(n):
        b = c.next(timeout=60)
        assert b is not None
        out.append(b.copy())
    return out


def same(a, b):
    return (a.step == b.step and a.checksum == b.checksum and a.resume_state == b.resume_state
            and all(np.array_equal(getattr(a, k), getattr(b, k))
                    for k in ("input_ids", "labels", "position_ids", "cu_seqlens")))


def test_layout_matches_the_c_headers(bins):
    if not bins.have("tools/proto_layout"):
        pytest.skip("build/tools/proto_layout not built")
    c = json.loads(subprocess.run([bins.path("tools/proto_layout")], capture_output=True, check=True,
                                  text=True).stdout)
    assert c["ring_off"] == L.RING_OFF
    assert c["batch_off"] == L.BATCH_OFF
    assert c["batch_header_size"] == L.BATCH_HEADER_BYTES == L.BATCH_OFF["resume_state"] + L.RESUME_STATE_BYTES
    assert c["ring_header_size"] <= L.RING_HEADER_BYTES == c["RING_HEADER_BYTES"]
    for k in ("RING_MAGIC", "RING_VERSION", "BATCH_MAGIC", "BATCH_LAYOUT_VERSION", "RESUME_STATE_BYTES",
              "LABEL_IGNORE", "F_END_OF_DATA", "PROTO_VERSION", "DEFAULT_SOCKET"):
        assert c[k] == getattr(L, k), k
    # the struct formats put every field at its C offset
    assert L.BATCH_HEADER.size == L.BATCH_OFF["resume_state"]
    pos = 0
    for name, code in zip(L.BATCH_FIELDS, L.BATCH_HEADER.format.lstrip("<")):
        assert L.BATCH_OFF[name] == pos, name
        pos += 8 if code == "Q" else 4
    assert L.RING_GEOMETRY.size == L.RING_OFF["total_bytes"] + 8
    for s in c["shapes"]:
        assert L.slot_bytes(s["B"], s["T"]) == s["slot_bytes"], s
        if s["offsets"][0]:
            assert list(L.array_offsets(s["B"], s["T"])) == s["offsets"], s


def test_limits_match_the_c_header():
    """barq_loaderd/limits.py is the Python copy of proto/job_limits.h: every BT_JOB_* value equal."""
    from barq_loaderd import limits
    text = open(os.path.join(ROOT, "proto", "job_limits.h")).read()
    found = dict(re.findall(r"#define BT_(JOB_\w+)\s+\(?([0-9u <]+)\)?", text))
    assert found, text
    for name, expr in found.items():
        assert hasattr(limits, name), f"barq_loaderd.limits lacks {name}"
        assert getattr(limits, name) == eval(expr.replace("u", "")), name
    assert {k for k in vars(limits) if k.startswith("JOB_")} == set(found)


def test_same_batches_as_the_c_client(loaderd, dataset, model_path, bins, tmp_path):
    d = loaderd(base_config(dataset, model_path))
    spec = job_spec(dataset, model_path, epochs=1)
    (tmp_path / "job.json").write_text(json.dumps(spec))
    p = run_consumer(bins, d.sock, tmp_path / "job.json", 1000)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    want = batches_of(out.splitlines())
    assert len(want) > 5 and "end" in out.split()
    got = []
    with client(d, spec) as c:
        assert (c.B, c.T, c.vocab) == (2, 64, 49152)
        for b in c:
            assert not b.owned and not b.input_ids.flags.writeable and not b.input_ids.flags.owndata
            assert b.input_ids.shape == (2, 64) and b.input_ids.dtype == np.int32
            assert b.cu_seqlens[0] == 0 and b.cu_seqlens[-1] == 128
            # labels are the unshifted ids or -100 (loaderd's chat format labels the answers)
            lab = b.labels != L.LABEL_IGNORE
            assert (b.labels[lab] == b.input_ids[lab]).all() and lab.sum() == b.n_labelled_tokens > 0
            got.append((b.step, f"{b.checksum:016x}", str(b.n_real_tokens), str(b.n_docs), str(b.epoch)))
        assert c.next() is None  # stays ended
        assert c.state_dict()["next_step"] == len(want)
    assert got == want


@pytest.mark.parametrize("world", [1, 2])
def test_resumed_client_yields_the_uninterrupted_batches(loaderd, dataset, model_path, world):
    d = loaderd(base_config(dataset, model_path))
    spec = job_spec(dataset, model_path)  # endless: epochs 0
    rank = world - 1
    N, K = 9, 4
    with client(d, spec, rank=rank, world_size=world) as c:
        want = take(c, N)
        assert [b.rank for b in want] == [rank] * N
    with client(d, spec, rank=rank, world_size=world) as c:
        first = take(c, K)
        state = json.loads(json.dumps(c.state_dict()))  # JSON round trip, as a checkpoint would
    assert state["next_step"] == K and state["rank"] == rank and state["world_size"] == world
    with client(d, spec, rank=rank, world_size=world, resume=state) as c:
        rest = take(c, N - K)
    assert all(same(a, b) for a, b in zip(first + rest, want))
    assert [b.step for b in rest] == list(range(K, N))
    # the raw resume_state of the last batch works too (steps are then not checked against K)
    with client(d, spec, rank=rank, world_size=world, resume=first[-1].resume_state) as c:
        assert same(take(c, 1)[0], want[K])
    # a state of another rank / job is refused before anything is read; another world size only
    # from rank 0's state
    if world == 2:
        with pytest.raises(ValueError, match="every rank resumes from rank 0's state"):
            client(d, spec, rank=0, world_size=world + 1, resume=state)
        with pytest.raises(ValueError, match="another rank is refused"):
            client(d, spec, rank=0, world_size=world, resume=state)
    with pytest.raises(ValueError, match="another job"):
        client(d, dict(spec, seed=99), rank=rank, world_size=world, resume=state)
    other = job_spec(dataset, model_path)
    other["name"] = "renamed"  # the name does not change the batches: accepted
    with client(d, other, rank=rank, world_size=world, resume=state) as c:
        assert same(take(c, 1)[0], want[K])


def test_resume_on_another_world_size(loaderd, dataset, model_path):
    """A state of 2 ranks resumed by 1 and by 4 clients (attach "resume_world", PROTOCOL.md): rank r
    of W takes rows r, r+W, ... of each data window (B rows a batch), so after 2 ranks took K
    batches each (2KB rows), one client goes on with the uninterrupted 1-rank stream's rows 2KB,
    2KB+1, ... and rank r of 4 with rows 2KB+r, 2KB+r+4."""
    d = loaderd(base_config(dataset, model_path))
    spec = job_spec(dataset, model_path)
    K = 2

    def rows(batches):
        return [(b.input_ids[i].tobytes(), b.labels[i].tobytes()) for b in batches for i in range(b.B)]

    with client(d, spec, rank=0, world_size=1) as c:
        one = rows(take(c, 8))
        B = c.B
    n = 2 * K * B  # rows the two ranks took
    states = []
    for r in range(2):
        with client(d, spec, rank=r, world_size=2) as c:
            assert rows(take(c, K)) == one[r:n:2]
            states.append(json.loads(json.dumps(c.state_dict())))
    with client(d, spec, rank=0, world_size=1, resume=states[0]) as c:
        b = take(c, 1)
        assert rows(b) == one[n:n + B] and b[0].step == K
        assert c.state_dict()["world_size"] == 1  # the state is this world's from now on
    for r in range(4):
        with client(d, spec, rank=r, world_size=4, resume=states[0]) as c:
            assert rows(take(c, 1)) == one[n + r:n + r + 4 * B:4], r
    with pytest.raises(ValueError, match="every rank resumes from rank 0's state"):
        client(d, spec, rank=0, world_size=1, resume=states[1])
    # 3 does not divide the 2KB rows the old ranks took: loaderd refuses
    with pytest.raises(bl.LoaderdRefused):
        client(d, spec, rank=0, world_size=3, resume=states[0])


def test_loaderd_errors_are_python_exceptions(loaderd, dataset, model_path, tmp_path):
    d = loaderd(base_config(dataset, model_path))
    cases = [
        (dict(job_spec(dataset, model_path), seq_len=3), '"seq_len": 3 is out of range'),
        (dict(job_spec(dataset, model_path), colour="red"), "colour"),
        (dict(job_spec(dataset, model_path), shards=["/etc/passwd"]), "no file by that name inside data_roots"),
        (dict(job_spec(dataset, model_path), format="yaml"), "format"),
    ]
    for spec, needle in cases:
        with pytest.raises(bl.LoaderdRefused) as e:
            client(d, spec)
        assert needle in e.value.loaderd_message and needle in str(e.value), e.value
        assert e.value.op == "attach"
    with pytest.raises(bl.LoaderdConnectionError, match="is loaderd running"):
        bl.LoaderdClient(job_spec(dataset, model_path), socket_path=str(tmp_path / "none.sock"))
    with pytest.raises(ValueError, match="rank"):
        client(d, job_spec(dataset, model_path), rank=2, world_size=2)
    with pytest.raises(ValueError, match="integers"):
        client(d, job_spec(dataset, model_path), rank=0.5, world_size=2)
    with client(d, job_spec(dataset, model_path), rank=np.int64(1), world_size=np.int32(2)) as c:
        assert (c.rank, c.world_size) == (1, 2) and type(c.rank) is int
    c.close()  # twice is fine; next() after close() is an error, not a silent re-attach
    with pytest.raises(bl.LoaderdClosed, match="after close"):
        c.next(timeout=1)
    with pytest.raises(TypeError):
        client(d, "not a dict")
    # relative paths are made absolute against our cwd, as proto/client.c does
    cwd = os.getcwd()
    try:
        os.chdir(dataset)
        with client(d, dict(job_spec(dataset, model_path), shards=["./train-*.jsonl"])) as c:
            assert c.spec["shards"] == [str(dataset / "train-*.jsonl")]
            assert c.next(timeout=60) is not None
    finally:
        os.chdir(cwd)
    # requests other than attach: status works, an unknown op is refused with loaderd's words
    assert bl.request("status", socket_path=d.sock)["ok"] is True
    with pytest.raises(bl.LoaderdRefused, match="loaderd refused frobnicate"):
        bl.request("frobnicate", socket_path=d.sock)


def test_reports_show_in_loaderctl_status(loaderd, dataset, model_path):
    d = loaderd(base_config(dataset, model_path))
    with client(d, job_spec(dataset, model_path, name="py-trainer")) as c:
        c.next(timeout=60)
        c.report(7, 2.5, 1234.5)
        st = json.loads(d.ctl("status", "--json").stdout)
        (job,) = st["jobs"]
        assert job["name"] == "py-trainer" and job["peer"]["pid"] == os.getpid()
        assert job["trainer"]["step"] == 7 and job["trainer"]["loss"] == 2.5
        assert job["trainer"]["tokens_per_s"] == 1234.5
        text = d.ctl("status").stdout
        assert "py-trainer" in text and "2.5000" in text
        c.report(8, float("nan"))  # a diverged loss travels as null
        job = json.loads(d.ctl("status", "--json").stdout)["jobs"][0]
        assert job["trainer"]["step"] == 8 and job["trainer"]["loss"] is None
        with pytest.raises(ValueError):
            c.report(-1, 1.0)
    # detached on close: the job is gone
    deadline = time.time() + 30
    while json.loads(d.ctl("status", "--json").stdout)["jobs"]:
        assert time.time() < deadline, "the job outlived close()"
        time.sleep(0.05)


def test_rank_and_world_from_the_environment():
    r = bl.resolve_rank_world
    assert r({}) == (0, 1, "single")
    assert r({"RANK": "3", "WORLD_SIZE": "4"}) == (3, 4, "torchrun")
    assert r({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}) == (1, 2, "slurm")
    assert r({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"})[2] == "torchrun"
    for env, needle in [({"RANK": "1"}, "WORLD_SIZE is not"), ({"WORLD_SIZE": "2"}, "RANK is not"),
                        ({"RANK": "2", "WORLD_SIZE": "2"}, "not below"), ({"RANK": "x", "WORLD_SIZE": "2"}, "integer"),
                        ({"RANK": "0", "WORLD_SIZE": "0"}, ">= 1"), ({"RANK": "-1", "WORLD_SIZE": "2"}, "negative"),
                        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "99999999"}, "largest")]:
        with pytest.raises(ValueError, match=needle):
            r(env)


def test_trainer_job_spec_is_the_trainers(tmp_path):
    cfg = {"name": "demo", "model": "models/m.gguf", "socket": "/tmp/x.sock",
           "data": {"shards": ["data/*.jsonl"], "format": "text", "seq_len": 256, "micro_batch_size": 2},
           "eval": {"shards": ["/abs/eval.jsonl"]}}
    p = tmp_path / "job.json"
    p.write_text(json.dumps(cfg))
    spec, sock = bl.trainer_job_spec(str(p))
    cwd = os.getcwd()
    assert sock == "/tmp/x.sock"
    assert spec == {"name": "demo", "shards": [os.path.join(cwd, "data/*.jsonl")], "format": "text",
                    "text_field": "text", "tokenizer": os.path.join(cwd, "models/m.gguf"), "seq_len": 256,
                    "micro_batch_size": 2, "seed": 1234, "epochs": 0, "tokenizer_threads": 2}
    ev, _ = bl.trainer_job_spec(cfg, eval=True)
    assert ev["name"] == "demo-eval" and ev["shards"] == ["/abs/eval.jsonl"] and ev["epochs"] == 1
    with pytest.raises(ValueError, match="model"):
        bl.trainer_job_spec({"data": {"shards": ["x"]}})


# ---- hostile rings and batches (a fake producer: our own sealed memfd) ----

def fake_ring(B=2, T=16, n_slots=2, seal=True, lie=None):
    import fcntl
    sb = L.slot_bytes(B, T)
    total = L.RING_HEADER_BYTES + n_slots * sb
    fd = os.memfd_create("fake-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, total)
    hdr = dict(magic=L.RING_MAGIC, version=L.RING_VERSION, n_slots=n_slots, slot_bytes=sb, B=B, T=T, total=total)
    hdr.update(lie or {})
    os.pwrite(fd, L.RING_GEOMETRY.pack(*hdr.values()), 0)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


def test_hostile_ring_headers_are_refused():
    Ring(fake_ring()).close()
    for kw, needle in [(dict(seal=False), "sealed against shrinking"),
                       (dict(lie={"magic": 1}), "bad magic"),
                       (dict(lie={"version": 2}), "bad magic/version"),
                       (dict(lie={"n_slots": 3}), "lying header"),
                       (dict(lie={"n_slots": 0}), "geometry invalid"),
                       (dict(lie={"slot_bytes": 64}), "lying header"),
                       (dict(lie={"total": 1 << 40}), "lying header"),
                       (dict(lie={"B": 1 << 20, "T": 1 << 20}), "geometry invalid")]:
        fd = fake_ring(**kw)
        with pytest.raises(bl.LoaderdProtocolError, match=needle):
            Ring(fd)
        with pytest.raises(OSError):
            os.fstat(fd)  # the ring took the fd and closed it, on failure too
    # an impossible head (beyond tail + n_slots) is a protocol error, not a read past the ring
    r = Ring(fake_ring())
    r.buffer[64:72] = (5).to_bytes(8, "little")
    with pytest.raises(bl.LoaderdProtocolError, match="impossible head"):
        r.peek(0)
    r.buffer[64:72] = (0).to_bytes(8, "little")
    with pytest.raises(bl.LoaderdTimeout):
        r.peek(0.05)
    r.buffer[192:196] = (1).to_bytes(4, "little")  # producer closed, ring empty
    with pytest.raises(bl.LoaderdClosed):
        r.peek(1)
    r.close()


def test_hostile_batches_are_refused_naming_the_violation(loaderd, dataset, model_path):
    d = loaderd(base_config(dataset, model_path))
    with client(d, job_spec(dataset, model_path)) as c:
        good = c.next(timeout=60)
        slot = bytearray(c._ring.buffer[c._ring.slot_offset(good.step):][:c._ring.slot_bytes])
    B, T = 2, 64
    o_ids, o_lab, o_pos, o_cu, o_sp, o_sk, o_src, o_line, o_ok, o_lp = L.array_offsets(B, T)

    def put(buf, off, vals):
        buf[off:off + 4 * len(vals)] = np.asarray(vals, "<i4").tobytes()

    def check(mutate, needle, vocab=49152, checksum=False):
        s = bytearray(slot)
        mutate(s)
        with pytest.raises(bl.LoaderdProtocolError, match=needle):
            validate(read_batch(s, 0, B, T), vocab, checksum)

    validate(read_batch(slot, 0, B, T), 49152, True)
    cu = read_batch(slot, 0, B, T).cu_seqlens.tolist()
    check(lambda s: put(s, 0, [0xDEAD]), "bad magic")
    check(lambda s: put(s, 4, [1]), "layout version")
    check(lambda s: put(s, 24, [3]), "shape 3x64")
    check(lambda s: put(s, 48, [4]), "unknown flags")
    check(lambda s: put(s, 40, [1]), "n_cu 1 outside")
    check(lambda s: put(s, 40, [10 ** 6]), "outside")
    check(lambda s: put(s, o_ids + 8, [12345]), "checksum mismatch", checksum=True)
    check(lambda s: put(s, o_cu, [1]), r"cu_seqlens\[0\]=1")
    check(lambda s: put(s, o_cu + 4 * (len(cu) - 1), [127]), "want B\\*T=128")
    check(lambda s: put(s, o_cu + 4, [cu[2], cu[1]]), "not increasing")
    check(lambda s: put(s, o_ids, [60000]), r"input_ids\[0\]=60000 outside")
    check(lambda s: put(s, o_ids, [-5]), "input_ids")
    check(lambda s: put(s, o_lab, [7]), "first token of segment at 0 has a label")
    check(lambda s: put(s, o_pos + 4, [5]), r"position_ids\[1\]=5 \(want 1")
    check(lambda s: put(s, 36, [3]), "n_labelled_tokens 3 but")
    check(lambda s: put(s, 32, [10 ** 6]), "token counts")
    # layout 2's segment fields (an SFT job: every segment plain, seg_pair -1)
    assert read_batch(slot, 0, B, T).seg_kind.tolist() == [L.SEG_PLAIN] * (len(cu) - 1)
    assert read_batch(slot, 0, B, T).seg_pair.tolist() == [-1] * (len(cu) - 1)
    check(lambda s: put(s, o_sk, [9]), r"seg_kind\[0\]=9 unknown")
    check(lambda s: put(s, o_sp, [0]), "plain segment 0 has seg_pair 0")
    check(lambda s: put(s, o_sp + 4, [7]), "checksum mismatch", checksum=True)
    rec = lambda s: (put(s, o_src, [0]), put(s, o_line, [1]))  # noqa: E731 (a record's shard and line)
    check(lambda s: (put(s, o_sk, [L.SEG_REJECTED]), put(s, o_sp, [0]), rec(s)), "rejected segment 0 does not follow")
    check(lambda s: (put(s, o_sk, [L.SEG_CHOSEN]), put(s, o_sp, [0]), rec(s)), "chosen segment 0 is not followed")
    # layout 3: record identity and cached reference log-probs
    b0 = read_batch(slot, 0, B, T)
    assert b0.seg_src.tolist() == b0.seg_line.tolist() == [-1] * (len(cu) - 1)
    assert b0.seg_ref_ok.tolist() == [0] * (len(cu) - 1) and b0.seg_ref_logp.tolist() == [0.0] * (len(cu) - 1)
    check(lambda s: put(s, o_src, [2]), "plain segment 0 has seg_src 2")
    check(lambda s: put(s, o_ok, [1]), r"seg_ref_logp\[0\]=0 with seg_ref_ok 1|plain segment 0 has seg_src -1, seg_line -1, seg_ref_ok 1")
    check(lambda s: s.__setitem__(slice(o_lp, o_lp + 8), np.float64(-2.0).tobytes()), r"seg_ref_logp\[0\]=-2 with seg_ref_ok 0")
    check(lambda s: (put(s, o_sk, [L.SEG_KTO_DESIRABLE]), put(s, o_sp, [0]), put(s, o_line, [0]), put(s, o_src, [0])),
          "segment 0 has seg_src 0, seg_line 0")
    check(lambda s: s.__setitem__(slice(o_lp + 8, o_lp + 16), np.float64(-1.0).tobytes()), "checksum mismatch",
          checksum=True)
    lab = read_batch(slot, 0, B, T).labels.reshape(-1)
    t = int(np.argmax(lab != L.LABEL_IGNORE))
    check(lambda s: put(s, o_lab + 4 * t, [70000]), f"labels\\[{t}\\]=70000 outside")
    # a segment crossing the row end: drop the row-start boundary at T
    k = cu.index(T)
    merged = cu[:k] + cu[k + 1:]
    check(lambda s: (put(s, o_cu, merged), put(s, 40, [len(merged)])), "row start 64 is not a segment boundary")


def test_loaderd_restart_client_continues_exactly(loaderd, dataset, model_path):
    cfg = base_config(dataset, model_path, ring_slots=2)
    spec = job_spec(dataset, model_path)
    N, K = 14, 5
    d = loaderd(cfg)
    with client(d, spec) as c:
        want = take(c, N)
    d.stop()
    d2 = loaderd(cfg)
    with pytest.warns(RuntimeWarning, match="reconnecting"):
        with client(d2, spec, reconnect_s=60) as c:
            got = take(c, K)
            assert d2.stop(signal.SIGTERM) == 0
            d3 = loaderd(cfg)
            got += take(c, N - K)  # drains the ring, then re-attaches to the new loaderd
            assert c.reconnects == 1
            c.report(N, 1.0)
            assert json.loads(d3.ctl("status", "--json").stdout)["jobs"][0]["trainer"]["step"] == N
    assert all(same(a, b) for a, b in zip(got, want)) and len(got) == N
    # with reconnecting off, loaderd going away ends the stream with LoaderdClosed
    with client(d3, spec, reconnect_s=0) as c:
        take(c, 1)
        d3.proc.kill()
        d3.proc.wait()
        with pytest.raises(bl.LoaderdClosed, match="reconnecting disabled"):
            take(c, 100)


def test_end_of_data_and_bad_lines_counted(loaderd, tmp_path, model_path):
    data = tmp_path / "eod"
    data.mkdir()
    write_shard(data / "a.jsonl", [chat_line(f"q{i}", f"a{i}") for i in range(10)] + ["{broken"])
    d = loaderd(base_config(data, model_path))
    spec = {"name": "eod", "shards": [str(data / "a.jsonl")], "format": "chat", "tokenizer": model_path,
            "seq_len": 256, "micro_batch_size": 1, "epochs": 2}
    with client(d, spec) as c:
        steps = [b.step for b in c]
        assert steps == list(range(len(steps))) and len(steps) >= 2
        job = json.loads(d.ctl("status", "--json").stdout)["jobs"][0]
        assert job["bad_lines"]["json"] == 2 and job["state"] == "done"  # one bad line, two epochs


def test_failed_job_raises_with_loaderds_error(loaderd, tmp_path, model_path):
    data = tmp_path / "bad"
    data.mkdir()
    write_shard(data / "a.jsonl", ["not json", '{"messages": 5}'])
    d = loaderd(base_config(data, model_path))
    spec = {"name": "bad", "shards": [str(data / "a.jsonl")], "format": "chat", "tokenizer": model_path,
            "seq_len": 64, "micro_batch_size": 1}
    with client(d, spec) as c:
        with pytest.raises(bl.LoaderdClosed, match="job failed: .*no valid documents") as e:
            c.next(timeout=60)
    assert str(e.value).count("pipeline: ") == 1, str(e.value)  # the part is named once


def test_ring_without_libatomic_on_x86_64(monkeypatch):
    """Without libatomic.so.1 the ring falls back to plain aligned accesses (x86-64 only): the
    counters still move as the protocol says."""
    import platform
    from barq_loaderd import ring as R
    if platform.machine() not in ("x86_64", "amd64"):
        pytest.skip("the fallback exists on x86-64 only")
    monkeypatch.setattr(R.ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(R, "_ATOMICS", None)
    r = Ring(fake_ring(n_slots=2))
    assert not r._a.native
    r.buffer[64:72] = (2).to_bytes(8, "little")  # the producer committed two batches
    assert r.peek(0) == L.RING_HEADER_BYTES and r.fill() == 2
    r.release()
    assert r.peek(0) == L.RING_HEADER_BYTES + r.slot_bytes
    r.release()
    assert int.from_bytes(r.buffer[128:136], "little") == 2 and int.from_bytes(r.buffer[136:140], "little") == 2
    with pytest.raises(bl.LoaderdTimeout):
        r.peek(0.05)
    r.close()
    assert r.buffer is None
    monkeypatch.setattr(R, "_ATOMICS", None)  # the next ring gets the native atomics again


# ---- the client reads job files, finds the socket and names the base model as the trainer does ----

JOB_BASE = """name: yjob
model: models/m.gguf
data:
  shards: [data/a.jsonl]
"""

# (YAML text, what it tests); each is read by `trainer config --check` and by barq_loaderd; both
# must accept it with the same values, or both refuse it (at the same line when the trainer says one)
YAML_CASES = [
    (JOB_BASE, "plain"),
    ("\ufeff" + JOB_BASE, "a UTF-8 BOM"),
    ("name: yjob\nmodel: models/m.gguf\ndata:\n  shards: &sh [data/a.jsonl, \"data/b c.jsonl\"]\n"
     "eval:\n  shards: *sh\n", "an anchored list reused by an alias"),
    ("name: yjob\nmodel: models/m.gguf\n\"#k\": &k socket\n*k : /tmp/aliased.sock\n"
     "data: {shards: data/a.jsonl, seq_len: 0x100, micro_batch_size: 0o7, seed: !!float 0o11}\n",
     "an alias as a key, a single string as a list, hex / octal integers, an octal !!float"),
    ("name: yes\nmodel: models/m.gguf\ndata: {shards: [data/a.jsonl], format: text, text_field: on}\n"
     "optim: {lr: 1e-3}\n", "yes / on are strings (YAML 1.2), 1e-3 a number"),
    ("name: yjob\nmodel: models/m.gguf\ndata:\n  shards: [data/a.jsonl]\n  seq_len: 256\n  seq_len: 512\n",
     "a duplicate key"),
    ("base: &b {shards: [data/a.jsonl]}\nname: yjob\nmodel: models/m.gguf\ndata:\n  <<: *b\n", "a merge key"),
    (JOB_BASE + "---\nname: other\n", "two documents"),
    (JOB_BASE + "threads: !!python/object:os.system ls\n", "a foreign tag"),
    ("name: yjob\nmodel: models/m.gguf\ndata: {shards: [data/a.jsonl], seq_len: .inf}\n", "an infinity"),
    ("name: yjob\nmodel: models/m.gguf\ndata: {shards: [data/a.jsonl], seq_len: \"512\"}\n",
     "a quoted number is a string"),
    ("name: ~\nmodel: models/m.gguf\ndata: {shards: [data/a.jsonl]}\n", "null for a string"),
    ("name: yjob\nmodel: models/m.gguf\ndata: {shards: [data/a.jsonl], seed: 99999999999999999999}\n",
     "an integer past 64 bits"),
    ("name: yjob\nmodel: models/m.gguf\ndata: {shards: [data/a.jsonl], micro_batch_size: 4.5}\n",
     "a fraction for an integer"),
    ("\"#deep\": " + "[" * 70 + "]" * 70 + "\n" + JOB_BASE, "nesting past 64 levels"),
    ("a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
     "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
     "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n"
     + JOB_BASE, "a billion laughs"),
    ("- name: yjob\n", "a list at the top"),
    ("name: yjob\nmodel: models/m.gguf\ndata: {shards: [data/a.jsonl]\n", "a syntax error"),
]
JSON_CASES = [
    ('{"name": "j", "model": "models/m.gguf", "data": {"shards": ["data/a.jsonl"], "seq_len": 64}}', "plain"),
    ('{"name": "j", "name": "k", "model": "models/m.gguf", "data": {"shards": ["data/a.jsonl"]}}',
     "a duplicate key"),
    ('{"name": "j", "model": "models/m.gguf", "data": {"shards": ["data/a.jsonl"], "seed": NaN}}', "NaN"),
    ('{"name": "j", "model": "models/m.gguf", "data": {"shards": "data/a.jsonl", "seed": 7.0}}',
     "a single string as a list, an integral real"),
    ('{"name": "j\\u0000", "model": "models/m.gguf", "data": {"shards": ["data/a.jsonl"]}}', "a NUL"),
    ('{"name": "j", "model": "models/m.gguf", "data": {"shards": ["data/a.jsonl"], "seed": 1e400}}',
     "a real overflow"),
    ("name: j\n", "YAML in a .json file"),
]


def trainer_check(bins, path, env=None, print_key=None):
    args = [bins.path("trainer"), "config", "--check", str(path), "--format", "json"]
    if print_key:
        args[-2:] = ["--print", print_key]
    return subprocess.run(args, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("kind", ["yaml", "json"])
def test_job_files_are_read_as_the_trainer_reads_them(bins, tmp_path, kind):
    """Every case: `trainer config --check` and barq_loaderd.trainer_job_spec agree on the job spec
    (stream keys, model, socket) or both refuse the file, at the same line when the trainer names
    one. YAML's anchors, aliases (also as keys), duplicate and merge keys, tags, YAML 1.1 words,
    billion laughs; JSON's duplicates, NaN, NUL, overflow."""
    if not bins.have("trainer"):
        pytest.skip("build/trainer not built")
    env = {k: v for k, v in os.environ.items() if k != "LOADERD_SOCKET"}
    cases = YAML_CASES if kind == "yaml" else JSON_CASES
    for i, (text, what) in enumerate(cases):
        path = tmp_path / f"job{i}.{kind}"
        path.write_text(text, encoding="utf-8")
        t = trainer_check(bins, path, env)
        try:
            spec, sock = bl.trainer_job_spec(str(path))
            err = None
        except ValueError as e:
            err = str(e)
        if t.returncode != 0:
            assert t.returncode == 2, (what, t.stderr)
            assert err is not None, f"{what}: the trainer refuses it ({t.stderr.strip()}), the client read {spec}"
            if err.startswith(str(path)):  # the reader refused: at the trainer's line
                m = re.search(re.escape(str(path)) + r":(\d+):", t.stderr)
                assert m and err.startswith(f"{path}:{m.group(1)}:"), (what, t.stderr, err)
            else:  # a key's value refused: in the trainer's words
                assert err.startswith("config: ") and err[len("config: "):] in t.stderr, (what, t.stderr, err)
            continue
        assert err is None, f"{what}: the trainer reads it, the client refused: {err}"
        eff = json.loads(t.stdout)
        cwd = os.getcwd()
        want = {"name": eff["name"], "shards": [os.path.join(cwd, s) for s in eff["data"]["shards"]],
                "format": eff["data"]["format"], "tokenizer": os.path.join(cwd, eff["model"]),
                "seq_len": eff["data"]["seq_len"], "micro_batch_size": eff["data"]["micro_batch_size"],
                "seed": eff["data"]["seed"], "epochs": 0, "tokenizer_threads": eff["data"]["tokenizer_threads"]}
        if eff["data"]["format"] == "text":
            want["text_field"] = eff["data"]["text_field"]
        assert spec == want, what
        assert sock == eff["socket"], what
        job = bl.load_job(str(path))
        if "optim" in job:
            assert job["optim"]["lr"] == eff["optim"]["lr"], what  # 1e-3: a number, as for the trainer
    # the client's own reader is what refused, not a later check: the parse error names the line
    dup = (r"job5\.yaml:6:\d+: duplicate key \"data\.seq_len\" \(first at line 5\)" if kind == "yaml" else
           r"job1\.json:1:\d+: duplicate key 'name'")
    with pytest.raises(bl.JobFileError, match=dup):
        bl.load_job(str(tmp_path / ("job5.yaml" if kind == "yaml" else "job1.json")))


def test_socket_is_found_as_the_trainer_finds_it(bins, tmp_path, monkeypatch):
    """The job's socket, else $LOADERD_SOCKET (set and non-empty), else /run/loaderd/loaderd.sock:
    trainer_job_spec / trainer_socket give what `trainer config --print socket` gives, for JSON
    and YAML jobs."""
    if not bins.have("trainer"):
        pytest.skip("build/trainer not built")
    base = {"name": "j", "model": "models/m.gguf", "data": {"shards": ["data/a.jsonl"]}}
    for env_sock in (None, "", "/tmp/from-env.sock"):
        for job_sock in (None, "/tmp/from-job.sock"):
            job = dict(base, **({"socket": job_sock} if job_sock else {}))
            for kind in ("json", "yaml"):
                path = tmp_path / f"job.{kind}"
                path.write_text(json.dumps(job))  # JSON is YAML too
                env = {k: v for k, v in os.environ.items() if k != "LOADERD_SOCKET"}
                monkeypatch.delenv("LOADERD_SOCKET", raising=False)
                if env_sock is not None:
                    env["LOADERD_SOCKET"] = env_sock
                    monkeypatch.setenv("LOADERD_SOCKET", env_sock)
                t = trainer_check(bins, path, env, print_key="socket")
                assert t.returncode == 0, t.stderr
                want = t.stdout.strip().strip('"')
                assert want == (job_sock or env_sock or "/run/loaderd/loaderd.sock")
                assert bl.trainer_job_spec(str(path))[1] == want, (env_sock, job_sock, kind)
                assert bl.trainer_socket(job) == want
    with pytest.raises(ValueError, match='config: socket: expected a non-empty string, got ""'):
        bl.trainer_socket(dict(base, socket=""))


def write_gguf_meta(path, **kv):
    """A metadata-only GGUF (gguf-py's writer) with the given general.* strings."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in kv.items():
        w.add_string(k.replace("__", "."), v)
    w.add_array("tokenizer.ggml.tokens", ["a", "b"])  # arrays are skipped by the reader
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_base_model_is_the_real_one(tmp_path, model_path):
    """base_model_name_or_path: the job's key, else the GGUF's general.source.* (a Hugging Face
    URL as its repo id), else a model directory itself, else the trainer's default with a
    warning; general.base_model.* (the parent model) is not taken for this model."""
    job = {"model": model_path, "data": {"shards": ["x"]}}
    assert bl.base_model_name_or_path(dict(job, base_model_name_or_path="org/exact")) == "org/exact"
    g = tmp_path / "g"
    g.mkdir()
    cases = [({"general__source__url": "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct/tree/main"},
              "HuggingFaceTB/SmolLM2-135M-Instruct"),
             ({"general__source__repo_url": "https://huggingface.co/Qwen/Qwen2.5-0.5B"}, "Qwen/Qwen2.5-0.5B"),
             ({"general__source__huggingface__repository": "meta-llama/Llama-3.2-1B"}, "meta-llama/Llama-3.2-1B"),
             ({"general__source__url": "https://example.org/models/x"}, "https://example.org/models/x")]
    for i, (kv, want) in enumerate(cases):
        p = write_gguf_meta(g / f"m{i}.gguf", **kv)
        assert bl.base_model_name_or_path(dict(job, model=p)) == want, kv
    parent_only = write_gguf_meta(g / "parent.gguf", general__base_model__0__repo_url="https://huggingface.co/a/b")
    for m in (parent_only, model_path):  # the real SmolLM2 GGUF names no source either
        with pytest.warns(RuntimeWarning, match="set base_model_name_or_path"):
            assert bl.base_model_name_or_path(dict(job, model=m)) == bl.client.TRAINER_BASE_MODEL_DEFAULT
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    assert bl.base_model_name_or_path(dict(job, model=str(hf_dir))) == str(hf_dir)
    bad = g / "bad.gguf"
    bad.write_bytes(open(cases and g / "m0.gguf", "rb").read()[:40])
    with pytest.raises(ValueError, match="truncated GGUF header"):
        bl.base_model_name_or_path(dict(job, model=str(bad)))
    with pytest.raises(ValueError, match="base_model_name_or_path: expected a non-empty string"):
        bl.base_model_name_or_path(dict(job, base_model_name_or_path=""))


def test_learning_rate_schedule_is_the_trainers(trainer_stack, tmp_path):
    """barq_loaderd.trainer_schedule gives, step by step, the lr `trainer train` used (its
    metrics.jsonl), for warm-up + cosine and warm-up + linear with a floor: the first step's lr is
    lr / warmup_steps, not 0."""
    from conftest import tiny_model
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "train.jsonl", [chat_line(f"q{i}", f"answer number {i} " * 5) for i in range(40)])
    ld = trainer_stack(data)
    model = tiny_model(tmp_path / "tiny.gguf")
    for sched, ratio in (("cosine", 0.2), ("linear", 0.0)):
        job = {"name": f"lr-{sched}", "model": str(model), "base_dtype": "fp32", "socket": ld.sock,
               "data": {"shards": [str(data / "train.jsonl")], "seq_len": 64, "micro_batch_size": 1,
                        "tokenizer_threads": 1},
               "optim": {"lr": 3e-3, "warmup_steps": 3}, "schedule": sched, "min_lr_ratio": ratio,
               "steps": 7, "threads": 1, "out_dir": str(tmp_path / f"out-{sched}"),
               "report": {"dir": str(tmp_path / f"rep-{sched}"), "plot": False}}
        path = tmp_path / f"job-{sched}.yaml"
        path.write_text(json.dumps(job))
        p = subprocess.run([os.path.join(ROOT, os.environ.get("BT_BUILD", "build"), "trainer"), "train",
                            "--config", str(path)], capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        rows = [json.loads(line) for line in open(tmp_path / f"rep-{sched}" / "metrics.jsonl")]
        lrs = [(r["step"], r["lr"]) for r in rows if "lr" in r and "loss" in r]
        assert len(lrs) == 7, rows
        lr_of = bl.trainer_schedule(str(path))
        for step, lr in lrs:
            assert abs(lr_of(step - 1) - lr) <= 1e-9 * lr + 1e-15, (sched, step, lr, lr_of(step - 1))
        assert lrs[0][1] == pytest.approx(1e-3)  # 3e-3 / 3: the first update is not at lr 0
