"""Shared fixtures for BarqTrain's process-level tests.

Paths: binaries come from $BT_BUILD (default "build", relative to the repository root; the
ASan+UBSan variants live in $BT_BUILD/asan), the model from $BT_MODEL (default
models/SmolLM2-135M-Instruct.Q4_1.gguf). Tests run from anywhere.

Fixtures:
  bins           -> Bins: .path(name, asan=False), .have(name, asan=False)
  model_path     -> absolute path of the GGUF model (skips the test when it is missing)
  sock_path      -> a short, fresh Unix socket path under /tmp (sun_path is 108 bytes)
  notify_socket  -> NotifySocket: an AF_UNIX datagram socket standing in for systemd's
                    $NOTIFY_SOCKET (.path, .wait_for("READY=1", timeout))
  loaderd        -> factory: loaderd(config: dict, asan=None, notify=True, args=(), wait=True,
                    env=None, preexec=None) -> Loaderd (asan=None: the ASan build when it exists and is not older than the plain one;
                    preexec: run in the child before exec, e.g. to set a resource limit),
                    started and READY; every daemon still running at the end is stopped with
                    SIGTERM and must exit 0
  trainer_stack  -> for trainer runs on a tiny model: skips unless loaderd, trainer and
                    tools/mk_tiny_gguf are built and the model is present; serve(data_dir) ->
                    Loaderd starts the plain (non-ASan) loaderd without a notify socket, with
                    data_roots [data_dir] and model_roots [tmp_path, the model's directory]
  chat_line(u, a) / write_shard(path, lines) / tiny_model(path, seed) / tiny_model_hd64(path, seed) /
  read_safetensors(path) /
  rel_l2(a, b, part) / ckpt_step(dir) helpers, PauseHook, reachable_by_all(binary) (a copy any
  user can run, for tests that switch users) and the ROOT / BUILD / MODEL paths are importable
  from conftest (`from conftest import chat_line`).
"""
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time

import pytest

# test_e2e_cuda_emu.py needs build/emu/trainer, test_gpu_scripts.py the emulator's test and
# benchmark programs; `make test-emu` builds them and runs both with BT_EMU_TRAINER set.
collect_ignore = [] if os.environ.get("BT_EMU_TRAINER") else ["test_e2e_cuda_emu.py", "test_gpu_scripts.py"]
# test_python_client_hf.py needs torch + transformers: `make pytest-torch` runs it in .venv-torch/
# with BT_VENV_TORCH set.
# test_export_hf.py (HF's own check of our exports) likewise.
if not os.environ.get("BT_VENV_TORCH"):
    collect_ignore += ["test_python_client_hf.py", "test_export_hf.py"]
# test_slurm.py brings up a real Slurm; `make test-slurm` runs it (BT_SLURM=1), after test-emu.
if os.environ.get("BT_SLURM") != "1":
    collect_ignore.append("test_slurm.py")
# test_systemd.py boots a container with systemd as PID 1; `make test-systemd` runs it (BT_SYSTEMD=1).
if os.environ.get("BT_SYSTEMD") != "1":
    collect_ignore.append("test_systemd.py")
# test_llamacpp.py needs llama.cpp's library (scripts/llamacpp-ref.sh); `make test-llamacpp` runs
# it (BT_LLAMACPP=1) after installing it, and reports SKIPPED with the reason where it cannot.
if os.environ.get("BT_LLAMACPP") != "1":
    collect_ignore.append("test_llamacpp.py")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.path.join(ROOT, os.environ.get("BT_BUILD", "build"))
MODEL = os.path.join(ROOT, os.environ.get("BT_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf"))

# ASan: leaks are errors (exit code != 0), UBSan stops at the first report.
SAN_ENV = {
    "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0:exitcode=23",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:exitcode=24",
}


def chat_line(user, assistant):
    """One chat-format JSONL record."""
    return json.dumps({"messages": [{"role": "user", "content": user},
                                    {"role": "assistant", "content": assistant}]})


def write_shard(path, lines):
    """Write lines (str or bytes) as a .jsonl file; a .zst suffix compresses with zstd(1)."""
    data = b"".join((l if isinstance(l, bytes) else l.encode()) + b"\n" for l in lines)
    path = str(path)
    if path.endswith(".zst"):
        subprocess.run(["zstd", "-q", "-f", "-o", path], input=data, check=True)
    else:
        with open(path, "wb") as f:
            f.write(data)
    return path


