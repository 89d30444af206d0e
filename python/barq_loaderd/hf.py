"""transformers Trainer fed by loaderd.

    from barq_loaderd.torch import LoaderdDataset
    from barq_loaderd.hf import LoaderdTrainer

    ds = LoaderdDataset(job_spec)                       # or LoaderdDataset.from_trainer_config("job.json")
    trainer = LoaderdTrainer(model=model, args=TrainingArguments(max_steps=100, ...), train_dataset=ds)
    trainer.train()                                     # trainer.train(resume_from_checkpoint=True) resumes

LoaderdTrainerMixin (for your own Trainer subclass: class T(LoaderdTrainerMixin, SFTTrainer)):
  * feeds each LoaderdDataset through a plain DataLoader(batch_size=None): loaderd already made
    the micro-batch (B x T from the job spec, per_device_train_batch_size is not used) and
    already split the data by rank, so accelerate must neither re-batch, dispatch nor shard it;
    the Trainer moves the tensors to the device itself;
  * adds a LoaderdCallback;
  * train(resume_from_checkpoint=...) restores the loaderd position saved in the checkpoint
    (loaderd_state_rank{R}.json) and turns off the Trainer's own batch skipping, which would
    otherwise read and drop every batch already trained on.

LoaderdCallback (works with any Trainer):
  * turns model.config.use_cache off at train start: with a cache object, transformers' eager /
    SDPA attention do not detect packed sequences from position_ids and attend across
    documents (see barq_loaderd.torch);
  * reports step, loss and tokens/s to loaderd after every optimiser step and every logged loss
    (loaderctl status);
  * writes each rank's stream position into every checkpoint (on_save);
  * detaches from loaderd when training ends (the position is kept).

IterableDatasets have no length: TrainingArguments.max_steps must be set (> 0).
"""
import json
import logging
import os

from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from .errors import LoaderdError
from .gguf_meta import source_model
from .schedule import trainer_schedule
from .torch import LoaderdDataset

logger = logging.getLogger("barq_loaderd")
STATE_FILE = "loaderd_state_rank{rank}.json"


def from_gguf(path, dtype=None, name_or_path=None, **kwargs):
    """A transformers causal LM from a .gguf file (loaderd's tokenizers are GGUF files, so this is
    the model whose vocabulary matches), as a plain dense model that Trainer, PEFT and
    save_pretrained accept: transformers' GGUF loader (GgufConfig(dequantize=True): every weight
    unpacked, as gguf-py dequantises it, to `dtype`, default float32), then its GGUF quantizer
    marker removed (transformers 5.x keeps it on a fully dequantised model and then refuses to
    train or save it). kwargs go to from_pretrained.

    name_or_path: the model's name_or_path (and config._name_or_path), which PEFT records as the
    adapter's base_model_name_or_path: give the job's (barq_loaderd.base_model_name_or_path(job));
    else the source the GGUF's metadata names (gguf_meta.source_model), else transformers' own
    value, the GGUF's folder, where PEFT finds no config.json (a warning says so)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    path = os.path.abspath(path)
    if int(transformers.__version__.split(".")[0]) >= 5:
        from transformers.utils.quantization_config import GgufConfig
        kwargs.update(dtype=dtype or torch.float32,
                      quantization_config=GgufConfig(gguf_file=os.path.basename(path), dequantize=True))
    else:  # transformers 4.x always dequantises GGUF weights and attaches no quantizer
        kwargs.update(torch_dtype=dtype or torch.float32)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), **kwargs)
    q = getattr(model, "hf_quantizer", None)
    if q is not None:
        if not getattr(q.quantization_config, "dequantize", False):
            raise RuntimeError(f"{path}: transformers kept GGUF blocks packed; cannot return a dense model")
        q.remove_quantization_config(model)
    name = name_or_path or source_model(path)
    if name:
        set_name_or_path(model, name)
    else:
        logger.warning("barq_loaderd: %s names no source model (general.source.*): an adapter saved from it "
                       "records %s as its base, where PEFT finds no config.json; pass name_or_path (the job's "
                       "base_model_name_or_path)", path, model.name_or_path)
    return model


def set_name_or_path(model, name):
    """Make `name` the model's name_or_path (what PEFT's get_peft_model records as the adapter's
    base_model_name_or_path, and save_pretrained as config._name_or_path). Call it before
    get_peft_model; on a PeftModel it also updates every adapter's config."""
    for m in (model, getattr(model, "base_model", None), getattr(getattr(model, "base_model", None), "model", None)):
        if m is not None and hasattr(m, "config") and hasattr(m, "name_or_path"):
            m.name_or_path = name
            m.config._name_or_path = name
    for cfg in (getattr(model, "peft_config", None) or {}).values():
        cfg.base_model_name_or_path = name


