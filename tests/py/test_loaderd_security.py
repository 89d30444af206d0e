"""Security (issue 3 §7): socket mode and group, SO_PEERCRED/SO_PEERGROUPS checks against
allowed_users/allowed_groups, path policy (realpath inside data_roots: symlinked files and
directories, `..`, datasets), limits (request size, JSON depth, clients, jobs, ring bytes),
sealed memfds, and hostile clients: liars, slowloris, stalled readers, clients vanishing
mid-message. None may crash loaderd or slow down anyone else."""
import fcntl
import grp
import json
import os
import pwd
import socket
import stat
import subprocess
import sys
import time

import pytest

from conftest import chat_line, read_line, write_shard
from test_loaderd_server import attach, base_config, check_batch, dataset, job_spec, parse_batch  # noqa: F401

F_GET_SEALS = 1034
F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW = 1, 2, 4

AS_USER = r"""
import json, os, socket, sys
uid, gid, groups, path = int(sys.argv[1]), int(sys.argv[2]), [int(g) for g in sys.argv[3].split(",") if g], sys.argv[4]
os.setgroups(groups); os.setgid(gid); os.setuid(uid)
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(path)
except OSError as e:
    print(json.dumps({"connect_error": e.errno})); sys.exit(0)
try:
    s.sendall(b'{"v":1,"op":"hello"}\n')
except OSError:
    pass  # a refused peer may be cut off before it finishes sending; the refusal is still there
buf = b""
while b"\n" not in buf:
    try:
        c = s.recv(4096)
    except ConnectionResetError:
        break
    if not c: break
    buf += c
print(buf.split(b"\n")[0].decode() or json.dumps({"eof": True}))
"""


def as_user(sock, uid, gid, groups=()):
    r = subprocess.run([sys.executable, "-c", AS_USER, str(uid), str(gid), ",".join(map(str, groups)), sock],
                       capture_output=True, text=True, timeout=30, cwd="/")  # the clone may be out of its reach
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture
def open_dir(sock_path):
    """Let other users reach the socket's directory (the fixture makes it 0700)."""
    os.chmod(os.path.dirname(sock_path), 0o755)
    return sock_path


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")


@needs_root
def test_socket_mode_and_group(loaderd, dataset, model_path, open_dir):
    d = loaderd(base_config(dataset, model_path, socket_group="nogroup"))
    st = os.stat(d.sock)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == grp.getgrnam("nogroup").gr_gid
    nobody = pwd.getpwnam("nobody")
    # not the owner, not in the group: the file mode keeps it out before loaderd sees anything
    assert as_user(d.sock, 1, 1)["connect_error"] in (13,)  # EACCES
    # in the group (as primary or supplementary group): allowed (no allowed_* lists)
    assert as_user(d.sock, nobody.pw_uid, nobody.pw_gid)["ok"] is True
    assert as_user(d.sock, 1, 1, [nobody.pw_gid])["ok"] is True
    # an unknown group is a start-up error naming the key
    d.stop()
    bad = loaderd(base_config(dataset, model_path, socket_group="no-such-group-xyz"), wait=False)
    assert bad.proc.wait(timeout=20) == 1 and "socket_group" in bad.log_text()


@needs_root
def test_allowed_users_and_groups(loaderd, dataset, model_path, open_dir):
    nobody = pwd.getpwnam("nobody")
    d = loaderd(base_config(dataset, model_path, socket_mode="0666", allowed_users=["daemon", 4242]))
    rep = as_user(d.sock, nobody.pw_uid, nobody.pw_gid)
    assert rep["ok"] is False and "permission denied" in rep["error"] and str(nobody.pw_uid) in rep["error"]
    assert as_user(d.sock, pwd.getpwnam("daemon").pw_uid, 1)["ok"] is True  # by name
    assert as_user(d.sock, 4242, 4242)["ok"] is True  # by id
    assert d.request({"op": "hello"})["ok"] is True  # root is always allowed
    assert "refusing client" in d.log_text() and "allowed_users" in d.log_text()
    st = json.loads(d.ctl("status", "--json").stdout)
    assert st["refused"]["permission"] == 1
    d.stop()
    # groups: primary gid or any supplementary group (SO_PEERGROUPS)
    d = loaderd(base_config(dataset, model_path, socket_mode="0666", allowed_groups=["nogroup"]))
    assert as_user(d.sock, nobody.pw_uid, nobody.pw_gid)["ok"] is True
    assert as_user(d.sock, 4242, 4242)["ok"] is False
    assert as_user(d.sock, 4242, 4242, [4243, nobody.pw_gid])["ok"] is True
    # a refused peer cannot attach either: the connection is closed after the refusal
    code = r"""
import json, os, socket, sys
os.setgroups([]); os.setgid(4242); os.setuid(4242)
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
try:
    s.sendall(json.dumps({"v": 1, "op": "attach", "job": json.loads(sys.argv[2])}).encode() + b"\n")
except OSError:
    pass
data = b""
while True:
    try:
        c = s.recv(65536)
    except ConnectionResetError:
        break
    if not c: break
    data += c
sys.stdout.write(data.decode())
"""
    r = subprocess.run([sys.executable, "-c", code, d.sock, json.dumps(job_spec(dataset, model_path))],
                       capture_output=True, text=True, timeout=30, cwd="/")
    assert "permission denied" in r.stdout and r.stdout.count("\n") == 1, r
    assert json.loads(d.ctl("status", "--json").stdout)["jobs"] == []
    d.stop()
    for bad, key in [({"allowed_users": ["no-such-user-xyz"]}, "allowed_users"),
                     ({"allowed_groups": [-1]}, "allowed_groups"), ({"allowed_users": "root"}, "allowed_users"),
                     ({"client_timeout_s": -1}, "client_timeout_s")]:
        b = loaderd(base_config(dataset, model_path, **bad), wait=False)
        assert b.proc.wait(timeout=20) == 1 and key in b.log_text(), b.log_text()