def tiny_model(path, seed=7):
    """Write a tiny random Llama GGUF to path with $BT_BUILD/tools/mk_tiny_gguf: 2 layers, hidden
    64, 4 heads (2 KV), FFN 128, and the real model's vocabulary and tokenizer (so loaderd's
    tokenizer matches). Returns path."""
    subprocess.run([os.path.join(BUILD, "tools", "mk_tiny_gguf"), "--out", str(path),
                    "--tokenizer-from", MODEL, "--layers", "2", "--hidden", "64", "--heads", "4",
                    "--kv-heads", "2", "--ffn", "128", "--seed", str(seed)], check=True)
    return path


def read_safetensors(path):
    """{name: (shape, values)} of an F32 safetensors file (the PEFT adapters the trainer writes)."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        assert meta["dtype"] == "F32", (name, meta)
        a, b = meta["data_offsets"]
        count = (b - a) // 4
        out[name] = (meta["shape"], struct.unpack(f"<{count}f", raw[8 + n + a:8 + n + b]))
    return out


def rel_l2(a, b, part):
    """||a - b|| / ||b|| over the tensors of two read_safetensors results whose name holds part."""
    num = den = 0.0
    for name, (shape, bvals) in b.items():
        if part not in name:
            continue
        ashape, avals = a[name]
        assert ashape == shape, name
        num += sum((x - y) ** 2 for x, y in zip(avals, bvals))
        den += sum(y * y for y in bvals)
    assert den > 0, part
    return (num / den) ** 0.5


def run_trainer(cmd, cfg, *args, ok=True, timeout=300):
    """build/trainer `cmd` --config cfg *args at debug log level (so every step's loss line is
    printed at full precision); asserts exit 0 when ok. Returns the CompletedProcess."""
    e = dict(os.environ, BT_LOG_LEVEL="debug")
    r = subprocess.run([os.path.join(BUILD, "trainer"), cmd, "--config", cfg, *args],
                       capture_output=True, text=True, timeout=timeout, env=e)
    if ok:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def step_losses(text):
    """{step: (loss, grad norm)} as the trainer printed them (strings: compared to the digit)."""
    return {int(s): (l, g) for s, l, g in re.findall(r"step (\d+) loss (\S+) grad norm (\S+)", text)}


def ckpt_step(d):
    """The optimiser step of the trainer checkpoint in directory d (trainer/io/checkpoint.h)."""
    raw = open(os.path.join(str(d), "trainer_state.bin"), "rb").read()
    assert raw[:6] == b"BTCKPT"
    return struct.unpack_from("<q", raw, 16)[0]


def tiny_model_hd64(path, seed=11):
    """Like tiny_model, with head_dim 64 (the GPU attention supports 64 and 128): hidden 128, 2
    heads, 1 KV head, FFN 256. Returns path."""
    subprocess.run([os.path.join(BUILD, "tools", "mk_tiny_gguf"), "--out", str(path), "--tokenizer-from", MODEL,
                    "--layers", "2", "--hidden", "128", "--heads", "2", "--kv-heads", "1", "--ffn", "256",
                    "--seed", str(seed)], check=True)
    return path


_SHARED_BIN_DIR = []


def reachable_by_all(path):
    """A copy of the executable `path` that any user can run, for tests that run it as another
    user (nobody): the clone may sit under a directory other users cannot enter (mode 0700, as
    `mktemp -d` makes and as many home directories are), so build/... is out of their reach.
    The copy lives in one world-readable temporary directory per session (removed at exit)."""
    import atexit
    if not _SHARED_BIN_DIR:
        d = tempfile.mkdtemp(prefix="bt-bin-", dir="/tmp")
        os.chmod(d, 0o755)
        atexit.register(shutil.rmtree, d, True)
        _SHARED_BIN_DIR.append(d)
    rel = os.path.relpath(os.path.abspath(path), BUILD).replace(os.sep, "_")
    dst = os.path.join(_SHARED_BIN_DIR[0], rel)
    if not os.path.exists(dst) or os.path.getmtime(dst) < os.path.getmtime(path):
        shutil.copy2(path, dst + ".new")
        os.chmod(dst + ".new", 0o755)
        os.replace(dst + ".new", dst)
    return dst


class PauseHook:
    """The bt_test_pause_point hook (common/bt_common.h) of a process under test: pass .env to
    the process; every file it maps or opens as a shard whose path contains `match` pauses it
    until `action(path)` (run on a thread here, e.g. truncating that file) returns. .paths lists
    the paths seen; .stop() ends the servicing thread."""

    def __init__(self, tmp_path, match, action):
        import threading
        self.dir = str(tmp_path / "pause-hook")
        os.mkdir(self.dir)
        self.mapped, self.resume = os.path.join(self.dir, "mapped"), os.path.join(self.dir, "resume")
        os.mkfifo(self.mapped)
        os.mkfifo(self.resume)
        self.env = {"BT_TEST_MAP_PAUSE_DIR": self.dir, "BT_TEST_MAP_PAUSE_MATCH": match}
        self.paths, self.errors = [], []
        self.action = action
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            with open(self.mapped, "rb") as f:  # blocks until a paused process (or stop) writes
                line = f.read().decode(errors="replace").strip()
            if line == "\0stop":
                return
            self.paths.append(line)
            try:
                self.action(line)
            except Exception as e:  # the test sees it in .errors; the process must go on
                self.errors.append(repr(e))
            with open(self.resume, "wb") as f:
                f.write(b"g")

    def stop(self):
        if self.thread.is_alive():
            with open(self.mapped, "wb") as f:
                f.write(b"\0stop\n")
            self.thread.join(10)


class Bins:
    def __init__(self, build):
        self.build = build

    def path(self, name, asan=False):
        return os.path.join(self.build, "asan", name) if asan else os.path.join(self.build, name)

    def have(self, name, asan=False):
        """An executable of that name; the ASan one only when it is not older than the plain build's
        (a stale ASan binary from an earlier build would test old code: then the plain one is used)."""
        p = self.path(name, asan)
        if not os.access(p, os.X_OK):
            return False
        plain = self.path(name)
        if asan and os.access(plain, os.X_OK) and os.path.getmtime(p) < os.path.getmtime(plain):
            import warnings
            warnings.warn(f"{p} is older than {plain}: using the plain build (make the ASan one again)")
            return False
        return True


@pytest.fixture(scope="session")
def bins():
    return Bins(BUILD)


@pytest.fixture(scope="session")
def model_path():
    if not os.path.exists(MODEL):
        pytest.skip(f"model {MODEL} not present (make model)")
    return MODEL


@pytest.fixture
def sock_path():
    d = tempfile.mkdtemp(prefix="bt-", dir="/tmp")
    yield os.path.join(d, "ld.sock")
    shutil.rmtree(d, ignore_errors=True)


class NotifySocket:
    """Receives sd_notify datagrams like systemd does."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="bt-n-", dir="/tmp")
        self.path = os.path.join(self.dir, "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.messages = []

    def wait_for(self, needle, timeout=20.0, proc=None):
        """Wait until a datagram containing `needle` arrives; returns its text."""
        for m in self.messages:
            if needle in m:
                return m
        end = time.time() + timeout
        while time.time() < end:
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"process exited ({proc.returncode}) before sending {needle!r}")
            self.sock.settimeout(0.2)
            try:
                m = self.sock.recv(65536).decode(errors="replace")
            except socket.timeout:
                continue
            self.messages.append(m)
            if needle in m:
                return m
        raise AssertionError(f"no {needle!r} notification within {timeout}s; got {self.messages}")

    def close(self):
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def notify_socket():
    n = NotifySocket()
    yield n
    n.close()


