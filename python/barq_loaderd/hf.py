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
from .torch import LoaderdDataset

logger = logging.getLogger("barq_loaderd")
STATE_FILE = "loaderd_state_rank{rank}.json"


def from_gguf(path, dtype=None, **kwargs):
    """A transformers causal LM from a .gguf file (loaderd's tokenizers are GGUF files, so this is
    the model whose vocabulary matches), as a plain dense model that Trainer, PEFT and
    save_pretrained accept: transformers' GGUF loader (GgufConfig(dequantize=True): every weight
    unpacked, as gguf-py dequantises it, to `dtype`, default float32), then its GGUF quantizer
    marker removed (transformers 5.x keeps it on a fully dequantised model and then refuses to
    train or save it). kwargs go to from_pretrained."""
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
    return model


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
