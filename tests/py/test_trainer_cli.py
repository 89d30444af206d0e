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
                           "heartbeat_timeout_s": 60, "secret_file": None}
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