def thread_stacks(pid):
    """Every thread's stack of a process that hangs (gdb, when installed), for the failure message."""
    gdb = shutil.which("gdb")
    if not gdb:
        return "(no gdb: no stacks)"
    try:
        r = subprocess.run([gdb, "-p", str(pid), "-batch", "-ex", "thread apply all bt"],
                           capture_output=True, text=True, timeout=120)
        return r.stdout[-20000:] + r.stderr[-2000:]
    except subprocess.TimeoutExpired:
        return "(gdb timed out)"


class Loaderd:
    """A running loaderd. .sock, .proc, .log_text(), .request(obj), .ctl(*args), .stop()."""

    def __init__(self, bins, cfg_path, sock, asan, notify, log_path, args=(), extra_env=None, preexec=None):
        self.bins, self.sock, self.asan, self.notify = bins, sock, asan, notify
        self.cfg_path, self.log_path = cfg_path, log_path
        env = dict(os.environ)
        env.update(SAN_ENV)
        env.update(extra_env or {})
        if notify is not None:
            env["NOTIFY_SOCKET"] = notify.path
        else:
            env.pop("NOTIFY_SOCKET", None)
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen([bins.path("loaderd", asan), "--config", cfg_path, "--foreground", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, preexec_fn=preexec)

    def wait_ready(self, timeout=30.0):
        if self.notify is not None:
            self.notify.wait_for("READY=1", timeout, self.proc)
        else:
            end = time.time() + timeout
            while not os.path.exists(self.sock):
                assert self.proc.poll() is None, self.log_text()
                assert time.time() < end, "loaderd did not create its socket\n" + self.log_text()
                time.sleep(0.05)
        return self

    def log_text(self):
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(self.sock)
        return s

    def request(self, obj, sock=None):
        """Send one request (dict, "v" added) and return the decoded reply."""
        own = sock is None
        s = self.connect() if own else sock
        msg = dict(obj)
        msg.setdefault("v", 1)
        s.sendall(json.dumps(msg).encode() + b"\n")
        line = read_line(s)
        if own:
            s.close()
        return json.loads(line)

    def ctl(self, *args, timeout=30):
        return subprocess.run([self.bins.path("loaderctl"), "--socket", self.sock, *args],
                              capture_output=True, text=True, timeout=timeout)

    def stop(self, sig=signal.SIGTERM, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stacks = thread_stacks(self.proc.pid)
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("loaderd did not stop\n" + self.log_text() + "\n" + stacks)
        self.log.close()
        return rc


# "x: x: " in a log line: a message wrapped by a caller that adds the part (or path) its callee
# already wrote ("token cache: token cache: ..."); the loaderd fixture fails a test whose daemon
# logged one.
DOUBLED_PART = re.compile(r"(?:^|: )([^:\n]{1,200}): \1: ", re.M)


def read_line(s, limit=64 << 20):
    """Read one '\\n'-terminated line from a stream socket (bytes, without the newline)."""
    buf = b""
    while b"\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("connection closed before a full line: %r" % buf[:200])
        buf += chunk
        if len(buf) > limit:
            raise ValueError("line too long")
    return buf.split(b"\n", 1)[0]


@pytest.fixture
def loaderd(bins, tmp_path, sock_path):
    """Factory starting loaderd with a config dict ("socket" defaults to a fresh tmp path)."""
    started = []

    def start(config=None, asan=None, notify=True, args=(), wait=True, env=None, preexec=None):
        if asan is None:
            asan = bins.have("loaderd", asan=True)
        if not bins.have("loaderd", asan):
            pytest.skip(f"{bins.path('loaderd', asan)} not built")
        cfg = {"socket": sock_path}
        cfg.update(config or {})
        cfg_path = str(tmp_path / f"loaderd-{len(started)}.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        n = NotifySocket() if notify else None
        d = Loaderd(bins, cfg_path, cfg["socket"], asan, n, str(tmp_path / f"loaderd-{len(started)}.log"), args, env,
                    preexec)
        started.append(d)
        if wait:
            d.wait_ready()
        return d

    yield start
    failures = []
    for d in started:
        if d.proc.poll() is None:
            rc = d.stop()
            if rc != 0:
                failures.append(f"loaderd exited {rc} at teardown\n{d.log_text()[-4000:]}")
        doubled = DOUBLED_PART.search(d.log_text())
        if doubled:  # a message wrapped with the part it already names (issue 21 §11)
            failures.append(f"loaderd's log names a part twice: {doubled.group(0)!r}")
        if d.notify is not None:
            d.notify.close()
    assert not failures, "\n".join(failures)


@pytest.fixture
def trainer_stack(bins, model_path, tmp_path, loaderd):
    """serve(data_dir) -> Loaderd for trainer runs on tiny models kept in tmp_path (see the module
    docstring); skips when a binary is missing."""
    for b in ("loaderd", "trainer", "tools/mk_tiny_gguf"):
        if not bins.have(b):
            pytest.skip(f"{bins.path(b)} not built")

    def serve(data_dir):
        return loaderd({"data_roots": [str(data_dir)],
                        "model_roots": [str(tmp_path), os.path.dirname(model_path)]},
                       asan=False, notify=False)

    return serve
