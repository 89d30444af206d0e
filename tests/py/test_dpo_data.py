"""scripts/make-dpo-data: the FOLDOC preference data set of `make demo-dpo` (issue 25 §4).

One real build (FOLDOC, installed by scripts/setup.sh; ~6 s) checked for: loaderd's `preference`
format in TRL's conversational form, chosen != rejected, no held-out term anywhere in training,
every pair's confusable really linked (cross-reference, shared headword word or shared gloss
words, checked against the raw FOLDOC text), both sides of comparable length (the shorter side
must not be the chosen one in most pairs: a summed log-prob would prefer it for its length),
glosses cut at sentence ends, counts. Determinism: a second build of a small dictd
fixture under another PYTHONHASHSEED gives the same bytes.
"""
import gzip
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "make-dpo-data")
FOLDOC_INDEX = "/usr/share/dictd/foldoc.index"
FOLDOC_DICT = "/usr/share/dictd/foldoc.dict.dz"
WORD = re.compile(r"[a-z][a-z0-9+#]{3,}")


def run(out, *args, seed_env="0"):
    env = dict(os.environ, PYTHONHASHSEED=seed_env)
    r = subprocess.run([sys.executable, SCRIPT, str(out), *args], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def load(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(l) for l in f]


def term_of(rec):
    m = re.fullmatch(r"What is (.*)\?", rec["prompt"][0]["content"], re.S)
    assert m, rec["prompt"]
    return m.group(1)


@pytest.fixture(scope="module")
def foldoc_build(tmp_path_factory):
    if not (os.path.exists(FOLDOC_INDEX) and os.path.exists(FOLDOC_DICT)):
        pytest.skip("dict-foldoc is not installed (scripts/setup.sh installs it)")
    out = tmp_path_factory.mktemp("dpo")
    msg = run(out, "--explain")
    man = json.load(open(out / "MANIFEST.json"))
    train = [r for n in man["files"] if n.startswith("train-") for r in load(out / n)]
    held = load(out / "eval.jsonl")
    return out, msg, man, train, held


def test_format_counts_and_no_leak(foldoc_build):
    out, msg, man, train, held = foldoc_build
    assert man["train_records"] == len(train) > 5000, msg
    assert man["eval_records"] == len(held) == 200, msg
    assert man["files"] == ["train-000.jsonl", "train-001.jsonl", "eval.jsonl"]
    for r in train + held:
        assert set(r) == {"prompt", "chosen", "rejected", "meta"}
        assert [m["role"] for m in r["prompt"]] == ["user"]
        assert [m["role"] for m in r["chosen"]] == ["assistant"] == [m["role"] for m in r["rejected"]]
        assert r["chosen"][0]["content"].strip() and r["rejected"][0]["content"].strip()
        assert r["chosen"] != r["rejected"]
        assert term_of(r) == r["meta"]["term"] != r["meta"]["confusable"]
    held_terms = {term_of(r) for r in held}
    held_defs = {r["chosen"][0]["content"] for r in held}
    assert len(held_terms) == len(held)
    for r in train:  # no held-out term in training: not as prompt, not as chosen, not as rejected
        assert term_of(r) not in held_terms and r["meta"]["confusable"] not in held_terms
        assert r["chosen"][0]["content"] not in held_defs and r["rejected"][0]["content"] not in held_defs
    # every rule is used, counts add up
    for split, n in (("train", len(train)), ("eval", len(held))):
        assert sum(man["rules"][split].values()) == n
        assert all(v > 0 for v in man["rules"][split].values()), man["rules"]


def test_confusables_really_linked(foldoc_build):
    _, _, _, train, held = foldoc_build
    recs = train + held
    # the raw FOLDOC text of each term: cross-references as written ({...})
    mod = _module()
    xrefs = {t["head"]: t["xrefs"] for t in mod.read_terms(FOLDOC_INDEX, FOLDOC_DICT)}
    defs = {term_of(r): r["chosen"][0]["content"] for r in recs}
    for r in recs:
        m = r["meta"]
        x, y = m["term"], m["confusable"]
        if m["rule"] == "xref":
            assert y.lower() in xrefs[x] or x.lower() in xrefs[y], m
        elif m["rule"] == "head":
            hx = set(re.findall(r"[a-z0-9+#]+", x.lower()))
            hy = set(re.findall(r"[a-z0-9+#]+", y.lower()))
            assert m["shared"] and set(m["shared"]) <= hx & hy, m
        else:
            assert m["rule"] == "text"
            wx = set(WORD.findall(r["chosen"][0]["content"].lower()))
            wy = set(WORD.findall(r["rejected"][0]["content"].lower()))
            assert m["shared"] and set(m["shared"]) <= wx & wy, m
        if y in defs:  # the rejected text is the confusable term's own gloss
            assert r["rejected"][0]["content"] == defs[y]


def _module():
    import importlib.machinery
    import importlib.util
    loader = importlib.machinery.SourceFileLoader("mk_dpo", SCRIPT)
    spec = importlib.util.spec_from_loader("mk_dpo", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def test_comparable_lengths_and_glosses(foldoc_build):
    _, _, man, train, held = foldoc_build
    assert man["length_ratio"] == 1.15 and man["max_words"] == 32 and man["min_words"] == 8
    for r in train + held:
        c, j = r["chosen"][0]["content"], r["rejected"][0]["content"]
        assert max(len(c), len(j)) <= 1.15 * min(len(c), len(j)), r["meta"]
        for t in (c, j):
            assert 8 <= len(t.split()) <= 32 and "\n" not in t, t
    # length is no shortcut: the chosen side is the shorter one in about half the pairs (the old
    # full definitions: 139 of 200 held-out pairs)
    for recs in (train, held):
        shorter = sum(len(r["chosen"][0]["content"]) < len(r["rejected"][0]["content"]) for r in recs)
        assert 0.4 * len(recs) <= shorter <= 0.6 * len(recs), (shorter, len(recs))


def test_gloss_cuts_at_sentence_ends():
    g = _module().gloss
    d = "A compiler for Foo, e.g. Bar. It runs on J. Random's PC. Third one here is long.\n\nMore."
    assert g(d, 6) == "A compiler for Foo, e.g. Bar."
    assert g(d, 12) == "A compiler for Foo, e.g. Bar. It runs on J. Random's PC."
    assert g(d, 32) == "A compiler for Foo, e.g. Bar. It runs on J. Random's PC. Third one here is long."
    assert g(d, 3) == "A compiler for"  # a first sentence longer than the limit: its first words
    assert g("One. two. Three 3.5 four.", 2) == "One. two."  # "two" is no sentence start


def _dictd(tmp_path, entries):
    """A dictd index + gzip'd dict (FOLDOC's layout) of entries [(head, body)]."""
    b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def num(n):
        s = ""
        while True:
            s = b64[n % 64] + s
            n //= 64
            if not n:
                return s

    data, idx = b"", []
    for head, body in entries:
        raw = f"{head}\n\n   {body}\n\n   (2001-01-01)\n\n".encode()
        idx.append(f"{head}\t{num(len(data))}\t{num(len(raw))}\n")
        data += raw
    (tmp_path / "f.index").write_text("".join(idx))
    with gzip.open(tmp_path / "f.dict.dz", "wb") as f:
        f.write(data)
    return ["--index", str(tmp_path / "f.index"), "--dict", str(tmp_path / "f.dict.dz")]


def test_deterministic_and_linked_on_fixture(tmp_path):
    topics = ["parser", "compiler", "kernel", "network", "database", "register", "cache", "socket"]
    entries = []
    for i, t in enumerate(topics):
        for k in range(5):
            other = topics[(i + 1) % len(topics)]
            body = (f"A {t} variant number {k} that works with a {{{other} {k}}} for handling "
                    f"{t}-specific workloads in distributed setups with sample{i}{k} tokens.")
            entries.append((f"{t} {k}", body))
    args = _dictd(tmp_path, entries)
    a, b = tmp_path / "a", tmp_path / "b"
    run(a, *args, "--eval-terms", "6", "--shards", "3", "--seed", "7", seed_env="1")
    run(b, *args, "--eval-terms", "6", "--shards", "3", "--seed", "7", seed_env="2")
    for n in json.load(open(a / "MANIFEST.json"))["files"]:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n
    man = json.load(open(a / "MANIFEST.json"))
    assert man["train_records"] == 34 and man["eval_records"] == 6, man
    # another seed: another split
    c = tmp_path / "c"
    run(c, *args, "--eval-terms", "6", "--shards", "3", "--seed", "8")
    assert (a / "eval.jsonl").read_bytes() != (c / "eval.jsonl").read_bytes()
    # a second run with the same arguments is a no-op
    assert "up to date" in run(a, *args, "--eval-terms", "6", "--shards", "3", "--seed", "7")
