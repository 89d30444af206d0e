"""The GPU path's scripts, end to end on the CPU emulator (no GPU): scripts/gpu-pack, scripts/gpu-run,
tests/gpu/run.sh and tests/bench/gpu/run.sh, run the way a 15-minute lease runs them.

`make test-emu` runs this file with BT_EMU_TRAINER set, after building the emulator's test and
benchmark programs (build/emu/tests, build/emu/bench). `scripts/gpu-pack --emu` packs those (each
piece's payload is built and checked against the call limit here; xz preset 0 for speed, so the size
checked is an upper bound of the -9 one), and every "device call" runs in a scratch copy of the working
tree (what the device tool sends) with the carried .gpu/ parts, $OUT and $BT_GPU_HOME of its own:

  * each piece's prepared call, read from tests/gpu/README.md, runs with a short BT_DEADLINE and a
    timeout forced in one step: A (a test binary cut at the deadline: TIMEOUT, then the sanitizer
    step SKIPPED for the deadline), B (two calls carrying the model's two parts; the demo stopped
    at its time with everything it started), C (a benchmark invocation past BENCH_TIMEOUT, its
    finished rows kept), D (the benchmark step cut at its budget); each asserts the summary lines,
    the files in $OUT (never more than 6) and their contents;
  * `one`: a second call skips the unpacking, Python's lzma unpacks where xz is absent, a binary
    with an unresolved library is a warning naming it; the second model part alone fails at once;
  * tests/gpu/run.sh: "no device" fails under BT_GPU_REQUIRE=1 and is a skip without it
    (BT_EMU_NO_DEVICE), a crashing case is followed by a restart after it (BT_EMU_CRASH_KERNEL),
    the sanitizer plan's order, BT_GPU_QUICK, per-run TIMEOUT lines and the log tarball (with a
    stand-in for compute-sanitizer, which needs a GPU), and "sanitizers unavailable on this
    runtime" where the tool refuses the device;
  * gpu-pack refuses a payload over the limit, with the figures."""
import os
import re
import shlex
import shutil
import subprocess
import tarfile
import time

import pytest

from conftest import BUILD, MODEL, ROOT

EMU = os.path.join(BUILD, "emu")
pytestmark = pytest.mark.skipif(
    not os.path.exists(os.path.join(EMU, "tests", "test_kernels_gpu")) or
    not os.path.exists(os.path.join(EMU, "bench", "bench_step_gpu")),
    reason=f"the emulator's programs are not built in {EMU} (make test-emu builds them)")

OUT_FILES = {"summary.txt", "info.txt", "tests.log", "sanitizer.log", "sanitizer-logs.tar.gz", "bench.md"}

# A stand-in for compute-sanitizer (which needs a GPU): the same command line, runs the program,
# prints the summary line; records "tool program BT_GPU_QUICK" per call. FAKE_SAN_UNSUPPORTED: refuses
# the device as on gVisor; FAKE_SAN_SLOW=tool:program: that run hangs (a timeout must stop it).
FAKE_SANITIZER = r"""#!/usr/bin/env bash
if [ "$1" = --version ]; then echo "Compute Sanitizer stand-in (tests/py/test_gpu_scripts.py)"; echo "Version 0.0"; exit 0; fi
tool=memcheck code=0
while [ $# -gt 0 ]; do
  case "$1" in --tool) tool=$2; shift 2 ;; --error-exitcode) code=$2; shift 2 ;; --*) shift ;; *) break ;; esac
done
echo "$tool $(basename "$1") ${BT_GPU_QUICK:-unset}" >> "$FAKE_SAN_CALLS"
if [ -n "${FAKE_SAN_UNSUPPORTED:-}" ]; then
  echo "========= COMPUTE-SANITIZER"; echo "========= Error: Device not supported"; exit 1
fi
if [ "${FAKE_SAN_SLOW:-}" = "$tool:$(basename "$1")" ]; then sleep 300; fi
"$@"; rc=$?
echo "========= ERROR SUMMARY: 0 errors"
exit $rc
"""


