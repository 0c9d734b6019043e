"""The one place that talks to torch.distributed about the world itself."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


# (default process group, this rank in it): a rank never changes within one world; keyed by the
# group object so thread-worlds (gt.testing) and re-initialised worlds each get their own
_LAST_RANK: tuple = (None, 0)


def world_rank() -> int:
    global _LAST_RANK
    pg = dist.distributed_c10d._world.default_pg
    last_pg, rank = _LAST_RANK
    if pg is not None and pg is last_pg:
        return rank
    rank = dist.get_rank()
    _LAST_RANK = (pg, rank)
    return rank


def world_size() -> int:
    return dist.get_world_size()


def default_backend() -> str:
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def init_world(rank: int, world_size: int, backend: str | None, timeout, store=None) -> None:
    backend = backend or default_backend()
    kwargs = {}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if world_size == 1 and store is None:
        store = dist.HashStore()
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kwargs)
    else:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, **kwargs)


def destroy_world() -> None:
    if is_initialized():
        dist.destroy_process_group()


def default_timeout() -> datetime.timedelta:
    return datetime.timedelta(minutes=30)
