"""loaderd as a process: READY over NOTIFY_SOCKET, attach from a Python consumer that maps the
memfd ring (layouts per proto/ring.h and proto/batch.h, see proto/PROTOCOL.md), batch checks,
loaderctl status/metrics/watch, data_roots enforcement, hostile clients, drain, SIGHUP, SIGTERM."""
import ctypes
import json
import mmap
import os
import signal
import socket
import stat
import struct
import subprocess
import time

import pytest

from conftest import chat_line, read_line, write_shard

RING_MAGIC = 0x3130474E49525442
BATCH_MAGIC = 0x41425442
RING_HDR = 4096
BATCH_HDR = 320
IGNORE = -100
F_END = 1

_libc = ctypes.CDLL(None, use_errno=True)
SYS_futex, FUTEX_WAKE = 202, 1  # x86-64


def r64(n):
    return (n + 63) & ~63


def fnv1a64(data, h=0xCBF29CE484222325):
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


class Ring:
    """Minimal consumer of a loaderd ring (proto/ring.h): read head, read slot, bump tail."""

    def __init__(self, fd):
        size = os.fstat(fd).st_size
        self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        (self.magic, self.version, self.n_slots, self.slot_bytes, self.B, self.T,
         self.total) = struct.unpack_from("<QIIQIIQ", self.mm, 0)
        assert self.magic == RING_MAGIC and self.version == 1
        assert self.total == size == RING_HDR + self.n_slots * self.slot_bytes
        self.head = ctypes.c_uint64.from_buffer(self.mm, 64)
        self.tail = ctypes.c_uint64.from_buffer(self.mm, 128)
        self.tail_seq = ctypes.c_uint32.from_buffer(self.mm, 136)
        self.producer_waiting = ctypes.c_uint32.from_buffer(self.mm, 140)
        self.producer_closed = ctypes.c_uint32.from_buffer(self.mm, 192)
        self.consumer_closed = ctypes.c_uint32.from_buffer(self.mm, 196)

    def next(self, timeout=30.0):
        """Bytes of the next slot, or None when the producer closed an empty ring."""
        end = time.time() + timeout
        while True:
            t = self.tail.value
            if self.head.value != t:
                off = RING_HDR + (t % self.n_slots) * self.slot_bytes
                return bytes(self.mm[off:off + self.slot_bytes])
            if self.producer_closed.value and self.head.value == t:
                return None
            assert time.time() < end, "no batch within %.0fs" % timeout
            time.sleep(0.002)

    def release(self):
        self.tail.value = self.tail.value + 1
        self.tail_seq.value = self.tail_seq.value + 1
        if self.producer_waiting.value:
            _libc.syscall(SYS_futex, ctypes.c_void_p(ctypes.addressof(self.tail_seq)), FUTEX_WAKE, 0x7FFFFFFF,
                          None, None, 0)

    def close(self):
        del self.head, self.tail, self.tail_seq, self.producer_waiting, self.producer_closed, self.consumer_closed
        self.mm.close()


def parse_batch(slot, B, T):
    (magic, version, job_id, rank, step, b, t, n_real, n_lab, n_cu, n_docs, flags, epoch,
     checksum) = struct.unpack_from("<IIIIQIIIIIIIIQ", slot, 0)
    n = B * T
    arr = r64(4 * n)
    ints = lambda off, k: list(struct.unpack_from("<%di" % k, slot, off))
    return {
        "magic": magic, "version": version, "job_id": job_id, "rank": rank, "step": step, "B": b, "T": t,
        "n_real": n_real, "n_labelled": n_lab, "n_cu": n_cu, "n_docs": n_docs, "flags": flags, "epoch": epoch,
        "checksum": checksum,
        "input_ids": ints(BATCH_HDR, n), "labels": ints(BATCH_HDR + arr, n),
        "position_ids": ints(BATCH_HDR + 2 * arr, n),
        "cu": ints(BATCH_HDR + 3 * arr, n_cu if 0 < n_cu <= n + 1 else 0),
        # layout 2: seg_pair, seg_kind after cu_seqlens (B*T + 1 int32, rounded to 64)
        "seg_pair": ints(BATCH_HDR + 3 * arr + r64(4 * (n + 1)), n_cu - 1 if 0 < n_cu <= n + 1 else 0),
        "seg_kind": ints(BATCH_HDR + 4 * arr + r64(4 * (n + 1)), n_cu - 1 if 0 < n_cu <= n + 1 else 0),
        # layout 3: seg_src, seg_line, seg_ref_ok (int32), seg_ref_logp (float64) after them
        "seg_src": ints(BATCH_HDR + 5 * arr + r64(4 * (n + 1)), n_cu - 1 if 0 < n_cu <= n + 1 else 0),
        "seg_line": ints(BATCH_HDR + 6 * arr + r64(4 * (n + 1)), n_cu - 1 if 0 < n_cu <= n + 1 else 0),
        "seg_ref_ok": ints(BATCH_HDR + 7 * arr + r64(4 * (n + 1)), n_cu - 1 if 0 < n_cu <= n + 1 else 0),
        "seg_ref_logp": list(struct.unpack_from("<%dd" % (n_cu - 1 if 0 < n_cu <= n + 1 else 0), slot,
                                                BATCH_HDR + 8 * arr + r64(4 * (n + 1)))),
        "raw_arrays": slot[BATCH_HDR:BATCH_HDR + 3 * arr], "arr": arr,
    }


