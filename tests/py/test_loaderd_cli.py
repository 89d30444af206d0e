"""loaderd's and loaderctl's command lines (getopt_long) and the key tables behind loaderd's
configuration file and job spec (issue 22 §3).

- Both programs take the options they always took, in any order around loaderctl's command,
  and refuse a stray or incomplete argument naming it (exit 2) with the usage.
- `loaderd --config-keys` / `--job-keys` print the key tables; every key they print is in the
  README's configuration table / PROTOCOL.md's job keys, and every key the README's table
  names is one loaderd knows: the docs cannot drift from the rows.
"""
import os
import re
import subprocess

from conftest import ROOT


def run(bins, name, *args):
    return subprocess.run([bins.path(name), *args], capture_output=True, text=True, timeout=60)


def keys_of(table_text):
    return re.findall(r"^\| `([a-z_\[\].]+)` \|", table_text, re.M)


def test_loaderd_options(bins, tmp_path):
    r = run(bins, "loaderd", "--help")
    assert r.returncode == 0 and "usage: loaderd --config FILE" in r.stdout and "--check" in r.stdout
    assert run(bins, "loaderd", "-h").stdout == r.stdout
    for args, named in ([], None), (["--config"], "--config"), (["--frob"], "--frob"), (["stray"], "stray"), \
                       (["--config", "x.json", "--socket"], "--socket"):
        r = run(bins, "loaderd", *args)
        assert r.returncode == 2 and "usage: loaderd" in r.stderr, (args, r.stderr)
        want = f"unknown or incomplete argument '{named}'" if named else "--config FILE is required"
        assert want in r.stderr, (args, r.stderr)
    cfg = tmp_path / "c.json"
    cfg.write_text('{"socket": "/tmp/x.sock"}')
    for args in (["--config", str(cfg), "--check"], ["--check", f"--config={cfg}"]):
        r = run(bins, "loaderd", *args)
        assert r.returncode == 0 and "ok (socket /tmp/x.sock" in r.stdout, (args, r.stdout, r.stderr)


def test_loaderctl_options(bins, tmp_path):
    r = run(bins, "loaderctl", "--help")
    assert r.returncode == 0 and "usage: loaderctl" in r.stdout
    for args, named in (["status", "jobs"], "jobs"), (["--rows"], "--rows"), (["--bogus", "status"], "--bogus"):
        r = run(bins, "loaderctl", *args)
        assert r.returncode == 2 and f"unknown or incomplete argument '{named}'" in r.stderr, (args, r.stderr)
    r = run(bins, "loaderctl", "preview", "--rows", "0")
    assert r.returncode == 2 and "--rows wants an integer" in r.stderr
    r = run(bins, "loaderctl", "--interval=0.01", "watch")
    assert r.returncode == 2 and "--interval wants seconds" in r.stderr
    r = run(bins, "loaderctl", "preview")
    assert r.returncode == 2 and "--job JOB.json is required" in r.stderr
    # options after the command, and --opt=value: the socket named is the one tried
    sock = str(tmp_path / "none.sock")
    for args in (["status", "--socket", sock], [f"--socket={sock}", "status", "--json"]):
        r = run(bins, "loaderctl", *args)
        assert r.returncode == 1 and f"cannot connect to {sock}" in r.stderr, (args, r.stderr)


def test_config_keys_match_the_readme(bins):
    r = run(bins, "loaderd", "--config-keys")
    assert r.returncode == 0, r.stderr
    keys = keys_of(r.stdout)
    assert len(keys) == 21 and "memory_budget_bytes" in keys and "socket" in keys, keys
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme[readme.index("`/etc/loaderd/loaderd.json`"):]
    table = section[:section.index("\n\n", section.index("| key |"))]
    documented = set(re.findall(r"`([a-z_]+)`", "\n".join(l.split("|")[1] for l in table.splitlines()[2:])))
    assert documented == set(keys), (sorted(documented ^ set(keys)))


def test_job_keys_match_the_protocol(bins):
    r = run(bins, "loaderd", "--job-keys")
    assert r.returncode == 0, r.stderr
    keys = keys_of(r.stdout)
    assert "seq_len" in keys and "datasets[].weight" in keys, keys
    proto = open(os.path.join(ROOT, "proto", "PROTOCOL.md")).read()
    para = proto[proto.index("* `job` keys"):proto.index("Unknown keys are refused", proto.index("* `job` keys"))]
    for k in keys:
        assert re.search(r"\b%s\b" % re.escape(k.split(".")[-1]), para), (k, para)
