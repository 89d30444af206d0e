#!/usr/bin/env python3
"""Preference-loss fixtures: TRL's own loss code on fixed per-sequence log-probs, for
tests/unit/trainer/test_preference.c (trainer/preference.c).

For each case (DPO sigmoid / hinge / ipo / robust / exo_pair and a weighted combination, ORPO,
CPO sigmoid / hinge / ipo / simpo, KTO kto / apo_zero_unpaired) it runs TRL 1.16.0's real
functions, unchanged:
  DPO   trl.trainer.dpo_trainer.DPOTrainer._compute_loss
  ORPO  trl.experimental.orpo.ORPOTrainer.get_batch_loss_metrics (+ odds_ratio_loss)
  CPO   trl.experimental.cpo.CPOTrainer.get_batch_loss_metrics (+ cpo_loss)
  KTO   trl.trainer.kto_trainer.KTOTrainer._compute_loss (+ _compute_kl_logps)
on a stand-in `self` (the attributes those functions read, an accelerator whose gather is the
identity: one process) and a stand-in model whose `fused_lm_head=True` output carries per-token
log-probs that sum, per sequence, to the fixed values (the first completion position holds the
value, the others 0, so TRL's `.sum(dim=1)` gives it back). ORPO / CPO take their logps from
`concatenated_forward`, which TRL computes with get_batch_logps (`average_log_prob`: sum over the
completion / token count); the stand-in returns sum / count of the same leaves, so every gradient
is with respect to the summed log-probs, as in BarqTrain's API. Reference log-probs are given as
precomputed (`precompute_ref_log_probs=True`), so no reference model is involved.

Loss, metrics (TRL's names) and the gradients (torch autograd) of the loss with respect to each
sequence's summed log-prob (and the NLL term) go to tests/fixtures/preference/trl_losses.json.
Inputs are float64 (TRL keeps the dtype it is given; ORPO casts to fp32 itself, `.float()`).

Then DPO (loss types sigmoid and ipo) on a real model: the tiny Llama of
tests/fixtures/hf/tiny-llama-tied with the PEFT adapter tests/fixtures/hf/lora/adapter-init,
TRL's fused LM head, DataCollatorForPreference and DPOTrainer._compute_loss with the reference
= the same model with the adapter disabled -> tiny_dpo.json (pairs, per-sequence log-probs, loss,
metrics) and tiny_dpo_grads.safetensors (LoRA gradients); then ORPO and CPO's SimPO with the NLL
term on the same model and pairs through the trainers' own concatenated_forward and
get_batch_loss_metrics (tiny_dpo.json "orpo_cpo_cases"); then KTOTrainer._compute_loss on four
unpaired examples from those pairs with TRL's cycled KL completions ("kto_case"); for
tests/unit/trainer/test_preference_tiny.c.

Usage (repo root; needs .venv-torch with trl from python/requirements-torch.txt, made by
scripts/venv-torch.sh; VENV_TORCH overrides its path as there):
    python3 tests/reference/gen_preference_fixtures.py [--out tests/fixtures/preference]
Deterministic: fixed seed, CPU, one thread; two runs give byte-identical files.
"""
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRL_VERSION = "1.16.0"


def reexec_in_venv_torch():
    venv = Path(os.environ.get("VENV_TORCH", REPO / ".venv-torch"))
    if not venv.is_absolute():
        venv = REPO / venv
    if os.environ.get("BT_IN_VENV_TORCH") != "1" and "--no-venv" not in sys.argv:
        py = venv / "bin" / "python"
        if not py.exists():
            sys.exit(f"gen_preference: {venv} is missing: run scripts/venv-torch.sh first "
                     "(it installs python/requirements-torch.txt, trl included)")
        env = dict(os.environ, BT_IN_VENV_TORCH="1", PYTHONHASHSEED="0")
        os.execve(str(py), [str(py), str(Path(__file__).resolve())] + sys.argv[1:], env)
    for k, v in (("CUDA_VISIBLE_DEVICES", ""), ("HF_HUB_OFFLINE", "1"),
                 ("TRANSFORMERS_OFFLINE", "1"), ("OMP_NUM_THREADS", "1")):
        os.environ.setdefault(k, v)


