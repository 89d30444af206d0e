"""Monitoring and control (issue 3 §5): protocol version handshake, status/jobs/metrics fields
(consumer lag and idle time, tokenizer throughput, refusals by reason), `loaderctl` for people
(status, jobs, hello, watch redrawing in place on a terminal) and scripts (--json), and the
daemon-less tools `loaderctl preview` and `loaderctl tokenize`."""
import json
import os
import pty
import re
import select
import signal
import subprocess
import time

import pytest

from conftest import chat_line, read_line, write_shard
from test_loaderd_server import attach, base_config, check_batch, dataset, job_spec, parse_batch  # noqa: F401


def ctl_json(d, *args):
    out = d.ctl(*args, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_hello_and_versioning(loaderd, dataset, model_path):
    d = loaderd(base_config(dataset, model_path))
    rep = d.request({"op": "hello"})
    assert rep["ok"] and rep["v"] == 1 and rep["proto"] == 1 and rep["min_proto"] == 1
    assert rep["ring_version"] == 1 and rep["batch_layout_version"] == 3
    assert set(rep["ops"]) == {"hello", "attach", "detach", "report", "ref_put", "status", "jobs", "metrics", "drain", "reload"}
    assert rep["uid"] == os.getuid() and rep["pid"] == d.proc.pid
    # every reply carries "v"; a request from a future version is refused with a message
    for v in (0, 2, "1", None):
        r = d.request({"op": "status", "v": v})
        assert r["ok"] is False and r["v"] == 1 and "version" in r["error"], r
    out = d.ctl("hello")
    assert out.returncode == 0 and "protocol 1" in out.stdout, out


def test_status_consumer_lag_and_metrics(loaderd, dataset, model_path):
    d = loaderd(base_config(dataset, model_path))
    s, rep, ring = attach(d, job_spec(dataset, model_path, ring_slots=4))
    for step in range(3):
        check_batch(parse_batch(ring.next(), 2, 64), 2, 64, rep["job_id"], step)
        ring.release()
    deadline = time.time() + 10
    while True:  # the producer refills the ring: 4 waiting, one more in its hands
        job = ctl_json(d, "status")["jobs"][0]
        if job["ring_fill"] == 4:
            break
        assert time.time() < deadline, job
        time.sleep(0.05)
    assert job["consumed"] == 3 and job["batches"] >= 7
    assert job["consumer_lag_batches"] == job["batches"] - 3 and job["consumer_lag_batches"] >= 4
    time.sleep(1.5)  # the trainer takes nothing: idle time grows
    job = ctl_json(d, "status")["jobs"][0]
    assert job["consumer_idle_s"] >= 1.4, job
    ring.next()
    ring.release()
    time.sleep(0.1)
    job = ctl_json(d, "status")["jobs"][0]
    assert job["consumed"] == 4 and job["consumer_idle_s"] < 1.0, job
    jobs = ctl_json(d, "jobs")["jobs"]
    assert jobs[0]["consumed"] == 4 and "consumer_idle_s" not in jobs[0]  # the short listing
    st = ctl_json(d, "status")
    assert st["refused"] == {"max_clients": 0, "permission": 0, "timeout": 0, "too_long": 0, "max_clients_per_uid": 0}
    assert st["connections_total"] >= 5 and st["client_timeout_s"] == 60
    # Prometheus text: the new series, each announced by HELP and TYPE before its samples
    text = d.ctl("metrics").stdout
    labels = '{job="unit-job",job_id="%d",rank="0"}' % rep["job_id"]
    for name, kind in [("loaderd_consumer_lag_batches", "gauge"), ("loaderd_consumer_idle_seconds", "gauge"),
                       ("loaderd_batches_consumed_total", "counter"), ("loaderd_tokenizer_tokens_per_second", "gauge"),
                       ("loaderd_refused_connections_total", "counter"), ("loaderd_connections_total", "counter")]:
        assert "# HELP %s " % name in text and "# TYPE %s %s\n" % (name, kind) in text, name
    assert "loaderd_batches_consumed_total%s 4\n" % labels in text
    lag = re.search(r"^loaderd_consumer_lag_batches%s (\S+)$" % re.escape(labels), text, re.M)
    assert lag and float(lag.group(1)) >= 4
    assert 'loaderd_refused_connections_total{reason="permission"} 0' in text
    # human table shows the lag and idle columns
    out = d.ctl("status").stdout
    assert "LAG" in out and "IDLE" in out and "unit-job" in out
    s.close()
    ring.close()


def test_status_shows_a_runs_ranks_and_marks_the_one_behind(loaderd, dataset, model_path):
    """Ranks of one data-parallel run (the attach's "run") are shown together, in rank order, with
    step, loss, tokens/s, ring fill and the age of their last report; a rank two or more steps
    behind the others, or without any report while the others are past step 1, is marked.
    (The rule for a rank that stops reporting is unit-tested: tests/unit/loaderd/test_rank_status.c.)"""
    d = loaderd(base_config(dataset, model_path))
    spec = job_spec(dataset, model_path, name="sft")
    ranks = [attach(d, spec, rank=r, world=4, extra={"run": "r-1a2b.c:3"}) for r in (2, 0, 3, 1)]
    solo = attach(d, job_spec(dataset, model_path, name="solo"), extra={"run": None})
    assert all(rep["ok"] for _, rep, _ in ranks + [solo]), [rep for _, rep, _ in ranks + [solo]]
    for (s, rep, _), step in zip(ranks, (7, 10, None, 10)):  # ranks 2, 0, 3, 1
        if step is not None:
            r = d.request({"op": "report", "job_id": rep["job_id"], "step": step, "loss": 1.5 + step / 100,
                           "tokens_per_s": 900.0}, sock=s)
            assert r["ok"], r
    st = ctl_json(d, "status")
    sft = {j["rank"]: j for j in st["jobs"] if j["name"] == "sft"}
    assert [sft[r]["run"] for r in range(4)] == ["r-1a2b.c:3"] * 4
    assert [sft[r]["behind"] for r in range(4)] == [False, False, True, True], sft
    assert sft[2]["behind_reason"] == "3 steps behind"
    assert sft[3]["behind_reason"] == "no report yet, the others are at step 10"
    other = [j for j in st["jobs"] if j["name"] == "solo"][0]
    assert other["run"] is None and other["behind"] is False and other["behind_reason"] is None
    out = d.ctl("status").stdout
    assert 'run r-1a2b.c:3 "sft": 4 of 4 ranks on this node' in out, out
    rows = [l for l in out.splitlines() if re.match(r"^  [0-3]/4 ", l)]
    assert [l.split()[0] for l in rows] == ["0/4", "1/4", "2/4", "3/4"], out
    assert re.match(r"^  2/4 +7 +1\.5700 +900\.0 +\d+/\d+ +\d+\.\ds ago  << BEHIND: 3 steps behind$", rows[2]), rows
    assert rows[3].rstrip().endswith("none  << BEHIND: no report yet, the others are at step 10"), rows
    assert "BEHIND" not in rows[0] + rows[1], rows
    # "run" is checked like every other key
    for bad in ("", "x" * 65, "a b", 5, "é"):
        _, rep, ring = attach(d, spec, extra={"run": bad})
        assert not rep["ok"] and '"run"' in rep["error"] and ring is None, (bad, rep)


def test_metrics_are_wellformed_exposition(loaderd, dataset, model_path):
    """Every sample line parses (name, optional labels, float); HELP/TYPE come once per family
    and before its samples; label values are escaped (a newline cannot be in one: names with
    control characters are refused at attach, issue 21 §10)."""
    d = loaderd(base_config(dataset, model_path))
    s, rep, ring = attach(d, job_spec(dataset, model_path, name='a"b\\c d'))
    ring.next()
    text = d.ctl("metrics").stdout
    assert text.endswith("\n")
    sample = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(\\.|[^"\\])*",?)*\})? '
                        r'(-?[0-9.e+-]+|NaN|\+Inf|-Inf)$')
    helped, typed = set(), set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split(" ")[2]
            assert name not in helped, "duplicate HELP " + name
            helped.add(name)
        elif line.startswith("# TYPE "):
            name = line.split(" ")[2]
            assert name not in typed and name in helped
            typed.add(name)
        else:
            m = sample.match(line)
            assert m, "bad sample line: %r" % line
            assert m.group(1) in typed, "sample before TYPE: " + line
    assert 'job="a\\"b\\\\c d"' in text
    s.close()
    ring.close()


