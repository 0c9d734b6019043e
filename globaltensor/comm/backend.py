"""The one place that talks to torch.distributed about the world itself."""
from __future__ import annotations

import datetime
import weakref

import torch
import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


# (weak reference to the default process group, this rank in it): a rank never changes within
# one world; keyed by the group object so thread-worlds (gt.testing) and re-initialised worlds
# each get their own. Weak: after dist.destroy_process_group() this must not keep the group
# alive until interpreter exit (see comm/groups.py).
_LAST_RANK: tuple = (lambda: None, 0)
_AVAILABLE = dist.is_available()
# torch's registry keeps the default group in ``_default_pg`` behind a ``default_pg`` property:
# reading the attribute saves a Python call on every warm path (the property where it is absent)
_DEFAULT_PG = ("_default_pg" if _AVAILABLE and hasattr(dist.distributed_c10d._world, "_default_pg")
               else "default_pg")


def cached_rank() -> int | None:
    """This rank in the current default world, None when there is none. Once a world is known
    this is one attribute read and a compare: the warm paths (to_global, dispatch) call it."""
    global _LAST_RANK
    pg = getattr(dist.distributed_c10d._world, _DEFAULT_PG) if _AVAILABLE else None
    last_pg, rank = _LAST_RANK
    if pg is not None and last_pg() is pg:
        return rank
    if pg is None:
        return None
    rank = dist.get_rank()
    _LAST_RANK = (weakref.ref(pg), rank)
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
