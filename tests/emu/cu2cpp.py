#!/usr/bin/env python3
"""Rewrite one of our .cu files into host C++ for the CPU emulator (tests/emu/README.md).

    cu2cpp.py IN.cu OUT.cpp      rewrite (line numbers are kept; OUT starts with #line 1 "IN.cu")
    cu2cpp.py --check HDR...     fail if a header holds code the rewrite would have to change

Three rewrites, on code only (comments and string/char literals are skipped):
  1. launches  KERNEL<<<CFG>>>(ARGS)  ->  bt_emu_launch(KERNEL, "KERNEL", CFG)(ARGS)
     (KERNEL: an identifier, optionally qualified and with template arguments)
  2. extern __shared__ [__align__(N)] TYPE NAME[];
        ->  TYPE *NAME = reinterpret_cast<TYPE *>(bt_emu::dyn_smem());
  3. __shared__ TYPE NAME[...]...;  (static shared, becomes `static` in cuda_emu.h)
        ->  the same, followed by bt_emu::shared_poison(&NAME, sizeof(NAME)); per declarator, which
            fills it with 0xcd once per block (shared memory starts as garbage)
Anything it does not recognise (a `<<<` without `>>>(`, an unbalanced configuration, another
form of __shared__, inline asm outside an `#ifndef BT_CUDA_EMU` branch) is an error: exit 1 with
the file and line."""
import re
import sys


def die(path, src, pos, msg):
    line = src.count("\n", 0, pos) + 1
    sys.stderr.write("cu2cpp: %s:%d: %s\n" % (path, line, msg))
    sys.exit(1)


def code_mask(src):
    """mask[i] is True where src[i] is code (not in a comment or a string/char literal)."""
    n = len(src)
    mask = [True] * n
    i = 0
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            for k in range(i, j):
                mask[k] = False
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k in range(i, j):
                mask[k] = False
            i = j
        elif c == '"' or c == "'":
            # raw strings are not used in our .cu files
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            j += 1
            for k in range(i + 1, min(j - 1, n)):
                mask[k] = False  # keep the quotes as code, the contents are not
            i = j
        else:
            i += 1
    return mask


def blank_non_code(src, mask):
    return "".join(ch if m or ch == "\n" else " " for ch, m in zip(src, mask))


IDENT = re.compile(r"[A-Za-z_][A-Za-z_0-9]*$")


def kernel_expr_start(code, end, path, src):
    """code[start:end] is the kernel expression before `<<<`: ident[::ident]*[<targs>]."""
    i = end
    while i > 0 and code[i - 1] in " \t":
        i -= 1
    if i > 0 and code[i - 1] == ">":  # template arguments
        depth = 0
        j = i - 1
        while j >= 0:
            if code[j] == ">":
                depth += 1
            elif code[j] == "<":
                depth -= 1
                if depth == 0:
                    break
            elif code[j] in ";{}":
                die(path, src, end, "unbalanced template arguments before <<<")
            j -= 1
        if j < 0:
            die(path, src, end, "unbalanced template arguments before <<<")
        i = j
    j = i
    while j > 0 and (code[j - 1].isalnum() or code[j - 1] in "_:"):
        j -= 1
    name = code[j:i]
    if not name or not IDENT.search(name.split("::")[-1]) or name[0].isdigit():
        die(path, src, end, "cannot find the kernel name before <<<")
    return j


def balanced(s):
    d = 0
    for ch in s:
        if ch in "([{":
            d += 1
        elif ch in ")]}":
            d -= 1
            if d < 0:
                return False
    return d == 0


def rewrite_launches(src, code, path):
    out = []
    pos = 0
    while True:
        k = code.find("<<<", pos)
        if k < 0:
            break
        start = kernel_expr_start(code, k, path, src)
        e = code.find(">>>", k + 3)
        if e < 0:
            die(path, src, k, "<<< without >>>")
        cfg = src[k + 3:e]
        if not balanced(code[k + 3:e]) or "<<<" in code[k + 3:e] or ";" in code[k + 3:e]:
            die(path, src, k, "cannot parse the launch configuration <<<%s>>>" % cfg.strip())
        nargs = 1
        depth = 0
        for ch in code[k + 3:e]:
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
            elif ch == "," and depth == 0:
                nargs += 1
        if not 2 <= nargs <= 4:
            die(path, src, k, "launch configuration needs 2 to 4 arguments, got %d" % nargs)
        a = e + 3
        while a < len(code) and code[a] in " \t\n":
            a += 1
        if a >= len(code) or code[a] != "(":
            die(path, src, e, "expected the kernel arguments `(` after >>>")
        kern = src[start:k].strip()
        kname = re.sub(r"\s+", "", kern)
        out.append(src[pos:start])
        out.append('bt_emu_launch(%s, "%s", %s)' % (kern, kname, cfg.strip() if "\n" not in cfg else cfg))
        pos = e + 3
    out.append(src[pos:])
    return "".join(out)


