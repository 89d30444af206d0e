"""The systemd service (issue 3 §6): scripts/loaderd.service passes `systemd-analyze verify`
and scores as well hardened offline, scripts/loaderd.sysusers.conf creates the system user, the
sd_notify protocol seen through a NOTIFY_SOCKET of the test's own (READY=1 with MAINPID,
STATUS=, WATCHDOG=1 at WATCHDOG_USEC/2, RELOADING=1 + MONOTONIC_USEC and READY=1 around a
SIGHUP reload, STOPPING=1 on SIGTERM, exit 0), and loaderd working under the unit's
MemoryDenyWriteExecute (W^X: no PCRE2 JIT; the dedicated pre-tokenizers need none)."""
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time

import pytest

from conftest import BUILD, ROOT, NotifySocket
from test_loaderd_hardening import NOBODY, open_dir, run_as  # noqa: F401
from test_loaderd_server import attach, base_config, check_batch, dataset, job_spec, parse_batch  # noqa: F401

UNIT = os.path.join(ROOT, "scripts", "loaderd.service")
SYSUSERS = os.path.join(ROOT, "scripts", "loaderd.sysusers.conf")


def need(tool):
    path = shutil.which(tool)
    if not path:
        pytest.skip(f"{tool} not installed (Debian package: systemd)")
    return path


@pytest.fixture
def installed_unit(tmp_path, bins):
    """The unit as `make install` writes it, pointing at the built binary."""
    if not bins.have("loaderd"):
        pytest.skip("build/loaderd not built")
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "render-unit.sh"), UNIT,
                        os.path.dirname(bins.path("loaderd")), str(tmp_path), bins.path("loaderd"),
                        bins.path("loaderctl")], capture_output=True, text=True, timeout=60, check=True)
    text = r.stdout
    assert not re.search(r"@[A-Z]+@", text), "unsubstituted placeholder"
    p = tmp_path / "loaderd.service"
    p.write_text(text)
    return p


def directives(path):
    d = {}
    for line in open(path):
        line = line.strip()
        if line and not line.startswith(("#", "[")) and "=" in line:
            k, v = line.split("=", 1)
            d.setdefault(k, []).append(v)
    return d


