"""Who am I in the job: rank, world size, local rank, node rank; joining the job.

``init()`` reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (set by launch.py,
torchrun or gt.spawn). With none set, it makes a world of 1. Inside the thread-per-rank test
harness (``gt.testing``) each thread sees its own rank through a context variable.
"""
from __future__ import annotations

import contextvars
from dataclasses import dataclass

from .world import get_rank, get_world_size, init, int_env as _int_env, is_initialized  # noqa: F401


@dataclass(frozen=True, slots=True)
class LocalInfo:
    """What torch.distributed does not know: the node-local view of this rank."""

    local_rank: int
    local_world_size: int
    node_rank: int
    node_size: int


# set per thread by gt.testing; None means "read the environment variables"
_LOCAL = contextvars.ContextVar("globaltensor_local_info", default=None)


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


def set_local_info(info: LocalInfo | None):
    """Used by gt.testing: make this thread see ``info``. Returns a token for reset."""
    return _LOCAL.set(info)
