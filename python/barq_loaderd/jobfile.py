"""Trainer job files (JSON or YAML) read exactly as `trainer` reads them (trainer/config.c
bt_config_load; common/yaml_json.c for YAML), so that a job file means the same thing to our C
trainer and to a Python trainer fed through this package.

    from barq_loaderd.jobfile import load_job
    job = load_job("job.yaml")          # dict; JobFileError (a ValueError) names file:line:column

Which parser: a path ending in .yaml or .yml is YAML, anything else JSON (the trainer's rule).
Both: at most 64 MiB, UTF-8, a leading UTF-8 BOM skipped, the root must be a mapping / object.

JSON (jansson with JSON_REJECT_DUPLICATES in the trainer): a key given twice in one object is an
error; NaN / Infinity, integers outside int64, reals that overflow and \\u0000 in strings are
refused, as jansson refuses them.

YAML: the events come from libyaml, as in the trainer (PyYAML's CParser, which is libyaml;
PyYAML's pure-Python parser where PyYAML was built without it), and are turned into the tree by
the rules of common/yaml_json.c, transcribed here:
  - exactly one document; mappings -> dicts (a key is the scalar's text, whatever its style or
    tag; a key given twice is an error naming both lines), sequences -> lists;
  - plain scalars by the YAML 1.2 core schema: null, Null, NULL, ~ and empty -> None;
    true/True/TRUE/false/False/FALSE -> bool; [-+]?[0-9]+, 0o[0-7]+, 0x[0-9a-fA-F]+ -> int
    (outside int64: error); decimal and exponent forms (1e-3, 2.5, .5, 5.) -> float; .inf / .nan
    -> error (JSON has no such numbers); anything else -> str. So YAML 1.1's yes/no/on/off are
    strings, where PyYAML's own safe_load would make them booleans (and 1e-3 a string);
  - quoted, literal and folded scalars are strings; the tags !!str, !!int, !!float, !!bool,
    !!null (and the non-specific "!") are honoured, any other tag is an error;
  - anchors and aliases are expanded (an alias copies the anchored value; an anchor on a key is
    not registered; an alias used as a key must name a string); the expansion is capped at
    1,000,000 values and nesting at 64 levels (billion laughs fail with a message);
  - merge keys (<<) are refused: YAML 1.1 only.
"""
import json
import os

MAX_BYTES = 64 << 20
MAX_NODES = 1000000   # common/yaml_json.h BT_YAML_MAX_NODES
MAX_DEPTH = 64        # BT_YAML_MAX_DEPTH
TAG_PREFIX = "tag:yaml.org,2002:"
INT64 = (-(1 << 63), (1 << 63) - 1)


class JobFileError(ValueError):
    """A job file that the trainer would refuse to read; the message starts with origin:line:col
    where there is one."""


def is_yaml(path):
    """The trainer's rule (bt_config_is_yaml): the name ends in .yaml or .yml."""
    p = os.fspath(path)
    return (len(p) > 5 and p.endswith(".yaml")) or (len(p) > 4 and p.endswith(".yml"))


def load_job(path):
    """The job file at path as a dict (see the module doc). JobFileError on anything the trainer
    refuses to read; OSError when it cannot be read."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise JobFileError(f"{path}: larger than {MAX_BYTES >> 20} MiB")
    return loads_yaml(data, path) if is_yaml(path) else loads_json(data, path)


def _text(data, origin):
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise JobFileError(f"{origin}:{line}:{col}: not valid UTF-8") from None


class _Refused(Exception):
    """Raised by the JSON hooks; _json_refusal then finds where."""


def loads_json(data, origin="<json>"):
    """A JSON job text (str or bytes) -> dict, with the trainer's JSON rules."""
    text = _text(data, origin)

    def pairs(kv):
        keys = set()
        for k, _ in kv:
            if k in keys:
                raise _Refused()
            keys.add(k)
        return dict(kv)

    def constant(name):
        raise _Refused()

    def integer(t):
        v = int(t)
        if not INT64[0] <= v <= INT64[1]:
            raise _Refused()
        return v

    def real(t):
        v = float(t)
        if v in (float("inf"), float("-inf")):
            raise _Refused()
        return v
    try:
        root = json.loads(text, object_pairs_hook=pairs, parse_constant=constant, parse_int=integer,
                          parse_float=real)
    except _Refused:
        line, col, what = _json_refusal(text)
        raise JobFileError(f"{origin}:{line}:{col}: {what}") from None
    except json.JSONDecodeError as e:
        hint = ""
        if e.lineno == 1 and e.colno <= 1 and not origin.endswith(".json"):
            hint = " (a YAML config needs a .yaml or .yml file name)"
        raise JobFileError(f"{origin}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}{hint}") from None
    if not isinstance(root, dict):
        raise JobFileError(f"{origin}: expected a JSON object at top level")
    if _has_nul(root):  # jansson refuses \u0000 without JSON_ALLOW_NUL
        line, col, what = _json_refusal(text)
        raise JobFileError(f"{origin}:{line}:{col}: {what}")
    return root


