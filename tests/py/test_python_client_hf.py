"""The loaderd Python client with torch, transformers and PEFT (issue 15 point 1), run by
`make pytest-torch` in .venv-torch/ (python/requirements-torch.txt; barq_loaderd installed there
with `pip install ./python`). Collected only when $BT_VENV_TORCH is set (conftest.py).

* LoaderdDataset yields exactly what transformers' own DataCollatorWithFlattening returns for the
  segments of each loaderd batch, and collate() of several equals the collator over all of them;
* a resumed LoaderdDataset (state_dict / load_state_dict) yields the batches of an uninterrupted
  one; DataLoader worker processes are refused;
* SmolLM2-135M with transformers + PEFT LoRA on CPU, fed by loaderd: the first-step loss of our CPU
  trainer (`trainer train`, fp32 base, LoRA B = 0 at init so both forwards are the base model's)
  and transformers' loss on the same first batch agree within fp32 tolerance; the same batch with
  config.use_cache on (documents attend across each other in transformers 5.23) does not, so the
  comparison sees the attention mask; then LoaderdTrainer trains a few steps (its first logged
  loss is that same loss) with progress visible in `loaderctl status`;
* the README's example (python/examples/hf_trainer.py) runs and resumes from its checkpoint.
"""
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import DataCollatorWithFlattening, TrainerCallback

from barq_loaderd import LoaderdClient, resolve_rank_world
from barq_loaderd.hf import LoaderdTrainer, disable_cache, from_gguf
from barq_loaderd.torch import LoaderdDataset, collate
from conftest import BUILD, MODEL, ROOT, chat_line, tiny_model, write_shard

assert "site-packages" in LoaderdDataset.__module__ or "site-packages" in sys.modules["barq_loaderd"].__file__, \
    "the tests must use the installed package (pip install ./python), not the source tree"

torch.set_num_threads(2)


@pytest.fixture
def stack(tmp_path, trainer_stack):
    data = tmp_path / "data"
    data.mkdir()
    lines = [chat_line(f"Tell me about item {i}.", f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box that "
                       f"weighs {i * 7 % 23} kilograms and costs {i * 3} coins.") for i in range(120)]
    write_shard(data / "train-000.jsonl", lines[:60])
    write_shard(data / "train-001.jsonl", lines[60:])
    ld = trainer_stack(data)
    return {"tmp": tmp_path, "data": data, "ld": ld}


def job_config(stack, **over):
    j = {"name": "hf-parity", "model": MODEL, "base_dtype": "fp32", "socket": stack["ld"].sock,
         "data": {"shards": [str(stack["data"] / "train-*.jsonl")], "format": "chat", "seq_len": 128,
                  "micro_batch_size": 1, "seed": 5, "tokenizer_threads": 1},
         "lora": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0},
         "optim": {"lr": 1e-3, "warmup_steps": 0, "weight_decay": 0.0},
         "steps": 1, "grad_accum": 1, "threads": 2, "seed": 3, "log_every": 1,
         "out_dir": str(stack["tmp"] / "bt-adapter")}
    j.update(over)
    return j


def features_of(batch):
    """The batch's segments as DataCollatorWithFlattening features (padding tail included)."""
    ids, labels = batch.input_ids.reshape(-1), batch.labels.reshape(-1)
    return [{"input_ids": ids[a:b].tolist(), "labels": labels[a:b].tolist()} for a, b in batch.segments()]


def assert_same(ours, ref):
    assert set(ours) == set(ref)
    for k, v in ref.items():
        if isinstance(v, torch.Tensor):
            assert isinstance(ours[k], torch.Tensor) and ours[k].dtype == v.dtype and ours[k].shape == v.shape, k
            assert torch.equal(ours[k], v), k
        else:
            assert type(ours[k]) is type(v) and ours[k] == v, k