def check_batch(b, B, T, job_id, step):
    """The batch contract of proto/batch.h, checked independently of the C validator."""
    n = B * T
    assert b["magic"] == BATCH_MAGIC and b["version"] == 3
    assert (b["B"], b["T"], b["job_id"], b["step"]) == (B, T, job_id, step)
    assert b["flags"] == 0
    ids, labels, pos, cu = b["input_ids"], b["labels"], b["position_ids"], b["cu"]
    # checksum: FNV-1a 64 over the three arrays (B*T int32 each), cu_seqlens[0..n_cu), then
    # seg_pair, seg_kind, seg_src, seg_line, seg_ref_ok, seg_ref_logp [0..n_cu-1)
    arr = b["arr"]
    raw = b["raw_arrays"]
    sp, sk = b["seg_pair"], b["seg_kind"]
    data = (raw[0:4 * n] + raw[arr:arr + 4 * n] + raw[2 * arr:2 * arr + 4 * n] + struct.pack("<%di" % len(cu), *cu)
            + b"".join(struct.pack("<%di" % len(b[k]), *b[k]) for k in ("seg_pair", "seg_kind", "seg_src", "seg_line",
                                                                          "seg_ref_ok"))
            + struct.pack("<%dd" % len(b["seg_ref_logp"]), *b["seg_ref_logp"]))
    assert sk == [0] * (len(cu) - 1) and sp == [-1] * (len(cu) - 1), "an SFT job's segments are all plain"
    assert b["seg_src"] == b["seg_line"] == [-1] * (len(cu) - 1) and b["seg_ref_ok"] == [0] * (len(cu) - 1)
    assert b["seg_ref_logp"] == [0.0] * (len(cu) - 1)
    assert fnv1a64(data) == b["checksum"]
    assert cu[0] == 0 and cu[-1] == n
    assert all(a < c for a, c in zip(cu, cu[1:]))
    assert all(r * T in cu for r in range(B)), "every row start is a boundary"
    for a, c in zip(cu, cu[1:]):
        assert a // T == (c - 1) // T, "segment crosses a row"
        assert pos[a:c] == list(range(c - a)), "position_ids restart at 0 per document"
        assert labels[a] == IGNORE, "first token of a document has no label"
    assert all(l == IGNORE or l == i for l, i in zip(labels, ids)), "labels are unshifted input ids or -100"
    assert sum(l != IGNORE for l in labels) == b["n_labelled"] > 0
    assert 0 < b["n_real"] <= n
    assert all(0 <= i < 49152 for i in ids)