def _json_refusal(text):
    """(line, column, what) of the first thing in document order that jansson refuses although
    Python's json accepts it: a key repeated in its object (the position just past it, where
    jansson stops), NaN / Infinity, an integer outside int64, a real that overflows (the position
    of the value), \\u0000 in a string. Only called on the error path."""
    from json import scanner
    from json.decoder import JSONDecoder, scanstring
    ws = " \t\n\r"
    at = [0]

    class Found(Exception):
        pass

    def value(s, idx, scan_once):
        at[0] = idx
        return scan_once(s, idx)

    def skip(s, i):
        while s[i] in ws:
            i += 1
        return i

    def parse_object(s_and_end, strict, scan_once, *_):
        s, end = s_and_end  # just past "{"
        keys = set()
        end = skip(s, end)
        if s[end] == "}":
            return {}, end + 1
        while True:
            start = skip(s, end)
            key, end = scanstring(s, start + 1, strict)
            if "\0" in key:
                raise Found(start, "invalid JSON: \\u0000 is not allowed")
            if key in keys:
                raise Found(end, f"duplicate key {key!r} (each key may appear only once in an object)")
            keys.add(key)
            end = skip(s, skip(s, end) + 1)  # past ":"
            _, end = value(s, end, scan_once)
            end = skip(s, end)
            if s[end] == "}":
                return {}, end + 1
            end += 1  # ","

    def parse_array(s_and_end, scan_once):
        s, end = s_and_end  # just past "["
        end = skip(s, end)
        if s[end] == "]":
            return [], end + 1
        while True:
            _, end = value(s, skip(s, end), scan_once)
            end = skip(s, end)
            if s[end] == "]":
                return [], end + 1
            end += 1

    def constant(name):
        raise Found(at[0], f"invalid JSON: {name} is not a JSON number")

    def integer(t):
        if not INT64[0] <= int(t) <= INT64[1]:
            raise Found(at[0], f"invalid JSON: too big integer {t[:40]}")
        return 0

    def real(t):
        if float(t) in (float("inf"), float("-inf")):
            raise Found(at[0], f"invalid JSON: real number overflow {t[:40]}")
        return 0.0

    def string(s, end, strict):
        v, stop = scanstring(s, end, strict)
        if "\0" in v:
            raise Found(end - 1, "invalid JSON: \\u0000 is not allowed")
        return v, stop

    d = JSONDecoder(parse_constant=constant, parse_int=integer, parse_float=real)
    d.parse_object, d.parse_array, d.parse_string = parse_object, parse_array, string
    scan = scanner.py_make_scanner(d)
    try:
        value(text, len(text) - len(text.lstrip(ws)), scan)
    except Found as f:
        pos, what = f.args
        return text.count("\n", 0, pos) + 1, pos - (text.rfind("\n", 0, pos) + 1) + 1, what
    except (ValueError, IndexError, StopIteration):
        pass
    return 1, 1, "invalid JSON"


def _has_nul(v):
    if isinstance(v, str):
        return "\0" in v
    if isinstance(v, list):
        return any(_has_nul(x) for x in v)
    if isinstance(v, dict):
        return any("\0" in k or _has_nul(x) for k, x in v.items())
    return False


# ---- YAML ----

def _all_in(s, chars):
    return bool(s) and all(c in chars for c in s)


