"""Run a reference generator inside .venv-hf (made by gen_hf_fixtures.py from
requirements-hf.txt: torch 2.5.1, transformers 4.46.3, ...), CPU only, offline, one thread.

    from venv_hf import reexec_in_venv_hf
    reexec_in_venv_hf(__file__, "gen_rope")   # first thing, before importing torch

re-executes `script` with .venv-hf's python unless it already runs there (BT_HF_IN_VENV=1) or
`--no-venv` is on the command line (then the current interpreter is used), with PYTHONHASHSEED=0;
exits naming the fix when .venv-hf does not exist. Afterwards sets CUDA_VISIBLE_DEVICES="",
HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE = 1 and OMP_NUM_THREADS = 1 unless set.
"""
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-hf"


def reexec_in_venv_hf(script, tag):
    if os.environ.get("BT_HF_IN_VENV") != "1" and "--no-venv" not in sys.argv:
        py = VENV / "bin" / "python"
        if not py.exists():
            sys.exit(f"{tag}: {VENV} is missing: run tests/reference/gen_hf_fixtures.py first "
                     "(it creates it with tests/reference/requirements-hf.txt)")
        env = dict(os.environ, BT_HF_IN_VENV="1", PYTHONHASHSEED="0")
        os.execve(str(py), [str(py), str(Path(script).resolve())] + sys.argv[1:], env)
    for k, v in (("CUDA_VISIBLE_DEVICES", ""), ("HF_HUB_OFFLINE", "1"),
                 ("TRANSFORMERS_OFFLINE", "1"), ("OMP_NUM_THREADS", "1")):
        os.environ.setdefault(k, v)