@pytest.fixture
def dataset(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    lines = [chat_line(f"What is the colour of box {i}?", f"Box {i} is painted shade number {i * 13}.")
             for i in range(60)]
    write_shard(data / "train-000.jsonl", lines[:30] + ["not json", '{"messages": 5}'])
    write_shard(data / "train-001.jsonl", lines[30:])
    return data


def base_config(dataset, model_path, **extra):
    cfg = {"data_roots": [str(dataset)], "model_roots": [os.path.dirname(model_path)]}
    cfg.update(extra)
    return cfg


def job_spec(dataset, model_path, **extra):
    spec = {"name": "unit-job", "shards": [str(dataset / "train-*.jsonl")], "format": "chat",
            "tokenizer": model_path, "seq_len": 64, "micro_batch_size": 2, "seed": 3}
    spec.update(extra)
    return spec


def attach(d, spec, rank=0, world=1, extra=None):
    """Attach over a fresh connection (extra: more request keys, e.g. "run"); returns (socket,
    reply, Ring or None)."""
    s = d.connect()
    req = {"v": 1, "op": "attach", "job": spec, "rank": rank, "world_size": world, **(extra or {})}
    s.sendall(json.dumps(req).encode() + b"\n")
    buf, fds = b"", []
    while b"\n" not in buf:
        msg, got, _, _ = socket.recv_fds(s, 65536, 4)
        assert msg or got, "loaderd closed the connection during attach"
        buf += msg
        fds += got
    reply = json.loads(buf.split(b"\n", 1)[0])
    if not reply.get("ok"):
        assert not fds
        return s, reply, None
    assert len(fds) == 1
    return s, reply, Ring(fds[0])


def test_ready_attach_batches_status(loaderd, dataset, model_path):
    d = loaderd(base_config(dataset, model_path))
    st = os.stat(d.sock)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    s, rep, ring = attach(d, job_spec(dataset, model_path))
    assert rep["ok"] and rep["v"] == 1 and rep["B"] == 2 and rep["T"] == 64 and rep["vocab"] == 49152
    assert (ring.B, ring.T, ring.n_slots) == (2, 64, rep["slots"])
    for step in range(6):
        slot = ring.next()
        assert slot is not None
        check_batch(parse_batch(slot, 2, 64), 2, 64, rep["job_id"], step)
        ring.release()
    s.sendall(b'{"v":1,"op":"report","job_id":%d,"step":41,"loss":1.75,"tokens_per_s":321.5}\n' % rep["job_id"])
    assert json.loads(read_line(s))["ok"] is True
    assert json.loads(d.ctl("status", "--json").stdout)["jobs"][0]["trainer"]["base"] is None
    # the trainer's frozen base rides on its reports (kept until the next one that carries it)
    base = {"dtype": "gguf", "types": "Q4_K+Q6_K", "bits_per_weight": 4.75, "bytes": 3 << 20}
    s.sendall(json.dumps({"v": 1, "op": "report", "step": 41, "loss": 1.75, "base": base}).encode() + b"\n")
    assert json.loads(read_line(s))["ok"] is True
    s.sendall(b'{"v":1,"op":"report","job_id":%d,"step":41,"loss":1.75,"tokens_per_s":321.5}\n' % rep["job_id"])
    assert json.loads(read_line(s))["ok"] is True
    assert json.loads(d.ctl("status", "--json").stdout)["jobs"][0]["trainer"]["base"] == base
    assert "base: gguf Q4_K+Q6_K, 4.75 bits per weight, 3.0 MiB of linears" in d.ctl("status").stdout
    time.sleep(1.2)  # one rate tick
    out = d.ctl("status")
    assert out.returncode == 0, out.stderr
    assert "unit-job" in out.stdout and "running" in out.stdout and "1.7500" in out.stdout, out.stdout
    js = json.loads(d.ctl("status", "--json").stdout)
    job = js["jobs"][0]
    assert job["name"] == "unit-job" and job["rank"] == 0 and job["world_size"] == 1
    assert job["trainer"]["step"] == 41 and job["trainer"]["loss"] == 1.75
    assert job["bad_lines"]["json"] == 1 and job["bad_lines"]["field"] == 1
    assert 0 < job["packing_efficiency"] <= 1 and job["ring_slots"] == rep["slots"]
    assert job["docs"] > 0 and job["tokens"] > 0 and job["tokens_per_s"] > 0
    jobs = d.ctl("jobs")
    assert "unit-job" in jobs.stdout
    # detach: the job disappears, the producer is joined
    s.sendall(b'{"v":1,"op":"detach"}\n')
    assert json.loads(read_line(s))["ok"] is True
    s.close()
    ring.close()
    deadline = time.time() + 10
    while json.loads(d.ctl("status", "--json").stdout)["jobs"]:
        assert time.time() < deadline
        time.sleep(0.05)
    assert "attached" in d.log_text() and "pid=" in d.log_text()


def test_metrics_exposition(loaderd, dataset, model_path):
    d = loaderd(base_config(dataset, model_path))
    s, rep, ring = attach(d, job_spec(dataset, model_path, name='we"ird\\name'))
    ring.next()
    out = d.ctl("metrics")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    seen_type = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert kind in ("counter", "gauge")
            seen_type[name] = kind
        elif line.startswith("# HELP "):
            continue
        else:
            name = line.split("{", 1)[0].split(" ", 1)[0]
            assert name in seen_type, "sample before its # TYPE: " + line
            float(line.rsplit(" ", 1)[1])
    for m in ("loaderd_documents_total", "loaderd_tokens_total", "loaderd_bad_lines_total",
              "loaderd_packing_efficiency", "loaderd_ring_fill", "loaderd_tokens_per_second"):
        assert "# HELP " + m + " " in text and m in seen_type
    assert seen_type["loaderd_documents_total"] == "counter"
    assert 'job="we\\"ird\\\\name"' in text  # label escaping
    assert 'reason="json"} 1' in text
    js = json.loads(d.ctl("metrics", "--json").stdout)
    assert js["ok"] and js["format"].startswith("prometheus") and "# TYPE loaderd_tokens_total counter" in js["text"]
    s.close()
    ring.close()


def test_paths_outside_roots_refused(loaderd, dataset, model_path, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    write_shard(outside / "secret.jsonl", [chat_line("a", "b")])
    os.symlink(outside / "secret.jsonl", dataset / "link.jsonl")
    d = loaderd(base_config(dataset, model_path))
    cases = [
        job_spec(dataset, model_path, shards=[str(outside / "*.jsonl")]),
        job_spec(dataset, model_path, shards=[str(dataset / ".." / "outside" / "secret.jsonl")]),
        job_spec(dataset, model_path, shards=[str(dataset / "link.jsonl")]),
        job_spec(dataset, model_path, shards=[str(dataset / "*.jsonl")]),  # glob catches the link too
        job_spec(dataset, model_path, tokenizer=str(outside / "secret.jsonl")),
    ]
    for spec in cases:
        s, rep, ring = attach(d, spec)
        assert rep["ok"] is False and "no file by that name inside" in rep["error"], rep
        s.close()
    for spec, needle in [(job_spec(dataset, model_path, shards=[str(dataset / "nope-*.jsonl")]),
                          "no file by that name inside data_roots"),
                         (job_spec(dataset, model_path, shards=["relative/*.jsonl"]), "absolute"),
                         (job_spec(dataset, model_path, seq_len="64"), "seq_len"),
                         (job_spec(dataset, model_path, bogus=1), "bogus"),
                         (job_spec(dataset, model_path, micro_batch_size=4096, seq_len=4096), "exceeds")]:
        s, rep, ring = attach(d, spec)
        assert rep["ok"] is False and needle in rep["error"], rep
        s.close()
    rep = d.request({"op": "attach", "job": job_spec(dataset, model_path), "rank": 2, "world_size": 2})
    assert rep["ok"] is False and "rank" in rep["error"]
    # still serving
    s, rep, ring = attach(d, job_spec(dataset, model_path))
    assert rep["ok"] and ring.next() is not None
    s.close()
    ring.close()


def test_refusals_do_not_list_files_outside_the_roots(loaderd, dataset, model_path, tmp_path):
    """A glob (or symlink) reaching outside data_roots is refused without naming what it matched
    or where it resolves: the reply must not list directories the client may not read."""
    outside = tmp_path / "outside"
    outside.mkdir()
    write_shard(outside / "hidden-name-1234.jsonl", [chat_line("a", "b")])
    os.symlink(outside / "hidden-name-1234.jsonl", dataset / "link.jsonl")
    os.symlink(outside / "hidden-name-1234.jsonl", tmp_path / "tok-link.gguf")
    d = loaderd(base_config(dataset, model_path))
    for spec in [job_spec(dataset, model_path, shards=[str(outside / "*.jsonl")]),
                 job_spec(dataset, model_path, shards=[str(dataset / "link.jsonl")]),
                 job_spec(dataset, model_path, shards=[str(dataset / "*.jsonl")]),
                 job_spec(dataset, model_path, tokenizer=str(tmp_path / "tok-link.gguf"))]:
        s, rep, ring = attach(d, spec)
        assert rep["ok"] is False and "no file by that name inside" in rep["error"], rep
        assert "hidden-name-1234" not in rep["error"], rep
        s.close()
    assert "hidden-name-1234" in d.log_text()  # the operator still sees the details


def test_error_replies_survive_multibyte_paths_cut_by_buffers(loaderd, dataset, model_path):
    """An attach refused with a message echoing a long non-ASCII path (cut inside a multi-byte
    character by the fixed-size error buffers) still gets its error reply (json_pack refuses
    invalid UTF-8, so the reply used to be dropped and the client waited for nothing)."""
    d = loaderd(base_config(dataset, model_path))
    s = d.connect()
    s.settimeout(10)
    for pad in range(3):  # one of the three offsets cuts inside a 3-byte character
        pat = str(dataset / ("x" * pad + "\u20ac" * 400 + "*.jsonl"))
        s.sendall(json.dumps({"v": 1, "op": "attach", "job": job_spec(dataset, model_path, shards=[pat])}).encode()
                  + b"\n")
        rep = json.loads(read_line(s))
        assert rep["ok"] is False and rep["op"] == "attach" and "shard pattern" in rep["error"], (pad, rep)
    s.close()


def test_hostile_clients(loaderd, dataset, model_path):
    d = loaderd(base_config(dataset, model_path, max_clients=16, max_request_bytes=65536))
    # garbage and protocol errors get an error reply and the connection stays usable
    s = d.connect()
    for bad in [b"\x00\xff\xfe garbage\n", b"[1,2,3]\n", b'{"op":"status"}\n', b'{"v":2,"op":"status"}\n',
                b'{"v":1,"op":"nope"}\n', b'{"v":1}\n', b"[" * 5000 + b"\n", b'{"v":1,"op":"report","step":1}\n',
                b'{"v":1,"op":"detach"}\n', b'{"v":1,"op":"attach","job":{"shards":5}}\n']:
        s.sendall(bad)
        rep = json.loads(read_line(s))
        assert rep["ok"] is False and rep["v"] == 1 and rep["error"], bad
    # a report's "base" (the trainer's frozen base, shown on operators' terminals): terminal
    # escapes, overlong or mistyped fields are refused before anything else is looked at
    ok = {"dtype": "gguf", "types": "Q4_K", "bits_per_weight": 4.5, "bytes": 1}
    for bad in ({**ok, "dtype": "\u001b[2J"}, {**ok, "types": "Q" * 64}, {**ok, "types": "Q4 K"},
                {**ok, "dtype": ""}, {**ok, "bits_per_weight": 1e300}, {**ok, "bits_per_weight": "4.5"},
                {**ok, "bytes": -1}, {**ok, "bytes": 2 ** 53}, {"dtype": "gguf"}, "gguf", [ok]):
        s.sendall(json.dumps({"v": 1, "op": "report", "step": 1, "base": bad}).encode() + b"\n")
        rep = json.loads(read_line(s))
        assert rep["ok"] is False and ('"base"' in rep["error"] or '"base.dtype" holds a control' in rep["error"]), \
            (bad, rep)
    s.sendall(b'{"v":1,"op":"status"}\r\n')
    assert json.loads(read_line(s))["ok"] is True
    s.close()
    # an over-long line: error reply, then the connection is closed
    s = d.connect()
    try:
        s.sendall(b"x" * (2 << 20))
    except (BrokenPipeError, ConnectionResetError):
        pass
    rep = json.loads(read_line(s))
    assert rep["ok"] is False and "longer than" in rep["error"]
    s.close()
    # half a request, then disconnect; a client that connects and says nothing
    for _ in range(5):
        h = d.connect()
        h.sendall(b'{"v":1,"op":"att')
        h.close()
    idle = d.connect()
    # many connections: beyond max_clients the extra ones are refused with a message
    conns = [d.connect() for _ in range(30)]
    refused = 0
    for c in conns:
        c.settimeout(0.5)
        try:
            data = c.recv(4096)
            if b"too many clients" in data:
                refused += 1
        except socket.timeout:
            pass
    # (the test runs as root, an operator: 8 of its connections past max_clients are its reserve)
    assert refused >= 5, refused
    for c in conns:
        c.close()
    idle.close()
    time.sleep(0.3)
    # a half-attached trainer that vanishes right after sending attach
    h = d.connect()
    h.sendall(json.dumps({"v": 1, "op": "attach", "job": job_spec(dataset, model_path)}).encode() + b"\n")
    h.close()
    # a normal client still works end to end
    s, rep, ring = attach(d, job_spec(dataset, model_path))
    assert rep["ok"], rep
    check_batch(parse_batch(ring.next(), 2, 64), 2, 64, rep["job_id"], 0)
    s.close()
    ring.close()
    assert d.proc.poll() is None
    out = d.ctl("status", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["bad_requests_total"] >= 8


def test_hostile_ring_writes_do_not_hurt_loaderd(loaderd, dataset, model_path):
    d = loaderd(base_config(dataset, model_path))
    s, rep, ring = attach(d, job_spec(dataset, model_path, ring_slots=2))
    assert ring.n_slots == 2
    ring.next()
    ring.tail.value = 10 ** 12  # impossible tail
    ring.mm[0:64] = b"\xff" * 64  # scribble over the geometry
    deadline = time.time() + 10
    while True:
        st = json.loads(d.ctl("status", "--json").stdout)
        if st["jobs"][0]["state"] == "failed":
            break
        assert time.time() < deadline, st
        time.sleep(0.1)
    assert "impossible tail" in st["jobs"][0]["error"]
    assert d.proc.poll() is None
    s.close()
    ring.close()


def test_end_of_data_with_epochs(loaderd, dataset, model_path):
    d = loaderd(base_config(dataset, model_path))
    s, rep, ring = attach(d, job_spec(dataset, model_path, epochs=1))
    steps, end = 0, False
    while True:
        slot = ring.next()
        assert slot is not None, "producer closed without an END_OF_DATA batch"
        hdr = parse_batch(slot, 2, 64)
        ring.release()
        if hdr["flags"] & F_END:
            end = True
            break
        check_batch(hdr, 2, 64, rep["job_id"], steps)
        steps += 1
        assert steps < 1000
    assert end and steps > 0
    assert ring.next(timeout=5) is None  # closed after the end marker
    st = json.loads(d.ctl("status", "--json").stdout)
    assert st["jobs"][0]["state"] == "done"
    s.close()
    ring.close()


def test_two_ranks_split_the_data(loaderd, dataset, model_path):
    d = loaderd(base_config(dataset, model_path))
    got = []
    for rank in range(2):
        s, rep, ring = attach(d, job_spec(dataset, model_path, epochs=1), rank=rank, world=2)
        ids = []
        while True:
            slot = ring.next()
            b = parse_batch(slot, 2, 64)
            ring.release()
            if b["flags"] & F_END:
                break
            assert b["rank"] == rank
            ids.append(tuple(b["input_ids"]))
        got.append(ids)
        s.close()
        ring.close()
    assert got[0] and got[1] and set(got[0]).isdisjoint(got[1])
    st = json.loads(d.ctl("status", "--json").stdout)
    assert st["jobs"] == [] or all(j["state"] in ("done", "stopped") for j in st["jobs"])


def test_drain_then_exit(loaderd, dataset, model_path):
    d = loaderd(base_config(dataset, model_path))
    s, rep, ring = attach(d, job_spec(dataset, model_path))
    out = d.ctl("drain")
    assert out.returncode == 0 and "draining" in out.stdout
    s2, rep2, _ = attach(d, job_spec(dataset, model_path))
    assert rep2["ok"] is False and "draining" in rep2["error"]
    s2.close()
    assert json.loads(d.ctl("status", "--json").stdout)["draining"] is True
    assert d.proc.poll() is None
    s.sendall(b'{"v":1,"op":"detach"}\n')
    s.close()
    ring.close()
    assert d.proc.wait(timeout=20) == 0, d.log_text()
    assert not os.path.exists(d.sock)
    assert "STOPPING=1" in d.notify.wait_for("STOPPING=1", 5)


def test_sigterm_with_attached_trainer_exits_zero(loaderd, dataset, model_path):
    d = loaderd(base_config(dataset, model_path))
    s, rep, ring = attach(d, job_spec(dataset, model_path))
    ring.next()  # the producer is blocked on a full ring
    time.sleep(0.3)
    assert d.stop(signal.SIGTERM) == 0, d.log_text()
    assert ring.producer_closed.value == 1
    assert not os.path.exists(d.sock)
    s.close()
    ring.close()


def test_sighup_reload_and_config_errors(loaderd, dataset, model_path, tmp_path, bins):
    other = tmp_path / "other"
    other.mkdir()
    write_shard(other / "x.jsonl", [chat_line(f"q{i}", f"answer {i}") for i in range(20)])
    d = loaderd(base_config(dataset, model_path))
    spec = job_spec(dataset, model_path, shards=[str(other / "x.jsonl")])
    s, rep, _ = attach(d, spec)
    assert rep["ok"] is False
    s.close()
    cfg = json.load(open(d.cfg_path))
    cfg["data_roots"].append(str(other))
    cfg["ring_slots"] = 4
    json.dump(cfg, open(d.cfg_path, "w"))
    d.proc.send_signal(signal.SIGHUP)
    d.notify.wait_for("RELOADING=1", 10)
    deadline = time.time() + 10
    while "reloaded" not in d.log_text():
        assert time.time() < deadline, d.log_text()
        time.sleep(0.05)
    assert "data_roots" in d.log_text() and "ring_slots: 8 -> 4" in d.log_text()
    s, rep, ring = attach(d, spec)
    assert rep["ok"] and rep["slots"] == 4, rep
    s.close()
    ring.close()
    # a broken config on reload keeps the old one
    open(d.cfg_path, "w").write('{"data_roots": 5}')
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.time() + 10
    while "keeping the running configuration" not in d.log_text():
        assert time.time() < deadline, d.log_text()
        time.sleep(0.05)
    assert d.proc.poll() is None
    # start-up refuses unknown keys and wrong types, naming the key
    for bad, key in [({"data_rootz": []}, "data_rootz"), ({"ring_slots": "8"}, "ring_slots"),
                     ({"socket_mode": 660}, "socket_mode"), ({"max_clients": 0}, "max_clients")]:
        p = tmp_path / "bad.json"
        p.write_text(json.dumps(bad))
        r = subprocess.run([bins.path("loaderd"), "--config", str(p), "--check"], capture_output=True, text=True)
        assert r.returncode == 1 and key in r.stderr, r.stderr
        r = subprocess.run([bins.path("loaderd"), "--config", str(p)], capture_output=True, text=True, timeout=20)
        assert r.returncode == 1 and key in r.stderr
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"socket": "/tmp/x.sock", "socket_mode": "0600"}))
    assert subprocess.run([bins.path("loaderd"), "--config", str(good), "--check"]).returncode == 0


