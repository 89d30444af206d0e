"""`systemctl start loaderd` under a real systemd (`make test-systemd`, part of `make test`).

A minimal Debian 12 root (debootstrap minbase + systemd + the runtime libraries of our binaries,
cached under build/systemd by tests/systemd/build-root.sh) is copied, BarqTrain is installed into
it with `make install DESTDIR=... PREFIX=/usr/local` exactly as the README's service section says,
a tiny model and chat shards go to /srv/barq (the example config's roots), and the copy is booted
with `systemd-nspawn -b`: systemd 252 is PID 1. tests/systemd/check.sh runs inside as a unit and
drives every check through systemctl, the journal and the real socket (readiness, STATUS=, the
watchdog, reload, the socket's group, a trainer job of a member, refusals, a clean stop with the
job continuing, the sandbox, the journal, the exposure score), writes one PASS/FAIL line per check
to a bind-mounted directory and powers the container off. Each check is one test here.

Skips (saying why, never passing) only where the container cannot run at all: not root, no
debootstrap / systemd-nspawn, no Debian mirror, or a kernel that refuses the namespaces.
Everything started is stopped by pid with a time bound."""
import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from conftest import BUILD, MODEL, ROOT, chat_line, tiny_model, write_shard

HERE = os.path.join(ROOT, "tests", "systemd")
CACHE = os.path.join(BUILD, "systemd")
RUN = os.path.join(CACHE, "run")
BOOT_TIMEOUT_S = 900

CHECKS = ["sysusers", "ready", "socket_mode", "member_trains", "non_member_refused", "status_line",
          "stop_clean", "job_continues", "watchdog_fed", "watchdog_restarts", "job_state_intact",
          "reload_logs_changes", "refused_with_reason", "reload_broken_keeps", "sandbox_process",
          "sandbox_writes", "sandbox_network", "sandbox_exec", "loaderd_no_exec", "journal", "exposure"]


def _need_binaries():
    need = [os.path.join(BUILD, n) for n in ("loaderd", "loaderctl", "trainer")]
    need += [os.path.join(BUILD, "tools", n) for n in ("sandbox_probe", "mk_tiny_gguf")]
    missing = [p for p in need if not os.access(p, os.X_OK)]
    if missing:
        pytest.fail("not built: %s (make all)" % ", ".join(missing))
    if not os.path.exists(MODEL):
        pytest.fail(f"{MODEL} missing (make model): the tiny model takes its vocabulary")
    return need