reexec_in_venv_torch()

import argparse  # noqa: E402
import json  # noqa: E402
import types  # noqa: E402
from collections import defaultdict  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from trl import DPOTrainer, KTOTrainer  # noqa: E402
from trl.experimental.cpo import CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOTrainer  # noqa: E402

DT = torch.float64


class IdentityAccelerator:
    """One process: gather and gather_for_metrics return their argument (accelerate's behaviour
    with num_processes == 1)."""
    device = torch.device("cpu")

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def unwrap_model(self, m):
        return m


class FusedHeadModel:
    """Stands for a causal LM called with `labels=..., fused_lm_head=True` (TRL 1.16.0's fused LM
    head output: log_probs [B, T-1], 0 where labels are -100). Returns `per_token[key]` for the
    input_ids tensor it is called with (identity lookup: the batch or the KL batch)."""
    training = True

    def __init__(self):
        self.by_ids = {}

    def add(self, input_ids, per_token):
        self.by_ids[id(input_ids)] = per_token

    def __call__(self, input_ids=None, labels=None, fused_lm_head=False, **kw):
        assert fused_lm_head and labels is not None
        lp = self.by_ids[id(input_ids)]
        z = torch.zeros_like(lp)
        return types.SimpleNamespace(log_probs=lp, entropy=z.detach(), mean_logits=z.detach(),
                                     is_top1=torch.zeros(lp.shape, dtype=torch.bool))


def per_token_from_sums(sums, width):
    """[B] leaf sums -> [B, width] per-token log-probs whose row sums are the leaves."""
    return F.pad(sums[:, None], (0, width - 1))


def masks(counts, width):
    """input_ids / attention_mask / completion_mask [B, width + 1] with counts[i] completion
    tokens at the end (position 0 is always prompt)."""
    b = len(counts)
    ids = torch.arange(b * (width + 1)).reshape(b, width + 1) % 97 + 3
    att = torch.ones(b, width + 1, dtype=torch.long)
    cm = torch.zeros(b, width + 1, dtype=torch.long)
    for i, c in enumerate(counts):
        cm[i, width + 1 - c:] = 1
    return ids, att, cm


def metrics_of(stub_metrics, names):
    out = {}
    for k in names:
        v = stub_metrics.get(k)
        out[k] = None if not v else float(v[-1])
    return out


PAIR_METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected"]


def grad_list(t):
    return [0.0] * t.numel() if t.grad is None else [float(x) for x in t.grad]