def job_lr_scheduler(optimizer, config, total_steps=None):
    """A torch LambdaLR giving `optimizer` our trainer's learning-rate curve for a job config
    (barq_loaderd.schedule: warm-up from lr / warmup_steps, not from 0; decay to
    lr * min_lr_ratio): the optimiser's lr after k scheduler steps is trainer_schedule(config)(k),
    the lr `trainer train` uses for its optimiser step k. The optimiser's base lr must be the job's
    optim.lr (TrainingArguments.learning_rate)."""
    from torch.optim.lr_scheduler import LambdaLR
    lr_of = trainer_schedule(config, total_steps)
    for g in optimizer.param_groups:
        base = g.get("initial_lr", g["lr"])
        if abs(base - lr_of.lr) > 1e-12 * max(1.0, lr_of.lr):
            raise ValueError(f"job_lr_scheduler: the optimiser's lr {base!r} is not the job's optim.lr {lr_of.lr!r}")
    return LambdaLR(optimizer, lambda step: lr_of(step) / lr_of.lr)


def _configs(model):
    """The config objects of a model and of what it wraps (PEFT, DDP)."""
    seen, out, m = set(), [], model
    for _ in range(8):
        if m is None or id(m) in seen:
            break
        seen.add(id(m))
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "use_cache"):
            out.append(cfg)
        m = getattr(m, "module", None) or getattr(m, "base_model", None) or getattr(m, "model", None)
    return out


def disable_cache(model):
    """Set use_cache = False on the model's config(s); True when one was on."""
    changed = False
    for cfg in _configs(model):
        if cfg.use_cache:
            cfg.use_cache = False
            changed = True
    return changed


class LoaderdCallback(TrainerCallback):
    """Progress reports to loaderd and stream positions in checkpoints for a LoaderdDataset."""

    def __init__(self, dataset):
        if not isinstance(dataset, LoaderdDataset):
            raise TypeError("LoaderdCallback needs the LoaderdDataset the Trainer trains on")
        self.dataset = dataset
        self.last_loss = None

    def on_train_begin(self, args, state, control, model=None, **kw):
        if model is not None and disable_cache(model):
            logger.warning("barq_loaderd: set model.config.use_cache = False: packed rows need it so that eager / "
                           "SDPA attention keep documents apart")

    def _report(self, step):
        try:
            self.dataset.report(step, self.last_loss)
        except LoaderdError as e:  # progress reports are best effort, like the C trainer's
            logger.warning("barq_loaderd: report to loaderd failed: %s", e)

    def on_step_end(self, args, state, control, **kw):
        self._report(state.global_step)  # the loss of this step is logged after on_step_end

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.last_loss = logs["loss"]
            self._report(state.global_step)

    def on_train_end(self, args, state, control, **kw):
        self.dataset.close()  # detach: loaderd stops producing; the position is kept for a resume

    def on_save(self, args, state, control, **kw):
        rank, _ = self.dataset.rank_world
        d = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, STATE_FILE.format(rank=rank))
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.dataset.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


class LoaderdTrainerMixin:
    """Mix into a transformers Trainer (sub)class before it; see the module docstring."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if isinstance(self.train_dataset, LoaderdDataset) and \
                not any(isinstance(c, LoaderdCallback) for c in self.callback_handler.callbacks):
            # first, so that the other callbacks see this step's report in loaderd
            self.callback_handler.callbacks.insert(0, LoaderdCallback(self.train_dataset))

    def _loaderd_loader(self, ds):
        return DataLoader(ds, batch_size=None, num_workers=0, pin_memory=self.args.dataloader_pin_memory)

    def get_train_dataloader(self):
        if isinstance(self.train_dataset, LoaderdDataset):
            return self._loaderd_loader(self.train_dataset)
        return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset=None):
        ds = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(ds, LoaderdDataset):
            return self._loaderd_loader(ds)
        return super().get_eval_dataloader(eval_dataset)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        ds = self.train_dataset
        ckpt = resume_from_checkpoint
        if isinstance(ckpt, bool) and ckpt:
            ckpt = get_last_checkpoint(self.args.output_dir)
            if ckpt is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        if isinstance(ds, LoaderdDataset) and isinstance(ckpt, (str, os.PathLike)):
            rank, _ = ds.rank_world
            path = os.path.join(ckpt, STATE_FILE.format(rank=rank))
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    ds.load_state_dict(json.load(f))
                self.args.ignore_data_skip = True  # the stream continues where the checkpoint was
                logger.info("barq_loaderd: resuming the loaderd stream from %s", path)
            else:
                logger.warning("barq_loaderd: %s has no %s: the Trainer will re-read and skip the batches already "
                               "trained on", ckpt, os.path.basename(path))
        return super().train(ckpt if ckpt is not None else resume_from_checkpoint, *args, **kwargs)


class LoaderdTrainer(LoaderdTrainerMixin, Trainer):
    """transformers.Trainer fed by a LoaderdDataset (see the module docstring)."""