EXTERN_SH = re.compile(
    r"extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s+)?([A-Za-z_][\w\s:]*?)\s*"
    r"([A-Za-z_]\w*)\s*\[\s*\]\s*;")
STATIC_SH = re.compile(r"__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s+)?([^;]*);")


def split_top(s):
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


def rewrite_shared(src, path):
    mask = code_mask(src)
    code = blank_non_code(src, mask)
    out, pos = [], 0
    for m in re.finditer(r"\b__shared__\b", code):
        s = m.start()
        if s < pos:
            continue
        pre = code[max(0, s - 40):s]
        if re.search(r"extern\s+$", pre):
            es = code.rfind("extern", 0, s)
            mm = EXTERN_SH.match(code, es)
            if not mm:
                die(path, src, s, "unsupported extern __shared__ declaration (expected "
                    "`extern __shared__ [__align__(N)] TYPE NAME[];`)")
            typ, name = mm.group(1).strip(), mm.group(2)
            out.append(src[pos:es])
            out.append("%s *%s = reinterpret_cast<%s *>(bt_emu::dyn_smem());" % (typ, name, typ))
            pos = mm.end()
            continue
        mm = STATIC_SH.match(code, s)
        if not mm or "=" in mm.group(1) or "(" in mm.group(1) or "{" in mm.group(1):
            die(path, src, s, "unsupported __shared__ declaration (expected "
                "`__shared__ [__align__(N)] TYPE NAME[dims], ...;` without initialiser)")
        decl = mm.group(1)
        parts = split_top(decl)
        names = []
        first = re.match(r"\s*(.*?)([A-Za-z_]\w*)\s*((?:\[[^\]]*\]\s*)*)$", parts[0], re.S)
        if not first or not first.group(1).strip():
            die(path, src, s, "cannot parse the __shared__ declaration")
        names.append(first.group(2))
        for p in parts[1:]:
            d = re.match(r"\s*([A-Za-z_]\w*)\s*((?:\[[^\]]*\]\s*)*)$", p)
            if not d:
                die(path, src, s, "cannot parse the __shared__ declarator %r" % p.strip())
            names.append(d.group(1))
        out.append(src[pos:mm.end()])
        out.append("".join(" bt_emu::shared_poison(&%s, sizeof(%s));" % (n, n) for n in names))
        pos = mm.end()
    out.append(src[pos:])
    return "".join(out)


def check_asm(src, code, path):
    """inline asm is only allowed in the `#ifndef BT_CUDA_EMU` branch of a conditional."""
    lines = code.split("\n")
    stack = []  # for each open #if: True if it is '#ifndef BT_CUDA_EMU' and we are in that branch
    off = 0
    for ln in lines:
        t = ln.strip()
        if t.startswith("#"):
            d = t[1:].strip()
            if d.startswith("if"):
                stack.append(bool(re.match(r"ifndef\s+BT_CUDA_EMU\b", d)))
            elif d.startswith("else") or d.startswith("elif"):
                if stack:
                    stack[-1] = False
            elif d.startswith("endif"):
                if stack:
                    stack.pop()
        elif re.search(r"\b(asm|__asm__)\b", ln) and not any(stack):
            die(path, src, off, "inline asm outside an `#ifndef BT_CUDA_EMU` branch: the emulator "
                "cannot run PTX (wrap the asm helper body, see tests/emu/README.md)")
        off += len(ln) + 1


def rewrite(path):
    src = open(path, encoding="utf-8").read()
    mask = code_mask(src)
    code = blank_non_code(src, mask)
    check_asm(src, code, path)
    src = rewrite_launches(src, code, path)
    src = rewrite_shared(src, path)
    mask = code_mask(src)
    code = blank_non_code(src, mask)
    for tok in ("<<<", ">>>"):
        k = code.find(tok)
        if k >= 0:
            die(path, src, k, "%s left after the rewrite" % tok)
    return '#line 1 "%s"\n' % path + src


def check_header(path):
    src = open(path, encoding="utf-8").read()
    code = blank_non_code(src, code_mask(src))
    for pat, what in ((r"<<<", "a kernel launch"), (r"\b__shared__\b", "a __shared__ declaration")):
        m = re.search(pat, code)
        if m:
            die(path, src, m.start(), "%s in a header: only .cu files are rewritten by cu2cpp.py"
                % what)
    check_asm(src, code, path)


def main(argv):
    if len(argv) >= 2 and argv[0] == "--check":
        for p in argv[1:]:
            check_header(p)
        return 0
    if len(argv) != 2:
        sys.stderr.write(__doc__)
        return 2
    out = rewrite(argv[0])
    with open(argv[1], "w", encoding="utf-8") as f:
        f.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
