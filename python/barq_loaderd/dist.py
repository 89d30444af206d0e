"""Rank and world size of this process, the way the trainer finds them (trainer/parallel/dist.c
bt_dist_env_resolve), with torch.distributed first when it is initialised:

  1. torch.distributed initialised: get_rank() / get_world_size();
  2. RANK + WORLD_SIZE (torchrun, accelerate launch, deepspeed);
  3. SLURM_PROCID + SLURM_NTASKS (srun);
  4. otherwise rank 0 of 1.

One of a pair without the other, a non-integer, a world size < 1 or a rank outside [0, world)
is a ValueError naming the variable (a half-set environment is a launcher mistake, not a reason
to train every rank on rank 0's data).
"""
import os

MAX_WORLD = 1 << 16


def _int(name, value):
    try:
        x = int(value.strip(), 10)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None
    if x < 0:
        raise ValueError(f"{name}={value!r} is negative")
    return x


def resolve_rank_world(env=None):
    """(rank, world_size, source) with source "torch.distributed", "torchrun", "slurm" or
    "single". env: a mapping to read instead of os.environ (tests)."""
    if env is None:
        try:
            import torch.distributed as tdist
            if tdist.is_available() and tdist.is_initialized():
                return tdist.get_rank(), tdist.get_world_size(), "torch.distributed"
        except ImportError:
            pass
        env = os.environ
    for rank_var, world_var, source in (("RANK", "WORLD_SIZE", "torchrun"),
                                        ("SLURM_PROCID", "SLURM_NTASKS", "slurm")):
        rv, wv = env.get(rank_var), env.get(world_var)
        if rv is None and wv is None:
            continue
        if wv is None:
            raise ValueError(f"{rank_var}={rv!r} is set but {world_var} is not")
        if rv is None:
            raise ValueError(f"{world_var}={wv!r} is set but {rank_var} is not")
        world, rank = _int(world_var, wv), _int(rank_var, rv)
        if world < 1:
            raise ValueError(f"{world_var}={wv!r}: the world size must be >= 1")
        if world > MAX_WORLD:
            raise ValueError(f"{world_var}={wv!r} exceeds the largest world size {MAX_WORLD}")
        if rank >= world:
            raise ValueError(f"{rank_var}={rv!r} is not below {world_var}={wv!r}")
        return rank, world, source
    return 0, 1, "single"
