#!/usr/bin/env python3
"""Include and call graph between C files, and the circles in it.

    scripts/depgraph.py [--edges] FILE...        (e.g. loaderd/server*.[ch])

A module is a file name without its extension (loaderd/stream.c and loaderd/stream.h are the
module loaderd/stream). Edges between the modules named on the command line:
  include  X includes "Y.h"
  call     X.c names a function that Y.c defines (non-static; a call, or a reference such as a
           table row or a callback), or a function body in X.h does
Functions are found with Universal Ctags over the repository's C files; comments and string
literals are ignored. Prints every edge with --edges, then each circle (a strongly connected set
of two or more modules, with the edges inside it) and exits 1 when there is one, 0 otherwise.
Used by tests/py/test_layering.py; the floors it checks are in docs/ARCHITECTURE.md.
"""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ["common", "proto", "kernels", "loaderd", "trainer"]
IDENT = re.compile(r"[A-Za-z_]\w*")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def module(path):
    return os.path.splitext(os.path.normpath(path))[0]


def strip(text):
    """Text with comments, string and character literals blanked (lines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + " " * (min(j, n) - i - 1) + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def bodies(code):
    """Function bodies of a header: top-level {...} blocks that follow a ')'."""
    parts, depth, start = [], 0, None
    for i, c in enumerate(code):
        if c == "{":
            if depth == 0 and code[:i].rstrip().endswith(")"):
                start = i
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0 and start is not None:
                parts.append(code[start:i + 1])
                start = None
    return "\n".join(parts)


def definitions(extra=()):
    """name -> module of every non-static function defined in a .c file of the parts (and in
    the .c files of `extra`)."""
    files = [p for p in extra if p.endswith(".c")]
    for part in PARTS:
        for d, _, names in os.walk(os.path.join(ROOT, part)):
            files += [os.path.relpath(os.path.join(d, f), ROOT) for f in names if f.endswith(".c")]
    out = subprocess.run(["ctags", "-o", "-", "--kinds-C=f", "--fields=+S", "-L", "-"], cwd=ROOT,
                         input="\n".join(files), capture_output=True, text=True, check=True).stdout
    defs = {}
    for line in out.splitlines():  # the files named first win a name defined twice
        cols = line.split("\t")
        if len(cols) < 4 or any(c == "file:" for c in cols[3:]):
            continue  # static
        defs.setdefault(cols[0], module(cols[1]))
    return defs


def graph(paths):
    mods = {module(p) for p in paths}
    defs = definitions(paths)
    edges = {}  # (a, b) -> set of reasons
    for p in paths:
        a = module(p)
        text = open(os.path.join(ROOT, p), encoding="utf-8", errors="replace").read()
        for inc in INCLUDE.findall(text):
            cand = os.path.normpath(os.path.join(os.path.dirname(p), inc))
            for b in (module(inc), module(cand)):
                if b in mods and b != a:
                    edges.setdefault((a, b), set()).add("include " + inc)
                    break
        code = strip(text)
        if p.endswith(".h"):
            code = bodies(code)
        for name in set(IDENT.findall(code)):
            b = defs.get(name)
            if b in mods and b != a:
                edges.setdefault((a, b), set()).add(name)
    return mods, edges


def circles(mods, edges):
    """Strongly connected sets of two or more modules (Tarjan)."""
    adj = {m: sorted(b for (a, b) in edges if a == m) for m in mods}
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in adj[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for m in sorted(mods):
        if m not in index:
            visit(m)
    return out


def main(argv):
    show = "--edges" in argv
    paths = sorted({os.path.relpath(os.path.abspath(p), ROOT) for p in argv if p != "--edges"})
    if not paths:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    mods, edges = graph(paths)
    if show:
        for (a, b) in sorted(edges):
            print(f"{a} -> {b}: {', '.join(sorted(edges[(a, b)]))}")
    found = circles(mods, edges)
    for comp in found:
        inner = [f"  {a} -> {b}: {', '.join(sorted(edges[(a, b)]))}" for (a, b) in sorted(edges)
                 if a in comp and b in comp]
        print("circle: " + " <-> ".join(comp) + "\n" + "\n".join(inner))
    if not found:
        print(f"no circle among {len(mods)} modules ({len(edges)} edges)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
