#!/usr/bin/env python3
"""Truncation fixtures for preference / KTO records: what TRL 1.16.0 makes of a tokenized record
under `max_length`, for tests/unit/loaderd/test_format_pref.c (loaderd/format.c
ld_format_pref_fit with max_prompt_length 0).

TRL 1.x has no max_prompt_length. Its trainers (trl/trainer/dpo_trainer.py, kto_trainer.py,
1.16.0) first drop every example whose prompt alone fills max_length (DPOTrainer /
KTOTrainer._prepare_dataset: `dataset.filter(lambda example: len(example["prompt_ids"]) <
args.max_length)`, DPO with truncation_mode "keep_start", the default; KTO always), then the
collators cut each prompt + completion sequence to its first max_length tokens
(DataCollatorForPreference with truncation_mode "keep_start", DataCollatorForUnpairedPreference).
This runs those two collators, unchanged, on fixed token-id records of several lengths against
several max_length values, and writes per case either "dropped" (the filter's condition, which is
one line and is evaluated here as TRL writes it) or the collated sequences (padding removed with the
attention mask): input_ids and completion_mask of chosen and rejected (DPO) or of the completion
(KTO).

Usage (repo root; needs .venv-torch with trl from python/requirements-torch.txt):
    python3 tests/reference/gen_pref_truncation_fixtures.py [--out tests/fixtures/preference]
Deterministic: fixed records; two runs give byte-identical files.
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from venv_torch import reexec_in_venv_torch  # noqa: E402

reexec_in_venv_torch(__file__, "gen_pref_truncation_fixtures")

import argparse  # noqa: E402
import json  # noqa: E402

import trl  # noqa: E402
from trl.trainer.dpo_trainer import DataCollatorForPreference  # noqa: E402
from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference  # noqa: E402

TRL_VERSION = "1.16.0"
PAD = 0


def ids(start, n):
    """n distinct non-pad token ids from start."""
    return list(range(start, start + n))


# (prompt length, chosen length, rejected length): shorter, equal and longer responses; prompts
# shorter than, equal to and longer than some max_length
SHAPES = [(3, 5, 2), (6, 2, 7), (1, 9, 9), (10, 4, 1), (4, 1, 1), (8, 8, 3)]
MAX_LENGTHS = [1, 3, 4, 5, 8, 9, 11, 30]


def unpad(t, m):
    return [int(x) for x, a in zip(t.tolist(), m.tolist()) if a]


def dpo_case(p, c, r, m):
    ex = {"prompt_ids": ids(100, p), "chosen_ids": ids(200, c), "rejected_ids": ids(300, r)}
    case = dict(ex, max_length=m)
    if not len(ex["prompt_ids"]) < m:  # DPOTrainer._prepare_dataset's filter ("keep_start")
        case["dropped"] = True
        return case
    out = DataCollatorForPreference(pad_token_id=PAD, max_length=m, truncation_mode="keep_start")([ex])
    # the collator stacks chosen rows first, then rejected rows
    for k, row in (("chosen", 0), ("rejected", 1)):
        am = out["attention_mask"][row]
        case[k] = {"input_ids": unpad(out["input_ids"][row], am),
                   "completion_mask": unpad(out["completion_mask"][row], am)}
    case["dropped"] = False
    return case


def kto_case(p, c, m):
    ex = {"prompt_ids": ids(100, p), "completion_ids": ids(200, c), "label": True}
    case = {"prompt_ids": ex["prompt_ids"], "completion_ids": ex["completion_ids"], "max_length": m}
    if not len(ex["prompt_ids"]) < m:  # KTOTrainer._prepare_dataset's filter
        case["dropped"] = True
        return case
    out = DataCollatorForUnpairedPreference(pad_token_id=PAD, max_length=m)([ex])
    am = out["attention_mask"][0]
    case["completion"] = {"input_ids": unpad(out["input_ids"][0], am),
                          "completion_mask": unpad(out["completion_mask"][0], am)}
    case["dropped"] = False
    return case


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / "tests/fixtures/preference"))
    a = ap.parse_args()
    assert trl.__version__ == TRL_VERSION, f"trl {trl.__version__}, the pin is {TRL_VERSION}"
    dpo = [dpo_case(p, c, r, m) for p, c, r in SHAPES for m in MAX_LENGTHS]
    kto = [kto_case(p, c, m) for p, c, _ in SHAPES for m in MAX_LENGTHS]
    doc = {"trl": TRL_VERSION, "source": "trl/trainer/dpo_trainer.py DataCollatorForPreference "
           "(truncation_mode keep_start) and kto_trainer.py DataCollatorForUnpairedPreference, after "
           "the _prepare_dataset filter len(prompt_ids) < max_length", "dpo": dpo, "kto": kto}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trl_truncation.json").write_text(json.dumps(doc, indent=0, sort_keys=True) + "\n")
    print(f"gen_pref_truncation: {len(dpo)} DPO and {len(kto)} KTO cases, "
          f"{sum(c['dropped'] for c in dpo)} / {sum(c['dropped'] for c in kto)} dropped")


if __name__ == "__main__":
    main()
