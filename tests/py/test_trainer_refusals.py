"""The trainer against the rest of issue 21's outside checks:

- §6 diverged results never exit 0: `trainer eval --adapter` with lora_alpha 1e38 is refused by the
  adapter loader with the job config's own limit; an adapter whose (finite) weights overflow makes
  the held-out evaluation end with a clear message and exit status 3, never "held-out loss: -nan";
  `trainer generate` likewise for non-finite logits;
- §7 memory the node does not have: `train` compares its memory plan (trainer estimate's bill) with
  what it may use (here RLIMIT_AS, set for real with prlimit) before allocating, and refuses with
  the figures and what to change; --force starts anyway (and then fails cleanly, not killed);
- §9 the reason for a failed job: when loaderd fails the job (every record empty), the trainer
  prints loaderd's own reason, asked before it detaches; `trainer config --check` refuses a
  seq_len loaderd would refuse;
- §11 `--set optim..lr=0.5` is refused (not taken as optim.lr); a checkpoint's 3 GiB sparse
  trainer_state.bin is refused by its size, not read.
Set BT_TRAINER_ASAN=1 to run the ASan+UBSan trainer (the prlimit cases then skip: ASan reserves
more address space than any RLIMIT_AS leaves)."""
import json
import os
import re
import shutil
import struct
import subprocess
import time

import numpy as np
import pytest

from conftest import BUILD, MODEL, SAN_ENV, write_shard

ASAN = os.environ.get("BT_TRAINER_ASAN") == "1"
TRAINER = os.path.join(BUILD, "asan", "trainer") if ASAN else os.path.join(BUILD, "trainer")


def tiny(path, seed=7):
    subprocess.run([os.path.join(BUILD, "tools", "mk_tiny_gguf"), "--out", str(path), "--tokenizer-from", MODEL,
                    "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
                    "--seed", str(seed), "--tied", "1"], check=True)
    return path


def trainer(*args, env=None, prefix=(), timeout=600):
    e = dict(os.environ)
    e.update(SAN_ENV)
    e.update(env or {})
    return subprocess.run([*prefix, TRAINER, *[str(a) for a in args]], capture_output=True, text=True, env=e,
                          timeout=timeout)


def write_job(tmp, **over):
    j = {"model": str(tmp / "tiny.gguf"), "base_dtype": "fp32", "socket": str(tmp / "no.sock"),
         "data": {"shards": [str(tmp / "data" / "*.jsonl")], "format": "text", "seq_len": 32,
                  "micro_batch_size": 2, "seed": 5, "tokenizer_threads": 1},
         "eval": {"shards": [str(tmp / "data" / "*.jsonl")], "max_batches": 2},
         "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0}, "optim": {"lr": 1e-3},
         "steps": 4, "threads": 1, "timeout_s": 120, "out_dir": str(tmp / "adapter"),
         "checkpoint_dir": str(tmp / "ckpt"), "report": {"dir": str(tmp / "report"), "plot": False}}
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(j.get(k), dict):
            j[k].update(v)
        else:
            j[k] = v
    p = tmp / "job.json"
    p.write_text(json.dumps(j))
    return p


