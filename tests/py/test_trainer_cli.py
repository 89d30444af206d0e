"""`trainer config` and `trainer estimate` from the command line, and the estimate against the
measured peak RSS of a real run.

- every template, plain and --documented, is valid JSON that `trainer config --check` accepts,
  and the documented one ("#" comment keys) gives the same effective config;
- config errors (unknown key, wrong type, impossible value, unknown template) exit 2 and name
  the key;
- `trainer estimate` prints the bill for both backends;
- the CPU estimate is within 15% of the peak RSS the trainer reports (getrusage ru_maxrss) for
  the demo job's shape on SmolLM2-135M scaled down to stay fast: seq_len 128 x micro-batch 1,
  1 step, no eval (plain LoRA and LoRA+ with activation checkpointing)."""
import json
import os
import re
import subprocess

import pytest

from conftest import BUILD, ROOT

TRAINER = os.path.join(BUILD, "trainer")


def run(*args, timeout=120, **kw):
    return subprocess.run([TRAINER, *args], capture_output=True, text=True, timeout=timeout, **kw)


@pytest.fixture(autouse=True)
def need_trainer():
    if not os.access(TRAINER, os.X_OK):
        pytest.skip(f"{TRAINER} not built")


def test_config_reference_is_committed():
    """docs/CONFIG.md is the key table as `trainer config --reference` prints it (`make docs`)."""
    r = run("config", "--reference")
    assert r.returncode == 0, r.stderr
    with open(os.path.join(ROOT, "docs", "CONFIG.md"), encoding="utf-8") as f:
        assert f.read() == r.stdout, "docs/CONFIG.md is stale: run `make docs`"
    assert "| `cuda.nf4_matmul` | deprecated alias of `cuda.base_matmul` |" in r.stdout
    assert run("config", "--reference", "--documented").returncode == 2


@pytest.mark.parametrize("name", ["default", "qlora", "long-context"])
def test_templates_round_trip(tmp_path, name):
    plain = run("config", "--template", name)
    assert plain.returncode == 0, plain.stderr
    doc = run("config", "--template", name, "--documented")
    assert doc.returncode == 0, doc.stderr
    pj, dj = json.loads(plain.stdout), json.loads(doc.stdout)
    assert not any(k.startswith("#") for k in pj)
    assert "#" in dj and "#seq_len" in dj["data"] and "#r" in dj["lora"]
    effective = []
    for text in (plain.stdout, doc.stdout):
        p = tmp_path / "job.json"
        p.write_text(text)
        r = run("config", "--check", str(p))
        assert r.returncode == 0, r.stderr
        effective.append(json.loads(r.stdout))
    assert effective[0] == effective[1]
    if name == "long-context":
        assert effective[0]["trainable_modules"] == ["embed_tokens", "norm"]
        assert effective[0]["activation_checkpointing"] is True


def test_config_errors_name_the_key(tmp_path):
    p = tmp_path / "job.json"
    p.write_text(run("config", "--template", "default").stdout)
    cases = [
        (["--set", "optim.momentum=0.9"], 'unknown key "optim.momentum"'),
        (["--set", "data.seq_len=\"long\""], "data.seq_len: expected an integer"),
        (["--set", "lora.lora_dropout=1.5"], "lora.lora_dropout: expected a number in [0, 1)"),
        (["--set", "trainable_modules=[\"lm_head\"]"], "trainable_modules: expected an array"),
        (["--set", "stop_at_step=31"], "stop_at_step: expected an integer in [0, steps = 30]"),
        (["--set", "checkpoint_every=-2"], "checkpoint_every: expected an integer >= 0"),
    ]
    for args, needle in cases:
        r = run("config", "--check", str(p), *args)
        assert r.returncode == 2 and needle in r.stderr, (args, r.stderr)
    r = run("config", "--template", "huge")
    assert r.returncode == 2 and 'unknown template "huge"' in r.stderr
    r = run("config")
    assert r.returncode == 2
    r = run("estimate", "--config", str(p), "--set", "lora.r=0")
    assert r.returncode == 2 and "lora.r" in r.stderr
    r = run("estimate", "--config", str(p), "--set", "model=/nonexistent.gguf")
    assert r.returncode == 1 and "nonexistent" in r.stderr


def estimate_peak(cfg_path):
    r = run("estimate", "--config", cfg_path)
    assert r.returncode == 0, r.stderr
    m = re.search(r"^\s+peak\s+([0-9.]+) MiB\s+([0-9.]+) MiB", r.stdout, re.M)
    assert m, r.stdout
    for part in ("base linears", "embedding", "LoRA params + grads + AdamW m, v", "activations",
                 "loss chunk workspace", "CPU (fp32)", "CUDA (bf16)"):
        assert part in r.stdout, r.stdout
    return float(m.group(1)), float(m.group(2)), r.stdout