def sh(cmd, cwd=ROOT, env=None, timeout=600):
    r = subprocess.run(cmd, cwd=cwd, env=env, shell=isinstance(cmd, str), capture_output=True,
                       text=True, timeout=timeout)
    return r.returncode, r.stdout + r.stderr


def readme_calls():
    """{(piece, call): (carry list, timeout_s, command)} from tests/gpu/README.md."""
    text = open(os.path.join(ROOT, "tests", "gpu", "README.md")).read()
    calls = {}
    for m in re.finditer(r"^# piece ([ABCD]), call (\d) of (\d): carry \[([^\]]*)\], timeout_s (\d+)\n(.+)$",
                         text, re.M):
        carry = [c.strip().strip('"') for c in m.group(4).split(",") if c.strip()]
        calls[(m.group(1), int(m.group(2)))] = (carry, int(m.group(5)), m.group(6).strip())
    return calls


def with_env(command, **over):
    """The README command with its leading VAR=value words replaced or added from `over`."""
    words = shlex.split(command)
    assigns, rest = {}, []
    for i, w in enumerate(words):
        if re.match(r"^[A-Z_][A-Z0-9_]*=", w) and not rest:
            k, v = w.split("=", 1)
            assigns[k] = v
        else:
            rest = words[i:]
            break
    assigns.update({k: str(v) for k, v in over.items()})
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in assigns.items()) + " " + " ".join(map(shlex.quote, rest))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu-scripts")


@pytest.fixture(scope="module")
def packs(work):
    """Each piece packed from the emulator build: {piece: (pack dir, gpu-pack output)}; B with a tiny
    model that carries the real one's name (the demo's job names that file)."""
    model = work / "model" / os.path.basename(MODEL)
    model.parent.mkdir()
    subprocess.run([os.path.join(BUILD, "tools", "mk_tiny_gguf"), "--out", str(model), "--tokenizer-from", MODEL,
                    "--layers", "2", "--hidden", "128", "--heads", "2", "--kv-heads", "1", "--ffn", "256",
                    "--seed", "11", "--type", "Q4_1", "--embd-type", "Q8_0"], check=True)
    res = {}
    for piece in "ABCD":
        d = work / f"pack-{piece}"
        env = dict(os.environ, GPU_PACK_OUT=str(d), GPU_PACK_XZ_LEVEL="0", GPU_PACK_CACHE=str(work / "cache"),
                   MODEL=str(model), BT_BUILD=os.path.relpath(BUILD, ROOT))
        args = ["scripts/gpu-pack", "--piece", piece, "--emu", "--no-build"] + (["--model"] if piece == "B" else [])
        rc, out = sh(args, env=env)
        assert rc == 0, out
        res[piece] = (d, out)
    return res


def test_pack_sizes_within_the_call_limit(packs):
    for piece, (d, out) in packs.items():
        m = re.search(r"one call carries it: payload ([0-9.]+) \+ working tree ([0-9.]+) = ([0-9.]+) MiB of 60 MiB", out)
        assert m, out
        assert float(m.group(3)) <= 60 and float(m.group(1)) > 0.5, out
        assert os.path.getsize(d / "one" / "payload.tar.xz") / 2**20 == pytest.approx(float(m.group(1)), abs=0.01)
        assert "EMULATED build" in out
        with tarfile.open(d / "one" / "payload.tar.xz") as t:
            names = set(t.getnames())
        want = {"A": ["build/cuda/tests/test_kernels_gpu", "build/cuda/tests/test_attention_gpu",
                      "build/cuda/tests/test_trainer_gpu", "build/cuda/tests/test_families_gpu",
                      "build/cuda/tests/test_pref_gpu",
                      "build/lib/libopenblas.so.0"],
                "B": ["build/cuda/tests/test_trainer_gpu", "build/trainer", "build/loaderd", "build/loaderctl",
                      "data/demo/MANIFEST.json", "build/gpu-site/gguf/__init__.py"],
                "C": ["build/cuda/bench/bench_kernels_gpu", "build/gpu-site/bitsandbytes/__init__.py",
                      "build/gpu-site/bitsandbytes/libbitsandbytes_cuda130.so"],
                "D": ["build/cuda/bench/bench_step_gpu", "build/gpu-site/bitsandbytes/__init__.py"]}[piece]
        for w in want:
            assert w in names, (piece, w)
        # only what the piece needs; bitsandbytes' other CUDA libraries never travel
        assert not any("libbitsandbytes_cuda132" in n or "libbitsandbytes_cuda12" in n for n in names)
        if piece == "B":  # its call runs test_trainer_gpu's SmolLM2 cases only (tests/gpu/README.md)
            assert "build/cuda/tests/test_families_gpu" not in names
        if piece != "B":
            assert not any(n.startswith("data/") or n == "build/trainer" for n in names), piece
        if piece in "CD":
            assert not any(n.startswith("build/cuda/tests/") for n in names), piece
    out = packs["B"][1]
    m1 = re.search(r"call 1 carries \S+ \+ \S+ \(([0-9.]+) MiB\): ([0-9.]+) MiB of 60", out)
    m2 = re.search(r"call 2 carries \S+ \(([0-9.]+) MiB\): ([0-9.]+) MiB of 60", out)
    assert m1 and m2, out
    assert float(m1.group(2)) <= 60 and float(m2.group(2)) <= 60
    d = packs["B"][0]
    assert (d / "model-1" / "model.part").stat().st_size > 0 and (d / "model-2" / "model.part").stat().st_size > 0