def test_unit_verifies_and_is_hardened(installed_unit, bins, tmp_path):
    analyze = need("systemd-analyze")
    r = subprocess.run([analyze, "verify", str(installed_unit)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr
    d = directives(installed_unit)
    expect = {"Type": "notify", "NotifyAccess": "main", "RuntimeDirectory": "loaderd", "User": "loaderd",
              "ProtectSystem": "strict", "NoNewPrivileges": "yes", "RestrictAddressFamilies": "AF_UNIX",
              "PrivateNetwork": "yes", "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes",
              "ProtectKernelLogs": "yes", "ProtectControlGroups": "yes", "SystemCallFilter": "@system-service",
              "MemoryDenyWriteExecute": "yes", "LockPersonality": "yes", "SystemCallArchitectures": "native",
              "RestrictNamespaces": "yes", "WatchdogSec": "30s", "CapabilityBoundingSet": ""}
    for k, v in expect.items():
        assert v in d.get(k, []), f"{k}={v} missing from the unit"
    assert "DynamicUser" not in d, "DynamicUser implies RemoveIPC and a changing uid"
    # reload through loaderctl (no /bin/kill: procps is not on minimal systems, and NoExecPaths=
    # leaves only loaderd, loaderctl and their libraries executable)
    assert d["ExecReload"] == [f"{os.path.dirname(bins.path('loaderd'))}/loaderctl --config {tmp_path}/loaderd/loaderd.json reload"]
    assert d["NoExecPaths"] == ["/ /dev /dev/shm /tmp /var/tmp /run /run/loaderd /var/cache/loaderd"]
    execp = d["ExecPaths"][0].split()
    assert execp[:2] == [bins.path("loaderd"), bins.path("loaderctl")] and len(execp) > 2, execp
    libc = subprocess.run(["ldd", bins.path("loaderd")], capture_output=True, text=True).stdout
    m = re.search(r"libc\.so\.6 => (\S+)", libc)
    assert m and os.path.dirname(os.path.realpath(m.group(1))) in execp, (execp, libc)
    r = subprocess.run([analyze, "security", "--offline=yes", str(installed_unit)], capture_output=True, text=True,
                       timeout=60)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", r.stdout + r.stderr)
    assert m, r.stdout[-2000:] + r.stderr
    assert float(m.group(1)) <= 2.0, "exposure %s:\n%s" % (m.group(1), r.stdout[-3000:])


def test_sysusers_creates_a_system_user(tmp_path):
    sysusers = need("systemd-sysusers")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    r = subprocess.run([sysusers, f"--root={root}", SYSUSERS], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    pw = [l.split(":") for l in (root / "etc" / "passwd").read_text().splitlines() if l.startswith("loaderd:")]
    gr = [l.split(":") for l in (root / "etc" / "group").read_text().splitlines() if l.startswith("loaderd:")]
    assert len(pw) == 1 and len(gr) == 1
    uid, gid = int(pw[0][2]), int(pw[0][3])
    assert 0 < uid < 1000 and gid == int(gr[0][2]), pw  # a system user: exempt from logind's RemoveIPC
    assert pw[0][6].endswith("nologin")


def test_notify_protocol(loaderd, dataset, model_path):
    d = loaderd(base_config(dataset, model_path), env={"WATCHDOG_USEC": "300000"})
    n = d.notify
    ready = n.wait_for("READY=1", 10)
    assert "MAINPID=%d" % d.proc.pid in ready and "STATUS=listening on " + d.sock in ready
    t0 = time.time()
    n.wait_for("WATCHDOG=1", 5)
    time.sleep(1.2)
    # drain what arrived: pings at WATCHDOG_USEC/2 = 150 ms
    n.sock.settimeout(0.05)
    while True:
        try:
            n.messages.append(n.sock.recv(65536).decode())
        except socket.timeout:
            break
    pings = sum(m == "WATCHDOG=1" for m in n.messages)
    assert pings >= 0.8 / 0.15 - 1, (pings, time.time() - t0)
    assert "job(s)" in n.wait_for("STATUS=0 job(s), ", 10)
    # SIGHUP: RELOADING=1 with MONOTONIC_USEC (Type=notify-reload contract), then READY=1 again
    before = len(n.messages)
    d.proc.send_signal(signal.SIGHUP)
    rel = n.wait_for("RELOADING=1", 10)
    m = re.search(r"MONOTONIC_USEC=(\d+)", rel)
    assert m and abs(int(m.group(1)) / 1e6 - time.clock_gettime(time.CLOCK_MONOTONIC)) < 10
    end = time.time() + 10
    while not any(x.startswith("READY=1") for x in n.messages[before:]):
        assert time.time() < end, n.messages[before:]
        n.sock.settimeout(0.2)
        try:
            n.messages.append(n.sock.recv(65536).decode())
        except socket.timeout:
            pass
    idx_rel = max(i for i, x in enumerate(n.messages) if "RELOADING=1" in x)
    idx_ready = max(i for i, x in enumerate(n.messages) if x.startswith("READY=1"))
    assert idx_ready > idx_rel, "READY=1 comes after RELOADING=1"
    assert d.request({"op": "status"})["reloads_total"] == 1
    # SIGTERM: STOPPING=1, exit 0, socket removed
    s, rep, ring = attach(d, job_spec(dataset, model_path))
    assert rep["ok"]
    assert d.stop(signal.SIGTERM) == 0, d.log_text()
    assert "STOPPING=1" in n.wait_for("STOPPING=1", 5)
    assert ring.producer_closed.value == 1 and not os.path.exists(d.sock)
    s.close()
    ring.close()


def test_watchdog_only_for_the_main_pid(loaderd, dataset, model_path):
    """WATCHDOG_PID names another process: sd_watchdog_enabled says no, so no pings."""
    d = loaderd(base_config(dataset, model_path), env={"WATCHDOG_USEC": "200000", "WATCHDOG_PID": "1"})
    d.notify.wait_for("READY=1", 10)
    time.sleep(0.8)
    d.notify.sock.settimeout(0.05)
    try:
        while True:
            d.notify.messages.append(d.notify.sock.recv(65536).decode())
    except socket.timeout:
        pass
    assert not any("WATCHDOG=1" in m for m in d.notify.messages)


PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1


def _mdwe():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0) != 0:
        os._exit(77)


def test_works_under_memory_deny_write_execute(bins, dataset, model_path, tmp_path, sock_path):
    """MemoryDenyWriteExecute=yes in the unit: run the real daemon with the kernel's W^X (prctl
    PR_SET_MDWE, the mechanism systemd uses on kernels >= 6.3) and take batches from it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(66, 0, 0, 0, 0) < 0:  # PR_GET_MDWE
        pytest.skip("kernel without PR_SET_MDWE (Linux < 6.3)")
    if not bins.have("loaderd"):
        pytest.skip("build/loaderd not built")
    cfg = dict(base_config(dataset, model_path), socket=sock_path)
    cp = tmp_path / "mdwe.json"
    cp.write_text(json.dumps(cfg))
    log = open(tmp_path / "mdwe.log", "wb")
    notify = NotifySocket()
    p = subprocess.Popen([bins.path("loaderd"), "--config", str(cp)], stdout=log, stderr=subprocess.STDOUT,
                         preexec_fn=_mdwe, env=dict(os.environ, NOTIFY_SOCKET=notify.path))
    try:
        notify.wait_for("READY=1", 20, p)
        with open(f"/proc/{p.pid}/status") as f:
            st = f.read()
        if "Mdwe" in st:  # shown since Linux 6.3 for processes with the flag
            assert re.search(r"^Mdwe:\s+1", st, re.M), st

        class D:
            sock = sock_path

            def connect(self):
                s = socket.socket(socket.AF_UNIX)
                s.settimeout(30)
                s.connect(sock_path)
                return s

        s, rep, ring = attach(D(), job_spec(dataset, model_path))
        assert rep["ok"], rep
        for step in range(3):
            check_batch(parse_batch(ring.next(), 2, 64), 2, 64, rep["job_id"], step)
            ring.release()
        s.close()
        ring.close()
    finally:
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=30)
        log.close()
        notify.close()
        assert rc == 0, open(tmp_path / "mdwe.log").read()


# ---------------------------------------------------------------- reload over the socket (issue 31)

def test_loaderctl_reload_reports_the_outcome(loaderd, dataset, model_path, tmp_path, open_dir):
    """`loaderctl --config F reload` (the unit's ExecReload=): loaderd re-reads F as on SIGHUP and
    answers with the outcome, so `systemctl reload` fails when the new configuration is refused;
    operators only; --config finds the socket in F, or the default when F does not parse."""
    d = loaderd(base_config(dataset, model_path, socket_mode="0666"))
    ctl = [os.path.join(BUILD, "loaderctl"), "--config", d.cfg_path]
    cfg = json.load(open(d.cfg_path))
    cfg["ring_slots"] = 5
    json.dump(cfg, open(d.cfg_path, "w"))
    r = subprocess.run(ctl + ["reload"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert re.match(r"loaderd reloaded \S+: 1 setting\(s\) changed", r.stdout), r.stdout
    assert "ring_slots: 8 -> 5" in d.log_text() and "reload requested by pid" in d.log_text()
    assert d.request({"op": "status"})["reloads_total"] == 1
    # a refused configuration: exit 1 with loaderd's reason, the running one is kept
    open(d.cfg_path, "w").write(json.dumps({**cfg, "ring_slots": "many"}))
    r = subprocess.run(ctl + ["reload"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "keeping the running configuration" in r.stderr and "ring_slots" in r.stderr, r.stderr
    assert d.proc.poll() is None and d.ctl("status").returncode == 0
    st = d.request({"op": "status"})
    assert st["reloads_total"] == 1
    # not an operator: refused, nothing reloaded
    code, err = run_as(NOBODY, os.path.join(BUILD, "loaderctl"), "--socket", d.sock, "reload")
    assert code == 1 and "operators only" in err, err
    # --config on a file that does not parse: a note, then the default socket
    bad = tmp_path / "broken.json"
    bad.write_text('{"socket": ')
    r = subprocess.run([os.path.join(BUILD, "loaderctl"), "--config", str(bad), "hello"], capture_output=True,
                       text=True, timeout=30, env={**os.environ, "LOADERD_SOCKET": d.sock})
    assert r.returncode == 1 and str(bad) in r.stderr and "/run/loaderd/loaderd.sock" in r.stderr, r.stderr


def test_log_lines_carry_journal_priorities(bins, dataset, model_path, tmp_path, sock_path):
    """With stderr connected to journald ($JOURNAL_STREAM names its device and inode) every line
    is "<N>component: message" (N the syslog priority), so `journalctl -p` filters by level; with
    stderr anywhere else, the ISO timestamp and level words as before."""
    cfg = tmp_path / "loaderd.json"
    cfg.write_text(json.dumps(base_config(dataset, model_path, socket=sock_path, ring_slots=4)))
    for journal in (True, False):
        log = tmp_path / f"stderr-{journal}.log"
        with open(log, "wb") as f:
            st = os.fstat(f.fileno())
            env = {**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + (0 if journal else 1)}"}
            p = subprocess.Popen([bins.path("loaderd"), "--config", str(cfg)], stderr=f, env=env)
            try:
                end = time.time() + 20
                while "listening on" not in log.read_text():
                    assert time.time() < end and p.poll() is None, log.read_text()
                    time.sleep(0.05)
                cfg.write_text(json.dumps(base_config(dataset, model_path, socket=sock_path, ring_slots="x")))
                p.send_signal(signal.SIGHUP)
                while "keeping the running configuration" not in log.read_text():
                    assert time.time() < end, log.read_text()
                    time.sleep(0.05)
            finally:
                p.send_signal(signal.SIGTERM)
                assert p.wait(30) == 0
        cfg.write_text(json.dumps(base_config(dataset, model_path, socket=sock_path, ring_slots=4)))
        lines = log.read_text().splitlines()
        if journal:
            assert all(re.match(r"<[3467]>[a-z_ ]+: ", l) for l in lines), lines
            assert any(l.startswith("<6>loaderd: listening on ") for l in lines), lines
            assert any(l.startswith("<3>loaderd: reload of ") for l in lines), lines
        else:
            assert all(re.match(r"\d{4}-\d\d-\d\dT[\d:.]+Z (debug|info|warn|error) ", l) for l in lines), lines


def test_loaderd_refuses_execve_itself(loaderd, dataset, model_path):
    """loaderd installs its own seccomp filter against execve/execveat (loaderd/sandbox.h) and says
    so in status; the filter itself is checked in tests/unit/loaderd/test_sandbox.c."""
    d = loaderd(base_config(dataset, model_path))
    assert d.request({"op": "status"})["sandbox"] == {"no_exec": True}
    with open(f"/proc/{d.proc.pid}/status") as f:
        st = dict(l.split(":", 1) for l in f if ":" in l)
    assert st["NoNewPrivs"].strip() == "1" and st["Seccomp"].strip() == "2", st
