"""Preference data through loaderd's token cache, and reference log-probs kept next to the tokens
(issue 25 §2; loaderd/refstore.h, proto/PROTOCOL.md op ref_put, batch layout 3).

A fake trainer stands in for the real one: for every chosen / rejected / kto segment without a
cached value (seg_ref_ok 0) it "computes" a value that is a function of the segment's tokens and
hands it back with ref_put. Checked: the preference shard is tokenized once into the cache and
gives the same batches as without it; values put in one epoch are served in the next and in the
next job with the same key (and land in the cache as a sidecar); another ref_base, another packing
(max_length) or another trainer uid get none; a sidecar whose key parts differ (a forged or
damaged file) is refused, logged, never served; malformed and conflicting puts are refused and
counted; token arrays and resume states are unchanged by the reference fields.
"""
import glob
import hashlib
import json
import os
import struct
import sys
import time

import numpy as np
import pytest

from conftest import ROOT, PauseHook, write_shard

sys.path.insert(0, os.path.join(ROOT, "python"))
import barq_loaderd as bl  # noqa: E402
from barq_loaderd import layout as L  # noqa: E402

SEQ = 160
RECS = [{"prompt": f"Question {i}: what is {w}?", "chosen": f"{w} is a thing number {i}.",
         "rejected": f"No idea about {w} {'really ' * (i % 3)}."}
        for i, w in enumerate("apple pear plum fig kiwi lime date yuzu sloe quince".split())]
KTO = [{"prompt": f"Say {w}.", "completion": f"{w}!", "label": i % 2 == 0}
       for i, w in enumerate("one two three four five".split())]


def fake_ref(ids, labels):
    """The fake reference model: a deterministic value of the segment's tokens (<= 0)."""
    lab = [x for x in labels if x != -100]
    return -(0.5 * len(lab) + (sum(ids) % 1000) / 1000.0)


def segments(b):
    ids, lab = (np.asarray(x).reshape(-1) for x in (b.input_ids, b.labels))
    cu = b.cu_seqlens.tolist()
    for k in range(len(cu) - 1):
        yield (k, ids[cu[k]:cu[k + 1]].tolist(), lab[cu[k]:cu[k + 1]].tolist(), int(b.seg_kind[k]), int(b.seg_src[k]),
               int(b.seg_line[k]), int(b.seg_ref_ok[k]), float(b.seg_ref_logp[k]))


def run(d, spec, put=None, n=None):
    """Batches of one job (until the end, or n); with put (the ref_base), values of segments without
    one are computed and handed back before each release. Returns (batches, served, missing,
    put results)."""
    out, served, missing, results = [], 0, 0, []
    with bl.LoaderdClient(spec, socket_path=d.sock, verify_checksum=True) as c:
        while n is None or len(out) < n:
            b = c.next(timeout=120)
            if b is None or b.end_of_data:
                break
            bl.validate(b, vocab=49152)
            vals = []
            for k, ids, lab, kind, src, line, ok, lp in segments(b):
                if kind == L.SEG_PLAIN:
                    continue
                if ok:
                    assert lp == fake_ref(ids, lab), "a served value is the one put for this very segment"
                    served += 1
                else:
                    missing += 1
                    vals.append((src, line, 1 if kind == L.SEG_REJECTED else 0, fake_ref(ids, lab)))
            if put and vals:
                results.append(c.ref_put(put, vals))
            out.append(b.copy())
            c.release()
    return out, served, missing, results


def status(d):
    return json.loads(d.ctl("status", "--json").stdout)["token_cache"]


@pytest.fixture
def env(loaderd, tmp_path, model_path):
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "pref.jsonl", [json.dumps(r) for r in RECS])
    write_shard(data / "kto.jsonl", [json.dumps(r) for r in KTO])
    cache = tmp_path / "cache"
    cfg = {"data_roots": [str(data)], "model_roots": [os.path.dirname(os.path.abspath(model_path))],
           "token_cache_dir": str(cache)}
    d = loaderd(cfg)
    spec = {"name": "ref", "shards": [str(data / "pref.jsonl")], "format": "preference",
            "tokenizer": os.path.abspath(model_path), "seq_len": SEQ, "micro_batch_size": 2, "seed": 5, "epochs": 1,
            "ring_slots": 1}
    return d, spec, data, cache, cfg


FIELDS = ("input_ids", "labels", "position_ids", "cu_seqlens", "seg_pair", "seg_kind", "seg_src", "seg_line")


def same_tokens(a, b, state=True):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.step == y.step and (not state or x.resume_state == y.resume_state)
        assert all(np.array_equal(getattr(x, k), getattr(y, k)) for k in FIELDS)


