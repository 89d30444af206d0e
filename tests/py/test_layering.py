"""The wiring between loaderd's and the trainer's files (issue 22 §3, §5): floors that only call and
include downwards, and one place that names each op.

- The include/call graph (scripts/depgraph.py) of the control server's files (loaderd/server*)
  and of the data plane's (pipeline -> stream -> chunkq / packer / source / format, over job.h)
  has no circle; the trainer's data-parallel floor (trainer/parallel) is below its run
  (trainer/loop) and never reaches back up.
- An op of the control protocol is named once, as a row of the command table in
  loaderd/server.c: no other code in loaderd/server* spells an op's name (comments aside), and
  loaderd's hello lists exactly the table's rows.
"""
import glob
import os
import re
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import depgraph  # noqa: E402

SERVER = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "loaderd", "server*.[ch]")))
DATA_PLANE = [f"loaderd/{m}.{e}" for m in ("pipeline", "stream", "chunkq", "packer", "source", "format", "job")
              for e in ("c", "h")]


def graph_circles(paths):
    mods, edges = depgraph.graph(paths)
    return depgraph.circles(mods, edges), edges


def test_server_floors_have_no_circle():
    found, edges = graph_circles(SERVER)
    assert not found, found
    # the transport hands requests up through hooks: it calls nothing of the floors above it
    assert not [b for (a, b) in edges if a == "loaderd/server_conn" and b != "loaderd/server_priv"], edges


def test_data_plane_floors_have_no_circle():
    found, edges = graph_circles([p for p in DATA_PLANE if os.path.exists(os.path.join(ROOT, p))])
    assert not found, found
    assert ("loaderd/stream", "loaderd/pipeline") not in edges


def test_parallel_is_below_the_loop():
    """Issue 22 §5: the data-parallel start-up, rendezvous and watchdog live in trainer/parallel/
    (not trainer/dist/, a name tools and people read as build output), on a floor below the run
    (trainer/loop): the run calls them, they never call or include the run."""
    assert not os.path.exists(os.path.join(ROOT, "trainer", "dist"))
    par = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "trainer", "parallel", "*.[ch]")))
    loop = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "trainer", "loop", "*.[ch]")))
    assert par and loop
    found, edges = graph_circles(par + loop)
    assert not [c for c in found if any(m.startswith("trainer/parallel/") for m in c)], found
    assert not [(a, b) for (a, b) in edges if a.startswith("trainer/parallel/") and b.startswith("trainer/loop/")], edges
    assert [(a, b) for (a, b) in edges if a.startswith("trainer/loop/") and b.startswith("trainer/parallel/")], edges


def test_loop_has_no_circle():
    """Issue 22 §2: the run's files call and include one way: train -> eval -> batches -> run,
    with the types the run and its callers share (run_types.h) on a floor of their own (run.h
    once included train.h, which made the four files one circle)."""
    loop = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "trainer", "loop", "*.[ch]")))
    found, edges = graph_circles(loop)
    assert not found, found
    assert ("trainer/loop/run", "trainer/loop/train") not in edges, edges


def test_script_reports_a_circle(tmp_path):
    """The checker itself: two files that call each other are a circle (exit 1)."""
    a, b, c = tmp_path / "zz_layer_a.c", tmp_path / "zz_layer_b.c", tmp_path / "zz_layer_c.c"
    a.write_text("int zz_a(void);\nint zz_b(void);\nint zz_a(void) { return zz_b(); }\n")
    b.write_text("int zz_a(void);\nint zz_b(void);\nint zz_b(void) { return zz_a(); }\n")
    c.write_text("int zz_b(void);\nint zz_c(void) { return zz_b(); }\n")
    script = os.path.join(ROOT, "scripts", "depgraph.py")
    r = subprocess.run([sys.executable, script, str(a), str(b)], capture_output=True, text=True)
    assert r.returncode == 1 and "circle" in r.stdout and "zz_layer_a" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([sys.executable, script, str(b), str(c)], capture_output=True, text=True)
    assert r.returncode == 0 and "no circle" in r.stdout, r.stdout + r.stderr


OPS = ["hello", "attach", "detach", "report", "status", "jobs", "metrics", "drain", "reload"]


def test_ops_are_named_once():
    table = open(os.path.join(ROOT, "loaderd", "server.c")).read()
    rows = re.findall(r'^\s*\{"([a-z]+)", (?:NULL|ld_parse_\w+), ld_op_\w+, LD_(?:ANYONE|OPERATORS)\},', table, re.M)
    assert rows == OPS, rows
    for path in SERVER:
        code = depgraph.strip(open(os.path.join(ROOT, path)).read())  # comments and strings blanked
        raw = open(os.path.join(ROOT, path)).read()
        # string literals naming an op, outside comments (strip() keeps a literal's quotes)
        literals = [m for m in re.finditer(r'"([a-z_]+)"', raw) if code[m.start()] == '"' and m.group(1) in OPS]
        named = [m.group(1) for m in literals if not (path == "loaderd/server.c" and m.group(1) in rows)]
        # "jobs" is also a reply key (the job list of status / jobs)
        named = [n for n in named if n != "jobs" or path != "loaderd/server_status.c"]
        assert not named, (path, named)
        assert not re.search(r"\bLD_OP_[A-Z]+\b", code), path


def test_document_path_grows_fallibly():
    """Issue 22 §4: the arrays that grow with a document (its tokens, its mask) never use the
    aborting bt_ids_push in the daemon's document path (every tokenizer family included); tests/unit/loaderd/test_memory.c and
    test_loaderd_faults.py check what happens instead (skipped, counted as "memory")."""
    files = ["common/tokenizer.c", "common/tokenizer_pre.c", "common/tokenizer_spm.c", "common/chat.c"] + \
        sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "loaderd", "*.c")))
    for path in files:
        code = depgraph.strip(open(os.path.join(ROOT, path)).read())
        assert not re.search(r"\bbt_ids_push\s*\(", code), path
    # the SentencePiece encoder's scratch (occurrences, symbols, bigram heap, escaped copy) grows
    # with the document too: no aborting allocation below its "encode" marker (the vocabulary's
    # own tables above it are built once, at load)
    raw = open(os.path.join(ROOT, "common", "tokenizer_spm.c")).read()
    assert "/* ---- encode ---- */" in raw
    encode = depgraph.strip(raw[raw.index("/* ---- encode ---- */"):])
    assert not re.search(r"\bbt_(x\w+|vec_xgrow)\s*\(", encode), re.findall(r"\bbt_(?:x\w+|vec_xgrow)\s*\(", encode)