def _is_int(s):
    """(base, digits) when s is a core-schema integer, else None."""
    if s.startswith("0o"):
        return (8, s[2:]) if _all_in(s[2:], "01234567") else None
    if s.startswith("0x"):
        return (16, s[2:]) if _all_in(s[2:], "0123456789abcdefABCDEF") else None
    body = s[1:] if s[:1] in "-+" else s
    return (10, s) if _all_in(body, "0123456789") else None


def _is_float(s):
    p = s[1:] if s[:1] in "-+" else s
    i, n = 0, len(p)
    digits = 0
    while i < n and p[i].isascii() and p[i].isdigit():
        i, digits = i + 1, digits + 1
    if i < n and p[i] == ".":
        i += 1
        frac = 0
        while i < n and p[i].isascii() and p[i].isdigit():
            i, frac = i + 1, frac + 1
        if not digits and not frac:
            return False
    elif not digits:
        return False
    if i < n and p[i] in "eE":
        i += 1
        if i < n and p[i] in "-+":
            i += 1
        if not (i < n and p[i].isascii() and p[i].isdigit()):
            return False
        while i < n and p[i].isascii() and p[i].isdigit():
            i += 1
    return i == n


def _is_special_float(s):
    p = s[1:] if s[:1] in "-+" else s
    return p in (".inf", ".Inf", ".INF") or s in (".nan", ".NaN", ".NAN")


class _Yaml:
    def __init__(self, origin):
        self.origin = origin
        self.stack = []      # open collections: [node, path, pending key, anchor]
        self.anchors = []    # [(name, value)], searched from the end
        self.nodes = 0
        self.root = None
        self.have_root = False
        self.docs = 0

    def fail(self, mark, what):
        line, col = (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)
        raise JobFileError(f"{self.origin}:{line}:{col}: {what}")

    def resolve(self, e):
        s, tag, kind = e.value, e.tag, None
        if tag == "!":
            kind = "str"
        elif tag and tag.startswith(TAG_PREFIX):
            kind = tag[len(TAG_PREFIX):]
            if kind not in ("str", "int", "float", "bool", "null"):
                self.fail(e.start_mark, f"unsupported tag !!{kind} (str, int, float, bool, null)")
        elif tag:
            self.fail(e.start_mark, f"unsupported tag {tag[:60]}")
        if kind is None and e.style not in (None, ""):
            kind = "str"
        if "\0" in s:
            self.fail(e.start_mark, "NUL byte in a scalar")
        if kind == "str":
            return s
        if kind in (None, "null") and s in ("", "~", "null", "Null", "NULL"):
            return None
        if kind in (None, "bool"):
            if s in ("true", "True", "TRUE"):
                return True
            if s in ("false", "False", "FALSE"):
                return False
        num = _is_int(s)
        if kind in (None, "int") and num:
            v = int(num[1], num[0])
            if not INT64[0] <= v <= INT64[1]:
                self.fail(e.start_mark, f"integer {s[:40]} does not fit in 64 bits")
            return v
        if kind in (None, "float") and (_is_float(s) or num):
            # an integer form keeps its base (0o17 -> 15.0), saturating at 2^64 - 1 as strtoull
            v = float(s) if num is None or num[0] == 10 else float(min(int(num[1], num[0]), (1 << 64) - 1))
            if v in (float("inf"), float("-inf")):
                self.fail(e.start_mark, f"number {s[:40]} is out of range")
            return v
        if kind in (None, "float") and _is_special_float(s):
            self.fail(e.start_mark, f"{s}: infinities and NaN have no JSON form")
        if kind:
            self.fail(e.start_mark, f"\"{s[:40]}\" is not a valid !!{kind}")
        return s

    def key_expected(self):
        return bool(self.stack) and isinstance(self.stack[-1][0], dict) and self.stack[-1][2] is None

    def take_key(self, e, text, lines):
        top = self.stack[-1]
        if "\0" in text:
            self.fail(e.start_mark, "NUL byte in a key")
        if text == "<<":
            self.fail(e.start_mark, "merge keys (<<) are not supported: write the keys out")
        path = f"{top[1]}.{text}" if top[1] else text
        if text in top[0]:
            self.fail(e.start_mark, f"duplicate key \"{path[:80]}\" (first at line {lines.get(path, 0)})")
        lines[path] = e.start_mark.line + 1
        top[2] = text

    def attach(self, value):
        if not self.stack:
            self.root, self.have_root = value, True
            return
        top = self.stack[-1]
        if isinstance(top[0], list):
            top[0].append(value)
        else:
            top[0][top[2]] = value
            top[2] = None

    def child_path(self):
        top = self.stack[-1]
        if isinstance(top[0], list):
            return f"{top[1]}[{len(top[0])}]"
        return f"{top[1]}.{top[2]}" if top[1] else top[2]


