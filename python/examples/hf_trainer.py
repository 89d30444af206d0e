"""LoRA fine-tuning with transformers' Trainer + PEFT, fed by loaderd: the same job file our C
trainer runs (`trainer train --config job.json|job.yaml`), trained by PyTorch instead.

    python python/examples/hf_trainer.py --config job.json [--model M] [--output-dir DIR]
                                         [--max-steps N] [--resume] [--cpu] [--hf-schedule]

The job file is read as the trainer reads it (JSON, or YAML for .yaml / .yml: barq_loaderd.load_job),
and from it: the loaderd stream (data.*; the socket as the trainer finds it: the job's `socket`,
else $LOADERD_SOCKET, else /run/loaderd/loaderd.sock; tokenizer = model), the model (a Hugging
Face directory / hub id, or the .gguf itself, dequantised by transformers), LoRA (lora.r,
lora_alpha, lora_dropout, target_modules), the optimiser (optim.lr, weight_decay, beta1, beta2,
eps, grad_clip), steps, grad_accum, seed, save_every, log_every, and the learning-rate schedule
of `trainer train` (optim.warmup_steps, schedule, min_lr_ratio: barq_loaderd.schedule; the first
step uses lr / warmup_steps, not 0). --hf-schedule asks for transformers' own schedule instead
(warm-up from lr 0, decay to 0, min_lr_ratio not applied).
--model overrides the model transformers loads (loaderd still tokenizes with the job's GGUF, so
it must be the same model). Checkpoints go to --output-dir (default runs/hf) every save_every
steps; --resume continues from the last one, loaderd stream included. The final adapter is
saved to OUTPUT_DIR/adapter (PEFT format) naming the real base model in adapter_config.json
(barq_loaderd.base_model_name_or_path: the job's base_model_name_or_path, else the source the
GGUF's metadata names), so PEFT can load it. Under torchrun each process reads its own rank's
stream (RANK / WORLD_SIZE). Run from the repository root (relative paths in the job file are
resolved against the working directory, as the trainer does).
"""
import argparse
import os

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, TrainingArguments

from barq_loaderd import base_model_name_or_path, load_job
from barq_loaderd.hf import LoaderdTrainer, from_gguf, job_lr_scheduler, set_name_or_path
from barq_loaderd.torch import LoaderdDataset


def load_model(name, base_name):
    """A causal LM in fp32 (a .gguf dequantised by transformers' GGUF loader, else
    from_pretrained) whose name_or_path, recorded by PEFT in the adapter, is base_name."""
    if name.endswith(".gguf"):
        return from_gguf(name, name_or_path=base_name)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)
    set_name_or_path(model, base_name)
    return model


class JobTrainer(LoaderdTrainer):
    """LoaderdTrainer with the job's learning-rate schedule (that of `trainer train`); job=None:
    transformers' own (TrainingArguments.lr_scheduler_type, warmup_steps)."""

    def __init__(self, *args, job=None, **kwargs):
        self.job = job
        super().__init__(*args, **kwargs)

    def create_scheduler(self, num_training_steps, optimizer=None):
        if self.job is None:
            return super().create_scheduler(num_training_steps, optimizer)
        if self.lr_scheduler is None:
            # over the job's steps, not --max-steps: a run stopped early and resumed follows one curve
            self.lr_scheduler = job_lr_scheduler(optimizer or self.optimizer, self.job)
            self._created_lr_scheduler = True
        return self.lr_scheduler


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="trainer job file (JSON, or YAML: .yaml / .yml)")
    ap.add_argument("--model", help="model for transformers (default: the job's model)")
    ap.add_argument("--output-dir", default="runs/hf")
    ap.add_argument("--max-steps", type=int, help="default: the job's steps")
    ap.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output-dir")
    ap.add_argument("--cpu", action="store_true", help="train on the CPU even when a GPU is present")
    ap.add_argument("--hf-schedule", action="store_true",
                    help="transformers' schedule (warm-up from lr 0, decay to 0) instead of the trainer's")
    a = ap.parse_args()
    job = load_job(a.config)                                  # JSON or YAML, as the trainer reads it
    lora, optim = job.get("lora", {}), job.get("optim", {})

    train = LoaderdDataset.from_trainer_config(job)          # this rank's loaderd stream
    if a.model and not a.model.endswith(".gguf") and "base_model_name_or_path" not in job:
        base_name = a.model                                   # a Hugging Face directory / hub id
    else:
        base_name = base_model_name_or_path(dict(job, model=a.model or job["model"]))
    model = load_model(a.model or job["model"], base_name)
    model = get_peft_model(model, LoraConfig(
        r=lora.get("r", 16), lora_alpha=lora.get("lora_alpha", 32), lora_dropout=lora.get("lora_dropout", 0.05),
        target_modules=lora.get("target_modules", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"]), task_type="CAUSAL_LM"))
    steps = a.max_steps or job.get("steps", 100)
    sched = job.get("schedule", "cosine")
    args = TrainingArguments(
        output_dir=a.output_dir, max_steps=steps,
        gradient_accumulation_steps=job.get("grad_accum", 1),
        learning_rate=optim.get("lr", 2e-4), weight_decay=optim.get("weight_decay", 0.0),
        adam_beta1=optim.get("beta1", 0.9), adam_beta2=optim.get("beta2", 0.999), adam_epsilon=optim.get("eps", 1e-8),
        warmup_steps=optim.get("warmup_steps", 0), max_grad_norm=optim.get("grad_clip", 1.0),
        lr_scheduler_type={"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[sched],
        logging_steps=job.get("log_every", 1), save_steps=job.get("save_every") or 500,
        save_strategy="steps", seed=job.get("seed", 1234), report_to=[], use_cpu=a.cpu,
        dataloader_num_workers=0)
    trainer = JobTrainer(model=model, args=args, train_dataset=train, job=None if a.hf_schedule else job)
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    print(f"loaderd: {train.batches_yielded} batches read, stream at step {train.state_dict()['next_step']}")
    if trainer.is_world_process_zero():
        model.save_pretrained(os.path.join(a.output_dir, "adapter"))
        print(f"adapter: {os.path.join(a.output_dir, 'adapter')}")


if __name__ == "__main__":
    main()