def test_loaderctl_watch_redraws_in_place_on_a_tty(loaderd, dataset, model_path, bins):
    d = loaderd(base_config(dataset, model_path))
    s, rep, ring = attach(d, job_spec(dataset, model_path))
    pid, fd = pty.fork()
    if pid == 0:  # child: loaderctl on a terminal
        os.execv(bins.path("loaderctl"), [bins.path("loaderctl"), "--socket", d.sock, "watch", "--interval", "0.2"])
    out = b""
    end = time.time() + 3
    while time.time() < end:
        r, _, _ = select.select([fd], [], [], 0.1)
        if r:
            try:
                out += os.read(fd, 65536)
            except OSError:
                break
    os.kill(pid, signal.SIGINT)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    text = out.decode(errors="replace")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert text.count("\x1b[H") >= 3, "each frame starts by homing the cursor"
    assert "\x1b[2J" not in text, "frames overwrite in place instead of clearing the screen"
    assert "\x1b[K" in text and "\x1b[J" in text and "unit-job" in text
    s.close()
    ring.close()


@pytest.fixture
def chat_job(tmp_path, model_path):
    data = tmp_path / "pv"
    data.mkdir()
    lines = [chat_line(f"What is {i}+{i}?", f"It is {2 * i}.\nDone.") for i in range(30)]
    write_shard(data / "a.jsonl", lines + ["not json"])
    spec = {"name": "pv", "shards": [str(data / "*.jsonl")], "format": "chat", "tokenizer": model_path,
            "seq_len": 128, "micro_batch_size": 2, "seed": 5}
    p = tmp_path / "job.json"
    p.write_text(json.dumps(spec))
    return p


