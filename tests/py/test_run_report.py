"""Run reports, `trainer eval --adapter/--checkpoint` and the refusal of ignored settings,
end to end through loaderd on a tiny random Llama (the real SmolLM2 vocabulary).

- Every run writes metrics.jsonl (one line per step with loss, lr, grad norm, tokens/s, data
  wait, memory; held-out evaluations) whose losses are the ones the trainer printed, report.png
  (gnuplot) at the end and again with `trainer report RUN_DIR`, and with report.tensorboard
  TensorBoard event files that TensorBoard's own EventAccumulator (PyPI tensorboard) reads back
  with the same values.
- `trainer eval --adapter DIR` on the adapter a run wrote gives the run's "after" held-out loss
  exactly; a PEFT-written adapter (tests/fixtures/hf/lora/adapter-init, PEFT save_pretrained)
  loads; `--checkpoint DIR` scores the checkpoint.
- Every command refuses a command-line setting it would not use, naming it."""
import json
import math
import os
import re
import subprocess

import pytest

from conftest import BUILD, ROOT, chat_line, tiny_model, write_shard

TRAINER = os.path.join(BUILD, "trainer")


@pytest.fixture
def env(tmp_path, trainer_stack):
    data = tmp_path / "data"
    data.mkdir()
    good = [chat_line(f"What is item {i}?", f"Item {i} is a thing with number {i * 7}.")
            for i in range(40)]
    write_shard(data / "train-000.jsonl.zst", good)
    write_shard(data / "eval.jsonl.zst", good[:8])
    model = tiny_model(tmp_path / "tiny.gguf", 7)
    ld = trainer_stack(data)
    job = {"model": str(model), "base_dtype": "fp32", "socket": str(ld.sock),
           "data": {"shards": [str(data / "train-*.jsonl.zst")], "format": "chat", "seq_len": 64,
                    "micro_batch_size": 2, "seed": 5},
           "eval": {"shards": [str(data / "eval.jsonl.zst")], "max_batches": 3},
           "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
           "optim": {"lr": 1e-2, "warmup_steps": 1}, "steps": 4, "threads": 1,
           "checkpoint_every": 2, "checkpoint_dir": str(tmp_path / "ckpt"),
           "out_dir": str(tmp_path / "run" / "adapter"),
           "report": {"tensorboard": True}}
    (tmp_path / "job.json").write_text(json.dumps(job))
    return {"tmp": tmp_path, "job": tmp_path / "job.json", "run": tmp_path / "run"}


