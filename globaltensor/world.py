"""The world: joining it, this rank, its size and its timeout. The one place that talks to
torch.distributed about the world itself (gt.env re-exports what users call)."""
from __future__ import annotations

import datetime
import os
import weakref

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .errors import GlobalTensorError


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


# (weak reference to the default process group, this rank in it): a rank never changes within
# one world; keyed by the group object so thread-worlds (gt.testing) and re-initialised worlds
# each get their own. Weak: after dist.destroy_process_group() this must not keep the group
# alive until interpreter exit (see runtime/groups.py).
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


def world_timeout() -> datetime.timedelta:
    """The timeout the world was made with (``gt.init(timeout=...)``); torch's default otherwise.

    Groups made later (``dist.new_group``) do not inherit it by themselves: pass it to them.
    """
    pg = c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - this backend is absent or keeps no options
            continue
    return c10d.default_pg_timeout


def int_env(name: str, default: int) -> int:
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


def get_rank() -> int:
    rank = cached_rank()
    return int_env("RANK", 0) if rank is None else rank


def get_world_size() -> int:
    if is_initialized():
        return dist.get_world_size()
    return int_env("WORLD_SIZE", 1)


def init(backend: str | None = None, timeout: float | datetime.timedelta | None = None) -> None:
    """Join the job started by launch.py / torchrun / gt.spawn; a no-op if already joined.

    ``backend``: None picks gloo for cpu, plus NCCL for cuda when a GPU is present.
    ``timeout``: seconds (or a timedelta) after which a stuck collective raises.
    """
    if is_initialized():
        return
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = datetime.timedelta(seconds=timeout)
    if timeout is not None and not (isinstance(timeout, datetime.timedelta)
                                    and timeout.total_seconds() > 0):
        raise GlobalTensorError(
            f"expected timeout in seconds > 0 or a datetime.timedelta, found {timeout!r}; "
            f"e.g. gt.init(timeout=60)"
        )
    world = int_env("WORLD_SIZE", 1)
    rank = int_env("RANK", 0)
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
    init_world(rank=rank, world_size=world, backend=backend, timeout=timeout)