def test_preview_marks_loss_and_documents(bins, chat_job):
    r = subprocess.run([bins.path("loaderctl"), "preview", "--job", str(chat_job), "--rows", "3"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.count("--- batch ") == 3 and out.count("--- row stats: ") == 3
    assert "|doc 1|" in out and "|doc 2|" in out
    assert "\x1b[" not in out, "no ANSI codes when stdout is not a terminal"
    # loss spans are exactly the assistant answers (ChatML: content and <|im_end|>)
    spans = re.findall(r"\[\[(.*?)\]\]", out, re.S)
    assert spans and all(re.fullmatch(r"It is \d+\.\u21b5\nDone\.<\|im_end\|>", x) for x in spans), spans
    assert "<|im_start|>user" in out and "[[<|im_start|>" not in out
    docs_in_rows = sum(int(m) for m in re.findall(r"row stats: (\d+) doc", out))
    assert docs_in_rows == len(spans) >= 3, "one loss span per chat document"
    assert re.search(r"=== 3 row\(s\), \d+ doc\(s\), \d+ real token\(s\), \d+ labelled", out)
    assert "json=1" in out  # the bad line is counted by reason
    forced = subprocess.run([bins.path("loaderctl"), "preview", "--job", str(chat_job), "--rows", "1", "--color"],
                            capture_output=True, text=True, timeout=60)
    assert forced.returncode == 0 and "\x1b[7;32m" in forced.stdout and "[[" not in forced.stdout


def test_preview_errors(bins, tmp_path, chat_job):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"shards": ["/nonexistent/*.jsonl"], "format": "chat", "tokenizer": "/x.gguf",
                               "seq_len": 64, "micro_batch_size": 1, "bogus": 1}))
    r = subprocess.run([bins.path("loaderctl"), "preview", "--job", str(bad)], capture_output=True, text=True)
    assert r.returncode == 1 and "bogus" in r.stderr
    r = subprocess.run([bins.path("loaderctl"), "preview"], capture_output=True, text=True)
    assert r.returncode == 2 and "--job" in r.stderr
    r = subprocess.run([bins.path("loaderctl"), "preview", "--job", str(tmp_path / "none.json")],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "cannot read" in r.stderr
    r = subprocess.run([bins.path("loaderctl"), "preview", "--job", str(chat_job), "--rows", "0"],
                       capture_output=True, text=True)
    assert r.returncode == 2


def test_tokenize_ids_and_pieces(bins, model_path):
    text = "Hello world\n<|im_start|>user\n\n  spaces\ttab 12345 é中\n"
    ids = subprocess.run([bins.path("loaderctl"), "tokenize", "--tokenizer", model_path, "--ids"], input=text,
                         capture_output=True, text=True, timeout=60)
    assert ids.returncode == 0, ids.stderr
    rows = ids.stdout.split("\n")
    assert len(rows) == 5 and rows[4] == ""  # one output line per input line
    assert rows[0] == "19556 905"  # SmolLM2: "Hello", " world" (HF tokenizers parity fixture ids)
    assert rows[1].split()[0] == "1"  # <|im_start|> is one control token
    assert rows[2] == ""  # an empty line gives an empty line
    assert all(0 <= int(x) < 49152 for r in rows for x in r.split())
    pieces = subprocess.run([bins.path("loaderctl"), "tokenize", "--tokenizer", model_path], input=text,
                            capture_output=True, text=True, timeout=60)
    assert pieces.returncode == 0
    prow = pieces.stdout.split("\n")
    assert prow[0] == "Hello Ġworld" and prow[1].startswith("<|im_start|> ")
    assert [len(r.split()) for r in prow] == [len(r.split()) for r in rows]
    plain = subprocess.run([bins.path("loaderctl"), "tokenize", "--tokenizer", model_path, "--ids", "--no-special"],
                           input="<|im_start|>\n", capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0 and plain.stdout.split()[0] != "1" and len(plain.stdout.split()) > 1
    r = subprocess.run([bins.path("loaderctl"), "tokenize", "--tokenizer", "/nonexistent.gguf"], input="x\n",
                       capture_output=True, text=True)
    assert r.returncode == 1 and "nonexistent" in r.stderr
