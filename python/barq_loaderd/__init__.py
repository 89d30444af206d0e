"""barq_loaderd: read BarqTrain's loaderd batches from Python (proto/PROTOCOL.md).

    from barq_loaderd import LoaderdClient          # NumPy, zero-copy
    from barq_loaderd.torch import LoaderdDataset   # torch IterableDataset, padding-free batches
    from barq_loaderd.hf import LoaderdTrainer      # transformers Trainer fed by loaderd
    from barq_loaderd import load_job, trainer_job_spec, base_model_name_or_path, trainer_schedule
                                                    # a trainer job file (JSON or YAML) read as
                                                    # `trainer` reads it: stream, socket, base
                                                    # model, learning-rate schedule

Pure Python (NumPy; torch and transformers only for the modules that name them).
"""
from .batch import Batch, flatten, validate
from .client import (LoaderdClient, absolute_job_spec, base_model_name_or_path, job_digest, read_trainer_config,
                     request, trainer_job_spec, trainer_socket)
from .dist import resolve_rank_world
from .jobfile import JobFileError, load_job
from .schedule import lr_at, trainer_schedule
from .errors import (LoaderdClosed, LoaderdConnectionError, LoaderdError, LoaderdProtocolError, LoaderdRefused,
                     LoaderdTimeout)

__version__ = "0.1.0"
__all__ = ["Batch", "JobFileError", "LoaderdClient", "LoaderdClosed", "LoaderdConnectionError", "LoaderdError",
           "LoaderdProtocolError", "LoaderdRefused", "LoaderdTimeout", "absolute_job_spec",
           "base_model_name_or_path", "flatten", "job_digest", "load_job", "lr_at", "read_trainer_config", "request",
           "resolve_rank_world", "trainer_job_spec", "trainer_schedule", "trainer_socket", "validate"]
