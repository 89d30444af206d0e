"""The repository stands alone, and what it names exists (issue 22 §5). Read from the tracked
files (`git ls-files`), so a comment that cites a note outside the repository, a document or a
section that does not exist, or a file that was renamed away fails here:

- no tracked file cites anything outside the repository: no note in the shared folder beside
  the repository other than its data sets (docs/data.md), no DESIGN.md, no research notes, no absolute
  /work/ paths;
- every citation of a repository document, `docs/<file>.md §<Section>` (the one form; also
  `proto/PROTOCOL.md §<n>`), names a file that exists and a heading of that file;
- every repository path a source, script or document names (`trainer/loop/step.c`,
  `docs/formats/`, ...) exists: as a tracked file or folder, or as the build product of one
  (`tests/tools/ld_consume` from `ld_consume.c`, `trainer/main.o` from `main.c`)."""
import os
import re
import subprocess

import pytest

from conftest import ROOT

HERE = os.path.relpath(__file__, ROOT)

# What may not be cited. Built from parts so this file does not match itself.
DESIGN = "DESIGN" + ".md"
OUTSIDE = [
    (re.compile(r"\.\./(?:\.\./)*shared/(?!data/)"), "a note beside the repository (only the shared data sets are used, docs/data.md)"),
    (re.compile(r"\b" + re.escape(DESIGN)), "the design notes outside the repository"),
    (re.compile(r"(?<![\w/])(?:research/[\w-]+|kernels|pipeline-formats|llmc|anchors-2026)\.md\b"),
     "the research notes outside the repository"),
    (re.compile(r"(?<![\w.])/work/"), "a path of one machine"),
]

# A repository document cited with a section: docs/formats/gguf.md §Blocks, proto/PROTOCOL.md §3.
TOP = r"(?:common|proto|loaderd|kernels|trainer|scripts|tests|python|docs)"
CITE = re.compile(r"(?<![\w./-])(" + TOP + r"/[\w./-]*\.md)(?:\s+§\s?([A-Za-z][\w-]*\w|[A-Za-z]|\d+))?")
# Any repository path. Not preceded by a path character (/etc/loaderd/... is not ours), nor by an
# upstream repository's name ("ggml-org/ggml docs/gguf.md", "ggml's docs/gguf.md").
PATH = re.compile(r"(?<![\w./@$-])(" + TOP + r"/[\w./-]*[\w/])")
UPSTREAM = re.compile(r"(?:[\w.-]+/[\w.-]+|\w+'s)\s+`?$")
SCANNED = (".c", ".h", ".cu", ".cuh", ".cpp", ".py", ".md", ".sh", ".json", ".txt", ".service")
# Text that reads like a repository path and is not one.
NOT_PATHS = {
    "docs/s": "documents per second",
    "loaderd/loaderd.json": "the installed config, under SYSCONFDIR",
    "python/object": "a YAML tag in a hostile config",
    "tests/bench/bench_a.sh": "BENCH_ONLY's example names",
    "python/build": "setuptools' in-tree build directory, removed by venv-torch.sh",
    "trainer/dist": "trainer/parallel's old name, named where the rename is checked",
    "tests/test-chat-template.cpp": "llama.cpp's own test file (its repository's tests/)",
}


def tracked():
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


@pytest.fixture(scope="module")
def tree():
    files = tracked()
    dirs = set()
    for f in files:
        d = os.path.dirname(f)
        while d:
            dirs.add(d)
            d = os.path.dirname(d)
    texts = {}
    for f in files:
        if f.startswith(("tests/fixtures/", "tests/fuzz/corpus/")) or f == HERE:
            continue
        if not (f.endswith(SCANNED) or f.startswith("scripts/") or f in ("Makefile", ".ci/run")):
            continue
        try:
            with open(os.path.join(ROOT, f), encoding="utf-8") as fh:
                texts[f] = fh.read()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
    return set(files), dirs, texts


def lineno(text, pos):
    return text.count("\n", 0, pos) + 1


def test_nothing_outside_the_repository_is_cited(tree):
    _, _, texts = tree
    bad = [f"{f}:{lineno(t, m.start())}: {m.group(0)!r}: {why}"
           for f, t in texts.items() for rx, why in OUTSIDE for m in rx.finditer(t)]
    assert not bad, "cite the repository's own docs/ instead:\n" + "\n".join(bad)


def headings(path):
    """First words of the Markdown headings of `path`, trailing ':' / '.' dropped."""
    out = set()
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        for line in fh:
            m = re.match(r"#+\s+(\S+)", line)
            if m:
                out.add(m.group(1).rstrip(":."))
    return out


def test_cited_documents_and_sections_exist(tree):
    files, _, texts = tree
    bad, n = [], 0
    for f, t in texts.items():
        for m in CITE.finditer(t):
            if UPSTREAM.search(t[max(0, m.start() - 40):m.start()]):
                continue
            n += 1
            doc, sec = m.group(1), m.group(2)
            where = f"{f}:{lineno(t, m.start())}"
            if doc not in files:
                bad.append(f"{where}: {doc} does not exist")
            elif sec and sec not in headings(doc):
                bad.append(f"{where}: {doc} has no section {sec!r} (headings: {sorted(headings(doc))})")
    assert n > 20, f"only {n} citations found: is the pattern still right?"
    assert not bad, "\n".join(bad)


def exists(p, files, dirs):
    if p in files or p in dirs or p in NOT_PATHS:
        return True
    if any(f.startswith(p + ".") for f in files):  # named without its extension
        return True
    stem, ext = os.path.splitext(p)
    if ext == ".o":  # an object file of the build: its source
        return any(stem + e in files for e in (".c", ".cu", ".cpp"))
    # a program the build makes from a source of the same name (tests/tools/ld_consume)
    return not ext and any(p + e in files for e in (".c", ".cu", ".cpp", ".sh", ".py"))


def test_named_repository_paths_exist(tree):
    files, dirs, texts = tree
    bad = []
    for f, t in texts.items():
        for m in PATH.finditer(t):
            p = m.group(1).rstrip("/.")
            base = os.path.basename(p)
            # placeholders: kernels/cpu/X.c, tests/gpu/test_X_gpu.cu written as tests/gpu/test_
            if base.endswith("_") or base.split(".")[0] in ("X", "x", "N", "*"):
                continue
            if UPSTREAM.search(t[max(0, m.start() - 40):m.start()]):
                continue
            if not exists(p, files, dirs):
                bad.append(f"{f}:{lineno(t, m.start())}: {p}")
    assert not bad, "named but not in the repository:\n" + "\n".join(bad)


@pytest.mark.parametrize("doc", ["docs/ARCHITECTURE.md"])
def test_readme_links_the_map(doc):
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        assert f"]({doc})" in fh.read()