def write_adapter(d, alpha=4.0, value=0.01, layers=2, hidden=64, kv=32, r=2):
    """A PEFT adapter for the tiny model (q_proj and v_proj of every layer, every value `value`)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": ["q_proj", "v_proj"]}))
    tensors, blobs, off = {}, [], 0
    for l in range(layers):
        for mod, out in (("q_proj", hidden), ("v_proj", kv)):
            for ab, shape in (("A", [r, hidden]), ("B", [out, r])):
                a = np.full(shape, value, dtype=np.float32).tobytes()
                tensors[f"base_model.model.model.layers.{l}.self_attn.{mod}.lora_{ab}.weight"] = {
                    "dtype": "F32", "shape": shape, "data_offsets": [off, off + len(a)]}
                blobs.append(a)
                off += len(a)
    header = json.dumps(tensors).encode()
    header += b" " * (-len(header) % 8)
    (d / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"".join(blobs))
    return d


@pytest.fixture
def stack(tmp_path, trainer_stack):
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "a.jsonl", [json.dumps({"text": f"line {i} of the shard, with words"}) for i in range(200)])
    tiny(tmp_path / "tiny.gguf")
    return trainer_stack(data)


# ---------------------------------------------------------------- §6

def test_adapter_past_the_config_limits_is_refused(tmp_path, bins):
    """The issue's adapter: lora_alpha 1e38 (the job config caps it at 65536); refused by the
    adapter loader with the same limit, before any evaluation."""
    if not bins.have("tools/mk_tiny_gguf"):
        pytest.skip("tools/mk_tiny_gguf not built")
    tiny(tmp_path / "tiny.gguf")
    cfg = write_job(tmp_path)
    for alpha, r_, want in ((1e38, 2, 'got 1e+38'), (8.0, 4097, '"r" must be an integer in [1, 4096]')):
        ad = write_adapter(tmp_path / f"ad{r_}", alpha=alpha, r=r_ if r_ < 4097 else 2)
        if r_ == 4097:  # the config says 4097, the tensors do not matter: refused first
            c = json.loads((ad / "adapter_config.json").read_text())
            c["r"] = 4097
            (ad / "adapter_config.json").write_text(json.dumps(c))
        r = trainer("eval", "--config", cfg, "--adapter", ad)
        assert r.returncode == 1, (r.returncode, r.stdout, r.stderr[-3000:])
        assert want in r.stderr and "held-out loss" not in r.stdout, r.stderr[-3000:]
    r = trainer("generate", "--model", tmp_path / "tiny.gguf", "--adapter", tmp_path / "ad2", "--prompt", "hi",
                "--max-new-tokens", "2")
    assert r.returncode == 1 and "lora_alpha" in r.stderr, r.stderr[-3000:]


def test_nonfinite_heldout_loss_and_logits_are_errors(tmp_path, stack):
    """An adapter within every limit whose weights overflow fp32 (B A x past 3.4e38): `trainer
    eval` ends with a clear message and exit status 3, never a "-nan" loss with status 0; so does
    `trainer generate`, without sampling a token."""
    cfg = write_job(tmp_path, socket=stack.sock)
    ad = write_adapter(tmp_path / "huge", value=3e37)
    r = trainer("eval", "--config", cfg, "--adapter", ad)
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr[-3000:])
    assert "held-out evaluation: batch 1: the loss is" in r.stderr and "not a number" in r.stderr, r.stderr[-3000:]
    assert f"with adapter {ad}" in r.stderr and "held-out loss" not in r.stdout, (r.stdout, r.stderr[-3000:])
    # the same adapter at a sane scale evaluates to a finite loss
    ok = write_adapter(tmp_path / "sane", value=0.01)
    r = trainer("eval", "--config", cfg, "--adapter", ok)
    assert r.returncode == 0 and re.search(r"held-out loss: \d+\.\d+", r.stdout), r.stderr[-3000:]
    r = trainer("generate", "--model", tmp_path / "tiny.gguf", "--adapter", ad, "--prompt", "hello there",
                "--max-new-tokens", "4")
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr[-3000:])
    assert "infer: the logits at position" in r.stderr and "are not finite" in r.stderr, r.stderr[-3000:]
    assert r.stdout.strip() == "", r.stdout  # nothing was sampled from them


# ---------------------------------------------------------------- §7

def mem_available_gib():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / (1 << 20)
    return float("inf")


def test_memory_plan_checked_before_allocating(tmp_path, model_path):
    """The issue's job: lora.r 4096 on SmolLM2 needs ~32 GiB (trainer estimate); with an address
    space of 1 GiB (RLIMIT_AS, set with prlimit) train refuses before loading the model, with the
    figures and what to change, instead of being SIGKILLed by the OOM killer; --force starts anyway
    and fails cleanly at the first allocation it cannot make; a plan that fits starts."""
    if ASAN:
        pytest.skip("ASan reserves more address space than RLIMIT_AS leaves")
    if not shutil.which("prlimit"):
        pytest.skip("prlimit (util-linux) not installed")
    cfg = write_job(tmp_path, model=model_path, base_dtype="gguf", lora={"r": 4096},
                    data={"seq_len": 512, "micro_batch_size": 4})
    est = trainer("estimate", "--config", cfg)
    assert est.returncode == 0, est.stderr
    peak = float(re.search(r"^  peak\s+([0-9.]+) MiB", est.stdout, re.M).group(1)) / 1024
    limit = 1 << 30
    t0 = time.monotonic()
    r = trainer("train", "--config", cfg, prefix=("prlimit", f"--as={limit}"))
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
    assert f"memory: this run needs about {peak:.1f} GiB" in r.stderr, r.stderr[-3000:]
    assert "RLIMIT_AS 1.0 GiB" in r.stderr, r.stderr[-3000:]
    if mem_available_gib() > 2:  # else the busy machine's MemAvailable is the smaller limit
        assert "more than the 1.0 GiB this process may use (RLIMIT_AS;" in r.stderr, r.stderr[-3000:]
    assert "lower lora.r (now 4096)" in r.stderr and "--force" in r.stderr
    assert "info trainer: model " not in r.stderr and time.monotonic() - t0 < 60  # before loading anything
    r = trainer("train", "--config", cfg, "--force", prefix=("prlimit", f"--as={limit}"))
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])  # a clean failure, not -SIGKILL
    assert "starting anyway (--force)" in r.stderr and "out of memory" in r.stderr, r.stderr[-3000:]
    # a plan that fits starts as before (here: no loaderd, so it stops at the attach)
    r = trainer("train", "--config", cfg, "--set", "lora.r=4", "--set", "data.seq_len=64", "--set",
                "data.micro_batch_size=1", prefix=("prlimit", f"--as={limit}"))
    assert "memory: this run needs about" in r.stderr and "attach to loaderd" in r.stderr, r.stderr[-3000:]
    r2 = trainer("eval", "--config", cfg, "--force")
    assert r2.returncode == 2 and "--force (trainer train --force)" in r2.stderr, r2.stderr


# ---------------------------------------------------------------- §9

def test_failed_job_reason_reaches_the_trainer(tmp_path, trainer_stack):
    """loaderd fails the job (every record empty: no valid document in an epoch); the trainer's
    error carries loaderd's reason, asked while still attached (after the trainer exits the job is
    gone from `loaderctl status`)."""
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "a.jsonl", [json.dumps({"text": ""}) for _ in range(50)])
    tiny(tmp_path / "tiny.gguf")
    ld = trainer_stack(data)
    cfg = write_job(tmp_path, socket=ld.sock, eval={"shards": []})
    r = trainer("train", "--config", cfg)
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
    assert re.search(r"loaderd closed the stream of job \d+ before its end: job failed: pipeline: epoch 0 has no "
                     r"valid documents", r.stderr), r.stderr[-3000:]
    assert "see loaderctl status" not in r.stderr


def test_config_check_refuses_what_loaderd_refuses(tmp_path):
    cfg = write_job(tmp_path)
    r = trainer("config", "--check", cfg, "--set", "data.seq_len=8")
    assert r.returncode == 2 and "data.seq_len: expected an integer in [16, 1048576], got 8" in r.stderr, r.stderr
    r = trainer("config", "--check", cfg, "--set", "eval.lengths=[8, 64]")
    assert r.returncode == 2 and "eval.lengths" in r.stderr and "[16, 1048576]" in r.stderr, r.stderr
    r = trainer("config", "--check", cfg, "--set", "data.seq_len=16")
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------- §11

def test_set_paths_name_one_key(tmp_path):
    cfg = write_job(tmp_path)
    for bad, why in (("optim..lr=0.5", 'has an empty segment'), (".optim.lr=0.5", "starts with '.'"),
                     ("optim.lr.=0.5", "ends with '.'"), ("optim.#lr=0.5", "comment key")):
        for cmd in (("config", "--check", cfg), ("train", "--config", cfg)):
            r = trainer(*cmd, "--set", bad)
            assert r.returncode == 2 and why in r.stderr and f'--set "{bad}"' in r.stderr, (cmd, bad, r.stderr)
    r = trainer("config", "--check", cfg, "--set", "optim.lr=0.5", "--print", "optim.lr")
    assert r.returncode == 0 and r.stdout.strip() == "0.5", (r.stdout, r.stderr)


def test_sparse_checkpoint_state_is_not_read(tmp_path, stack):
    """A checkpoint whose trainer_state.bin is a 3 GiB sparse file: refused by its size before it
    is read (the resumed run's peak RSS stays far below it)."""
    cfg = write_job(tmp_path, socket=stack.sock, steps=4, stop_at_step=2, checkpoint_every=2)
    r = trainer("train", "--config", cfg)
    assert r.returncode == 0 and (tmp_path / "ckpt" / "trainer_state.bin").is_file(), r.stderr[-3000:]
    os.truncate(tmp_path / "ckpt" / "trainer_state.bin", 3 << 30)
    e = dict(os.environ)
    e.update(SAN_ENV)
    with open(tmp_path / "err.txt", "w") as ef:
        p = subprocess.Popen([TRAINER, "train", "--config", str(cfg), "--resume", str(tmp_path / "ckpt")],
                             stdout=subprocess.DEVNULL, stderr=ef, env=e)
        _, status, ru = os.wait4(p.pid, 0)  # this child's own peak RSS
    err = (tmp_path / "err.txt").read_text()
    assert os.waitstatus_to_exitcode(status) == 1, err[-3000:]
    assert "trainer_state.bin is 3221225472 bytes, more than a checkpoint of this job's" in err, err[-3000:]
    assert ru.ru_maxrss < 1024 * 1024, ru.ru_maxrss  # KiB: well under the file's 3 GiB


# ---------------------------------------------------------------- issue 24: Mistral's window

def test_mistral_sliding_window(tmp_path, stack):
    """A Mistral HF directory (MistralForCausalLM, config.json sliding_window; the tiny model
    merged to safetensors with its tokenizer, then re-labelled) trains on the CPU with its window
    applied: with data.seq_len 32, a window of 8 changes the first step's loss (the rows hold
    documents longer than 8 tokens), a window of 32 (>= every row) gives exactly the loss of no
    window at all; the log names the windowed attention. The merged export stays a Mistral with
    its window, and `trainer generate` runs past it (trainer/infer applies the window too)."""
    ad = write_adapter(tmp_path / "zero-adapter", value=0.0)
    d = tmp_path / "mistral"
    r = trainer("export", "--model", tmp_path / "tiny.gguf", "--adapter", ad, "--format",
                "safetensors", "--dtype", "f32", "--out", d)
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = json.loads((d / "config.json").read_text())
    for k in ("attention_bias", "mlp_bias", "pretraining_tp"):
        cfg.pop(k, None)
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral")

    def first_loss(window, steps=1):
        cfg["sliding_window"] = window
        (d / "config.json").write_text(json.dumps(cfg))
        out = tmp_path / f"adapter-{window}"
        r = trainer("train", "--config", write_job(tmp_path, model=str(d), socket=str(stack.sock),
                                                   steps=steps, out_dir=str(out)))
        assert r.returncode == 0, r.stderr[-3000:]
        text = r.stdout + r.stderr
        m = re.search(r"step 1/%d \| loss ([0-9.]+)" % steps, text)
        assert m, text[-3000:]
        return float(m.group(1)), text, out

    full, _, _ = first_loss(None)
    same, _, _ = first_loss(32)
    win8, text8, adapter = first_loss(8, steps=4)
    assert same == full, (same, full)
    assert win8 != full, (win8, full)
    assert "Mistral sliding_window 8 < data.seq_len 32: sliding-window attention on the layers " \
           "that have it" in text8, text8[-3000:]
    assert re.search(r"step 4/4 \| loss ", text8), text8[-3000:]
    # the merged export stays a Mistral with its window (MistralForCausalLM, sliding_window), and
    # `trainer generate` on it runs past the window
    m2 = tmp_path / "mistral-merged"
    r = trainer("export", "--model", d, "--adapter", adapter, "--format",
                "safetensors", "--dtype", "f32", "--out", m2)
    assert r.returncode == 0, r.stderr[-2000:]
    cfg2 = json.loads((m2 / "config.json").read_text())
    assert cfg2["architectures"] == ["MistralForCausalLM"] and cfg2["sliding_window"] == 8, cfg2
    r = trainer("generate", "--model", m2, "--base-dtype", "fp32", "--prompt", "hello there",
                "--max-new-tokens", "40")
    assert r.returncode == 0, r.stderr[-2000:]