def test_batches_are_datacollatorwithflattening_output(stack):
    cfg = job_config(stack)
    cfg["data"]["micro_batch_size"] = 2
    ds = LoaderdDataset.from_trainer_config(cfg)
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    with LoaderdClient(ds.spec, socket_path=stack["ld"].sock) as c:
        raw = [c.next(timeout=120).copy() for _ in range(6)]
    it = iter(ds)
    ours = [next(it) for _ in range(6)]
    ds.close()
    padded = 0
    for b, o in zip(raw, ours):
        feats = features_of(b)
        padded += b.n_real_tokens < b.B * b.T
        assert_same(o, collator(feats))
        assert o["input_ids"].shape == (1, b.B * b.T) and int((o["labels"] != -100).sum()) == b.n_labelled_tokens
    assert padded, "no batch with a padding tail: the padding segment case went untested"
    # several micro-batches at once (a Trainer's own DataLoader with data_collator=collate)
    assert_same(collate(ours[:3]), collator(features_of(raw[0]) + features_of(raw[1]) + features_of(raw[2])))
    assert collate(ours[:1]) is ours[0]


def test_dataset_rank_from_the_environment(stack, monkeypatch):
    cfg = job_config(stack)
    with LoaderdClient(LoaderdDataset.from_trainer_config(cfg).spec, socket_path=stack["ld"].sock, rank=1,
                       world_size=2) as c:
        want = c.next(timeout=120).copy()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ds = LoaderdDataset.from_trainer_config(cfg)
    got = next(iter(ds))
    assert ds.rank_world == (1, 2) and ds.state_dict()["rank"] == 1 and ds.state_dict()["world_size"] == 2
    assert np.array_equal(got["input_ids"].numpy().reshape(want.input_ids.shape), want.input_ids)
    ds.close()
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match="RANK='2' is not below WORLD_SIZE='2'"):
        next(iter(LoaderdDataset.from_trainer_config(cfg)))
    # an initialised torch.distributed wins over the environment
    import torch.distributed as tdist
    tdist.init_process_group("gloo", init_method=f"file://{stack['tmp']}/pg", rank=0, world_size=1)
    try:
        assert resolve_rank_world() == (0, 1, "torch.distributed")
        assert LoaderdDataset.from_trainer_config(cfg).rank_world == (0, 1)
    finally:
        tdist.destroy_process_group()


def test_dataset_resume_and_workers_refused(stack):
    cfg = job_config(stack)
    N, K = 8, 3

    def items(ds, n):
        it = iter(ds)
        out = [next(it) for _ in range(n)]
        return out

    want = items(LoaderdDataset.from_trainer_config(cfg), N)
    part = LoaderdDataset.from_trainer_config(cfg)
    first = items(part, K)
    state = json.loads(json.dumps(part.state_dict()))
    part.close()
    assert state["next_step"] == K
    resumed = LoaderdDataset.from_trainer_config(cfg)
    resumed.load_state_dict(state)
    rest = items(resumed, N - K)
    for a, b in zip(first + rest, want):
        assert all(torch.equal(a[k], b[k]) for k in ("input_ids", "labels", "position_ids", "cu_seq_lens_q"))
    # a new iteration of the same dataset continues where the last one stopped
    items(resumed, 1)
    assert resumed.state_dict()["next_step"] == N + 1
    resumed.close()
    with pytest.raises(ValueError, match="another job"):
        LoaderdDataset.from_trainer_config(job_config(stack, data=dict(cfg["data"], seed=6))).load_state_dict(state)
    loader = torch.utils.data.DataLoader(LoaderdDataset.from_trainer_config(cfg), batch_size=None, num_workers=1)
    with pytest.raises(RuntimeError, match="num_workers=0"):
        next(iter(loader))


def trainer_first_loss(cfg_path):
    env = dict(os.environ, BT_LOG_LEVEL="debug")
    r = subprocess.run([os.path.join(BUILD, "trainer"), "train", "--config", cfg_path], capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"step 1 loss (\S+) grad norm", r.stdout + r.stderr)
    assert m, r.stdout + r.stderr
    return float(m.group(1))