@pytest.mark.parametrize("variant", ["lora", "lora_plus"])
def test_estimate_within_15_percent_of_peak_rss(tmp_path, loaderd, model_path, variant):
    ld = loaderd({"data_roots": [os.path.join(ROOT, "data")],
                  "model_roots": [os.path.dirname(model_path)]})
    demo = json.loads(open(os.path.join(ROOT, "scripts", "job.demo.json")).read())
    if not os.path.exists(os.path.join(ROOT, "data", "demo")):
        pytest.skip("data/demo not present (make shards)")
    demo.update({"model": model_path, "socket": ld.sock, "steps": 1, "save_every": 0,
                 "eval": {"shards": []}, "out_dir": str(tmp_path / "adapter"), "threads": 2})
    demo["data"].update({"seq_len": 128, "micro_batch_size": 1,
                         "shards": [os.path.join(ROOT, "data", "demo", "train-*.jsonl.zst")]})
    if variant == "lora_plus":
        demo.update({"trainable_modules": ["embed_tokens", "norm"], "activation_checkpointing": True})
    p = tmp_path / "job.json"
    p.write_text(json.dumps(demo))
    est, est_cuda, table = estimate_peak(str(p))
    assert est_cuda > 0
    r = run("train", "--config", str(p), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"peak RSS ([0-9.]+) MiB", r.stderr)
    assert m, r.stderr
    rss = float(m.group(1))
    assert abs(est - rss) <= 0.15 * rss, f"estimate {est} MiB vs measured peak RSS {rss} MiB\n{table}"


def test_distributed_environment_is_checked_before_anything_runs(tmp_path):
    """Several processes (torchrun's RANK/WORLD_SIZE or Slurm's SLURM_PROCID/SLURM_NTASKS) train
    data-parallel over NCCL: the CPU backend refuses with the reason, a garbled launcher
    environment is named, and dist.* keys are validated like every other key."""
    p = tmp_path / "job.json"
    p.write_text(run("config", "--template", "default").stdout)
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS",
                          "SLURM_LOCALID", "MASTER_ADDR", "MASTER_PORT")}
    cases = [
        ({"RANK": "1", "WORLD_SIZE": "2"}, 'needs device "cuda"'),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, "4 processes (slurm: rank 0)"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "0"}, "WORLD_SIZE"),
    ]
    for extra, needle in cases:
        r = run("train", "--config", str(p), env={**clean, **extra}, timeout=60)
        assert r.returncode != 0 and needle in r.stderr, (extra, r.stderr)
    r = run("config", "--check", str(p), "--set", "dist.master_port=70000")
    assert r.returncode == 2 and "dist.master_port" in r.stderr, r.stderr
    r = run("config", "--check", str(p), "--set", "dist.rank=1")
    assert r.returncode == 2 and 'unknown key "dist.rank"' in r.stderr, r.stderr
    eff = json.loads(run("config", "--check", str(p), "--set", "dist.master_port=29600").stdout)
    assert eff["dist"] == {"master_addr": "127.0.0.1", "master_port": 29600, "timeout_s": 600,
                           "heartbeat_timeout_s": 60, "secret_file": None, "shard_base": False}
    for key, bad in (("dist.heartbeat_timeout_s", "0"), ("dist.secret_file", "3")):
        r = run("config", "--check", str(p), "--set", f"{key}={bad}")
        assert r.returncode == 2 and key in r.stderr, r.stderr
    # `config --print KEY` is how scripts ask the trainer (scripts/train.sbatch: the socket):
    # the job's socket, else $LOADERD_SOCKET, else the default
    no_sock = {k: v for k, v in clean.items() if k != "LOADERD_SOCKET"}
    job = json.loads(p.read_text())
    assert "socket" not in job, "templates must not pin the socket"
    r = run("config", "--check", str(p), "--print", "socket", env=no_sock)
    assert r.returncode == 0 and r.stdout == "/run/loaderd/loaderd.sock\n", r.stdout + r.stderr
    r = run("config", "--check", str(p), "--print", "socket", env={**no_sock, "LOADERD_SOCKET": "/tmp/e.sock"})
    assert r.stdout == "/tmp/e.sock\n", r.stdout + r.stderr
    r = run("config", "--check", str(p), "--set", "socket=/tmp/s.sock", "--print", "socket",
            env={**no_sock, "LOADERD_SOCKET": "/tmp/e.sock"})
    assert r.stdout == "/tmp/s.sock\n", r.stdout + r.stderr
    r = run("config", "--check", str(p), "--print", "dist.master_port")
    assert r.returncode == 0 and r.stdout == "29500\n", r.stdout + r.stderr
    r = run("config", "--check", str(p), "--print", "dist.nothing")
    assert r.returncode == 2 and "--print dist.nothing: no such key" in r.stderr, r.stderr
    r = run("config", "--template", "default", "--print", "socket")
    assert r.returncode == 2 and "--print KEY goes with --check" in r.stderr, r.stderr
    # a YAML job the same way; --print gives the value itself whatever --format says
    y = p.with_suffix(".yaml")
    y.write_text(run("config", "--check", str(p), "--format", "yaml").stdout)
    r = run("config", "--check", str(y), "--set", "socket=/tmp/y.sock", "--format", "yaml", "--print", "socket")
    assert r.returncode == 0 and r.stdout == "/tmp/y.sock\n", r.stdout + r.stderr
    r = run("config", "--check", str(y), "--format", "yaml", "--print", "dist.master_port")
    assert r.returncode == 0 and r.stdout == "29500\n", r.stdout + r.stderr


