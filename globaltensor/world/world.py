"""The world: joining it, this rank, its size and its timeout. The one place that talks to
torch.distributed about the world itself (gt.env re-exports what users call)."""
from __future__ import annotations

import datetime
import os
import re
import weakref

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from . import exits, stalls as watch
from ..errors import GlobalTensorError


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
    if timeout is None and store is None:
        timeout = default_timeout(backend)
    kwargs = {}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if world_size == 1 and store is None:
        store = dist.HashStore()
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kwargs)
    else:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, **kwargs)
    leave = exits.register(rank, world_size, world_timeout())
    if world_size > 1:  # the stall report, and ranks that left named by those waiting for them
        watched = watch.start(c10d._get_default_store(), rank, world_size, leave.generation)
        leave.progress = lambda: watched.count


def start_watch(stall_s: float | None = None) -> "watch.Watch":
    """Watch a world made without init_world (gt.testing's thread-ranks): stall reports after
    ``stall_s`` seconds (None: GT_STALL_REPORT)."""
    return watch.start(c10d._get_default_store(), dist.get_rank(), dist.get_world_size(),
                       stall_s=stall_s)


def destroy_world() -> None:
    if is_initialized():
        dist.destroy_process_group()


# A collective that waits this long is stuck: CPU (gloo) jobs give up after 5 minutes instead of
# torch's 30, GPU jobs keep torch's own default (NCCL: 10 minutes). GT_TIMEOUT overrides both.
DEFAULT_CPU_TIMEOUT_S = 300.0


def default_timeout(backend: str) -> datetime.timedelta | None:
    """The timeout ``gt.init`` uses when given none: GT_TIMEOUT (seconds) when set, else
    DEFAULT_CPU_TIMEOUT_S for a CPU-only backend; None (torch's default) with NCCL."""
    raw = os.environ.get("GT_TIMEOUT", "").strip()
    if raw:
        try:
            seconds = float(raw)
        except ValueError:
            seconds = -1.0
        if not seconds > 0:
            raise GlobalTensorError(
                f"expected GT_TIMEOUT to be a number of seconds > 0, found {raw!r}; e.g. "
                f"GT_TIMEOUT=60, or unset it for the default ({DEFAULT_CPU_TIMEOUT_S:g}s on CPU)")
        return datetime.timedelta(seconds=seconds)
    if "nccl" in backend:
        return None
    return datetime.timedelta(seconds=DEFAULT_CPU_TIMEOUT_S)


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


def backend() -> str:
    """The default group's backend ("gloo", "nccl", "cpu:gloo,cuda:nccl")."""
    return str(dist.get_backend())


def init(backend: str | None = None, timeout: float | datetime.timedelta | None = None) -> None:
    """Join the job started by launch.py / torchrun / gt.spawn / SLURM's srun; a no-op if
    already joined. ``gt.init`` (env.init) is this, then the planner's cost figures.

    ``backend``: None picks gloo for cpu, plus NCCL for cuda when a GPU is present.
    ``timeout``: seconds (or a timedelta) after which a stuck collective raises; None reads
    GT_TIMEOUT, else 300 s on CPU (torch's own default with NCCL).
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
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        os.environ.update(slurm_env(os.environ))  # under srun: its variables, as torchrun's
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


def slurm_env(environ) -> dict[str, str]:
    """Under ``srun`` (SLURM_PROCID and SLURM_NTASKS set): RANK, WORLD_SIZE, LOCAL_RANK,
    NODE_RANK, MASTER_ADDR (the job's first node) and MASTER_PORT (15000 + the job id's last
    four digits) as Lightning and Ignite derive them; variables already set are kept. Empty
    outside SLURM."""
    if not environ.get("SLURM_PROCID") or not environ.get("SLURM_NTASKS"):
        return {}
    out = {"RANK": environ["SLURM_PROCID"], "WORLD_SIZE": environ["SLURM_NTASKS"],
           "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
           "NODE_RANK": environ.get("SLURM_NODEID", "0")}
    nodes = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or "127.0.0.1"
    out["MASTER_ADDR"] = first_node(nodes)
    job = "".join(c for c in environ.get("SLURM_JOB_ID", "") if c.isdigit())
    out["MASTER_PORT"] = str(15000 + int(job[-4:])) if job else "29500"
    per_node = environ.get("SLURM_NTASKS_PER_NODE", "")
    if per_node.isdigit():
        out["LOCAL_WORLD_SIZE"] = per_node
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if environ.get(name):
            out[name] = environ[name]
    for name, value in out.items():
        if not value.isdigit() and name not in ("MASTER_ADDR",):
            raise GlobalTensorError(
                f"expected the SLURM variables behind {name} to be integers, found {value!r}; "
                f"start the job with srun, or set RANK / WORLD_SIZE yourself")
    return out


def first_node(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[003-005,9],gpu1`` -> ``node003``."""
    nodes = re.sub(r"\[(.*?)[,-].*\]", "\\1", nodelist.strip())  # the first of each range
    nodes = re.sub(r"\[(.*?)\]", "\\1", nodes)  # a range of one number
    return nodes.split(" ")[0].split(",")[0]
