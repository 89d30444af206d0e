"""The command lines of the test and benchmark tools (tests/tools/*.c, tests/bench/gpu/*.cu), all
parsed with getopt_long (issue 22 section 3): --help prints the usage on stdout and exits 0; an
unknown option, an option missing its value, or a stray argument prints a usage line on stderr
and exits 2, before the tool does any work (no model, socket or device is needed for that).

The GPU benchmarks are checked in their emulator builds ($BT_BUILD/emu/bench, make test-emu),
where present: they parse the command line before looking for a device."""
import os
import subprocess

import pytest

from conftest import BUILD

# tool -> an option that takes a value (given without one below)
TOOLS = {
    "tools/bench_dataplane": "--model",
    "tools/bench_pipeline": "--shards",
    "tools/bench_ring": "--slots",
    "tools/bench_tok": "--engine",
    "tools/bench_train": "--tokens",
    "tools/bt_logits": "--ids",
    "tools/ld_consume": "--socket",
    "tools/mk_tiny_gguf": "--layers",
    "tools/sandbox_probe": "--write",
    "emu/bench/bench_kernels_gpu": "--shape",
    "emu/bench/bench_step_gpu": "--attn",
}


def run(tool, *args):
    path = os.path.join(BUILD, tool)
    if not os.access(path, os.X_OK):
        pytest.skip(f"{path} not built")
    return subprocess.run([path, *args], capture_output=True, text=True, timeout=60)


def usage_line(text, tool):
    name = os.path.basename(tool)
    return any(ln.startswith("usage:") and name in ln for ln in text.splitlines())


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_help_prints_usage_and_exits_0(tool):
    r = run(tool, "--help")
    assert r.returncode == 0, r.stderr
    assert usage_line(r.stdout, tool), r.stdout


@pytest.mark.parametrize("tool", sorted(TOOLS))
@pytest.mark.parametrize("args", [("--no-such-option",), ("--no-such-option", "1"), ("stray-argument",),
                                  ("VALUE_OPT",)], ids=["unknown", "unknown-with-value", "stray", "no-value"])
def test_bad_command_line_prints_usage_and_exits_2(tool, args):
    args = [TOOLS[tool] if a == "VALUE_OPT" else a for a in args]
    if os.path.basename(tool) in ("bench_tok", "bench_train") and args == ["stray-argument"]:
        args = ["one", "two", "three"]  # these take positional arguments: too many of them
    r = run(tool, *args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert usage_line(r.stderr, tool), r.stderr
    assert not r.stdout.strip(), r.stdout  # refused before doing any work
