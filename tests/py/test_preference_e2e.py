"""Preference and KTO records end to end (issue 25 §1): a JSONL shard -> loaderd (the daemon, the
real SmolLM2 tokenizer, ChatML) -> ring -> batches read by the Python client.

- `preference`: every good pair arrives exactly once, as two adjacent segments of one row
  (seg_kind chosen then rejected, the same seg_pair; the client's validate() checks the layout);
  each side is token for token what loaderd's own `chat` format makes of [user: prompt,
  assistant: response] (the reference), except that only the response carries labels: the
  prompt (identical in both sides) is all -100. Bad records are skipped and logged with file,
  line and reason; a pair longer than a row is skipped as `overlong`, never split.
- `kto`: one segment per record, seg_kind desirable / undesirable from "label", its own seg_pair.
"""
import json
import os
import re
import sys

import numpy as np
import pytest

from conftest import ROOT, write_shard

sys.path.insert(0, os.path.join(ROOT, "python"))
import barq_loaderd as bl  # noqa: E402
from barq_loaderd import layout as L  # noqa: E402

SEQ = 128

GOOD = [
    {"prompt": "What is the capital of France?", "chosen": "Paris.", "rejected": "Lyon, I think."},
    {"prompt": "Name a prime number.", "chosen": "Seven.", "rejected": "Nine."},
    {"prompt": "Say hello.", "chosen": "Hello!", "rejected": "Goodbye."},
    {"prompt": "Two plus two?", "chosen": "Four.", "rejected": "Five, maybe six."},
    {"prompt": "Colour of the sky?", "chosen": "Blue.", "rejected": "Green."},
]
CONV = {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
                   {"role": "user", "content": "Tell me a fruit."}],
        "chosen": [{"role": "assistant", "content": "An apple."}],
        "rejected": [{"role": "assistant", "content": "A chair."}]}
BAD = [  # (record, reason, piece of the message)
    ({"prompt": "p", "chosen": "a"}, "field", 'missing "rejected"'),
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, "field", "identical"),
    ({"prompt": "p", "chosen": "", "rejected": "b"}, "empty", '"chosen" is empty'),
    ({"prompt": "p", "chosen": 3, "rejected": "b"}, "field", "expected string or array"),
    ({"prompt": "word " * 200, "chosen": "yes", "rejected": "no"}, "overlong", "does not fit a row"),
]


def segs(b):
    ids, lab = (np.asarray(x).reshape(-1) for x in (b.input_ids, b.labels))
    cu = b.cu_seqlens.tolist()
    for k in range(len(cu) - 1):
        s, e = cu[k], cu[k + 1]
        yield k, s, e, ids[s:e].tolist(), lab[s:e].tolist(), int(b.seg_kind[k]), int(b.seg_pair[k])


def run_job(d, shard, fmt, tok, **extra):
    spec = {"name": f"pref-{fmt}", "shards": [str(shard)], "format": fmt, "tokenizer": tok, "seq_len": SEQ,
            "micro_batch_size": 2, "seed": 3, "epochs": 1, **extra}
    out = []
    with bl.LoaderdClient(spec, socket_path=d.sock, verify_checksum=True) as c:
        while True:
            b = c.next(timeout=120)
            if b is None or b.end_of_data:
                break
            bl.validate(b, vocab=49152)
            out.append(b.copy())
            c.release()
    return out


def chat_reference(d, tmp_path, tok, convs):
    """ids and labels of loaderd's `chat` rendering of each conversation (one per row: seq_len)."""
    data = tmp_path / "data"
    shard = data / "ref.jsonl"
    write_shard(shard, [json.dumps({"messages": m}) for m in convs])
    ref = {}
    for b in run_job(d, shard, "chat", tok):
        for _k, _s, _e, ids, lab, kind, _p in segs(b):
            if any(x != -100 for x in lab):
                ref[tuple(ids)] = lab
    return ref


