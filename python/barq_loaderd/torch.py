"""loaderd as a torch.utils.data.IterableDataset yielding padding-free batches, exactly what
transformers' DataCollatorWithFlattening(return_flash_attn_kwargs=True) returns for the packed
segments of one loaderd micro-batch (barq_loaderd.batch.flatten):

    input_ids, labels, position_ids   torch.int64 [1, B*T]
    cu_seq_lens_q, cu_seq_lens_k      torch.int32 [segments + 1]
    max_length_q, max_length_k        int

Use it with DataLoader(ds, batch_size=None) (the batches are already made by loaderd; B and T
come from the job spec), or with transformers' Trainer through barq_loaderd.hf. Attention must
keep the segments apart: flash-attention reads cu_seq_lens_*; eager / SDPA attention in
transformers >= 4.53 derive a block-diagonal mask from position_ids, but only with use_cache
off (transformers 5.23 skips the packed-sequence detection when a cache object exists, and
LlamaModel creates one when config.use_cache is true): barq_loaderd.hf turns it off.
"""
import json
import time

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from .batch import flatten
from .client import LoaderdClient, absolute_job_spec, job_digest, trainer_job_spec
from .dist import resolve_rank_world
from .errors import LoaderdError


def to_torch(flat):
    """flatten()'s NumPy dict -> the same dict with torch tensors (sharing the NumPy memory,
    which flatten() owns)."""
    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in flat.items()}


def collate(features):
    """Merge k >= 1 padding-free batches into one, as DataCollatorWithFlattening would flatten all
    their segments at once: input_ids / labels / position_ids concatenated along dim 1,
    cu_seq_lens_* offset and joined, max_length_* the maximum. For a transformers Trainer
    that builds its own DataLoader: data_collator=collate, per_device_train_batch_size=k."""
    if not features:
        raise ValueError("collate: no features")
    if len(features) == 1:
        return features[0]
    out = {k: torch.cat([f[k] for f in features], dim=1) for k in ("input_ids", "labels", "position_ids")}
    cus, base = [features[0]["cu_seq_lens_q"]], int(features[0]["cu_seq_lens_q"][-1])
    for f in features[1:]:
        cus.append(f["cu_seq_lens_q"][1:] + base)
        base += int(f["cu_seq_lens_q"][-1])
    cu = torch.cat(cus).to(torch.int32)
    out["cu_seq_lens_q"], out["cu_seq_lens_k"] = cu, cu.clone()
    out["max_length_q"] = out["max_length_k"] = max(int(f["max_length_q"]) for f in features)
    return out