def wait_until(pred, timeout=30):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def test_sidecar_writes_never_block_the_event_loop(loaderd, tmp_path, model_path):
    """The sidecar (and part file) writes -- a file write, fsync and a directory scan -- run off
    loaderd's event loop: while one is held at its pause point, loaderctl status still answers."""
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "pref.jsonl", [json.dumps(r) for r in RECS])
    answered, errors = [], []

    def probe(path):
        try:
            r = d.ctl("status", "--json", timeout=10)
            answered.append((path, r.returncode))
        except Exception as e:  # noqa: BLE001 (a timeout is the failure this test is about)
            errors.append(f"{path}: {e!r}")

    hook = PauseHook(tmp_path, ".ref", probe)
    cfg = {"data_roots": [str(data)], "model_roots": [os.path.dirname(os.path.abspath(model_path))],
           "token_cache_dir": str(tmp_path / "cache")}
    d = loaderd(cfg, env=hook.env)
    spec = {"name": "ref", "shards": [str(data / "pref.jsonl")], "format": "preference",
            "tokenizer": os.path.abspath(model_path), "seq_len": SEQ, "micro_batch_size": 2, "seed": 5,
            "epochs": 1, "ring_slots": 1, "ref_base": "sha256-" + "cd" * 32}
    _, _, missing, results = run(d, spec, put=spec["ref_base"])
    assert missing == 2 * len(RECS) and all(r[1] == 0 for r in results), results
    wait_until(lambda: any(p.endswith(".ref") for p, _ in answered) or errors)
    hook.stop()
    assert not errors and not hook.errors, (errors, hook.errors)
    assert any(p.endswith(".ref") and rc == 0 for p, rc in answered), answered


def test_values_put_are_served_next_epoch_and_next_job(env, loaderd, tmp_path):
    d, spec, data, cache, cfg = env
    plain, _, _, _ = run(d, spec)  # no ref_base: tokens through the cache, no reference fields
    st = status(d)
    assert st["built"] == 1 and st["ref_tables"] == 0, st
    # the same batches as a loaderd without a token cache (tokens cached as for SFT)
    d0 = loaderd({k: v for k, v in dict(cfg, socket=str(tmp_path / "nocache.sock")).items() if k != "token_cache_dir"})
    nocache, _, _, _ = run(d0, spec)
    same_tokens(plain, nocache)
    n_seg = sum(1 for b in plain for s in segments(b) if s[3] != L.SEG_PLAIN)
    assert n_seg == 2 * len(RECS)
    for b in plain:
        for k, ids, lab, kind, src, line, ok, lp in segments(b):
            if kind != L.SEG_PLAIN:
                assert src == 0 and 1 <= line <= len(RECS) and ok == 0 and lp == 0.0
    # epoch 1 computes and puts every value; epochs 2.. are served from the cache
    spec_r = dict(spec, ref_base="sha256-" + "ab" * 32, epochs=3)
    got, served, missing, results = run(d, spec_r, put=spec_r["ref_base"])
    per_epoch = len(got) // 3
    assert missing >= n_seg and served >= n_seg, (missing, served)  # the last epoch at least is all served
    assert all(r[1] == 0 for r in results), results
    last = got[2 * per_epoch:]
    assert all(s[6] == 1 for b in last for s in segments(b) if s[3] != L.SEG_PLAIN)
    same_tokens(got[:per_epoch], plain, state=False)  # the reference fields change no token
    # the sidecar is written on loaderd's thread pool once the last value arrived
    wait_until(lambda: status(d)["ref_written"] == 1)
    side = glob.glob(str(cache / "v1" / "*" / "*.ref"))
    assert len(side) == 1, side
    st = status(d)
    assert st["ref_written"] == 1 and st["ref_accepted"] == missing and st["ref_rejected"] == 0, st
    text = d.ctl("status").stdout  # for people: one line
    assert f"reference log-probs: 1 table(s), 0 file(s) read, 1 written, 0 refused; {missing} value(s) put and kept" \
        in text, text
    # the next job with the same key: every value from the start
    _, served, missing, _ = run(d, dict(spec_r, epochs=1))
    assert (served, missing) == (n_seg, 0)
    # a fresh loaderd (another node) on the same cache directory reads the sidecar
    d2 = loaderd(dict(cfg, socket=str(tmp_path / "n2.sock")))
    _, served, missing, _ = run(d2, dict(spec_r, epochs=1))
    assert (served, missing) == (n_seg, 0)
    assert status(d2)["ref_loaded"] == 1 and status(d2)["built"] == 0
    # another base, another packing: nothing served (a different key: a miss, never a wrong value)
    for other in (dict(spec_r, ref_base="sha256-" + "cd" * 32), dict(spec_r, max_length=60)):
        _, served, missing, _ = run(d2, dict(other, epochs=1))
        assert (served, missing) == (0, n_seg), other