def test_stale_socket_and_mode(loaderd, dataset, model_path, sock_path):
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(sock_path)
    stale.close()  # leaves a socket file nobody listens on
    d = loaderd(base_config(dataset, model_path, socket_mode="0600"))
    assert stat.S_IMODE(os.stat(d.sock).st_mode) == 0o600
    assert "stale" in d.log_text()
    # a second daemon on the same socket refuses to start and leaves the first alone
    second = loaderd(base_config(dataset, model_path), wait=False)
    assert second.proc.wait(timeout=20) == 1
    assert "already listening" in second.log_text()
    assert d.ctl("status").returncode == 0


def test_loaderctl_watch_and_errors(loaderd, dataset, model_path, bins, tmp_path):
    d = loaderd(base_config(dataset, model_path))
    s, rep, ring = attach(d, job_spec(dataset, model_path))
    p = subprocess.Popen([bins.path("loaderctl"), "--socket", d.sock, "watch", "--interval", "0.2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=10)
    assert p.returncode == 0, err
    assert out.count("loaderctl watch") >= 2 and "unit-job" in out
    r = subprocess.run([bins.path("loaderctl"), "--socket", str(tmp_path / "none.sock"), "status"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "cannot connect" in r.stderr
    r = subprocess.run([bins.path("loaderctl"), "frobnicate"], capture_output=True, text=True)
    assert r.returncode == 2
    env = dict(os.environ, LOADERD_SOCKET=d.sock)
    r = subprocess.run([bins.path("loaderctl"), "jobs"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "unit-job" in r.stdout
    s.close()
    ring.close()


def test_systemd_watchdog_and_status(loaderd, dataset, model_path):
    d = loaderd(base_config(dataset, model_path), env={"WATCHDOG_USEC": "400000"})
    assert "MAINPID=%d" % d.proc.pid in d.notify.wait_for("READY=1", 10)
    d.notify.wait_for("WATCHDOG=1", 5)
    assert "job(s)" in d.notify.wait_for("STATUS=0 job(s)", 10)