def test_preference_pairs(loaderd, tmp_path, model_path):
    data = tmp_path / "data"
    data.mkdir()
    records = GOOD[:2] + [BAD[0][0]] + GOOD[2:4] + [b for b, _, _ in BAD[1:]] + [GOOD[4], CONV]
    shard = data / "pref.jsonl"
    write_shard(shard, [json.dumps(r) for r in records])
    d = loaderd({"data_roots": [str(data)], "model_roots": [os.path.dirname(os.path.abspath(model_path))]})
    tok = os.path.abspath(model_path)
    batches = run_job(d, shard, "preference", tok)
    pairs = []
    for b in batches:
        s = list(segs(b))
        for i, (k, st, en, ids, lab, kind, pair) in enumerate(s):
            if kind == L.SEG_PLAIN:
                assert pair == -1 and all(x == -100 for x in lab)  # padding only: no SFT data here
                continue
            if kind == L.SEG_CHOSEN:
                k2, st2, en2, ids2, lab2, kind2, pair2 = s[i + 1]
                assert kind2 == L.SEG_REJECTED and pair2 == pair and en == st2, "a pair is two adjacent segments"
                assert st // SEQ == (en2 - 1) // SEQ, "a pair never crosses a row"
                pairs.append(((ids, lab), (ids2, lab2)))
            else:
                assert kind == L.SEG_REJECTED
    assert len(pairs) == len(GOOD) + 1, len(pairs)
    # the reference: loaderd's chat format on [prompt..., response]
    def conv(r, side):
        p = r["prompt"] if isinstance(r["prompt"], list) else [{"role": "user", "content": r["prompt"]}]
        a = r[side] if isinstance(r[side], list) else [{"role": "assistant", "content": r[side]}]
        return p + a
    recs = GOOD + [CONV]
    ref = chat_reference(d, tmp_path, tok, [conv(r, s) for r in recs for s in ("chosen", "rejected")])
    matched = set()
    for (ci, cl), (ri, rl) in pairs:
        assert tuple(ci) in ref and tuple(ri) in ref, "each side is the chat rendering of prompt + response"
        # the shared prompt: identical tokens, no labels; the response: the chat labels
        P = next(t for t, x in enumerate(cl) if x != -100)
        assert ci[:P] == ri[:P] and all(x == -100 for x in rl[:P])
        for ids, lab in ((ci, cl), (ri, rl)):
            want = ref[tuple(ids)]
            assert lab[P:] == want[P:]
            assert all(x == -100 for x in lab[:P])
        matched.add(tuple(ci))
    assert len(matched) == len(recs)
    log = d.log_text()
    for rec, reason, piece in BAD:
        n = records.index(rec) + 1
        assert re.search(rf"pref\.jsonl:{n}: {reason}: .*{re.escape(piece)}", log), (n, reason, log[-3000:])


def test_conversational_prompt_assistant_turn_has_no_loss(loaderd, tmp_path, model_path):
    data = tmp_path / "data"
    data.mkdir()
    shard = data / "conv.jsonl"
    write_shard(shard, [json.dumps(CONV)])
    d = loaderd({"data_roots": [str(data)], "model_roots": [os.path.dirname(os.path.abspath(model_path))]})
    tok = os.path.abspath(model_path)
    pref = [x for b in run_job(d, shard, "preference", tok) for x in segs(b) if x[5] == L.SEG_CHOSEN]
    assert len(pref) == 1
    ids, lab = pref[0][3], pref[0][4]
    chat = chat_reference(d, tmp_path, tok, [CONV["prompt"] + CONV["chosen"]])[tuple(ids)]
    # chat trains on "Hello! How can I help?" and the answer; preference on the answer only
    assert sum(x != -100 for x in chat) > sum(x != -100 for x in lab) > 0
    last = max(t for t, x in enumerate(chat) if x == -100 and t < len(chat) - 1 and any(y != -100 for y in chat[t:]))
    assert lab[last + 1:] == chat[last + 1:]