def run_dpo(params, inp):
    n = len(inp["policy_chosen"])
    pc = torch.tensor(inp["policy_chosen"], dtype=DT, requires_grad=True)
    pr = torch.tensor(inp["policy_rejected"], dtype=DT, requires_grad=True)
    counts = inp["chosen_tokens"] + inp["rejected_tokens"]
    width = max(counts) + 1
    ids, att, cm = masks(counts, width)
    model = FusedHeadModel()
    model.add(ids, per_token_from_sums(torch.cat([pc, pr]), width))
    stub = types.SimpleNamespace(
        model=model, accelerator=IdentityAccelerator(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl",
        loss_types=params["loss_type"], loss_weights=params["loss_weights"],
        beta=params["beta"], label_smoothing=params["label_smoothing"], use_weighting=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1, ref_model=None,
        args=types.SimpleNamespace(gradient_checkpointing_kwargs=None, discopop_tau=0.05))
    inputs = {"input_ids": ids, "attention_mask": att, "completion_mask": cm,
              "ref_chosen_logps": torch.tensor(inp["ref_chosen"], dtype=DT),
              "ref_rejected_logps": torch.tensor(inp["ref_rejected"], dtype=DT)}
    loss = DPOTrainer._compute_loss(stub, model, inputs, return_outputs=False)
    loss.backward()
    assert n == pc.numel()
    return {"loss": float(loss.detach()), "metrics": metrics_of(stub._metrics["train"], PAIR_METRICS),
            "grad": {"chosen": grad_list(pc), "rejected": grad_list(pr), "nll": 0.0}}


def run_orpo_cpo(algo, params, inp):
    pc = torch.tensor(inp["policy_chosen"], dtype=DT, requires_grad=True)
    pr = torch.tensor(inp["policy_rejected"], dtype=DT, requires_grad=True)
    nc = torch.tensor(inp["chosen_tokens"], dtype=DT)
    nr = torch.tensor(inp["rejected_tokens"], dtype=DT)
    nll = torch.tensor(inp["nll"], dtype=DT, requires_grad=True)
    if algo == "orpo":
        average = True
        nll_used = nll
    else:
        average = params["loss_type"][0] in ("ipo", "simpo")  # CPOTrainer.concatenated_forward
        nll_used = nll if params["cpo_alpha"] != 0 else torch.tensor(0.0)
    lc, lr = (pc / nc, pr / nr) if average else (pc * 1, pr * 1)
    dummy_logits = torch.zeros(len(pc), 2, 3, dtype=DT)

    def concatenated_forward(model, batch):
        return lc, lr, dummy_logits, dummy_logits, nll_used

    stub = types.SimpleNamespace(accelerator=IdentityAccelerator(), aux_loss_enabled=False,
                                 beta=params["beta"], concatenated_forward=concatenated_forward)
    if algo == "orpo":
        stub.odds_ratio_loss = types.MethodType(ORPOTrainer.odds_ratio_loss, stub)
        loss, metrics = ORPOTrainer.get_batch_loss_metrics(stub, None, {}, "train")
        extra = ["nll_loss", "log_odds_ratio", "log_odds_chosen"]
    else:
        stub.alpha = 0.0
        stub.loss_type = params["loss_type"][0]
        stub.simpo_gamma = params["simpo_gamma"]
        stub.label_smoothing = params["label_smoothing"]
        stub.cpo_alpha = params["cpo_alpha"]
        stub.cpo_loss = types.MethodType(CPOTrainer.cpo_loss, stub)
        loss, metrics = CPOTrainer.get_batch_loss_metrics(stub, None, {}, "train")
        extra = ["nll_loss"]
    loss.backward()
    met = {k: float(metrics[k]) for k in PAIR_METRICS + extra}
    return {"loss": float(loss.detach()), "metrics": met,
            "grad": {"chosen": grad_list(pc), "rejected": grad_list(pr),
                     "nll": 0.0 if nll.grad is None else float(nll.grad)}}


def run_kto(params, inp):
    pol = torch.tensor(inp["policy"], dtype=DT, requires_grad=True)
    n = pol.numel()
    counts = inp["tokens"]
    width = max(counts) + 1
    ids, att, cm = masks(counts, width)
    model = FusedHeadModel()
    model.add(ids, per_token_from_sums(pol, width))
    calc_kl = params["loss_type"][0] != "apo_zero_unpaired"  # KTOTrainer.__init__
    batch = {"input_ids": ids, "attention_mask": att, "completion_mask": cm,
             "label": torch.tensor(inp["desirable"], dtype=torch.bool),
             "ref_logps": torch.tensor(inp["ref"], dtype=DT)}
    if calc_kl:
        kcounts = inp["kl_tokens"]
        kw = max(kcounts) + 1
        kids, katt, kcm = masks(kcounts, kw)
        kids = kids + 1000  # a different tensor; values do not matter
        model.add(kids, per_token_from_sums(torch.tensor(inp["policy_kl"], dtype=DT), kw))
        batch.update({"KL_input_ids": kids, "KL_attention_mask": katt, "KL_completion_mask": kcm,
                      "ref_KL_logps": torch.tensor(inp["ref_kl"], dtype=DT)})
    stub = types.SimpleNamespace(
        model=model, accelerator=IdentityAccelerator(), aux_loss_enabled=False,
        precompute_ref_logps=True, calculate_KL=calc_kl, loss_type=params["loss_type"][0],
        beta=params["beta"], desirable_weight=params["desirable_weight"],
        undesirable_weight=params["undesirable_weight"],
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1, ref_model=None,
        args=types.SimpleNamespace(gradient_checkpointing_kwargs=None))
    stub._compute_kl_logps = types.MethodType(KTOTrainer._compute_kl_logps, stub)
    loss = KTOTrainer._compute_loss(stub, model, batch, return_outputs=False)
    loss.backward()
    met = metrics_of(stub._metrics["train"], PAIR_METRICS + ["kl"])
    met["rewards/accuracies"] = None  # KTO does not log it
    assert n == len(inp["desirable"])
    return {"loss": float(loss.detach()), "metrics": met,
            "grad": {"policy": grad_list(pol)}}


def pair_inputs(rng, n, ref=True, near_zero=False):
    nc = rng.integers(1, 40, n)
    nr = rng.integers(1, 40, n)
    pc = -(nc * rng.uniform(0.3, 2.5, n))
    pr = -(nr * rng.uniform(0.3, 2.5, n))
    if near_zero:  # ORPO: an average log-prob above -ln 2 takes log1mexp's other branch
        pc[0], nc[0] = -0.004, 4
        pr[1], nr[1] = -0.3, 1
    d = {"policy_chosen": pc.tolist(), "policy_rejected": pr.tolist(),
         "chosen_tokens": nc.tolist(), "rejected_tokens": nr.tolist(),
         "nll": float(rng.uniform(0.5, 3.0))}
    if ref:
        rc = pc + rng.normal(0.0, 8.0, n)
        rr = pr + rng.normal(0.0, 8.0, n)
        # a pair whose rewards tie exactly (rewards/accuracies counts strictly greater)
        rc[-1], rr[-1] = pc[-1], pr[-1]
        d["ref_chosen"] = rc.tolist()
        d["ref_rejected"] = rr.tolist()
    return d


def kto_inputs(rng, n, desirable, kl_shift):
    tok = rng.integers(1, 40, n)
    pol = -(tok * rng.uniform(0.3, 2.5, n))
    ref = pol + rng.normal(0.0, 8.0, n)
    ktok = np.roll(tok, 1)  # TRL cycles the completions by one for the KL batch
    pkl = -(ktok * rng.uniform(0.5, 3.0, n))
    rkl = pkl - kl_shift + rng.normal(0.0, 2.0, n)
    return {"policy": pol.tolist(), "ref": ref.tolist(), "tokens": tok.tolist(),
            "desirable": [bool(x) for x in desirable], "policy_kl": pkl.tolist(),
            "ref_kl": rkl.tolist(), "kl_tokens": ktok.tolist()}


def params_for(algo, **kw):
    p = {"beta": 0.1, "label_smoothing": 0.0, "simpo_gamma": 0.5, "cpo_alpha": 1.0,
         "desirable_weight": 1.0, "undesirable_weight": 1.0}
    p["loss_type"] = {"dpo": ["sigmoid"], "orpo": ["orpo"], "cpo": ["sigmoid"], "kto": ["kto"]}[algo]
    p["loss_weights"] = [1.0] * len(kw.get("loss_type", p["loss_type"]))
    p.update(kw)
    return p


def cases():
    rng = np.random.default_rng(25)
    out = []

    def add(name, algo, params, inp):
        out.append({"name": name, "algo": algo, "params": params, "inputs": inp})

    for lt, extra in (("sigmoid", {}), ("hinge", {}), ("ipo", {}),
                      ("robust", {"label_smoothing": 0.1}), ("exo_pair", {"label_smoothing": 1e-3})):
        add(f"dpo_{lt}", "dpo", params_for("dpo", loss_type=[lt], **extra), pair_inputs(rng, 7))
    add("dpo_sigmoid_beta0.5", "dpo", params_for("dpo", beta=0.5), pair_inputs(rng, 5))
    add("dpo_hinge_beta0.5", "dpo", params_for("dpo", loss_type=["hinge"], beta=0.5),
        pair_inputs(rng, 6))
    add("dpo_sigmoid+ipo", "dpo",
        params_for("dpo", loss_type=["sigmoid", "ipo"], loss_weights=[1.0, 0.25]),
        pair_inputs(rng, 6))
    add("dpo_one_pair", "dpo", params_for("dpo"), pair_inputs(rng, 1, ref=True))
    add("orpo", "orpo", params_for("orpo"), pair_inputs(rng, 6, ref=False, near_zero=True))
    add("orpo_beta1", "orpo", params_for("orpo", beta=1.0), pair_inputs(rng, 5, ref=False))
    add("cpo_sigmoid", "cpo", params_for("cpo"), pair_inputs(rng, 6, ref=False))
    add("cpo_sigmoid_ls", "cpo", params_for("cpo", label_smoothing=0.2), pair_inputs(rng, 6, ref=False))
    add("cpo_hinge", "cpo", params_for("cpo", loss_type=["hinge"]), pair_inputs(rng, 6, ref=False))
    add("cpo_ipo", "cpo", params_for("cpo", loss_type=["ipo"]), pair_inputs(rng, 6, ref=False))
    # SimPO as TRL's recipe runs it: CPO loss_type simpo, cpo_alpha 0 (the SimPO paper's beta 2,
    # gamma/beta 0.5 -> simpo_gamma 1.0), then with the NLL term and label smoothing
    add("simpo", "cpo", params_for("cpo", loss_type=["simpo"], beta=2.0, simpo_gamma=1.0,
                                   cpo_alpha=0.0), pair_inputs(rng, 6, ref=False))
    add("simpo_nll_ls", "cpo", params_for("cpo", loss_type=["simpo"], beta=2.5, simpo_gamma=0.5,
                                          cpo_alpha=1.0, label_smoothing=0.1),
        pair_inputs(rng, 6, ref=False))
    mixed = [True, False, True, True, False, False, True, False]
    add("kto", "kto", params_for("kto"), kto_inputs(rng, 8, mixed, kl_shift=3.0))
    add("kto_weighted", "kto", params_for("kto", beta=0.3, desirable_weight=1.33,
                                          undesirable_weight=0.75),
        kto_inputs(rng, 8, mixed, kl_shift=5.0))
    add("kto_kl_clamped", "kto", params_for("kto"), kto_inputs(rng, 8, mixed, kl_shift=-6.0))
    add("kto_all_desirable", "kto", params_for("kto"), kto_inputs(rng, 5, [True] * 5, kl_shift=2.0))
    add("kto_all_undesirable", "kto", params_for("kto"),
        kto_inputs(rng, 5, [False] * 5, kl_shift=2.0))
    add("kto_apo_zero_unpaired", "kto", params_for("kto", loss_type=["apo_zero_unpaired"]),
        kto_inputs(rng, 8, mixed, kl_shift=3.0))
    return out


# ---------------------------------------------------------------- tiny Llama + LoRA through DPO
TINY = REPO / "tests/fixtures/hf/tiny-llama-tied"
TINY_ADAPTER = REPO / "tests/fixtures/hf/lora/adapter-init"
TINY_LOSSES = (("sigmoid", {}), ("ipo", {}))


def tiny_pairs():
    """Three tokenized pairs (prompt_ids, chosen_ids, rejected_ids) of random ids in [3, 384)."""
    g = torch.Generator().manual_seed(2525)
    lens = ((5, 4, 6), (3, 7, 3), (6, 2, 5))

    def ids(n):
        return (torch.randint(3, 384, (n,), generator=g)).tolist()
    return [{"prompt_ids": ids(p), "chosen_ids": ids(c), "rejected_ids": ids(r)} for p, c, r in lens]


def tiny_dpo(out):
    """TRL's DPOTrainer._compute_loss with the real PEFT model: the tiny Llama of
    tests/fixtures/hf/tiny-llama-tied with the LoRA adapter tests/fixtures/hf/lora/adapter-init
    (non-zero lora_B), TRL's fused LM head added as DPOTrainer.__init__ adds it, the batch made by
    TRL's DataCollatorForPreference, the reference = the same model with the adapter disabled
    (ref_model None, precompute_ref_log_probs False: TRL's use_adapter(model, None)). Writes
    tiny_dpo.json (pairs, per-sequence policy / reference log-probs, loss and metrics per loss
    type) and tiny_dpo_grads.safetensors (<loss_type>.<PEFT key>: the LoRA gradients)."""
    from peft import PeftModel
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM
    from trl.trainer.dpo_trainer import DataCollatorForPreference
    from trl.trainer.utils import add_fused_lm_head

    base = LlamaForCausalLM.from_pretrained(TINY, dtype=torch.float32, attn_implementation="eager")
    pm = PeftModel.from_pretrained(base, TINY_ADAPTER, is_trainable=True)
    pm.train()  # lora_dropout is 0: train mode changes nothing but is what TRL runs
    add_fused_lm_head(pm.get_base_model(), outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    pairs = tiny_pairs()
    batch = DataCollatorForPreference(pad_token_id=0)(pairs)
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    kw = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        pol = pm(**kw, labels=labels, fused_lm_head=True).log_probs.sum(1)
        with pm.disable_adapter():
            ref = pm(**kw, labels=labels, fused_lm_head=True).log_probs.sum(1)
    n = len(pairs)
    doc = {"pairs": pairs, "policy_logps": pol.tolist(), "ref_logps": ref.tolist(),
           "order": "chosen 0..n-1 then rejected 0..n-1 (DataCollatorForPreference)", "cases": []}
    grads = {}
    for lt, extra in TINY_LOSSES:
        params = params_for("dpo", loss_type=[lt], **extra)
        stub = types.SimpleNamespace(
            model=pm, accelerator=IdentityAccelerator(), aux_loss_enabled=False, ld_alpha=None,
            precompute_ref_logps=False, f_divergence_type="reverse_kl",
            loss_types=params["loss_type"], loss_weights=params["loss_weights"],
            beta=params["beta"], label_smoothing=params["label_smoothing"], use_weighting=False,
            _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
            _total_train_tokens=0, _tp_size=1, ref_model=None,
            args=types.SimpleNamespace(gradient_checkpointing_kwargs=None, discopop_tau=0.05))
        pm.zero_grad(set_to_none=True)
        loss = DPOTrainer._compute_loss(stub, pm, dict(batch), return_outputs=False)
        loss.backward()
        for name, p in pm.named_parameters():
            if p.requires_grad:
                assert p.grad is not None and p.grad.abs().max() > 0, name
                grads[f"{lt}.{name.replace('.default', '')}"] = p.grad.detach().clone().contiguous()
        doc["cases"].append({"loss_type": lt, "params": params, "loss": float(loss.detach()),
                             "metrics": metrics_of(stub._metrics["train"], PAIR_METRICS)})
    assert len(pol) == 2 * n
    oc_cases, oc_grads = tiny_orpo_cpo(out)
    doc["orpo_cpo_cases"] = oc_cases
    grads.update(oc_grads)
    doc["kto_case"], kto_grads = tiny_kto()
    grads.update(kto_grads)
    (out / "tiny_dpo.json").write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    save_file(grads, str(out / "tiny_dpo_grads.safetensors"),
              # one key: safetensors writes a metadata map in no fixed order
              metadata={"generator": f"tests/reference/gen_preference_fixtures.py, trl {trl.__version__}"})
    print(f"gen_preference: tiny DPO ({len(TINY_LOSSES)} loss types), ORPO, SimPO, KTO ({len(grads)} LoRA "
          f"grads) -> "
          f"{(out / 'tiny_dpo.json').relative_to(REPO)}, tiny_dpo_grads.safetensors")


def tiny_orpo_cpo(out):
    """ORPO and CPO's SimPO (with the NLL term, cpo_alpha 1) on the same model and pairs, with the
    trainers' own concatenated_forward (full logits, get_batch_logps with average_log_prob, the
    chosen NLL by CrossEntropyLoss: ORPO over prompt + response, CPO over the response) and
    get_batch_loss_metrics. The batch is what their tokenize_row + collator produce: per side
    `<side>_input_ids` = prompt + response, right-padded with 0, `<side>_attention_mask`,
    `<side>_labels` = input_ids with -100 on the prompt and the padding. Returns the cases and
    the LoRA gradients (<name>.<PEFT key>)."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(TINY, dtype=torch.float32, attn_implementation="eager")
    pm = PeftModel.from_pretrained(base, TINY_ADAPTER, is_trainable=True)
    pm.train()
    pairs = tiny_pairs()
    batch = {}
    for side in ("chosen", "rejected"):
        seqs = [p["prompt_ids"] + p[f"{side}_ids"] for p in pairs]
        L = max(len(x) for x in seqs)
        ids = torch.zeros(len(seqs), L, dtype=torch.long)
        att = torch.zeros(len(seqs), L, dtype=torch.long)
        lab = torch.full((len(seqs), L), -100, dtype=torch.long)
        for i, (x, p) in enumerate(zip(seqs, pairs)):
            ids[i, :len(x)] = torch.tensor(x)
            att[i, :len(x)] = 1
            lab[i, len(p["prompt_ids"]):len(x)] = torch.tensor(p[f"{side}_ids"])
        batch.update({f"{side}_input_ids": ids, f"{side}_attention_mask": att,
                      f"{side}_labels": lab})
    cases, grads = [], {}
    for name, algo, params in (("orpo", "orpo", params_for("orpo")),
                               ("simpo", "cpo", params_for("cpo", loss_type=["simpo"], beta=2.0,
                                                           simpo_gamma=1.0, cpo_alpha=1.0))):
        cls = ORPOTrainer if algo == "orpo" else CPOTrainer
        stub = types.SimpleNamespace(accelerator=IdentityAccelerator(), aux_loss_enabled=False,
                                     is_encoder_decoder=False, padding_value=0, pad_token_id=0,
                                     beta=params["beta"], concatenated_inputs=cls.concatenated_inputs,
                                     get_batch_logps=cls.get_batch_logps)
        if algo == "orpo":
            stub.odds_ratio_loss = types.MethodType(ORPOTrainer.odds_ratio_loss, stub)
        else:
            stub.alpha = 0.0
            stub.loss_type = params["loss_type"][0]
            stub.simpo_gamma = params["simpo_gamma"]
            stub.label_smoothing = params["label_smoothing"]
            stub.cpo_alpha = params["cpo_alpha"]
            stub.cpo_loss = types.MethodType(CPOTrainer.cpo_loss, stub)
        forward = types.MethodType(cls.concatenated_forward, stub)
        seen = {}

        def recording_forward(model, b, forward=forward, seen=seen):
            o = forward(model, b)
            seen["chosen"], seen["rejected"], seen["nll"] = o[0], o[1], o[4]
            return o
        stub.concatenated_forward = recording_forward
        pm.zero_grad(set_to_none=True)
        loss, metrics = cls.get_batch_loss_metrics(stub, pm, dict(batch), "train")
        loss.backward()
        for n_, p in pm.named_parameters():
            if p.requires_grad:
                assert p.grad is not None and p.grad.abs().max() > 0, n_
                grads[f"{name}.{n_.replace('.default', '')}"] = p.grad.detach().clone().contiguous()
        extra = ["nll_loss", "log_odds_ratio", "log_odds_chosen"] if algo == "orpo" else ["nll_loss"]
        cases.append({"name": name, "algo": algo, "params": params, "loss": float(loss.detach()),
                      "metrics": {k: float(metrics[k]) for k in PAIR_METRICS + extra},
                      "avg_logps_chosen": seen["chosen"].tolist(),
                      "avg_logps_rejected": seen["rejected"].tolist(),
                      "nll": float(seen["nll"].detach())})
    return cases, grads


def tiny_kto_examples():
    """Four unpaired examples from the tiny pairs (label True = chosen side) with TRL's KL
    completions: KTOTrainer._prepare_dataset's add_kl_completion_ids cycles the completions by one
    (`[completion_ids[-1]] + completion_ids[:-1]`)."""
    pairs = tiny_pairs()
    ex = [(0, "chosen_ids", True), (1, "rejected_ids", False), (2, "chosen_ids", True),
          (0, "rejected_ids", False)]
    out = [{"prompt_ids": pairs[i]["prompt_ids"], "completion_ids": pairs[i][k], "label": lab}
           for i, k, lab in ex]
    comps = [e["completion_ids"] for e in out]
    for e, kl in zip(out, [comps[-1]] + comps[:-1]):
        e["KL_completion_ids"] = kl
    return out


def tiny_kto():
    """KTOTrainer._compute_loss (loss_type kto, desirable_weight 1.33, undesirable_weight 0.75:
    not the defaults, so that they matter) with the real PEFT model, TRL's fused LM head as
    KTOTrainer.__init__ adds it, DataCollatorForUnpairedPreference, the reference = the adapter
    disabled, the KL term from the cycled completions. Returns the case and the LoRA gradients."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference
    from trl.trainer.utils import add_fused_lm_head

    base = LlamaForCausalLM.from_pretrained(TINY, dtype=torch.float32, attn_implementation="eager")
    pm = PeftModel.from_pretrained(base, TINY_ADAPTER, is_trainable=True)
    pm.train()
    add_fused_lm_head(pm.get_base_model(), outputs=("log_probs", "entropy", "mean_logits"))
    examples = tiny_kto_examples()
    batch = DataCollatorForUnpairedPreference(pad_token_id=0)(examples)
    logps = {}
    with torch.no_grad():
        for pre in ("", "KL_"):
            lab = batch[f"{pre}input_ids"].masked_fill(batch[f"{pre}completion_mask"] == 0, -100)
            kw = {"input_ids": batch[f"{pre}input_ids"], "attention_mask": batch[f"{pre}attention_mask"]}
            logps[f"{pre}policy"] = pm(**kw, labels=lab, fused_lm_head=True).log_probs.sum(1).tolist()
            with pm.disable_adapter():
                logps[f"{pre}ref"] = pm(**kw, labels=lab, fused_lm_head=True).log_probs.sum(1).tolist()
    params = params_for("kto", desirable_weight=1.33, undesirable_weight=0.75)
    stub = types.SimpleNamespace(
        model=pm, accelerator=IdentityAccelerator(), aux_loss_enabled=False,
        precompute_ref_logps=False, calculate_KL=True, loss_type="kto", beta=params["beta"],
        desirable_weight=params["desirable_weight"], undesirable_weight=params["undesirable_weight"],
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1, ref_model=None,
        args=types.SimpleNamespace(gradient_checkpointing_kwargs=None))
    stub._compute_kl_logps = types.MethodType(KTOTrainer._compute_kl_logps, stub)
    pm.zero_grad(set_to_none=True)
    loss = KTOTrainer._compute_loss(stub, pm, dict(batch), return_outputs=False)
    loss.backward()
    grads = {}
    for n_, p in pm.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().max() > 0, n_
            grads[f"kto.{n_.replace('.default', '')}"] = p.grad.detach().clone().contiguous()
    met = metrics_of(stub._metrics["train"], PAIR_METRICS + ["kl"])
    met["rewards/accuracies"] = None
    case = {"examples": examples, "params": params, "loss": float(loss.detach()), "metrics": met,
            "policy_logps": logps["policy"], "ref_logps": logps["ref"],
            "KL_policy_logps": logps["KL_policy"], "KL_ref_logps": logps["KL_ref"]}
    return case, grads


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "tests/fixtures/preference"))
    ap.add_argument("--no-venv", action="store_true", help="use the current interpreter")
    a = ap.parse_args()
    if trl.__version__ != TRL_VERSION:
        sys.exit(f"gen_preference: trl {trl.__version__} found, the fixtures are for "
                 f"{TRL_VERSION} (python/requirements-torch.txt)")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    res = []
    for c in cases():
        if c["algo"] == "dpo":
            exp = run_dpo(c["params"], c["inputs"])
        elif c["algo"] == "kto":
            exp = run_kto(c["params"], c["inputs"])
        else:
            exp = run_orpo_cpo(c["algo"], c["params"], c["inputs"])
        c["expected"] = exp
        res.append(c)
    doc = {"generator": "tests/reference/gen_preference_fixtures.py",
           "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                        "torch": torch.__version__.split("+")[0]},
           "dtype": "float64 (ORPO: fp32 inside TRL's odds_ratio_loss)",
           "cases": res}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "trl_losses.json"
    path.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    print(f"gen_preference: {len(res)} cases -> {path.relative_to(REPO)}")
    tiny_dpo(out)


if __name__ == "__main__":
    main()