def test_pack_refused_over_the_limit(work):
    d = work / "pack-refused"
    env = dict(os.environ, GPU_PACK_OUT=str(d), GPU_PACK_XZ_LEVEL="0", GPU_CALL_LIMIT_MIB="12",
               BT_BUILD=os.path.relpath(BUILD, ROOT))
    rc, out = sh(["scripts/gpu-pack", "--piece", "all", "--emu", "--no-build"], env=env)
    assert rc == 1, out
    assert re.search(r"REFUSED: piece all: payload [0-9.]+ MiB \+ working tree [0-9.]+ MiB = [0-9.]+ MiB > 12 MiB", out), out
    assert not (d / "one").exists()
    rc, out = sh(["scripts/gpu-pack", "--piece", "E"])
    assert rc == 2 and "not one of all, A, B, C, D" in out


class Device:
    """A scratch 'device machine': a copy of the working tree (what a call sends), with $BT_GPU_HOME
    (kept between calls, as on a warm machine) and a fresh $OUT per call."""

    def __init__(self, base, name):
        self.base = base / name
        self.root = self.base / "tree"
        self.home = self.base / "home"
        self.root.mkdir(parents=True)
        self.home.mkdir()
        files = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT,
                               capture_output=True, check=True).stdout.decode().split("\0")
        for f in filter(None, files):
            src = os.path.join(ROOT, f)
            if os.path.isfile(src) and not os.path.islink(src):
                dst = self.root / f
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
        self.calls = 0

    def call(self, command, env=None, timeout=300):
        """One device call (put_carry first places what it carries), $OUT empty at its start. Returns
        (rc, output, {file: text} of $OUT, the summary's lines as [step, status, seconds, note])."""
        self.calls += 1
        out = self.base / f"out{self.calls}"
        out.mkdir()
        e = dict(os.environ, OUT=str(out), BT_GPU_HOME=str(self.home), BT_GPU_EMU="1", OMP_NUM_THREADS="1",
                 OPENBLAS_NUM_THREADS="1", BT_DEADLINE_RESERVE="2", BT_STEP_MIN="4", BT_RUN_MIN="3")
        e.pop("BT_MODEL", None)
        e.update(env or {})
        t0 = time.time()
        rc, text = sh(["bash", "-c", command], cwd=self.root, env=e, timeout=timeout)
        self.wall = time.time() - t0
        files = {}
        for f in os.listdir(out):
            p = out / f
            files[f] = p.read_text(errors="replace") if not f.endswith(".gz") else p.read_bytes()
        summary = []
        for line in files.get("summary.txt", "").splitlines():
            m = re.match(r"^(\S+)\s+(PASS|FAIL|TIMEOUT|SKIPPED)\s+(\d+)s(?:\s+(.*))?$", line)
            assert m, line
            summary.append([m.group(1), m.group(2), int(m.group(3)), m.group(4) or ""])
        assert set(files) <= OUT_FILES and len(files) <= 6, sorted(files)
        return rc, text, files, summary