def _count(v):
    if isinstance(v, list):
        return 1 + sum(_count(x) for x in v)
    if isinstance(v, dict):
        return 1 + sum(_count(x) for x in v.values())
    return 1


def _copy(v):
    if isinstance(v, list):
        return [_copy(x) for x in v]
    if isinstance(v, dict):
        return {k: _copy(x) for k, x in v.items()}
    return v


def loads_yaml(data, origin="<yaml>"):
    """A YAML job text (str or bytes) -> dict, with the trainer's rules (see the module doc)."""
    try:
        import yaml
    except ImportError:
        raise JobFileError(f"{origin}: reading a YAML job file needs PyYAML (pip install PyYAML)") from None
    text = _text(data, origin)
    loader = getattr(yaml, "CSafeLoader", None) or yaml.SafeLoader
    y = _Yaml(origin)
    lines = {}
    try:
        for e in yaml.parse(text, Loader=loader):
            _on_event(y, e, lines, yaml)
    except yaml.MarkedYAMLError as e:
        m = e.problem_mark or e.context_mark
        what = " ".join(x for x in (e.problem, e.context) if x) or "YAML syntax error"
        y.fail(m, what)
    except yaml.YAMLError as e:
        raise JobFileError(f"{origin}: {e}") from None
    if not isinstance(y.root, dict):
        raise JobFileError(f"{origin}:1:1: expected a mapping (key: value lines) at the top level")
    return y.root


def _on_event(y, e, lines, yaml):
    if isinstance(e, yaml.DocumentStartEvent):
        y.docs += 1
        if y.docs > 1:
            y.fail(e.start_mark, "more than one YAML document")
    elif isinstance(e, yaml.ScalarEvent):
        if y.key_expected():
            y.take_key(e, e.value, lines)
            return
        v = y.resolve(e)
        y.nodes += 1
        if y.nodes > MAX_NODES:
            y.fail(e.start_mark, f"more than {MAX_NODES} values")
        if e.anchor:
            y.anchors.append((e.anchor, v))
        y.attach(v)
    elif isinstance(e, yaml.AliasEvent):
        src, found = None, False
        for name, v in reversed(y.anchors):
            if name == e.anchor:
                src, found = v, True
                break
        if not found:
            y.fail(e.start_mark, f"unknown alias *{e.anchor[:60]}")
        if y.key_expected():
            if not isinstance(src, str):
                y.fail(e.start_mark, f"alias *{e.anchor[:60]} as a key")
            y.take_key(e, src, lines)
            return
        y.nodes += _count(src)
        if y.nodes > MAX_NODES:
            y.fail(e.start_mark, f"aliases expand to more than {MAX_NODES} values")
        y.attach(_copy(src))
    elif isinstance(e, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
        if y.key_expected():
            y.fail(e.start_mark, "a mapping or sequence as a key is not supported")
        if len(y.stack) >= MAX_DEPTH:
            y.fail(e.start_mark, f"nesting deeper than {MAX_DEPTH} levels")
        y.nodes += 1
        if y.nodes > MAX_NODES:
            y.fail(e.start_mark, f"more than {MAX_NODES} values")
        is_map = isinstance(e, yaml.MappingStartEvent)
        if e.tag and e.tag != TAG_PREFIX + ("map" if is_map else "seq"):
            y.fail(e.start_mark, f"unsupported tag {e.tag[:60]}")
        path = y.child_path() if y.stack else ""
        y.stack.append([{} if is_map else [], path, None, e.anchor])
    elif isinstance(e, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
        node, _, _, anchor = y.stack.pop()
        if anchor:
            y.anchors.append((anchor, node))
        y.attach(node)
