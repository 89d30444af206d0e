"""Hugging Face-complete exports checked by Hugging Face itself (issue 15): runs
tests/reference/check_exports.py --hf-dir with the pinned transformers / tokenizers of
python/requirements-torch.txt. Collected only when $BT_VENV_TORCH is set: `make pytest-torch`
(part of `make test`) runs it with .venv-torch/bin/python, so sys.executable is that interpreter.

What it proves: AutoTokenizer.from_pretrained on the directory `trainer export` writes gives the
ids of tokenizers' own tokenizer for every document of the parity corpus (SmolLM2 from the real
GGUF, Llama 3 and Qwen2 tokenizers), the safetensors shards equal save_pretrained's, and
pipeline("text-generation") greedy output equals `trainer generate`. Results recorded in
tests/fixtures/hf/exports_check.json. And (issue 12) extended models' exports give BarqTrain's
logits past the original context in transformers (check_exports.py --context-extension)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import MODEL, ROOT


def test_hf_reference_check(tmp_path):
    if not os.path.exists(MODEL):
        pytest.skip("model not present (make model)")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="",
               TOKENIZERS_PARALLELISM="false")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "reference", "check_exports.py"),
                        "--hf-dir", "--work", str(tmp_path)], capture_output=True, text=True,
                       env=env, timeout=1800, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(p.stdout[p.stdout.index("{"):])
    assert res["smollm2_tokenizer"]["mismatching_documents"] == 0
    assert res["smollm2_tokenizer"]["documents"] > 0
    assert all(g["equal"] for g in res["smollm2_pipeline_greedy"])


def test_extended_exports_in_transformers(tmp_path):
    """check_exports.py --context-extension: for linear, yarn and dynamic, a tiny model extended
    128 -> 256 and fine-tuned, merged to safetensors (config.json rope_scaling) and to GGUF
    (llama.rope.scaling.*), loaded by transformers gives the logits of BarqTrain's forward at
    positions 200..223 within 1e-4 and differs from the unscaled model; the LoRA GGUF carries the
    keys; a dynamic GGUF is refused."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="",
               TOKENIZERS_PARALLELISM="false")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "reference", "check_exports.py"),
                        "--context-extension", "--work", str(tmp_path)], capture_output=True,
                       text=True, env=env, timeout=1200, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(p.stdout[p.stdout.index("{"):])
    for method in ("linear", "yarn", "dynamic"):
        d = res[f"{method}_safetensors_logits_maxdiff"]
        assert d <= 1e-4 and res[f"{method}_vs_unscaled_logits_maxdiff"] > 100 * d, (method, res)
    for method in ("linear", "yarn"):
        assert res[f"{method}_gguf_logits_maxdiff"] <= 1e-4, (method, res)
    assert res["dynamic_gguf"].startswith("refused"), res
