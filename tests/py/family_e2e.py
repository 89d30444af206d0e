"""`trainer train` through loaderd on a tiny fixture family (a GGUF with its own byte-level
vocabulary: tests/reference/gen_qwen_fixtures.py / gen_phi3_fixtures.py / gen_gemma3_fixtures.py),
then the PEFT adapter it wrote loaded by peft on the fixture's Hugging Face directory (the same
weights): used by tests/py/test_export_qwen.py, test_export_phi3.py and test_export_gemma3.py,
which `make pytest-torch` runs with
.venv-torch's torch / transformers / peft.

What it checks: the run goes through loaderd (text shards, the GGUF's tokenizer), logs 8 steps
whose loss falls (mean of the last two below the first by 5% or more: lr 1e-2 on 40 repetitions of
a few sentences), and the adapter directory loads in peft.PeftModel.from_pretrained with every
LoRA tensor of the file taken (none missing or unexpected) and gives the logits of our own forward
with the adapter (build/tools/bt_logits on the GGUF, fp32) within 1e-4; the adapter is not the
identity (its logits differ from the base's by more than 1e-3). Takes a few seconds."""
import json
import os
import re
import shutil
import subprocess

import numpy as np

from conftest import BUILD, write_shard

TEXT = ["The quick brown fox jumps over the lazy dog.", "A small model learns a short text.",
        "Loaders pack rows of tokens for the trainer.", "Every step the loss should go down."]


def train(trainer_stack, tmp_path, model, targets, name):
    """`trainer train` through loaderd, 8 steps (the module docstring's run) on `model` (a GGUF
    inside tmp_path, loaderd's model_roots) with a LoRA of r 4, alpha 8 on `targets`; asserts the
    loss falls (losses printed under `name`) and returns the adapter directory it wrote
    (tmp_path / "adapter")."""
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "train.jsonl", [json.dumps({"text": t}) for t in TEXT * 40])
    ld = trainer_stack(data)
    out = tmp_path / "adapter"
    job = {"model": str(model), "base_dtype": "fp32", "socket": str(ld.sock),
           "data": {"shards": [str(data / "train.jsonl")], "format": "text", "seq_len": 64,
                    "micro_batch_size": 2, "seed": 3},
           "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": targets},
           "optim": {"lr": 1e-2, "warmup_steps": 0}, "steps": 8, "grad_accum": 1, "threads": 1,
           "out_dir": str(out)}
    (tmp_path / "job.json").write_text(json.dumps(job))
    r = subprocess.run([os.path.join(BUILD, "trainer"), "train", "--config",
                        str(tmp_path / "job.json")], capture_output=True, text=True, timeout=300)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-3000:]
    steps = re.findall(r"step (\d+)/8 \| loss ([0-9.]+) \| lr ", text)
    assert [int(s) for s, _ in steps] == list(range(1, 9)), text[-3000:]
    losses = [float(l) for _, l in steps]
    print(f"e2e {name}: losses {losses}")
    assert (losses[-1] + losses[-2]) / 2 < 0.95 * losses[0], losses
    assert " field: " not in ld.log_text()
    return out


def train_then_peft(trainer_stack, tmp_path, gguf, hf_dir, targets, torch, transformers, peft):
    model = tmp_path / "model.gguf"
    shutil.copyfile(gguf, model)  # inside loaderd's model_roots (trainer_stack)
    out = train(trainer_stack, tmp_path, model, targets,
                os.path.basename(os.path.dirname(str(gguf))))
    cfg = json.loads((out / "adapter_config.json").read_text())
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(base, out)
    from safetensors.torch import load_file
    ours = load_file(str(out / "adapter_model.safetensors"))
    state = {k.replace(".default", ""): v for k, v in pm.named_parameters() if "lora_" in k}
    assert set(ours) == set(state), (sorted(set(ours) ^ set(state)))[:6]
    for k, v in ours.items():
        assert torch.equal(state[k].detach(), v), k
    ids = [int(b) for b in "The quick brown fox".encode()]  # byte tokens of the fixture vocab
    with torch.no_grad():
        want = pm(input_ids=torch.tensor([ids])).logits[0].float().numpy()
    f = tmp_path / "bt_logits.bin"
    subprocess.run([os.path.join(BUILD, "tools", "bt_logits"), "--model", str(model), "--ids",
                    ",".join(map(str, ids)), "--pos0", "0", "--out", str(f), "--adapter", str(out)],
                   check=True, capture_output=True, timeout=120)
    got = np.fromfile(f, np.float32).reshape(len(ids), -1)
    err = float(np.abs(got - want).max())
    with torch.no_grad(), pm.disable_adapter():
        base_logits = pm(input_ids=torch.tensor([ids])).logits[0].float().numpy()
    print(f"e2e: PEFT logits of the trained adapter vs ours: max abs err {err:.3g}")
    assert err <= 1e-4
    assert float(np.abs(want - base_logits).max()) > 1e-3
    return cfg
