"""The wiring between the trainer's parts (issue 22): one backend interface, one run state, arrows
that run one way. Read from the sources and the built objects, so a change that brings back a
global, an #ifdef'd backend or an include running back up fails here:

- no BT_WITH_CUDA anywhere: the run (trainer/loop/train.c, eval.c, main.c) is compiled once and
  reaches its backend through trainer/backend/backend.h;
- include arrows run down: only the run (trainer/loop/, trainer/main.c) includes trainer/loop/,
  only the GPU trainer includes trainer/cuda/, trainer/backend/ includes nothing above the model,
  kernels/ nothing of trainer/; and the include graph of trainer/ + kernels/ has no cycle;
- the objects of trainer/loop call one way (no cycle between files, from nm), and the only
  writable global they define is the stop flag the signal handler sets (bt_run_stop_sig);
- kernels/cuda/ mirrors kernels/cpu/ op for op."""
import collections
import os
import re
import subprocess

import pytest

from conftest import BUILD, ROOT

INCLUDE = re.compile(r'^\s*#\s*include\s+"((?:trainer|kernels)/[^"]+)"', re.M)


def sources(*tops):
    for top in tops:
        for dp, _, fs in os.walk(os.path.join(ROOT, top)):
            for f in fs:
                if f.endswith((".c", ".h", ".cu")):
                    p = os.path.join(dp, f)
                    yield os.path.relpath(p, ROOT), open(p, errors="replace").read()


def include_edges():
    return [(f, inc) for f, text in sources("trainer", "kernels") for inc in INCLUDE.findall(text)]


def cycles(adj):
    found, color = [], {}

    def dfs(u, stack):
        color[u] = 1
        stack.append(u)
        for v in sorted(adj.get(u, ())):
            if color.get(v) == 1:
                found.append(stack[stack.index(v):] + [v])
            elif not color.get(v):
                dfs(v, stack)
        stack.pop()
        color[u] = 2

    for u in sorted(adj):
        if not color.get(u):
            dfs(u, [])
    return found


def test_no_backend_ifdef():
    hits = [f for f, text in sources("trainer", "kernels", "tests") if "BT_WITH_CUDA" in text]
    make = open(os.path.join(ROOT, "Makefile")).read()
    assert not hits and "BT_WITH_CUDA" not in make, hits
    for f in ("trainer/loop/train.c", "trainer/loop/eval.c", "trainer/main.c"):
        assert not re.search(r"^\s*#\s*if", open(os.path.join(ROOT, f)).read(), re.M), f


def test_include_arrows_run_down():
    bad = []
    for f, inc in include_edges():
        d = os.path.dirname(f)
        if inc.startswith("trainer/loop/") and not (d == "trainer/loop" or f == "trainer/main.c"):
            bad.append((f, inc, "only the run includes trainer/loop/"))
        if inc.startswith("trainer/cuda/") and d != "trainer/cuda":
            bad.append((f, inc, "only the GPU trainer includes trainer/cuda/"))
        # (the floors below trainer/, kernels/ (the workspace sizes the memory plan bills) and
        # common/, are open to it)
        if d == "trainer/backend" and inc.startswith("trainer/") and not (
                inc.startswith(("trainer/backend/", "trainer/model/")) or inc == "trainer/config.h"):
            bad.append((f, inc, "the backend interface sits below the backends and the run"))
        if f.startswith("kernels/") and inc.startswith("trainer/"):
            bad.append((f, inc, "kernels/ sits below trainer/"))
    assert not bad, "\n".join(map(str, bad))


def test_include_graph_has_no_cycle():
    adj = collections.defaultdict(set)
    for f, inc in include_edges():
        adj[f].add(inc)
    assert not cycles(adj)


def nm(obj):
    return subprocess.run(["nm", obj], capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def loop_objects():
    d = os.path.join(BUILD, "obj", "trainer", "loop")
    srcs = [f[:-2] for f in os.listdir(os.path.join(ROOT, "trainer", "loop")) if f.endswith(".c")]
    objs = {s: os.path.join(d, s + ".o") for s in srcs}
    missing = [o for o in objs.values() if not os.path.exists(o)]
    assert not missing, f"not built (make all): {missing}"
    return objs


def test_trainer_loop_calls_run_one_way(loop_objects):
    defined, used = {}, collections.defaultdict(set)
    for name, obj in loop_objects.items():
        for line in nm(obj).splitlines():
            p = line.split()
            if len(p) == 3 and p[1] in "TDBRC":
                defined[p[2]] = name
            elif len(p) == 2 and p[0] == "U":
                used[name].add(p[1])
    adj = {a: {defined[s] for s in syms if s in defined and defined[s] != a} for a, syms in used.items()}
    assert not cycles(adj), adj
    # the run is reached from above only: nothing in loop/ calls train.c
    assert not [a for a, bs in adj.items() if "train" in bs], adj


def test_the_one_writable_global_is_the_stop_flag(loop_objects):
    writable = []
    for name, obj in loop_objects.items():
        out = subprocess.run(["objdump", "-t", obj], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            m = re.search(r"\sO\s+(\.\S+)\s+\S+\s+(\S+)$", line)
            if m and re.match(r"\.(data|bss|tdata|tbss)(\.|$)", m.group(1)) and "rel.ro" not in m.group(1):
                writable.append((name, m.group(2)))
    assert writable == [("run", "bt_run_stop_sig")], writable


def test_kernels_cuda_mirrors_kernels_cpu():
    cpu = {f[:-2] for f in os.listdir(os.path.join(ROOT, "kernels", "cpu")) if f.endswith(".c")}
    cuda = {f[:-3] for f in os.listdir(os.path.join(ROOT, "kernels", "cuda")) if f.endswith(".cu")}
    ops = {"attention", "embedding", "ggml", "linear", "loss", "nf4", "norm", "optim", "rope", "swiglu"}
    assert ops <= cpu and ops <= cuda, (sorted(ops - cpu), sorted(ops - cuda))
    # the rest is each side's own: BLAS plumbing on the CPU; second kernel sets and bf16 casts on the GPU
    assert cpu - ops == {"blas_env", "blas_par", "tiled_gemm"}, sorted(cpu - ops)
    assert cuda - ops == {"attention_mma", "nf4_gemm", "convert"}, sorted(cuda - ops)
