"""Who am I in the job: rank, world size, local rank, node rank; joining the job.

``init()`` reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (set by launch.py,
torchrun or gt.spawn). With none set, it makes a world of 1. Inside the thread-per-rank test
harness (``gt.testing``) each thread sees its own rank through a context variable.
"""
from __future__ import annotations

import contextvars
import datetime
import functools
from dataclasses import dataclass

from .world import world as _world
from .world.world import get_rank, get_world_size, int_env as _int_env, is_initialized  # noqa: F401


def init(backend: str | None = None, timeout: float | datetime.timedelta | None = None) -> None:
    """Join the job started by launch.py / torchrun / gt.spawn / SLURM's srun; a no-op if
    already joined.

    ``backend``: None picks gloo for cpu, plus NCCL for cuda when a GPU is present.
    ``timeout``: seconds (or a timedelta) after which a stuck collective raises; None reads
    GT_TIMEOUT, else 300 s on CPU (torch's own default with NCCL).

    Then the planner's cost figures are set for the job, on every rank alike: from GT_COSTS
    ("default", or "alpha=SECONDS,beta=SECONDS"), else measured by a short probe on the world's
    group (well under a second), kept in GT_COSTS_CACHE's file if one is named
    (docs/planner.md, "Cost model").
    """
    if is_initialized():
        return
    from .runtime import costs  # read first: a bad GT_COSTS stops every rank before it joins

    wanted = costs.wanted()
    _world.init(backend=backend, timeout=timeout)
    if get_world_size() > 1:
        costs.at_start(wanted, costs.probe_device(_world.backend()))


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


def rank_zero_only(fn):
    """Decorator: ``fn`` runs on rank 0 only and returns None on every other rank (Lightning's
    ``rank_zero_only``). For logging and files, never for global operations: ``x.item()``,
    ``print(x)`` of a global tensor or a ``gt.comm`` call inside it would wait for ranks that
    never come. Read values first, on every rank, then pass them in::

        @gt.env.rank_zero_only
        def log(step, loss):
            print(f"step {step}: loss {loss:.4f}")

        log(step, loss.item())      # item() on every rank, the print on rank 0
    """
    @functools.wraps(fn)
    def on_rank_zero(*args, **kwargs):
        return fn(*args, **kwargs) if get_rank() == 0 else None
    return on_rank_zero


def print0(*values, sep: str = " ", end: str = "\n", file=None, flush: bool = False) -> None:
    """``print`` on rank 0 only; call it on every rank.

    The values are turned into text on every rank first: a global tensor's text is its whole
    value, which every rank must take part in gathering (``print(x)`` alone on rank 0 would wait
    forever for the others). Then rank 0 prints it::

        gt.print0("loss", loss)           # loss a global tensor: fine on every rank
    """
    text = sep.join(str(v) for v in values) if sep is not None else " ".join(map(str, values))
    if get_rank() == 0:
        print(text, end=end, file=file, flush=flush)


def all_device_placement(type: str = "cpu"):
    """Every rank of the world as a 1-D placement: OneFlow's
    ``flow.env.all_device_placement("cuda")``, the same as ``gt.placement.all(type)``."""
    from .placement import Placement

    return Placement.all(type)


def sub_placement(placement, axis):
    """``placement[axis]``: this rank's 1-D sub-placement along ``axis`` (a name or a number),
    as DTensor's ``mesh["tp"]``: the ranks that share this rank's coordinate on every other
    axis (``Placement.along(axis, rank)`` for any rank)."""
    return placement.along(axis, get_rank())

__all__ = ["get_rank", "get_world_size", "init", "is_initialized", "LocalInfo", "get_local_rank",
           "get_local_world_size", "get_node_rank", "get_node_size", "set_local_info",
           "rank_zero_only", "print0", "sub_placement", "all_device_placement"]


def simulated() -> bool:
    """Whether this code runs inside ``gt.simulate`` (tensors hold no data there)."""
    from .world.simulated import simulated as inside

    return inside()
