"""A real one-node Slurm for tests/py/test_slurm.py, private to one test session.

Debian's slurmctld / slurmd / slurm-client and munge (tests/slurm/install.sh installs them), no
systemd: everything lives in one private directory under /tmp and is stopped by pid.
  - munged runs as user munge with its own key and socket (the socket directory is made by hand,
    as /run/munge would be), started with setsid;
  - slurm.conf: ProctrackType=proctrack/linuxproc, TaskPlugin=task/none,
    SelectType=select/cons_tres, accounting and job-accounting-gather off, state / spool / log /
    pid files in the private directory, free TCP ports, AuthInfo pointing at the private munge
    socket, KillWait as the test asks, the node's real CPUs / memory (`slurmd -C`), and two `gres`
    GPUs of type "emu" (plain files stand in for their device files) for --gpus-per-task with the
    CUDA emulator;
  - `setsid slurmctld -D` then `setsid slurmd -D`, then wait for `scontrol ping` to say UP and
    `sinfo` to show the node idle.
Client commands find the cluster through $SLURM_CONF (SlurmCluster.env). Jobs and results are read
with `scontrol show job` (no slurmdbd). stop() cancels every job of the cluster, waits for them,
then stops slurmd, slurmctld and munged by pid.

Skips (pytest.skip, with the reason) only where Slurm cannot be had at all: the packages cannot be
installed, or the test does not run as root (slurmd and munged need it)."""
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
INSTALL = os.path.join(HERE, "..", "slurm", "install.sh")
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what, pred, timeout, interval=0.2):
    """Poll pred() until it is true (returned) or timeout seconds pass (AssertionError)."""
    end = time.time() + timeout
    while time.time() < end:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"slurm: {what} within {timeout} s")


class SlurmCluster:
    def __init__(self, kill_wait=5):
        self.kill_wait = kill_wait
        self.procs = {}
        self.dir = None

    # ------------------------------------------------------------------ bring-up
    def start(self):
        if os.geteuid() != 0:
            pytest.skip("slurm: a private slurmd and munged need root (slurmd starts jobs, munged runs "
                        "as user munge); run the tests as root, as CI does")
        r = subprocess.run(["bash", INSTALL], capture_output=True, text=True)
        if r.returncode == 3:
            pytest.skip("slurm: cannot be installed here: " + (r.stderr.strip() or r.stdout.strip()))
        assert r.returncode == 0, r.stdout + r.stderr
        for tool in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol"):
            assert shutil.which(tool) or os.path.exists("/usr/sbin/" + tool), f"{tool} missing after install"
        self.dir = tempfile.mkdtemp(prefix="bt-slurm-", dir="/tmp")
        os.chmod(self.dir, 0o755)
        for d in ("state", "spool", "log"):
            os.makedirs(os.path.join(self.dir, d))
        self._start_munge()
        self._write_conf()
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        for k in list(self.env):  # a session started under Slurm must not leak its job in here
            if k.startswith(("SLURM_", "SRUN_", "SBATCH_")) and k != "SLURM_CONF":
                del self.env[k]
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", self.conf])
        wait_for("slurmctld answers `scontrol ping`", lambda: "UP" in self.run(["scontrol", "ping"]).stdout, 60)
        self._spawn("slurmd", ["slurmd", "-D", "-f", self.conf, "-N", self.node])
        wait_for("the node is idle in sinfo", lambda: self.run(["sinfo", "-h", "-n", self.node, "-o", "%t"])
              .stdout.strip() == "idle", 60)
        return self

    def _spawn(self, name, argv, **kw):
        log = open(os.path.join(self.dir, "log", name + ".out"), "wb")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            env=dict(os.environ, SLURM_CONF=getattr(self, "conf", "")), **kw)
        log.close()

    def _start_munge(self):
        m = os.path.join(self.dir, "munge")
        os.makedirs(m)
        os.chmod(m, 0o755)  # clients of every user reach the socket through it
        mu = pwd.getpwnam("munge")
        self.munge_key = os.path.join(m, "munge.key")
        with open(self.munge_key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(self.munge_key, 0o400)
        for p in (m, self.munge_key):
            os.chown(p, mu.pw_uid, mu.pw_gid)
        self.munge_socket = os.path.join(m, "munge.socket")
        self._spawn("munged", ["munged", "-F", "--socket=" + self.munge_socket, "--key-file=" + self.munge_key,
                               "--pid-file=" + os.path.join(m, "munged.pid"),
                               "--log-file=" + os.path.join(m, "munged.log"),
                               "--seed-file=" + os.path.join(m, "munged.seed")],
                    user=mu.pw_uid, group=mu.pw_gid, extra_groups=[])
        wait_for("munged creates its socket and answers", lambda: os.path.exists(self.munge_socket) and subprocess.run(
            ["munge", "-n", "-S", self.munge_socket], capture_output=True).returncode == 0, 30)

    def _write_conf(self):
        hw = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.split("\n")[0]
        fields = dict(kv.split("=", 1) for kv in hw.split() if "=" in kv)
        host = socket.gethostname().split(".")[0]
        try:
            socket.gethostbyname(host)  # the trainers' rendezvous goes to the step's first host
            self.node = host
        except OSError:
            self.node = "localhost"
        d = self.dir
        self.conf = os.path.join(d, "slurm.conf")
        gres = os.path.join(d, "gres.conf")
        for i in range(2):  # "devices" for the emulated GPUs (task/none: nothing is constrained)
            open(os.path.join(d, f"emu-gpu{i}"), "w").close()
        with open(gres, "w") as f:
            f.write(f"NodeName={self.node} Name=gpu Type=emu File={d}/emu-gpu[0-1]\n")
        hwk = " ".join(f"{k}={fields[k]}" for k in ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket",
                                                   "ThreadsPerCore", "RealMemory") if k in fields)
        text = f"""# tests/py/slurm_cluster.py: a private one-node cluster
ClusterName=barqtest
SlurmctldHost={self.node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
KillWait={self.kill_wait}
MinJobAge=3600
GresTypes=gpu
NodeName={self.node} NodeAddr=127.0.0.1 {hwk} Gres=gpu:emu:2 State=UNKNOWN
PartitionName=barqtest Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
"""
        with open(self.conf, "w") as f:
            f.write(text)

    # ------------------------------------------------------------------ use
    def run(self, argv, **kw):
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("timeout", 60)
        return subprocess.run(argv, env=kw.pop("env", self.env), **kw)

    def job(self, job_id):
        """`scontrol show job` as a dict (empty when Slurm no longer knows the job)."""
        r = self.run(["scontrol", "show", "job", "-o", str(job_id)])
        if r.returncode:
            return {}
        out = {}
        for m in re.finditer(r"(\w+(?::\w+)?)=(\S*)", r.stdout):
            out.setdefault(m.group(1), m.group(2))
        return out

    def wait_job(self, job_id, timeout=300):
        """Until the job is in a terminal state: its scontrol record."""
        return wait_for(f"job {job_id} to end", lambda: (lambda j: j if j.get("JobState") in TERMINAL else None)(
            self.job(job_id)), timeout, 0.5)

    def log(self, name):
        try:
            with open(os.path.join(self.dir, "log", name)) as f:
                return f.read()
        except OSError:
            return ""

    # ------------------------------------------------------------------ tear-down
    def stop(self):
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run(["scancel", "--full", "-p", "barqtest"], timeout=30)
            try:
                wait_for("every job to end", lambda: not self.run(["squeue", "-h"]).stdout.strip(), 60)
            except (AssertionError, subprocess.TimeoutExpired):
                pass
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.get(name)
            if not p or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
