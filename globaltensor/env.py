"""Who am I in the job: rank, world size, local rank, node rank; joining the job.

``init()`` reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (set by launch.py,
torchrun or gt.spawn). With none set, it makes a world of 1. Inside the thread-per-rank test
harness (``gt.testing``) each thread sees its own rank through a context variable.
"""
from __future__ import annotations

import contextvars
import datetime
import os
from dataclasses import dataclass

from .comm import backend as _backend
from .errors import GlobalTensorError


@dataclass(frozen=True, slots=True)
class LocalInfo:
    """What torch.distributed does not know: the node-local view of this rank."""

    local_rank: int
    local_world_size: int
    node_rank: int
    node_size: int


# set per thread by gt.testing; None means "read the environment variables"
_LOCAL = contextvars.ContextVar("globaltensor_local_info", default=None)


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise GlobalTensorError(
            f"expected the environment variable {name} to be an integer, found {raw!r}; "
            f"unset it or launch with launch.py / torchrun"
        ) from None


def is_initialized() -> bool:
    return _backend.is_initialized()


def get_rank() -> int:
    rank = _backend.cached_rank()
    return _int_env("RANK", 0) if rank is None else rank


def get_world_size() -> int:
    if _backend.is_initialized():
        return _backend.world_size()
    return _int_env("WORLD_SIZE", 1)


def _local() -> LocalInfo:
    info = _LOCAL.get()
    if info is not None:
        return info
    world = get_world_size()
    local_world = _int_env("LOCAL_WORLD_SIZE", world)
    return LocalInfo(
        local_rank=_int_env("LOCAL_RANK", get_rank() % max(local_world, 1)),
        local_world_size=local_world,
        node_rank=_int_env("NODE_RANK", _int_env("GROUP_RANK", get_rank() // max(local_world, 1))),
        node_size=max(1, world // max(local_world, 1)),
    )


def get_local_rank() -> int:
    return _local().local_rank


def get_local_world_size() -> int:
    return _local().local_world_size


def get_node_rank() -> int:
    return _local().node_rank


def get_node_size() -> int:
    return _local().node_size


def init(backend: str | None = None, timeout: float | datetime.timedelta | None = None) -> None:
    """Join the job started by launch.py / torchrun / gt.spawn; a no-op if already joined.

    ``backend``: None picks gloo for cpu, plus NCCL for cuda when a GPU is present.
    ``timeout``: seconds (or a timedelta) after which a stuck collective raises.
    """
    if _backend.is_initialized():
        return
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = datetime.timedelta(seconds=timeout)
    if timeout is not None and not (isinstance(timeout, datetime.timedelta)
                                    and timeout.total_seconds() > 0):
        raise GlobalTensorError(
            f"expected timeout in seconds > 0 or a datetime.timedelta, found {timeout!r}; "
            f"e.g. gt.init(timeout=60)"
        )
    world = _int_env("WORLD_SIZE", 1)
    rank = _int_env("RANK", 0)
    if not 0 <= rank < world:
        raise GlobalTensorError(
            f"expected 0 <= RANK < WORLD_SIZE, found RANK={rank}, WORLD_SIZE={world}; "
            f"check the launcher's environment"
        )
    if world > 1:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
        if missing:
            raise GlobalTensorError(
                f"WORLD_SIZE={world} but {', '.join(missing)} is not set; start the job with "
                f"`python launch.py --nproc_per_node {world} script.py` or torchrun"
            )
    _backend.init_world(rank=rank, world_size=world, backend=backend, timeout=timeout)


def set_local_info(info: LocalInfo | None):
    """Used by gt.testing: make this thread see ``info``. Returns a token for reset."""
    return _LOCAL.set(info)