def trainer(*args, check=True):
    r = subprocess.run([TRAINER, *args], capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def heldout(text):
    return float(re.search(r"held-out loss: ([0-9.]+), perplexity", text).group(1))


def same4(eval_loss, train_loss):
    """trainer eval prints 6 decimals, train's before/after 4: the same loss rounds to it."""
    return abs(eval_loss - train_loss) <= 0.5e-4 + 1e-9


def test_report_eval_and_refusals(env):
    r = trainer("train", "--config", str(env["job"]))
    printed = [float(x) for x in re.findall(r"step \d+/4 \| loss ([0-9.]+)", r.stdout)]
    before, after = map(float, re.search(r"held-out loss: before ([0-9.]+) -> after ([0-9.]+)",
                                         r.stdout).groups())
    rep = env["run"] / "report"
    lines = [json.loads(x) for x in (rep / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if x["type"] == "train"]
    evals = [x for x in lines if x["type"] == "eval"]
    assert [x["step"] for x in train] == [1, 2, 3, 4]
    assert [round(x["loss"], 4) for x in train] == printed
    for x in train:
        assert x["lr"] > 0 and x["grad_norm"] > 0 and x["tokens"] > 0 and x["tokens_per_s"] > 0
        assert x["step_s"] > 0 and 0 <= x["data_wait_s"] <= x["step_s"] and x["peak_rss_mib"] > 0
        assert abs(x["tokens_per_s"] - x["tokens"] / x["step_s"]) <= 1e-6 * x["tokens_per_s"]
    assert [x["step"] for x in evals] == [0, 4]
    assert [round(x["loss"], 4) for x in evals] == [before, after]
    assert abs(evals[1]["perplexity"] - math.exp(evals[1]["loss"])) < 1e-6 * evals[1]["perplexity"]
    png = (rep / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10000
    # `trainer report` redraws it and summarises; bad lines are skipped and counted
    with open(rep / "metrics.jsonl", "a") as f:
        f.write('not json\n{"type": "train"}\n\x00\xff\n[1, 2]\n')
    os.unlink(rep / "report.png")
    s = trainer("report", str(rep))
    assert "4 steps" in s.stdout and f"held-out loss {before:.4f} (step 0) -> {after:.4f} (step 4)" \
        in s.stdout, s.stdout
    assert "4 lines skipped" in s.stderr, s.stderr
    bad = trainer("report", str(env["tmp"]), check=False)  # no metrics.jsonl there
    assert bad.returncode == 1 and "metrics.jsonl" in bad.stderr
    assert (rep / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert not [f for f in os.listdir(rep) if f.startswith(".plot-")]

    # TensorBoard's own reader sees the same scalars
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        pytest.skip("tensorboard (pip install tensorboard==2.21.0) not installed")
    ev = [f for f in os.listdir(rep) if f.startswith("events.out.tfevents.")]
    assert len(ev) == 1
    acc = EventAccumulator(str(rep))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for t in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s",
              "train/data_wait_s", "train/peak_rss_mib", "eval/loss", "eval/perplexity"):
        assert t in tags, tags
    got = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [s for s, _ in got] == [1, 2, 3, 4]
    assert all(abs(v - x["loss"]) <= 1e-6 * abs(x["loss"]) for (_, v), x in zip(got, train))
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars("eval/loss")] == \
        [(0, before), (4, after)]


def test_periodic_eval_and_model_card(env):
    """eval.every: a held-out evaluation every N steps during training, printed and written to
    metrics.jsonl and TensorBoard, without changing the training (same step losses, same final
    held-out loss as a run without it); report.png's title names the run and model; the adapter
    directory gets a model card (README.md) a Hugging Face user recognises, with the results, and
    that PEFT's own card reader (huggingface_hub ModelCard, through peft) accepts."""
    plain = trainer("train", "--config", str(env["job"]), "--set", "checkpoint_every=0",
                    "--set", "out_dir=" + str(env["tmp"] / "plain" / "adapter"))
    r = trainer("train", "--config", str(env["job"]), "--set", "checkpoint_every=0",
                "--set", "eval.every=2", "--set", "name=periodic")
    steps = lambda t: re.findall(r"step \d+/4 \| loss ([0-9.]+)", t)
    assert steps(r.stdout) == steps(plain.stdout), (r.stdout, plain.stdout)
    ba = lambda t: re.search(r"held-out loss: before ([0-9.]+) -> after ([0-9.]+)", t).groups()
    assert ba(r.stdout) == ba(plain.stdout)
    mid = re.findall(r"step 2/4 \| held-out loss ([0-9.]+) \| perplexity", r.stdout)
    assert len(mid) == 1 and "step 4/4 | held-out" not in r.stdout, r.stdout
    rep = env["run"] / "report"
    lines = [json.loads(x) for x in (rep / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["type"] == "eval"] == [0, 2, 4]
    assert round([x for x in lines if x["type"] == "eval"][1]["loss"], 4) == float(mid[0])
    run = [x for x in lines if x["type"] == "run"]
    assert len(run) == 1 and run[0]["name"] == "periodic" and run[0]["model"].endswith("tiny.gguf")
    s = trainer("report", str(rep))
    assert "held-out loss" in s.stdout and "(step 4)" in s.stdout, s.stdout
    # the model card
    card = (env["run"] / "adapter" / "README.md").read_text()
    assert card.startswith("---\nbase_model: ") and "library_name: peft" in card, card[:400]
    assert "<!-- written by BarqTrain -->" in card
    before, after = ba(r.stdout)
    assert f"held-out loss before training: {before}" in card, card
    assert f"held-out loss after step 4: {after}" in card, card
    assert "| lora.r | 4 |" in card and "PeftModel.from_pretrained" in card
    assert "--format gguf-lora" in card and "--lora adapter.gguf" in card
    # the front matter is the YAML metadata block the Hub reads (huggingface_hub's ModelCard
    # parses it with yaml.safe_load between the first two "---" lines)
    import yaml
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["library_name"] == "peft" and "lora" in meta["tags"], meta
    assert meta["base_model"] == meta["tags"][0].split("base_model:adapter:")[1], meta
    # the directory is still one BarqTrain replaces: a second run overwrites it, card included
    trainer("train", "--config", str(env["job"]), "--set", "checkpoint_every=0", "--set", "steps=2")
    assert "after step 2" in (env["run"] / "adapter" / "README.md").read_text()
    # eval.every needs something to evaluate, and is one loss per step (not per length)
    for sets, want in ((["eval.every=2", "eval.shards=[]"], "eval.shards is empty"),
                       (["eval.every=2", "eval.lengths=[32]"], "does not combine with eval.lengths"),
                       (["eval.every=-1"], "eval.every")):
        args = ["config", "--check", str(env["job"])]
        for x in sets:
            args += ["--set", x]
        p = trainer(*args, check=False)
        assert p.returncode != 0 and want in p.stderr, (sets, p.stderr)


def test_eval_adapter_checkpoint_and_refusals(env):
    r = trainer("train", "--config", str(env["job"]), "--set", "report.tensorboard=false")
    before, after = map(float, re.search(r"held-out loss: before ([0-9.]+) -> after ([0-9.]+)",
                                         r.stdout).groups())
    job = str(env["job"])
    adapter = str(env["run"] / "adapter")
    # the adapter the run wrote scores exactly the run's "after" loss; the base its "before"
    e = trainer("eval", "--config", job, "--adapter", adapter)
    assert same4(heldout(e.stdout), after) and f"adapter {adapter}" in e.stdout, e.stdout
    e = trainer("eval", "--config", job)
    assert same4(heldout(e.stdout), before) and e.stdout.rstrip().endswith("tokens)"), e.stdout
    # the step-2 checkpoint: between the two
    e = trainer("eval", "--config", job, "--checkpoint", str(env["tmp"] / "ckpt"))
    mid = heldout(e.stdout)
    assert "checkpoint" in e.stdout and not same4(mid, before) and not same4(mid, after), e.stdout
    e2 = trainer("eval", "--config", job, "--set", f"resume_from={env['tmp'] / 'ckpt'}")
    assert heldout(e2.stdout) == heldout(e.stdout)

    # refused rather than ignored, naming the setting
    cases = [
        (["eval", "--config", job, "--set", "optim.lr=1"], "eval does not use optim.lr"),
        (["eval", "--config", job, "--set", "steps=9"], "eval does not use steps"),
        (["eval", "--config", job, "--set", "report.tensorboard=true"], "eval does not use report"),
        (["eval", "--config", job, "--adapter", adapter, "--set", "lora.r=8"],
         "eval does not use lora.r when evaluating --adapter"),
        (["eval", "--config", job, "--set", "lora.r=8"], "eval does not use lora.r"),
        (["eval", "--config", job, "--resume", adapter], "--resume continues training"),
        (["eval", "--config", job, "--adapter", adapter, "--checkpoint", adapter], "not both"),
        (["eval", "--config", job, "--profile"], "--profile"),
        (["train", "--config", job, "--adapter", adapter], "--adapter"),
        (["train", "--config", job, "--checkpoint", adapter], "--checkpoint is for eval"),
        (["train", "--config", job, "--set", "cuda.attention=mma"],
         "train does not use cuda.attention on device \"cpu\""),
        (["estimate", "--config", job, "--set", "socket=/x"], "estimate does not use socket"),
        (["estimate", "--config", job, "--device", "cuda"], "estimate does not use device"),
        (["estimate", "--config", job, "--set", "eval.max_batches=2"], "eval.max_batches"),
        (["config", "--check", job, "--documented"], "--documented applies to --template only"),
        (["config", "--template", "qlora", "--set", "steps=3"], "--set applies to --check only"),
        (["generate", "--model", job, "--prompt", "x", "--seed", "3"], "--seed only applies to sampling"),
        (["generate", "--model", job, "--prompt", "x", "--top-p", "0.9"], "--top-p only applies"),
        (["export", "--model", job, "--adapter", adapter, "--format", "peft", "--out", adapter,
          "--max-shard-size", "1GB"], "--max-shard-size applies to --format safetensors only"),
    ]
    for args, want in cases:
        p = trainer(*args, check=False)
        assert p.returncode == 2 and want in p.stderr, (args, p.returncode, p.stderr)


def test_eval_peft_written_adapter(env):
    """An adapter written by PEFT itself (tests/fixtures/hf/lora/adapter-init: save_pretrained
    of a LoRA r 4 on all seven projections of a 2-layer, hidden-64, 4/2-head, FFN-128 Llama, the
    tiny GGUF's shapes) is evaluated on the tiny GGUF: it loads, and it changes the loss exactly
    when its lora_B is non-zero."""
    import array
    import struct
    ad = os.path.join(ROOT, "tests", "fixtures", "hf", "lora", "adapter-init")
    raw = open(os.path.join(ad, "adapter_model.safetensors"), "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8:8 + n])
    nonzero_b = any(any(array.array("f", raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]))
                    for k, v in hdr.items() if k.endswith("lora_B.weight"))
    base = heldout(trainer("eval", "--config", str(env["job"])).stdout)
    e = trainer("eval", "--config", str(env["job"]), "--adapter", ad)
    assert f"adapter {ad}" in e.stdout
    assert (heldout(e.stdout) != base) == nonzero_b, (heldout(e.stdout), base, nonzero_b)
    # an adapter whose shapes do not fit the base is refused, naming the mismatch
    bad = env["tmp"] / "bad-adapter"
    bad.mkdir()
    cfg = json.load(open(os.path.join(ad, "adapter_config.json")))
    cfg["r"] = 8
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    (bad / "adapter_model.safetensors").write_bytes(raw)
    p = trainer("eval", "--config", str(env["job"]), "--adapter", str(bad), check=False)
    assert p.returncode == 1 and "lora_A" in p.stderr, p.stderr


def test_profile_cpu(env):
    """--profile: one step's per-op time and memory table on stdout and in profile.json; the ops
    cover most of the step and each op of every layer is there."""
    r = trainer("train", "--config", str(env["job"]), "--profile", "--set", "steps=2",
                "--set", "checkpoint_every=0")
    assert "profile: step 2, 2 x 64 tokens x grad_accum 1, cpu" in r.stdout, r.stdout
    rows = dict(re.findall(r"\n([a-z_+ ()\-]+?) +(\d+) +[0-9.]+ +[0-9.]+% ", r.stdout))
    for op, calls in (("attention fwd", 2), ("attention bwd", 2), ("q_proj base fwd", 2),
                      ("down_proj lora bwd", 2), ("rope fwd", 4), ("embedding fwd", 1),
                      ("lm_head + cross-entropy fwd+bwd", 1), ("adamw", 1), ("clip grad norm", 1)):
        assert int(rows.get(op, 0)) == calls, (op, rows, r.stdout)
    m = re.search(r"ops: ([0-9.]+) ms of a ([0-9.]+) ms step \(([0-9.]+)%\); workspace ([0-9.]+) MiB,"
                  r" peak RSS ([0-9.]+) MiB", r.stdout)
    assert m, r.stdout
    assert 0 < float(m.group(1)) <= float(m.group(2)) and float(m.group(4)) > 0
    prof = json.loads((env["run"] / "report" / "profile.json").read_text())
    assert prof["step_s"] > 0 and {o["op"] for o in prof["ops"]} >= {"attention fwd", "adamw"}
    assert all(o["seconds"] >= 0 and o["calls"] >= 1 for o in prof["ops"])
