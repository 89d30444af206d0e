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

from conftest import ROOT, NotifySocket
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
    text = open(UNIT).read()
    text = text.replace("@BINDIR@", os.path.dirname(bins.path("loaderd"))).replace("@SYSCONFDIR@", str(tmp_path))
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


def test_unit_verifies_and_is_hardened(installed_unit):
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
    assert d["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
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