def test_kto_records(loaderd, tmp_path, model_path):
    data = tmp_path / "data"
    data.mkdir()
    recs = [{"prompt": "Name a colour.", "completion": "Blue.", "label": True},
            {"prompt": "Name a colour.", "completion": "Seven.", "label": False},
            {"prompt": "Say hi.", "completion": "Hi!", "label": True},
            {"prompt": "Say hi.", "completion": "no", "label": "yes"}]
    shard = data / "kto.jsonl"
    write_shard(shard, [json.dumps(r) for r in recs])
    d = loaderd({"data_roots": [str(data)], "model_roots": [os.path.dirname(os.path.abspath(model_path))]})
    kinds = []
    for b in run_job(d, shard, "kto", os.path.abspath(model_path)):
        n_rec = 0
        for k, s, e, ids, lab, kind, pair in segs(b):
            if kind == L.SEG_PLAIN:
                continue
            assert pair == n_rec  # its own index, 0, 1, ... within the batch
            n_rec += 1
            kinds.append(kind)
    assert sorted(kinds) == sorted([L.SEG_KTO_DESIRABLE, L.SEG_KTO_UNDESIRABLE, L.SEG_KTO_DESIRABLE])
    assert re.search(r"kto\.jsonl:4: field: .*expected true or false", d.log_text())


def test_resume_and_ranks_keep_pairs_whole(loaderd, tmp_path, model_path):
    """Endless preference job: a resumed client yields the uninterrupted batches (seg fields
    included); the two ranks of world 2 each get whole pairs, and between them every pair."""
    data = tmp_path / "data"
    data.mkdir()
    recs = [{"prompt": f"Question {i}: what is {i} plus {i}?", "chosen": f"It is {2 * i}.",
             "rejected": f"It is {2 * i + 1}, I believe." + " really" * (i % 5)} for i in range(60)]
    shard = data / "many.jsonl"
    write_shard(shard, [json.dumps(r) for r in recs])
    d = loaderd({"data_roots": [str(data)], "model_roots": [os.path.dirname(os.path.abspath(model_path))]})
    spec = {"name": "pref-resume", "shards": [str(shard)], "format": "preference", "tokenizer": os.path.abspath(model_path),
            "seq_len": SEQ, "micro_batch_size": 2, "seed": 4, "epochs": 0, "max_prompt_length": 16, "max_length": 40}

    def take(c, n):
        out = []
        for _ in range(n):
            b = c.next(timeout=60)
            bl.validate(b, vocab=49152)
            out.append(b.copy())
            c.release()
        return out

    fields = ("input_ids", "labels", "position_ids", "cu_seqlens", "seg_pair", "seg_kind")
    N, K = 8, 3
    with bl.LoaderdClient(spec, socket_path=d.sock, verify_checksum=True) as c:
        want = take(c, N)
    with bl.LoaderdClient(spec, socket_path=d.sock, verify_checksum=True) as c:
        first = take(c, K)
        state = json.loads(json.dumps(c.state_dict()))
    with bl.LoaderdClient(spec, socket_path=d.sock, verify_checksum=True, resume=state) as c:
        rest = take(c, N - K)
    for a, b in zip(first + rest, want):
        assert a.step == b.step and a.checksum == b.checksum
        assert all(np.array_equal(getattr(a, k), getattr(b, k)) for k in fields)
    assert any((b.seg_kind == L.SEG_CHOSEN).any() for b in want)
    # every record is truncated to max_length 40: prompt <= 16 tokens, each document <= 40
    for b in want:
        for k, s, e, ids, lab, kind, pair in segs(b):
            if kind != L.SEG_PLAIN:
                assert e - s <= 40
    # world 2: each rank's batches hold whole pairs (validate); one epoch covers each pair once
    spec1 = dict(spec, epochs=1, name="pref-ranks")
    seen = []
    for rank in range(2):
        with bl.LoaderdClient(spec1, socket_path=d.sock, rank=rank, world_size=2, verify_checksum=True) as c:
            while True:
                b = c.next(timeout=60)
                if b is None or b.end_of_data:
                    break
                bl.validate(b, vocab=49152)
                for k, s, e, ids, lab, kind, pair in segs(b):
                    if kind == L.SEG_CHOSEN:
                        seen.append(tuple(ids))
                c.release()
    assert len(seen) == len(set(seen)) == len(recs)
