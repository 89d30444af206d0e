"""The learning-rate schedule of our trainer (trainer/loop/optim.c bt_schedule_lr), in Python, so
that a PyTorch run of a job file follows the same curve as `trainer train` on it.

    from barq_loaderd import trainer_schedule
    lr_of = trainer_schedule("job.yaml")            # step (0-based optimiser step) -> lr
    # with transformers: barq_loaderd.hf.job_lr_scheduler(optimizer, job) (a LambdaLR)

The curve (llm.c llmc/schedulers.h warm-up, then decay to a floor):
  step < warmup:  lr * (step + 1) / warmup   -- the first update is not wasted at lr 0, where
                                                transformers' get_*_schedule_with_warmup start
  then, with p = (step - warmup) / (total - warmup) in [0, 1] and floor = lr * min_lr_ratio:
  cosine:   floor + (lr - floor) * 0.5 * (1 + cos(pi * p))
  linear:   floor + (lr - floor) * (1 - p)
  constant: lr
Steps past total keep the value at p = 1.
"""
import math

SCHEDULES = ("cosine", "linear", "constant")


def lr_at(step, lr, warmup, total, kind="cosine", min_lr_ratio=0.1):
    """Learning rate of optimiser step `step` (0-based; the first update is step 0). Arguments as
    the job file's optim.lr, optim.warmup_steps, steps, schedule and min_lr_ratio."""
    if kind not in SCHEDULES:
        raise ValueError(f"schedule {kind!r}: expected one of {', '.join(SCHEDULES)}")
    step = max(int(step), 0)
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    if kind == "constant":
        return lr
    floor = lr * min_lr_ratio
    span = total - warmup
    p = min((step - warmup) / span, 1.0) if span > 0 else 1.0
    if kind == "linear":
        return floor + (lr - floor) * (1.0 - p)
    return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * p))


def _num(o, path, key, default, lo, hi, lo_open):
    if key not in o:
        return default
    v = o[key]
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and \
        (v > lo if lo_open else v >= lo) and v <= hi
    if not ok:
        what = f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise ValueError(f"config: {path}: expected {what}, got {v!r}")
    return float(v)


def _int(o, path, key, default, lo):
    if key not in o:
        return default
    v = o[key]
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v == math.floor(v) \
        and lo <= v <= 2147483647
    if not ok:
        raise ValueError(f"config: {path}: expected an integer >= {lo}, got {v!r}")
    return int(v)


def trainer_schedule(config, total_steps=None):
    """step -> learning rate for a trainer job config (dict or job file path), with the trainer's
    keys, defaults and range checks: optim.lr (2e-4, in (0, 1]), optim.warmup_steps (0),
    schedule ("cosine"), min_lr_ratio (0.1, in [0, 1]), steps (100; total_steps overrides it, e.g.
    a --max-steps of the caller's). The function has attributes lr, warmup, total, kind and
    min_lr_ratio."""
    from .client import read_trainer_config
    config = read_trainer_config(config)
    optim = config.get("optim", {})
    if not isinstance(optim, dict):
        raise ValueError(f"config: optim: expected an object, got {optim!r}")
    lr = _num(optim, "optim.lr", "lr", 2e-4, 0, 1, True)
    warmup = _int(optim, "optim.warmup_steps", "warmup_steps", 0, 0)
    kind = config.get("schedule", "cosine")
    if kind not in SCHEDULES:
        raise ValueError(f"config: schedule: expected one of \"cosine\", \"linear\", \"constant\", got {kind!r}")
    ratio = _num(config, "min_lr_ratio", "min_lr_ratio", 0.1, 0, 1, False)
    total = _int(config, "steps", "steps", 100, 1) if total_steps is None else int(total_steps)

    def lr_of(step):
        return lr_at(step, lr, warmup, total, kind, ratio)
    lr_of.lr, lr_of.warmup, lr_of.total, lr_of.kind, lr_of.min_lr_ratio = lr, warmup, total, kind, ratio
    return lr_of