def _build_root(bins):
    r = subprocess.run(["bash", os.path.join(HERE, "build-root.sh"), CACHE, *bins], capture_output=True,
                       text=True, timeout=1800)
    if r.returncode == 77:
        pytest.skip("debootstrap cannot reach the Debian mirror: " + r.stderr.strip()[-300:])
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def _stage(root):
    """Install BarqTrain as the README says, then the test's assets, model, data and jobs."""
    r = subprocess.run(["make", "-s", "-C", ROOT, "install", f"DESTDIR={root}", "PREFIX=/usr/local",
                        f"BUILD={os.path.relpath(BUILD, ROOT)}"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assets = os.path.join(root, "usr/local/libexec/barq-test")
    os.makedirs(assets, exist_ok=True)
    shutil.copy(os.path.join(HERE, "check.sh"), assets)
    shutil.copy(os.path.join(BUILD, "tools", "sandbox_probe"), assets)
    os.chmod(os.path.join(assets, "check.sh"), 0o755)
    unit_dir = os.path.join(root, "etc/systemd/system")
    shutil.copy(os.path.join(HERE, "barq-check.service"), unit_dir)
    wants = os.path.join(unit_dir, "multi-user.target.wants")
    os.makedirs(wants, exist_ok=True)
    os.symlink("/etc/systemd/system/barq-check.service", os.path.join(wants, "barq-check.service"))
    srv = os.path.join(root, "srv/barq")
    for d in ("data", "models", "jobs"):
        os.makedirs(os.path.join(srv, d), exist_ok=True)
        os.chmod(os.path.join(srv, d), 0o755)
    tiny_model(os.path.join(srv, "models", "tiny.gguf"), 7)
    lines = [chat_line(f"What is item {i}?", f"Item {i} is a thing with number {i * 7}.") for i in range(200)]
    write_shard(os.path.join(srv, "data", "train-000.jsonl"), lines[:100])
    write_shard(os.path.join(srv, "data", "train-001.jsonl"), lines[100:])

    def job(steps, out_dir):
        return {"model": "/srv/barq/models/tiny.gguf", "base_dtype": "nf4",
                "data": {"shards": ["/srv/barq/data/train-*.jsonl"], "format": "chat", "seq_len": 64,
                         "micro_batch_size": 2, "seed": 5},
                "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
                "optim": {"lr": 1e-3, "warmup_steps": 1}, "steps": steps, "grad_accum": 1, "save_every": 0,
                "threads": 1, "out_dir": out_dir}
    for name, j in (("short", job(3, "/home/alice/run-short")), ("long", job(1000000, "/home/alice/run-long"))):
        with open(os.path.join(srv, "jobs", name + ".json"), "w") as f:
            json.dump(j, f, indent=1)
    for dirpath, dirnames, filenames in os.walk(srv):
        for n in filenames:
            os.chmod(os.path.join(dirpath, n), 0o644)


def _stop(proc, grace=30):
    """SIGTERM to systemd-nspawn (a clean container shutdown), then SIGKILL to its session."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.fixture(scope="module")
def results():
    if os.geteuid() != 0:
        pytest.skip("needs root: debootstrap and systemd-nspawn (run make test as root, as CI does)")
    for tool in ("debootstrap", "systemd-nspawn"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} not installed (scripts/setup.sh installs debootstrap and systemd-container)")
    bins = _need_binaries()
    base = _build_root(bins)
    if os.path.exists(RUN):
        subprocess.run(["rm", "-rf", "--one-file-system", RUN], check=True)
    os.makedirs(RUN)
    root = os.path.join(RUN, "root")
    subprocess.run(["cp", "-a", "--reflink=auto", base, root], check=True, timeout=600)
    _stage(root)
    res_dir = os.path.join(RUN, "results")
    os.makedirs(res_dir)
    nspawn = shutil.which("systemd-nspawn")
    probe = subprocess.run([nspawn, "-q", "-D", root, "--register=no", "--keep-unit", "/bin/true"], capture_output=True, text=True,
                           timeout=120)
    if probe.returncode != 0:
        pytest.skip("systemd-nspawn cannot run a container here: " + (probe.stderr or probe.stdout).strip()[-300:])
    boot_log = open(os.path.join(RUN, "boot.log"), "wb")
    t0 = time.time()
    proc = subprocess.Popen([nspawn, "-D", root, "--register=no", "--keep-unit", "-b", f"--bind={res_dir}:/results"],
                            stdin=subprocess.DEVNULL, stdout=boot_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        done = os.path.join(res_dir, "done")
        while not os.path.exists(done) and proc.poll() is None and time.time() - t0 < BOOT_TIMEOUT_S:
            time.sleep(0.5)
        try:
            proc.wait(60)  # check.sh powers the container off
        except subprocess.TimeoutExpired:
            pass
    finally:
        _stop(proc)
        boot_log.close()
    elapsed = time.time() - t0
    out = {}
    tsv = os.path.join(res_dir, "results.tsv")
    if os.path.exists(tsv):
        for line in open(tsv, encoding="utf-8", errors="replace"):
            parts = line.rstrip("\n").split("\t", 2)
            if len(parts) == 3:
                out.setdefault(parts[0], {})[parts[1]] = parts[2]
    out["_elapsed_s"] = elapsed
    out["_dir"] = res_dir
    if not os.path.exists(done):
        tail = open(os.path.join(RUN, "boot.log"), "rb").read()[-3000:].decode(errors="replace")
        pytest.fail(f"the checks did not finish within {BOOT_TIMEOUT_S} s (container exit {proc.returncode}); "
                    f"boot log tail:\n{tail}")
    print(f"\ntest-systemd: container booted, checked and powered off in {elapsed:.0f} s; "
          + ", ".join(f"{k}={v}" for k, v in out.get("INFO", {}).items()))
    return out


def _evidence(res, name):
    log = os.path.join(res["_dir"], "log.txt")
    text = open(log, encoding="utf-8", errors="replace").read() if os.path.exists(log) else ""
    i = text.find(f"== FAIL {name}:")
    return text[max(0, i - 3000):i + 500] if i >= 0 else text[-2000:]


@pytest.mark.parametrize("name", CHECKS)
def test_check(results, name):
    if name in results.get("PASS", {}):
        return
    detail = results.get("FAIL", {}).get(name)
    assert detail is not None, f"check {name} did not run; log:\n{_evidence(results, name)}"
    pytest.fail(f"{name}: {detail}\n--- evidence (build/systemd/run/results/log.txt) ---\n{_evidence(results, name)}")


def test_exposure_score(results):
    """systemd-analyze security's exposure level of the installed unit (the README quotes it)."""
    score = results.get("INFO", {}).get("exposure")
    assert score is not None, "no exposure score recorded"
    assert float(score) <= 1.5, open(os.path.join(results["_dir"], "security.txt")).read()[-3000:]