def sidecar_key(cache, base, uid, T, mpl, ml):
    """loaderd/refstore.c ref_key for the one entry in cache."""
    (entry,) = glob.glob(str(cache / "v1" / "*" / "*.btc"))
    with open(entry, "rb") as f:
        ek = f.read(48)[16:48]
    h = hashlib.sha256(b"barqtrain-refkey-v1\0" + ek + struct.pack("<5I", uid, T, mpl, ml, len(base)) + base.encode())
    return entry[:-4] + "-" + h.hexdigest()[:32] + ".ref", h.digest()


def test_forged_or_damaged_sidecar_is_refused(env, loaderd, tmp_path):
    d, spec, data, cache, cfg = env
    base_a, base_b = "base-A", "base-B"
    spec_a = dict(spec, ref_base=base_a, epochs=1)
    run(d, spec_a, put=base_a)
    path_a, key_a = sidecar_key(cache, base_a, os.getuid(), SEQ, 0, 0)
    wait_until(lambda: os.path.exists(path_a))  # written on loaderd's thread pool after the last put
    good = open(path_a, "rb").read()
    # 1. base A's values placed where base B's would be, checksum made valid: refused naming the base
    path_b, _ = sidecar_key(cache, base_b, os.getuid(), SEQ, 0, 0)
    with open(path_b, "wb") as f:
        f.write(good)
    d2 = loaderd(dict(cfg, socket=str(tmp_path / "n2.sock")))
    _, served, missing, _ = run(d2, dict(spec_a, ref_base=base_b))
    assert served == 0 and missing == 2 * len(RECS)
    assert 'its values are for base "base-A" but this job\'s ref_base is "base-B"' in d2.log_text()
    assert not os.path.exists(path_b) and status(d2)["ref_refused"] == 1
    # 2. a value changed in place (damaged): the checksum catches it
    bad = bytearray(good)
    bad[-40] ^= 0x01
    with open(path_a, "wb") as f:
        f.write(bad)
    d3 = loaderd(dict(cfg, socket=str(tmp_path / "n3.sock")))
    _, served, _, _ = run(d3, spec_a)
    assert served == 0 and "checksum mismatch" in d3.log_text() and status(d3)["ref_refused"] == 1
    # 3. a forged seq_len with a valid checksum, at the right path: refused naming the packing
    forged = bytearray(good)
    forged[80:84] = struct.pack("<I", SEQ * 2)
    forged[-32:] = hashlib.sha256(bytes(forged[:-32])).digest()
    with open(path_a, "wb") as f:
        f.write(forged)
    d4 = loaderd(dict(cfg, socket=str(tmp_path / "n4.sock")))
    _, served, _, _ = run(d4, spec_a)
    assert served == 0 and f"seq_len {SEQ * 2}, max_prompt_length 0, max_length 0 but this job has {SEQ}" in d4.log_text()


def test_bad_puts_are_refused_and_counted(env):
    d, spec, data, cache, cfg = env
    base = "base-A"
    with bl.LoaderdClient(dict(spec, epochs=1), socket_path=d.sock) as c:  # no ref_base in this job
        c.next(timeout=60)
        with pytest.raises(bl.LoaderdRefused, match='has no "ref_base"'):
            c.ref_put(base, [(0, 1, 0, -1.0)])
    with bl.LoaderdClient(dict(spec, ref_base=base, epochs=1, name="puts"), socket_path=d.sock) as c:
        b = c.next(timeout=60)
        seg = next(s for s in segments(b) if s[3] == L.SEG_CHOSEN)
        src, line = seg[4], seg[5]
        with pytest.raises(bl.LoaderdRefused, match='"base" "base-B" does not match job .* ref_base "base-A"'):
            c.ref_put("base-B", [(src, line, 0, -1.0)])
        acc, rej, errors = c.ref_put(base, [
            (src, line, 0, -2.5),          # good
            (src, line, 0, -2.5),          # the same again: accepted
            (src, line, 0, -3.5),          # conflict: the first value stays
            (src, line, 2, -1.0),          # no side 2
            (src, len(RECS) + 7, 0, -1.0),  # no such record
            (5, line, 0, -1.0),            # no such shard
            (src, line, 1, 0.5),           # a log-prob is <= 0
            (src, line, 1, float("nan")),  # not finite
            (src, line, 1, -2e9),          # below -1e9
        ])
        assert (acc, rej) == (2, 7), errors
        for piece in ("conflict", "side 2: 0 (chosen or kto) or 1", "not a record this job packs", "the job has 1 shard",
                      "must be finite and in"):
            assert any(piece in e for e in errors), (piece, errors)
        # malformed entries, sent raw
        rep = c._conn.request({"op": "ref_put", "job_id": c.job_id, "base": base,
                               "values": [[0, 1], "x", [0, 1, 0, "-1"], [0.5, 1, 0, -1.0]]})
        assert rep["accepted"] == 0 and rep["rejected"] == 4
        with pytest.raises(bl.LoaderdRefused, match="at most 4096"):
            c._conn.request({"op": "ref_put", "job_id": c.job_id, "base": base, "values": [[0, 1, 0, -1.0]] * 4097})
    st = status(d)
    assert st["ref_accepted"] == 2 and st["ref_rejected"] == 1 + 7 + 4 + 1, st