class LoaderdDataset(IterableDataset):
    """One rank's loaderd stream as padding-free torch batches.

    job: loaderd job spec (dict; see LoaderdClient), or use from_trainer_config(). rank /
    world_size: None = torch.distributed, else RANK/WORLD_SIZE, else SLURM_PROCID/SLURM_NTASKS,
    else 0 of 1 (resolved when iteration starts, so it may be built before
    init_process_group). Other keyword arguments go to LoaderdClient (socket_path,
    verify_checksum, reconnect_s). timeout_s: longest wait for one batch.

    Iterating attaches to loaderd and yields until the end of the data (endless for epochs 0);
    a new iteration continues where the last one stopped, or starts over when the last one
    reached the end. state_dict() is the position after the last batch yielded;
    load_state_dict() makes the next iteration continue from it, yielding exactly the batches
    an uninterrupted run would have (loaderd's determinism contract). DataLoader worker
    processes are refused (loaderd already tokenizes and packs in its own threads; a copy of
    the dataset per worker would read the same rank twice).

    segments=True adds "segments" to every item: the per-segment fields of the batch (layout 3,
    proto/PROTOCOL.md §4) as torch tensors of [n_segments]: seg_kind, seg_pair, seg_src, seg_line,
    seg_ref_ok (int32) and seg_ref_logp (float64), segment k being tokens cu_seq_lens_q[k] ..
    cu_seq_lens_q[k+1] (off by default: a transformers model takes the item as its arguments).
    ref_put(base, values) hands computed reference log-probs back (LoaderdClient.ref_put).

    report(step, loss, tokens_per_s=None) sends progress to loaderd (loaderctl status);
    tokens_per_s None = real tokens yielded per second over the time since the last report that
    followed new batches (a second report without new batches repeats that rate).
    """

    def __init__(self, job, socket_path=None, rank=None, world_size=None, timeout_s=600.0, segments=False,
                 **client_kw):
        super().__init__()
        self.segments = segments
        self.spec = absolute_job_spec(job)
        self.socket_path = socket_path
        self._rank_world = None if rank is None and world_size is None else (rank, world_size)
        self.timeout_s = timeout_s
        self.client_kw = client_kw
        self._client = None
        self._state = None
        self._restart = False
        self.tokens_yielded = 0        # real (non-padding) tokens of the batches yielded
        self.batches_yielded = 0
        self._last_report = (time.monotonic(), 0)
        self._rate = None

    @classmethod
    def from_trainer_config(cls, config, eval=False, **kw):
        """The stream our trainer reads for a trainer job config (path or dict): same job spec
        (trainer/config.c bt_config_job_json), same socket (config "socket") unless given."""
        spec, sock = trainer_job_spec(config, eval=eval)
        kw.setdefault("socket_path", sock)
        return cls(spec, **kw)

    @property
    def rank_world(self):
        if self._rank_world is None:
            r, w, _ = resolve_rank_world()
            self._rank_world = (r, w)
        return self._rank_world

    @property
    def client(self):
        """The attached LoaderdClient while iterating (None otherwise)."""
        return self._client

    def __iter__(self):
        if get_worker_info() is not None:
            raise RuntimeError("LoaderdDataset: use DataLoader(num_workers=0): loaderd tokenizes and packs in its "
                               "own threads, and a worker process would attach this rank's stream a second time")
        self.close()
        if self._restart:
            self._state, self._restart = None, False
        rank, world = self.rank_world
        client = LoaderdClient(self.spec, socket_path=self.socket_path, rank=rank, world_size=world,
                               resume=self._state, **self.client_kw)
        self._client = client
        try:
            while True:
                b = client.next(timeout=self.timeout_s)
                if b is None:
                    self._restart = True
                    return
                item = to_torch(flatten(b))
                if self.segments:
                    item["segments"] = {k: torch.from_numpy(np.array(getattr(b, k))) for k in (
                        "seg_kind", "seg_pair", "seg_src", "seg_line", "seg_ref_ok", "seg_ref_logp")}
                n_real = b.n_real_tokens
                client.release()
                self._state = client.state_dict()
                self.tokens_yielded += n_real
                self.batches_yielded += 1
                yield item
        finally:
            if self._client is client:
                self.close()

    def ref_put(self, base, values):
        """LoaderdClient.ref_put on the attached client (while iterating): (accepted, rejected, errors)."""
        if self._client is None:
            raise LoaderdError("ref_put: not attached (iterate first)")
        return self._client.ref_put(base, values)

    def state_dict(self):
        """Position of the stream after the last batch yielded (JSON types; see
        LoaderdClient.state_dict). Before any batch: the loaded state, or the start."""
        if self._state is not None and not self._restart:
            return dict(self._state)
        rank, world = self.rank_world
        return {"format": "barq-loaderd-state", "version": 1, "job_digest": job_digest(self.spec), "rank": rank,
                "world_size": world, "next_step": 0, "resume": None}

    def load_state_dict(self, state):
        """Continue from `state` (a state_dict(), or its JSON text) at the next iteration. The
        state must be of this job and rank, or rank 0's of a run with another world size (every
        rank then loads rank 0's state and continues at the row that run reached; keep
        micro_batch_size and the global batch, world size x gradient accumulation, the same);
        checked at attach: ValueError, or LoaderdRefused from loaderd."""
        if isinstance(state, (str, bytes)):
            state = json.loads(state)
        if not isinstance(state, dict) or state.get("format") != "barq-loaderd-state":
            raise ValueError("load_state_dict: not a barq_loaderd state (see LoaderdDataset.state_dict)")
        if state.get("job_digest") != job_digest(self.spec):
            raise ValueError("load_state_dict: the state belongs to another job (shards, format, tokenizer, "
                             "seq_len, micro_batch_size, seed, epochs or datasets differ)")
        self.close()
        self._state = dict(state) if state.get("resume") is not None else None
        self._restart = False

    def report(self, step, loss=None, tokens_per_s=None):
        """Send step / loss / tokens per second to loaderd (shown by `loaderctl status`). Returns
        False (nothing sent) when no iteration is attached; loaderd errors are raised."""
        now, toks = time.monotonic(), self.tokens_yielded
        if tokens_per_s is None:
            t0, k0 = self._last_report
            if toks > k0 and now > t0:  # a new window only once batches were yielded since the last
                self._rate = (toks - k0) / (now - t0)
                self._last_report = (now, toks)
            tokens_per_s = self._rate
        if self._client is None:
            return False
        try:
            self._client.report(step, loss, tokens_per_s)
        except LoaderdError:
            if self._client is None:
                return False
            raise
        return True

    def close(self):
        """Detach from loaderd (the stream's position is kept for the next iteration)."""
        c, self._client = self._client, None
        if c is not None:
            c.close()