LLAMA2_70B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
              "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8,
              "vocab_size": 32000, "tie_word_embeddings": False}


def test_estimate_shard_base_gpus_for(tmp_path):
    """dist.shard_base (issue 26): `--world-size W` bills one rank's 1/W shard of the base plus two
    all-gathered layers; `--gpus-for GiB` answers the fewest GPUs. Llama-2-70B NF4 at T = 2048 on
    24 GiB cards fits on 2 with checkpointing, offloaded checkpoints and LoRA r 8 (the bill is
    shown); the QLoRA recipe's r 64 does not (its LoRA state alone is ~14 GiB a rank)."""
    model = tmp_path / "llama-2-70b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA2_70B))
    p = tmp_path / "job.json"
    p.write_text(run("config", "--template", "qlora").stdout)
    lean = ["--set", f"model={model}", "--set", "data.seq_len=2048", "--set", "data.micro_batch_size=1",
            "--set", "activation_checkpointing=true", "--set", "cuda.offload_checkpoints=true",
            "--set", "lora.r=8"]
    r = run("estimate", "--config", str(p), *lean, "--gpus-for", "24")
    assert r.returncode == 0, r.stderr
    assert "\n2 GPUs of 24 GiB fit this job" in r.stdout, r.stdout
    rows = {int(m.group(1)): [float(x) for x in m.groups()[1:]] for m in re.finditer(
        r"^\s+(\d+)\s+([0-9.]+) MiB\s+([0-9.]+) MiB\s+([0-9.]+) MiB\s+([0-9.]+) MiB", r.stdout, re.M)}
    assert sorted(rows) == [1, 2], r.stdout
    (b1, g1, rest1, tot1), (b2, g2, rest2, tot2) = rows[1], rows[2]
    assert g1 == 0 and 0 < g2 < 0.1 * b2 and rest1 == rest2
    assert abs(b2 - b1 / 2) < 0.01 * b1  # whole NF4 groups: half, up to the padding
    assert tot1 > 24 * 1024 >= tot2
    # the per-rank table of --world-size 2 with the key set is the same W = 2 bill
    r2 = run("estimate", "--config", str(p), *lean, "--set", "dist.shard_base=true", "--world-size", "2")
    assert r2.returncode == 0, r2.stderr
    assert "dist.shard_base over 2 ranks" in r2.stdout and "all-gathered base layers" in r2.stdout
    m = re.search(r"^\s+peak\s+[0-9.]+ MiB\s+([0-9.]+) MiB", r2.stdout, re.M)
    assert m and abs(float(m.group(1)) - tot2) < 0.11, r2.stdout
    r5 = run("estimate", "--config", str(p), *lean, "--set", "dist.shard_base=true")
    assert "--world-size W gives one rank's of W" in r5.stdout, r5.stdout
    # without the key, --world-size leaves the whole base on every rank
    r3 = run("estimate", "--config", str(p), *lean, "--world-size", "2")
    assert "dist.shard_base over" not in r3.stdout
    # the QLoRA recipe's r 64: more GPUs, never 2
    r4 = run("estimate", "--config", str(p), *lean[:-2], "--gpus-for", "24")
    assert r4.returncode == 0 and "\n2 GPUs" not in r4.stdout, r4.stdout
    assert re.search(r"^\d+ GPUs of 24 GiB fit this job", r4.stdout, re.M), r4.stdout
    # bad values and other commands
    for bad in (["--gpus-for", "0"], ["--gpus-for", "big"], ["--world-size", "0"], ["--world-size", "2x"]):
        r = run("estimate", "--config", str(p), *bad)
        assert r.returncode == 2 and bad[0] in r.stderr, (bad, r.stderr)
    r = run("train", "--config", str(p), "--gpus-for", "24")
    assert r.returncode == 2 and "not an option of this command" in r.stderr


def test_shard_base_refused_on_cpu(tmp_path):
    """dist.shard_base shards across GPUs: the CPU backend refuses it at start, naming the key."""
    p = tmp_path / "job.json"
    p.write_text(run("config", "--template", "default").stdout)
    r = run("train", "--config", str(p), "--set", "dist.shard_base=true")
    assert r.returncode == 2 and "dist.shard_base" in r.stderr and "device \"cuda\"" in r.stderr, r.stderr
    r = run("config", "--check", str(p), "--set", "dist.shard_base=true")
    assert r.returncode == 0 and json.loads(r.stdout)["dist"]["shard_base"] is True