def test_path_policy_symlinks_dotdot_and_datasets(loaderd, dataset, model_path, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    write_shard(outside / "secret.jsonl", [chat_line("a", "b")])
    os.symlink(outside, dataset / "dirlink")  # a directory symlink leading out
    os.symlink("../outside/secret.jsonl", dataset / "rel.jsonl")  # a relative file symlink
    inner = dataset / "sub"
    inner.mkdir()
    os.symlink(dataset / "train-000.jsonl", inner / "ok.jsonl")  # stays inside: allowed
    d = loaderd(base_config(dataset, model_path))
    for shards in ([str(dataset / "dirlink" / "secret.jsonl")], [str(dataset / "dirlink" / "*.jsonl")],
                   [str(dataset / "rel.jsonl")], [str(dataset / "sub" / ".." / ".." / "outside" / "secret.jsonl")],
                   [str(dataset / "train-000.jsonl"), str(outside / "secret.jsonl")]):
        s, rep, _ = attach(d, job_spec(dataset, model_path, shards=shards))
        assert rep["ok"] is False and "no file by that name inside data_roots" in rep["error"], (shards, rep)
        s.close()
    # multi-dataset jobs: every dataset's shards go through the same policy
    spec = job_spec(dataset, model_path)
    del spec["shards"], spec["format"]
    spec["datasets"] = [{"shards": [str(dataset / "train-*.jsonl")], "format": "chat"},
                        {"shards": [str(dataset / "dirlink" / "*.jsonl")], "format": "chat", "weight": 1}]
    s, rep, _ = attach(d, spec)
    assert rep["ok"] is False and "no file by that name inside data_roots" in rep["error"], rep
    s.close()
    # `..` that stays inside and a symlink inside the root are fine
    s, rep, ring = attach(d, job_spec(dataset, model_path, shards=[str(inner / ".." / "sub" / "ok.jsonl")]))
    assert rep["ok"] is True and rep["shards"] == 1, rep
    ring.next()
    s.close()
    ring.close()


def test_limits_jobs_rings_depth_and_size(loaderd, dataset, model_path):
    d = loaderd(base_config(dataset, model_path, max_jobs=2, max_ring_bytes=1 << 20, max_json_depth=4,
                            max_request_bytes=4096))
    held = []
    for _ in range(2):
        s, rep, ring = attach(d, job_spec(dataset, model_path))
        assert rep["ok"], rep
        held.append((s, ring))
    s, rep, _ = attach(d, job_spec(dataset, model_path))
    assert rep["ok"] is False and "max_jobs 2" in rep["error"]
    s.close()
    held.pop()[0].close()  # one job leaves: a new attach fits again
    time.sleep(0.3)
    s, rep, ring = attach(d, job_spec(dataset, model_path))
    assert rep["ok"], rep
    held.append((s, ring))
    # ring bytes: 8 slots of 2 x 4096 tokens is about 1.3 MB > 1 MiB
    s2 = d.connect()
    s2.sendall(json.dumps({"v": 1, "op": "attach", "job": job_spec(dataset, model_path, seq_len=4096)}).encode() + b"\n")
    rep = json.loads(read_line(s2))
    # max_jobs is reached again, so take one away to see the ring limit itself
    if "max_jobs" in rep.get("error", ""):
        held.pop()[0].close()
        time.sleep(0.3)
        s2.sendall(json.dumps({"v": 1, "op": "attach", "job": job_spec(dataset, model_path, seq_len=4096)}).encode()
                   + b"\n")
        rep = json.loads(read_line(s2))
    assert rep["ok"] is False and "max_ring_bytes" in rep["error"], rep
    # depth: 4 levels of nesting allowed, 5 refused (the connection stays usable)
    s2.sendall(b'{"v":1,"op":"status","x":[[[1]]]}\n')
    assert json.loads(read_line(s2))["ok"] is True
    s2.sendall(b'{"v":1,"op":"status","x":[[[[1]]]]}\n')
    rep = json.loads(read_line(s2))
    assert rep["ok"] is False and "nested deeper than 4" in rep["error"]
    # size: 4 KiB lines; a longer one (even without a newline yet) closes the connection
    s2.sendall(b'{"v":1,"op":"status","pad":"' + b"x" * 5000)
    rep = json.loads(read_line(s2))
    assert rep["ok"] is False and "longer than 4096" in rep["error"]
    assert s2.recv(10) == b""
    s2.close()
    for s, ring in held:
        s.close()
        ring.close()
    st = json.loads(d.ctl("status", "--json").stdout)
    assert st["refused"]["too_long"] == 1


def test_ring_memfd_is_sealed(loaderd, dataset, model_path):
    d = loaderd(base_config(dataset, model_path))
    s = d.connect()
    s.sendall(json.dumps({"v": 1, "op": "attach", "job": job_spec(dataset, model_path)}).encode() + b"\n")
    msg, fds, _, _ = socket.recv_fds(s, 65536, 1)
    assert json.loads(msg.split(b"\n")[0])["ok"] and len(fds) == 1
    fd = fds[0]
    seals = fcntl.fcntl(fd, F_GET_SEALS)
    assert seals & F_SEAL_SHRINK and seals & F_SEAL_GROW and seals & F_SEAL_SEAL
    size = os.fstat(fd).st_size
    for n in (0, size // 2, size + 4096):
        with pytest.raises(PermissionError):
            os.ftruncate(fd, n)
    with pytest.raises(PermissionError):
        fcntl.fcntl(fd, 1033, 8)  # F_ADD_SEALS F_SEAL_WRITE: refused, the set is sealed
    assert os.fstat(fd).st_size == size
    os.close(fd)
    s.close()
    assert d.proc.poll() is None


def test_slowloris_and_idle_clients_time_out_without_blocking_others(loaderd, dataset, model_path):
    d = loaderd(base_config(dataset, model_path, client_timeout_s=1))
    slow = d.connect()
    slow.sendall(b'{"v":1,"op":"sta')  # half a line, then nothing
    trickle = d.connect()
    idle = d.connect()
    s, rep, ring = attach(d, job_spec(dataset, model_path))  # a trainer, quiet on the socket
    t0 = time.time()
    for _ in range(20):  # others are served at once meanwhile
        t = time.time()
        assert d.request({"op": "status"})["ok"] is True
        assert time.time() - t < 0.5
    # a client trickling one byte at a time never completes a line: still timed out (it may be
    # closed before it is done: no complete request since it connected)
    for ch in b'{"v":1,':
        try:
            trickle.sendall(bytes([ch]))
        except (BrokenPipeError, ConnectionResetError):
            break
        time.sleep(0.2)
    for c in (slow, trickle, idle):
        c.settimeout(10)
        rep2 = json.loads(read_line(c))
        assert rep2["ok"] is False and "timed out" in rep2["error"], rep2
        assert c.recv(10) == b""  # and closed
    assert time.time() - t0 < 8
    # the trainer with an attached job is not an idle client
    time.sleep(1.5)
    st = json.loads(d.ctl("status", "--json").stdout)
    assert len(st["jobs"]) == 1 and st["refused"]["timeout"] == 3
    check_batch(parse_batch(ring.next(), 2, 64), 2, 64, rep["job_id"], 0)
    s.sendall(b'{"v":1,"op":"report","step":1,"loss":1.0}\n')
    assert json.loads(read_line(s))["ok"] is True
    assert "client_timeout_s" in d.log_text()
    s.close()
    ring.close()


def test_liars_stalled_readers_and_vanishing_clients(loaderd, dataset, model_path):
    d = loaderd(base_config(dataset, model_path))
    s, rep, ring = attach(d, job_spec(dataset, model_path))
    victim = rep["job_id"]
    liar = d.connect()
    # another connection's job: cannot detach or report for it
    for req in ({"op": "detach", "job_id": victim}, {"op": "report", "job_id": victim, "step": 5, "loss": 9.9},
                {"op": "detach", "job_id": -1}, {"op": "detach", "job_id": 2 ** 40}, {"op": "detach"}):
        liar.sendall(json.dumps(dict(req, v=1)).encode() + b"\n")
        r = json.loads(read_line(liar))
        assert r["ok"] is False, (req, r)
    st = json.loads(d.ctl("status", "--json").stdout)
    st_job = [j for j in st["jobs"] if j["job_id"] == victim][0]
    assert st_job["state"] == "running" and st_job["trainer"] is None
    # a forged resume state: refused (or accepted as some state), never a crash
    liar.sendall(json.dumps({"v": 1, "op": "attach", "job": job_spec(dataset, model_path),
                             "resume": "ab" * 256}).encode() + b"\n")
    r = json.loads(read_line(liar, limit=1 << 20))
    assert "ok" in r
    liar.close()
    # a client that sends requests and never reads the replies: paused, others unaffected
    stall = d.connect()
    stall.setblocking(False)
    sent = 0
    try:
        for _ in range(20000):
            sent += stall.send(b'{"v":1,"op":"metrics"}\n' * 64)
    except BlockingIOError:
        pass
    t = time.time()
    assert d.request({"op": "status"})["ok"] is True and time.time() - t < 1.0
    check_batch(parse_batch(ring.next(), 2, 64), 2, 64, victim, 0)
    stall.close()
    # vanishing mid-message: half a line, half an attach, a reset connection
    for payload in (b'{"v":1,"op":"stat', b'{"v":1,"op":"attach","job":{"name":"x","sha',
                    json.dumps({"v": 1, "op": "attach", "job": job_spec(dataset, model_path)}).encode() + b"\n"):
        c = d.connect()
        c.sendall(payload)
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        c.close()  # RST
    time.sleep(0.5)
    st = json.loads(d.ctl("status", "--json").stdout)
    assert [j["job_id"] for j in st["jobs"]] == [victim] or len(st["jobs"]) == 1, st["jobs"]
    ring.release()
    check_batch(parse_batch(ring.next(), 2, 64), 2, 64, victim, 1)
    assert d.proc.poll() is None
    s.close()
    ring.close()


def test_no_existence_oracle_outside_the_roots(loaderd, dataset, model_path, tmp_path):
    """A pattern whose fixed (wildcard-free) directory prefix lies outside data_roots is refused
    before globbing, with the same reply whether or not anything exists there, and that reply is
    also the one for a pattern that matches nothing (issue 10 §3): nothing tells a client what
    exists outside the roots."""
    outside = tmp_path / "outside"
    outside.mkdir()
    write_shard(outside / "there.jsonl", [chat_line("a", "b")])
    os.symlink(outside, dataset / "dirlink")
    d = loaderd(base_config(dataset, model_path))
    pairs = [(outside / "there.jsonl", outside / "absent.jsonl"),
             (outside / "*.jsonl", outside / "*.nothing"),
             (outside / "th*re.jsonl", tmp_path / "no-such-dir" / "*.jsonl"),
             (dataset / "dirlink" / "there.jsonl", dataset / "dirlink" / "absent.jsonl"),
             (dataset / ".." / "outside" / "*.jsonl", dataset / ".." / "no-such-dir" / "x" / "*.jsonl")]
    for there, absent in pairs:
        errs = []
        for pat in (there, absent):
            s, rep, _ = attach(d, job_spec(dataset, model_path, shards=[str(pat)]))
            s.close()
            assert rep["ok"] is False and "no file by that name inside data_roots" in rep["error"], (pat, rep)
            errs.append(rep["error"].replace(str(pat), "PAT"))
        assert errs[0] == errs[1], errs
    # a pattern inside the roots that matches nothing reads the same
    pat = dataset / "nope-*.jsonl"
    s, rep, _ = attach(d, job_spec(dataset, model_path, shards=[str(pat)]))
    s.close()
    assert rep["ok"] is False and rep["error"].replace(str(pat), "PAT") == errs[0], (rep, errs)
    # inside the roots the details may be told
    s, rep, _ = attach(d, job_spec(dataset, model_path, shards=[str(dataset / "nodir" / ".." / "*.jsonl")]))
    s.close()
    assert rep["ok"] is False and "outside" not in rep["error"], rep


def test_duplicate_shards_counted_once(loaderd, dataset, model_path):
    """Overlapping patterns and repeated paths resolve to each file once (sort + unique)."""
    d = loaderd(base_config(dataset, model_path))
    shards = [str(dataset / "train-001.jsonl"), str(dataset / "train-*.jsonl"), str(dataset / "train-000.jsonl"),
              str(dataset / "." / "train-001.jsonl"), str(dataset / "train-001.jsonl")]
    s, rep, ring = attach(d, job_spec(dataset, model_path, shards=shards))
    assert rep["ok"] is True and rep["shards"] == 2, rep
    assert ring.next() is not None
    s.close()
    ring.close()
