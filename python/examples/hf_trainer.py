"""LoRA fine-tuning with transformers' Trainer + PEFT, fed by loaderd: the same job file our C
trainer runs (`trainer train --config job.json`), trained by PyTorch instead.

    python python/examples/hf_trainer.py --config job.json [--model M] [--output-dir DIR]
                                         [--max-steps N] [--resume] [--cpu]

From the job file: the loaderd stream (data.*, socket; tokenizer = model), the model (a Hugging
Face directory / hub id, or the .gguf itself, dequantised by transformers), LoRA (lora.r,
lora_alpha, lora_dropout, target_modules), the optimiser (optim.lr, weight_decay, beta1, beta2,
eps, warmup_steps, grad_clip), steps, grad_accum, schedule (as transformers defines it: cosine
decays to 0, the trainer's min_lr_ratio is not applied), seed, save_every, log_every.
--model overrides the model transformers loads (loaderd still tokenizes with the job's GGUF, so
it must be the same model). Checkpoints go to --output-dir (default runs/hf) every save_every
steps; --resume continues from the last one, loaderd stream included. The final adapter is
saved to OUTPUT_DIR/adapter (PEFT format). Under torchrun each process reads its own rank's
stream (RANK / WORLD_SIZE). Run from the repository root (relative paths in the job file are
resolved against the working directory, as the trainer does).
"""
import argparse
import json
import os

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, TrainingArguments

from barq_loaderd.hf import LoaderdTrainer, from_gguf
from barq_loaderd.torch import LoaderdDataset


def load_model(name):
    """A causal LM in fp32: a .gguf dequantised by transformers' GGUF loader, else from_pretrained."""
    if name.endswith(".gguf"):
        return from_gguf(name)
    return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="trainer job file (JSON)")
    ap.add_argument("--model", help="model for transformers (default: the job's model)")
    ap.add_argument("--output-dir", default="runs/hf")
    ap.add_argument("--max-steps", type=int, help="default: the job's steps")
    ap.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output-dir")
    ap.add_argument("--cpu", action="store_true", help="train on the CPU even when a GPU is present")
    a = ap.parse_args()
    with open(a.config, encoding="utf-8") as f:
        job = json.load(f)
    lora, optim = job.get("lora", {}), job.get("optim", {})

    train = LoaderdDataset.from_trainer_config(job)          # this rank's loaderd stream
    model = load_model(a.model or job["model"])
    model = get_peft_model(model, LoraConfig(
        r=lora.get("r", 16), lora_alpha=lora.get("lora_alpha", 32), lora_dropout=lora.get("lora_dropout", 0.05),
        target_modules=lora.get("target_modules", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"]), task_type="CAUSAL_LM"))
    args = TrainingArguments(
        output_dir=a.output_dir, max_steps=a.max_steps or job.get("steps", 100),
        gradient_accumulation_steps=job.get("grad_accum", 1),
        learning_rate=optim.get("lr", 2e-4), weight_decay=optim.get("weight_decay", 0.0),
        adam_beta1=optim.get("beta1", 0.9), adam_beta2=optim.get("beta2", 0.999), adam_epsilon=optim.get("eps", 1e-8),
        warmup_steps=optim.get("warmup_steps", 0), max_grad_norm=optim.get("grad_clip", 1.0),
        lr_scheduler_type={"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[
            job.get("schedule", "cosine")],
        logging_steps=job.get("log_every", 1), save_steps=job.get("save_every") or 500,
        save_strategy="steps", seed=job.get("seed", 1234), report_to=[], use_cpu=a.cpu,
        dataloader_num_workers=0)
    trainer = LoaderdTrainer(model=model, args=args, train_dataset=train)
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    print(f"loaderd: {train.batches_yielded} batches read, stream at step {train.state_dict()['next_step']}")
    if trainer.is_world_process_zero():
        model.save_pretrained(os.path.join(a.output_dir, "adapter"))
        print(f"adapter: {os.path.join(a.output_dir, 'adapter')}")


if __name__ == "__main__":
    main()