def put_carry(dev, pack_dir, carry):
    """The README's carry list ('.gpu/one', ...) from a pack made with GPU_PACK_OUT=pack_dir, placed
    in the device's tree as the device tool places carried paths."""
    for c in carry:
        dst = dev.root / c
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(pack_dir / os.path.relpath(c, ".gpu"), dst)


def leftovers(root):
    """Processes still running in or from the scratch tree `root` (a step must leave none)."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if str(root) in cmd or cwd == str(root) or cwd.startswith(str(root) + "/"):
            left.append((pid, cwd, cmd))
    return left


def test_piece_A_deadline_cuts_a_binary_and_skips_the_sanitizers(packs, work):
    calls = readme_calls()
    assert set(calls) == {("A", 1), ("B", 1), ("B", 2), ("C", 1), ("D", 1)}, calls
    for carry, timeout_s, cmd in calls.values():
        assert timeout_s <= 600 and len(cmd) <= 2000
        m = re.search(r"\bBT_DEADLINE=(\d+)\b", cmd)
        assert m and int(m.group(1)) <= timeout_s - 15, cmd
    carry, _, cmd = calls[("A", 1)]
    assert carry == [".gpu/one"]
    dev = Device(work, "A")
    put_carry(dev, packs["A"][0], carry)
    # the kernels test passes in seconds; the trainer test (two minutes on the emulator) is cut at
    # the deadline by tests/gpu/run.sh itself; the sanitizer step then has no time left
    rc, out, files, summary = dev.call(with_env(cmd, BT_DEADLINE=25, BT_GPU_BINS="kernels,trainer"),
                                       env={"BT_STEP_MIN": "10"})
    assert rc == 1, out
    assert [s[:2] for s in summary] == [["one", "PASS"], ["info", "PASS"], ["quick", "TIMEOUT"],
                                        ["sanitize", "SKIPPED"]], files["summary.txt"]
    assert "deadline" in summary[3][3]
    assert set(files) == {"summary.txt", "info.txt", "tests.log", "sanitizer.log"}
    assert "gpu-run: sanitize SKIPPED: the deadline is near" in files["sanitizer.log"]
    log = files["tests.log"]
    n_kernels = len(subprocess.run([os.path.join(EMU, "tests", "test_kernels_gpu"), "--list"], capture_output=True,
                                   text=True, timeout=60).stdout.split())
    assert f"test_kernels_gpu: {n_kernels} passed, 0 failed" in log
    assert re.search(r"^TIMEOUT test_trainer_gpu plain", log, re.M), log[-3000:]
    assert re.search(r"^\[       OK \] test_tiny_nf4$", log, re.M)  # what ran before the cut came back
    info = files["info.txt"]
    for what in ("runtime: ", "cpu: ", "memory: ", "gpu: ", "compute-sanitizer: ", "piece A",
                 "probe (test_kernels_gpu --probe-only): probe: one kernel ran on CPU emulator: ok"):
        assert what in info, (what, info)
    assert "torch" in info and "bitsandbytes" in info
    assert dev.wall < 25 + 15, dev.wall
    assert not leftovers(dev.root)

    # the same call again on the warm machine: the payload is not unpacked twice
    rc, out, files, summary = dev.call(with_env(cmd, BT_DEADLINE=20, BT_GPU_BINS="kernels",
                                                BT_GPU_SANITIZE="0"))
    assert "is already unpacked: skipped" in files["tests.log"], files["tests.log"]
    assert [s[:2] for s in summary][:3] == [["one", "PASS"], ["info", "PASS"], ["quick", "PASS"]]


def test_no_device_fails_under_bt_gpu_require(packs, work):
    dev = Device(work, "nodev")
    put_carry(dev, packs["A"][0], [".gpu/one"])
    rc, out, files, summary = dev.call("scripts/gpu-run one quick:60", env={"BT_EMU_NO_DEVICE": "1"})
    assert rc == 1
    assert [s[:2] for s in summary] == [["one", "PASS"], ["quick", "FAIL"]], files["summary.txt"]
    assert re.search(r"test-gpu: FAILED: no CUDA device \(cudaGetDeviceCount: .*\) and BT_GPU_REQUIRE=1",
                     files["tests.log"]), files["tests.log"]
    assert not re.search(r"^\[ +OK \] ", files["tests.log"], re.M)
    # without BT_GPU_REQUIRE (make test-gpu on a machine without a GPU): a skip, exit 0, no pass line
    e = dict(os.environ, BT_EMU_NO_DEVICE="1", BT_GPU_REQUIRE="0")
    rc, out = sh(["bash", "tests/gpu/run.sh", os.path.join(EMU, "tests", "test_kernels_gpu")], env=e)
    assert rc == 0 and "test-gpu: SKIPPED: no CUDA device (cudaGetDeviceCount" in out and "passed" not in out, out
    rc, out = sh(["bash", "tests/bench/gpu/run.sh", EMU], env=dict(e, BT_GPU_REQUIRE="1"))
    assert rc == 1 and "bench-gpu: FAILED: no CUDA device" in out, out
    # a test binary itself: FAIL and exit 1 under BT_GPU_REQUIRE=1, SKIPPED and 77 without
    rc, out = sh([os.path.join(EMU, "tests", "test_ggml_gpu")], env=dict(e, BT_GPU_REQUIRE="1"))
    assert rc == 1 and "FAIL: no CUDA device" in out, out
    rc, out = sh([os.path.join(EMU, "tests", "test_ggml_gpu")], env=e)
    assert rc == 77 and "SKIPPED: no CUDA device" in out, out


def test_crashing_case_is_followed_by_a_restart_after_it(work):
    logdir = work / "crash-logs"
    e = dict(os.environ, BT_GPU_EMU="1", BT_GPU_SANITIZE="0", BT_GPU_LOGDIR=str(logdir),
             BT_EMU_CRASH_KERNEL="rmsnorm_dw_reduce", OMP_NUM_THREADS="1")  # test_rmsnorm only (not the per-head norm)
    # a log beside the binaries (as an earlier run left them; even executable) is never taken for one
    bindir = work / "crash-bins"
    bindir.mkdir()
    k = bindir / "test_kernels_gpu"
    k.symlink_to(os.path.join(EMU, "tests", "test_kernels_gpu"))
    stale = bindir / "test_kernels_gpu.memcheck.log"
    stale.write_text("an old log\n")
    stale.chmod(0o755)
    rc, out = sh(["bash", "tests/gpu/run.sh", str(k), str(stale)], env=e)
    assert rc == 1, out
    assert "CRASH test_kernels_gpu in test_rmsnorm (exit 134, signal 6)" in out, out
    assert "== test_kernels_gpu (restarted after test_rmsnorm)" in out
    for case in ("test_rope", "test_swiglu", "test_linear_ce"):  # the cases after the crash ran
        assert re.search(rf"^\[       OK \] {case}$", out, re.M), case
    assert "test-gpu: FAILED: test_kernels_gpu (crash in test_rmsnorm)" in out
    assert "== test_kernels_gpu.memcheck.log" not in out and out.count("== test_kernels_gpu") == 2
    # --case on every binary; --list; --after of no case is an error
    listed = {}
    for b in ("test_kernels_gpu", "test_nf4_gemm_gpu", "test_ggml_gpu", "test_attention_gpu", "test_trainer_gpu",
              "test_families_gpu", "test_pref_gpu"):
        rc, out = sh([os.path.join(EMU, "tests", b), "--list"])
        names = out.split()
        assert rc == 0 and len(names) >= 4, (b, out)
        listed[b] = set(names)
        rc, out = sh([os.path.join(EMU, "tests", b), "--case", "no such case"], env=dict(os.environ, BT_GPU_EMU="1"))
        assert rc == 0 and f"{b}: 0 passed, 0 failed, 0 skipped" in out, out
        rc, out = sh([os.path.join(EMU, "tests", b), "--after", "no such case"], env=dict(os.environ, BT_GPU_EMU="1"))
        assert rc == 2 and "--after no such case: no such case" in out, out
    # the model-family cases left test_trainer_gpu for test_families_gpu: each case in one binary
    assert not listed["test_trainer_gpu"] & listed["test_families_gpu"]
    assert {"test_tiny_sliding_window", "test_qwen2_bias", "test_gemma3_step"} <= listed["test_families_gpu"]


def test_sanitizer_plan_timeouts_and_log_tarball(packs, work):
    dev = Device(work, "san")
    put_carry(dev, packs["A"][0], [".gpu/one"])
    fake = work / "compute-sanitizer"
    fake.write_text(FAKE_SANITIZER)
    fake.chmod(0o755)
    calls = work / "san-calls"
    env = {"COMPUTE_SANITIZER": str(fake), "FAKE_SAN_CALLS": str(calls), "BT_GPU_CASE": "errors",
           "FAKE_SAN_SLOW": "synccheck:test_attention_gpu", "BT_GPU_SAN_TIMEOUT": "6"}
    rc, out, files, summary = dev.call("BT_DEADLINE=200 scripts/gpu-run one sanitize", env=env)
    assert [s[:2] for s in summary] == [["one", "PASS"], ["sanitize", "TIMEOUT"]], files["summary.txt"]
    got = [line.split() for line in calls.read_text().splitlines()]
    assert got[0] == ["memcheck", "test_kernels_gpu", "unset"]  # the probe, as the tests see it
    runs = [(t, b) for t, b, q in got[1:]]
    assert runs == [("memcheck", "test_kernels_gpu"), ("memcheck", "test_nf4_gemm_gpu"), ("memcheck", "test_ggml_gpu"),
                    ("memcheck", "test_attention_gpu"), ("memcheck", "test_trainer_gpu"),
                    ("memcheck", "test_families_gpu"), ("memcheck", "test_pref_gpu"), ("racecheck", "test_nf4_gemm_gpu"), ("racecheck", "test_ggml_gpu"),
                    ("racecheck", "test_attention_gpu"), ("synccheck", "test_attention_gpu"),
                    ("initcheck", "test_kernels_gpu")], runs
    assert all(q == "1" for _, _, q in got[1:])  # BT_GPU_QUICK under every sanitizer run
    log = files["sanitizer.log"]
    assert re.search(r"^TIMEOUT test_attention_gpu synccheck", log, re.M), log
    assert log.count("ERROR SUMMARY: 0 errors") == 11
    tar = work / "san.tar.gz"
    tar.write_bytes(files["sanitizer-logs.tar.gz"])
    with tarfile.open(tar) as t:
        names = set(t.getnames())
        att = t.extractfile("sanitizer/test_attention_gpu.racecheck.log").read().decode()
    assert {"sanitizer/test_kernels_gpu.memcheck.log", "sanitizer/test_attention_gpu.synccheck.log",
            "sanitizer/test_kernels_gpu.initcheck.log"} <= names, names
    assert "[       OK ] attn/errors/wmma" in att
    assert not leftovers(dev.root)
    # a runtime whose sanitizer refuses the device (gVisor): said so, nothing run, not a failure
    calls.unlink()
    rc, out, files, summary = dev.call("BT_DEADLINE=60 scripts/gpu-run one sanitize",
                                       env=dict(env, FAKE_SAN_UNSUPPORTED="1"))
    assert rc == 1  # a skipped step is not a pass
    assert summary[1][:2] == ["sanitize", "SKIPPED"] and "sanitizers unavailable on this runtime" in summary[1][3]
    assert "test-gpu: sanitizers unavailable on this runtime (Error: Device not supported; exit 1); none run" \
        in files["sanitizer.log"], files["sanitizer.log"]
    assert len(calls.read_text().splitlines()) == 1  # the probe only


def test_one_python_fallback_and_unresolved_library_warning(packs, work):
    dev = Device(work, "one")
    put_carry(dev, packs["C"][0], [".gpu/one"])
    nox = work / "bin-without-xz"
    nox.mkdir()
    for d in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(d):
            continue
        for f in os.listdir(d):
            if f in ("xz", "unxz", "xzcat", "lzma") or (nox / f).exists():
                continue
            p = os.path.join(d, f)
            if os.path.isfile(p) and os.access(p, os.X_OK):
                (nox / f).symlink_to(p)
    rc, out, files, summary = dev.call("scripts/gpu-run one", env={"PATH": str(nox)})
    assert summary[0][:2] == ["one", "PASS"], files
    assert "one: xz not found: Python's lzma unpacks it" in files["tests.log"]
    assert os.access(dev.root / "build/cuda/bench/bench_kernels_gpu", os.X_OK)
    assert (dev.root / "build/gpu-site/bitsandbytes/libbitsandbytes_cuda130.so").exists()
    # a payload whose binary needs a library that did not travel: a warning naming it, not a failure
    stage = work / "stage-badlib"
    with tarfile.open(packs["C"][0] / "one" / "payload.tar.xz") as t:
        t.extractall(stage)
    subprocess.run(["patchelf", "--add-needed", "libbt-not-packed.so.1", str(stage / "build/cuda/bench/bench_kernels_gpu")],
                   check=True)
    bad = work / "pack-badlib" / "one"
    bad.mkdir(parents=True)
    subprocess.run(f"tar -C {stage} -cf - . | xz -0 > {bad}/payload.tar.xz && cd {bad} && sha256sum payload.tar.xz > payload.sha256",
                   shell=True, check=True)
    put_carry(dev, work / "pack-badlib", [".gpu/one"])
    rc, out, files, summary = dev.call("scripts/gpu-run one")
    assert rc == 0 and summary[0][:2] == ["one", "PASS"] and "WARNING" in summary[0][3], files
    assert "one: WARNING: unresolved libraries: bench_kernels_gpu (libbt-not-packed.so.1)" in files["tests.log"]
    # an emulated payload never runs outside the emulator
    rc, out, files, summary = dev.call("BT_GPU_HOME=$BT_GPU_HOME-2 scripts/gpu-run one info",
                                       env={"BT_GPU_EMU": "0"})
    assert "built for the CPU emulator" in files["tests.log"] and summary[0][:2] == ["one", "FAIL"]
    assert summary[1][0] == "info"  # info still runs after a failed `one`


def test_piece_B_two_calls_with_the_model_and_the_demo_stopped(packs, work):
    calls = readme_calls()
    d = packs["B"][0]
    # the second call alone (the machine was given back in between): fails within seconds
    lone = Device(work, "B-lone")
    carry2, _, cmd2 = calls[("B", 2)]
    put_carry(lone, d, carry2)
    t0 = time.time()
    rc, out, files, summary = lone.call(with_env(cmd2, BT_DEADLINE=60))
    assert time.time() - t0 < 15
    assert [s[:2] for s in summary][:2] == [["one", "FAIL"], ["model", "SKIPPED"]], files["summary.txt"]
    rc, out, files, summary = lone.call("scripts/gpu-run model")
    assert summary[0][:2] == ["model", "FAIL"]
    assert "part 2 of 2 of SmolLM2-135M-Instruct.Q4_1.gguf is here but part 1 is missing" in files["tests.log"]

    dev = Device(work, "B")
    carry1, _, cmd1 = calls[("B", 1)]
    assert carry1 == [".gpu/one", ".gpu/model-1"] and carry2 == [".gpu/model-2"]
    put_carry(dev, d, carry1)
    rc, out, files, summary = dev.call(with_env(cmd1, BT_DEADLINE=60))
    assert rc == 0, out
    assert [s[:2] for s in summary] == [["one", "PASS"], ["model", "PASS"], ["info", "PASS"]]
    assert summary[1][3] == "part 1 of 2 received"
    shutil.rmtree(dev.root / ".gpu" / "model-1")  # not carried again
    put_carry(dev, d, carry2)
    # call 2: the model is joined; the SmolLM2 step case runs on it (the emulator's size); the demo
    # cannot finish before the deadline and is stopped, everything it started with it
    rc, out, files, summary = dev.call(with_env(cmd2, BT_DEADLINE=35, BT_GPU_CASE="smollm2_step"))
    assert rc == 1
    assert [s[:2] for s in summary] == [["one", "PASS"], ["model", "PASS"], ["quick", "PASS"],
                                        ["demo", "TIMEOUT"], ["eval", "SKIPPED"]], files["summary.txt"]
    log = files["tests.log"]
    assert "one: no .gpu/one in this call; the payload unpacked earlier stays" in log or "already unpacked" in log
    assert "model: models/SmolLM2-135M-Instruct.Q4_1.gguf ready" in log
    assert re.search(r"^\[       OK \] test_smollm2_step$", log, re.M), log[-3000:]
    assert "loaded models/SmolLM2-135M-Instruct.Q4_1.gguf" in log
    assert "demo: loaderd listening on" in log and "gpu-run: demo: " in log and "are up: stopping it" in log
    assert (dev.root / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").stat().st_size == os.path.getsize(
        work / "model" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    time.sleep(0.5)
    assert not leftovers(dev.root), leftovers(dev.root)


def test_piece_C_benchmark_timeout_keeps_the_rows(packs, work):
    carry, _, cmd = readme_calls()[("C", 1)]
    dev = Device(work, "C")
    put_carry(dev, packs["C"][0], carry)
    # the kernel benchmark at the emulator's shapes takes ~20 s: BENCH_TIMEOUT=8 cuts it mid-table
    rc, out, files, summary = dev.call(with_env(cmd, BT_DEADLINE=60, BENCH_T=64, BENCH_TIMEOUT=8,
                                                BENCH_KERNELS_ARGS="--quick --shape tiny"))
    assert [s[:2] for s in summary] == [["one", "PASS"], ["info", "PASS"], ["bench", "TIMEOUT"]], files["summary.txt"]
    md = files["bench.md"]
    assert md.startswith("# GPU benchmarks: CPU emulator")
    assert re.search(r"^ceilings: CPU emulator: [0-9.e+-]+ bf16 TFLOP/s \(cuBLAS 512x512x512 GEMM\), [0-9.e+-]+ GB/s", md, re.M)
    rows = [r for r in md.splitlines() if r.startswith("| ") and "| barq |" in r]
    assert rows and all(r.endswith("| CPU emulator |") for r in rows), md
    assert "| bench_kernels_gpu | TIMEOUT after 8s |" in md
    assert "bench_torch" in md  # the next invocation still ran
    assert "TIMEOUT bench_kernels_gpu" in files["tests.log"]
    assert not leftovers(dev.root)


def test_piece_D_step_and_long_context_rows_cut_at_the_budget(packs, work):
    carry, _, cmd = readme_calls()[("D", 1)]
    dev = Device(work, "D")
    put_carry(dev, packs["D"][0], carry)
    over = dict(BT_DEADLINE=80, BENCH_SMOL="random:tiny", BENCH_SKIP_7B=1, BENCH_T=64, BENCH_STEPS=1,
                BENCH_LONG_T=64, BENCH_LONG_STEPS=1, BENCH_MAX_T_LIMIT=128)
    # the bench step's budget (its part of the call) ends before all of (b) and (c) are measured
    rc, out, files, summary = dev.call(with_env(cmd, **over).replace("bench:510", "bench:14"))
    assert [s[:2] for s in summary] == [["one", "PASS"], ["info", "PASS"], ["bench", "TIMEOUT"]], files["summary.txt"]
    md = files["bench.md"]
    assert "## (b) training step" in md
    assert re.search(r"^\| barq \(CUDA, wmma attn, dequant NF4\) \| random:tiny \| 1 x 64 \| 16 \| no \| \d+ \|.*\| CPU emulator \|$", md, re.M), md
    assert re.search(r"(TIMEOUT after \d+s|skipped: deadline)", md), md
    assert set(files) == {"summary.txt", "info.txt", "tests.log", "bench.md"}
    assert not leftovers(dev.root)
    # the whole of (c) within a longer budget: every row, the longest-T search printed T by T
    rc, out, files, summary = dev.call(with_env(cmd, **dict(over, BT_DEADLINE=150, BENCH_ONLY="c")))
    assert rc == 0, files.get("tests.log", out)[-3000:]
    md = files["bench.md"]
    assert md.count("| random:tiny |") == 4 + 2, md  # four long-context rows, two longest-T
    assert "T = 128 runs (the cap: longer not tried)" in md
    log = files["tests.log"]
    assert "longest-T search: trying T = 64 (cap 128)" in log and "longest-T search: T = 128: fits" in log