def hf_lora_model(cfg):
    from peft import LoraConfig, get_peft_model
    base = from_gguf(MODEL)
    assert not getattr(base, "is_quantized", False) and base.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    # the GGUF has no output.weight: lm_head is the (Q8_0) token embedding, as in our loader
    assert base.lm_head.weight.data_ptr() == base.model.embed_tokens.weight.data_ptr()
    lo = cfg["lora"]
    return get_peft_model(base, LoraConfig(r=lo["r"], lora_alpha=lo["lora_alpha"], lora_dropout=lo["lora_dropout"],
                                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"], task_type="CAUSAL_LM"))


class StatusProbe(TrainerCallback):
    """Reads `loaderctl status --json` whenever the Trainer logs a loss (after LoaderdCallback,
    which LoaderdTrainer runs first, reported it)."""

    def __init__(self, ld):
        self.ld, self.seen = ld, []

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            st = json.loads(self.ld.ctl("status", "--json").stdout)
            self.seen += [(j["name"], j["trainer"]) for j in st["jobs"] if j["trainer"]]


def test_first_step_loss_equals_our_trainer_then_hf_trainer_trains(stack, tmp_path):
    if not os.access(os.path.join(BUILD, "trainer"), os.X_OK):
        pytest.skip("build/trainer not built")
    cfg = job_config(stack)
    cfg_path = tmp_path / "job.json"
    cfg_path.write_text(json.dumps(cfg))
    ours = trainer_first_loss(str(cfg_path))

    model = hf_lora_model(cfg)
    disable_cache(model)
    batch = next(iter(LoaderdDataset.from_trainer_config(cfg)))  # the trainer's first batch (same job, rank 0 of 1)
    model.train()
    with torch.no_grad():
        hf = model(**batch).loss.item()
        model.base_model.model.config.use_cache = True
        crossed = model(**batch).loss.item()
        model.base_model.model.config.use_cache = False
    # fp32 on both sides; different summation orders (OpenBLAS vs torch) leave ~1e-6 relative
    tol = 2e-5 * abs(ours)
    print(f"first-step loss: trainer {ours!r}, transformers {hf!r} (rel diff {abs(hf - ours) / abs(ours):.2e}), "
          f"with use_cache on {crossed!r}")
    assert abs(hf - ours) <= tol, f"transformers {hf!r} vs trainer {ours!r}"
    assert abs(crossed - ours) > 50 * tol, "attending across documents should change the loss"

    # a few steps of transformers' Trainer + PEFT, fed by loaderd; step 1 is the same batch and loss
    from transformers import TrainingArguments
    ds = LoaderdDataset.from_trainer_config(cfg)
    probe = StatusProbe(stack["ld"])
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=3, learning_rate=1e-3, logging_steps=1,
                             save_strategy="no", report_to=[], use_cpu=True, lr_scheduler_type="constant",
                             dataloader_num_workers=0, seed=3)
    trainer = LoaderdTrainer(model=model, args=args, train_dataset=ds, callbacks=[probe])
    out = trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3 and all(math.isfinite(x) for x in logged)
    assert abs(logged[0] - ours) <= max(tol, 1e-4 * abs(ours)), (logged, ours)  # Trainer logs rounded losses
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(float(p.detach().abs().max()) > 0 for p in lora_b), "the Trainer did not update the adapter"
    assert out.global_step == 3 and ds.batches_yielded == 3
    # loaderctl status showed the run: our job, the Trainer's steps and losses
    assert [(name, t["step"], t["loss"]) for name, t in probe.seen] == \
        [("hf-parity", k + 1, logged[k]) for k in range(3)], probe.seen
    assert all(t["tokens_per_s"] > 0 for _, t in probe.seen)
    assert ds.client is None  # detached at the end of training
    assert json.loads(stack["ld"].ctl("status", "--json").stdout)["jobs"] == []


def write_zero_adapter(d, n_layers=2, hidden=64, r=1):
    """A PEFT adapter with B = 0 on q_proj (no effect): `trainer export` needs one to write a base."""
    from safetensors.torch import save_file
    os.makedirs(d)
    t = {}
    for i in range(n_layers):
        pre = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        t[pre + ".lora_A.weight"] = torch.zeros(r, hidden)
        t[pre + ".lora_B.weight"] = torch.zeros(hidden, r)
    save_file(t, os.path.join(d, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": r, "target_modules": ["q_proj"]}, f)


def test_readme_example_trains_and_resumes(stack, tmp_path):
    """The example as a user runs it: a YAML job file without a socket key ($LOADERD_SOCKET
    names loaderd's, as for our trainer), naming its base model (a Hugging Face directory of the
    same weights) in base_model_name_or_path. It trains, stops, resumes from its checkpoint with
    the loaderd stream; its learning rate follows the trainer's schedule (the first step at
    lr / warmup_steps, not 0); the adapter names the real base, so PEFT saves it without "Could not
    find a config file" and AutoPeftModelForCausalLM loads it with that base."""
    import yaml
    # a tiny random Llama with SmolLM2's tokenizer (the script is the same for any model), and the
    # same weights as a Hugging Face directory (our export of the base: an all-zero adapter)
    tiny = str(tiny_model(tmp_path / "tiny.gguf"))
    write_zero_adapter(str(tmp_path / "zero"))
    hf_base = tmp_path / "tiny-hf"
    subprocess.run([os.path.join(BUILD, "trainer"), "export", "--model", tiny, "--adapter", str(tmp_path / "zero"),
                    "--format", "safetensors", "--dtype", "f32", "--out", str(hf_base)], check=True,
                   capture_output=True)
    cfg = job_config(stack, name="example", model=tiny, steps=4, save_every=2, base_model_name_or_path=str(hf_base),
                     lora={"r": 4, "lora_alpha": 8, "lora_dropout": 0.05},
                     optim={"lr": 1e-3, "warmup_steps": 2, "weight_decay": 0.0}, min_lr_ratio=0.25)
    sock = cfg.pop("socket")
    cfg_path = tmp_path / "job.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    script = os.path.join(ROOT, "python", "examples", "hf_trainer.py")
    out = tmp_path / "out"

    def run(*extra):
        r = subprocess.run([sys.executable, script, "--config", str(cfg_path), "--output-dir", str(out), "--cpu",
                            *extra], capture_output=True, text=True, timeout=600, cwd=ROOT,
                           env=dict(os.environ, OMP_NUM_THREADS="2", LOADERD_SOCKET=sock))
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
        assert "Could not find a config file" not in r.stderr, r.stderr[-3000:]
        return r

    run("--max-steps", "2")
    state = json.loads((out / "checkpoint-2" / "loaderd_state_rank0.json").read_text())
    assert state["next_step"] == 2 and state["rank"] == 0 and state["world_size"] == 1
    r = run("--resume")
    # the stream continued at batch 2: two batches read, not four with the first two skipped
    assert "loaderd: 2 batches read, stream at step 4" in r.stdout, r.stdout[-2000:]
    state = json.loads((out / "checkpoint-4" / "loaderd_state_rank0.json").read_text())
    assert state["next_step"] == 4, "the resumed run read batches 2 and 3, not 0 and 1 again"
    # the learning rate of every step (transformers logs the one the step used) is the trainer's
    from barq_loaderd import trainer_schedule
    lr_of = trainer_schedule(str(cfg_path))
    hist = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    lrs = [(h["step"], h["learning_rate"]) for h in hist if "learning_rate" in h]
    assert [s for s, _ in lrs] == [1, 2, 3, 4], hist
    for step, lr in lrs:
        assert lr == pytest.approx(lr_of(step - 1), rel=1e-9), (step, lr)
    assert lrs[0][1] == pytest.approx(1e-3 / 2)  # warm-up 1/2, 2/2 (transformers: 0, 1/2)
    # half-way down the cosine to the floor lr * min_lr_ratio (transformers: to 0, 0.5e-3)
    assert lrs[3][1] == pytest.approx(0.25e-3 + 0.75e-3 * 0.5)
    # the adapter names the real base; PEFT loads it with that base
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    cfg_json = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert cfg_json["r"] == 4 and cfg_json["lora_alpha"] == 8
    assert cfg_json["base_model_name_or_path"] == str(hf_base)
    for ck in ("checkpoint-2", "checkpoint-4"):
        assert json.loads((out / ck / "adapter_config.json").read_text())["base_model_name_or_path"] == str(hf_base)
    import warnings
    from peft import AutoPeftModelForCausalLM, PeftModel
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        loaded = AutoPeftModelForCausalLM.from_pretrained(str(out / "adapter"), dtype=torch.float32)
    assert not [x for x in w if "config file" in str(x.message)], [str(x.message) for x in w]
    ref = PeftModel.from_pretrained(from_gguf(tiny), str(out / "adapter"))
    ids = torch.tensor([[1, 42, 7, 900, 5]])
    with torch.no_grad():
        a, b = loaded(input_ids=ids).logits, ref(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-5), float((a - b).abs().max())
