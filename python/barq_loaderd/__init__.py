"""barq_loaderd: read BarqTrain's loaderd batches from Python (proto/PROTOCOL.md).

    from barq_loaderd import LoaderdClient          # NumPy, zero-copy
    from barq_loaderd.torch import LoaderdDataset   # torch IterableDataset, padding-free batches
    from barq_loaderd.hf import LoaderdTrainer      # transformers Trainer fed by loaderd

Pure Python (NumPy; torch and transformers only for the modules that name them).
"""
from .batch import Batch, flatten, validate
from .client import LoaderdClient, absolute_job_spec, job_digest, request, trainer_job_spec
from .dist import resolve_rank_world
from .errors import (LoaderdClosed, LoaderdConnectionError, LoaderdError, LoaderdProtocolError, LoaderdRefused,
                     LoaderdTimeout)

__version__ = "0.1.0"
__all__ = ["Batch", "LoaderdClient", "LoaderdClosed", "LoaderdConnectionError", "LoaderdError",
           "LoaderdProtocolError", "LoaderdRefused", "LoaderdTimeout", "absolute_job_spec", "flatten",
           "job_digest", "request", "resolve_rank_world", "trainer_job_spec", "validate"]