def test_kto_values_and_resume(env, loaderd, tmp_path):
    d, spec, data, cache, cfg = env
    spec_k = dict(spec, shards=[str(data / "kto.jsonl")], format="kto", ref_base="base-K", epochs=1, name="kto")
    got, served, missing, results = run(d, spec_k, put="base-K")
    assert (served, missing) == (0, len(KTO)) and all(r[1] == 0 for r in results), results
    got2, served, missing, _ = run(d, spec_k)
    assert (served, missing) == (len(KTO), 0)
    same_tokens(got, got2)
    # resume mid-stream gives the same batches, values included
    spec_r = dict(spec, ref_base="base-K2", epochs=2, name="resume")
    want, _, _, _ = run(d, spec_r, put="base-K2")
    with bl.LoaderdClient(spec_r, socket_path=d.sock) as c:
        first = []
        for _ in range(3):
            first.append(c.next(timeout=60).copy())
            c.release()
        state = json.loads(json.dumps(c.state_dict()))
    with bl.LoaderdClient(spec_r, socket_path=d.sock, resume=state) as c:
        rest = []
        while True:
            b = c.next(timeout=60)
            if b is None or b.end_of_data:
                break
            rest.append(b.copy())
            c.release()
    same_tokens(first + rest, want)
    assert all(s[6] == 1 for b in first + rest for s in segments(b) if s[3] != L.SEG_PLAIN)


def test_nodes_share_values_through_part_files(env, loaderd, tmp_path):
    """Two loaderds (nodes) on one cache directory, one rank each: each node's trainer puts the
    values of its own rank's segments, so neither table is complete; at the end of the jobs each
    node writes its part, and the next job (on either node) merges them, is served every value and
    writes the sidecar (the parts are removed)."""
    d, spec, data, cache, cfg = env
    d2 = loaderd(dict(cfg, socket=str(tmp_path / "n2.sock")))
    spec_r = dict(spec, ref_base="base-N", epochs=1, name="nodes")
    import threading
    res = [None, None]

    def rank(i, node):
        with bl.LoaderdClient(spec_r, socket_path=node.sock, rank=i, world_size=2) as c:
            n = 0
            while True:
                b = c.next(timeout=120)
                if b is None or b.end_of_data:
                    break
                vals = [(s[4], s[5], 1 if s[3] == L.SEG_REJECTED else 0, fake_ref(s[1], s[2]))
                        for s in segments(b) if s[3] != L.SEG_PLAIN and not s[6]]
                if vals:
                    assert c.ref_put("base-N", vals)[1] == 0
                    n += len(vals)
                c.release()
            res[i] = n
    th = [threading.Thread(target=rank, args=(i, node)) for i, node in enumerate((d, d2))]
    for t in th:
        t.start()
    for t in th:
        t.join(timeout=120)
    assert res[0] > 0 and res[1] > 0 and res[0] + res[1] == 2 * len(RECS), res
    # each node writes its part when its job's teardown frees the table; the later one merges the
    # earlier one's part, completes the table and writes the sidecar (or both parts stay, when they
    # end together: the next job merges them)
    import time
    deadline = time.monotonic() + 20
    side = lambda: glob.glob(str(cache / "v1" / "*" / "*.ref"))  # noqa: E731
    parts = lambda: glob.glob(str(cache / "v1" / "*" / "*.ref.part-*"))  # noqa: E731
    while not (side() or len(parts()) == 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert side() or len(parts()) == 2, (side(), parts())
    _, served, missing, _ = run(d, dict(spec_r, name="after"))
    assert (served, missing) == (2 * len(RECS), 0)
    assert len(glob.glob(str(cache / "v1" / "*" / "*.ref"))) == 1
    assert glob.glob(str(cache / "v1" / "*" / "*.ref.part-*")) == []
    sts = [status(x) for x in (d, d2)]
    assert sum(x["ref_written"] for x in sts) in (1, 2), sts  # two nodes ending together may both complete it
