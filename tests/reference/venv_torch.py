"""Run a reference generator inside .venv-torch (`make venv-torch`, python/requirements-torch.txt:
torch 2.15.0, transformers 5.23.0, peft 0.21.2, gguf 0.19.0), CPU only, offline, one thread.

    from venv_torch import reexec_in_venv_torch
    reexec_in_venv_torch(__file__, "gen_qwen_fixtures")   # first thing, before importing torch

re-executes `script` with .venv-torch's python unless it already runs there (BT_TORCH_IN_VENV=1),
with PYTHONHASHSEED=0, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE = 1 and
OMP_NUM_THREADS = 1; exits naming the fix when .venv-torch does not exist.
"""
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_PY = REPO / ".venv-torch" / "bin" / "python"


def reexec_in_venv_torch(script, tag):
    if os.environ.get("BT_TORCH_IN_VENV") == "1":
        return
    if not VENV_PY.exists():
        sys.exit(f"{tag}: .venv-torch is missing: run `make venv-torch` first")
    env = dict(os.environ, BT_TORCH_IN_VENV="1", PYTHONHASHSEED="0", CUDA_VISIBLE_DEVICES="",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    os.execve(str(VENV_PY), [str(VENV_PY), str(Path(script).resolve())] + sys.argv[1:], env)
