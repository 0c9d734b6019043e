"""A world that does not exist (``gt.simulate``): torch.distributed's fake process group answers
this rank and the world's size, and no group sends anything; the executor records instead of
running (runtime/emit.py's simulated emitter), and the groups of placements are placeholders
(runtime/groups.py). The one place that makes or leaves such a world."""
from __future__ import annotations

import contextvars

import torch
import torch.distributed as dist

from ..errors import GlobalTensorError

_SIMULATED: contextvars.ContextVar[bool] = contextvars.ContextVar("gt_simulated", default=False)


def simulated() -> bool:
    """Whether this context runs inside ``gt.simulate``."""
    return _SIMULATED.get()


def enter(world_size: int, rank: int) -> contextvars.Token:
    """Join a fake world of ``world_size`` as ``rank`` (no process, no store, no message)."""
    if dist.is_initialized():
        raise GlobalTensorError(
            "gt.simulate runs a world that does not exist, so it starts before gt.init(): found "
            "a world already joined in this process; simulate in a script (or a process) of its "
            "own, before any gt.init()")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    return _SIMULATED.set(True)


def leave(token: contextvars.Token) -> None:
    """Back to the process as it was: the fake world is destroyed."""
    _SIMULATED.reset(token)
    if dist.is_initialized():
        dist.destroy_process_group()


def wrapper_device(local: torch.Tensor, placement) -> torch.device:
    """The device a global tensor reports: its piece's; inside gt.simulate, where the piece is
    meta, the device the job runs on (the placement's): torch chooses kernels by the device
    (scaled_dot_product_attention takes its math decomposition on meta, the fused flash kernel
    on CPU), so the simulation dispatches as the real run. A CUDA placement simulated without a
    GPU reports CPU."""
    device = local.device
    if device.type != "meta" or not _SIMULATED.get():
        return device
    kind = placement.type
    return torch.device(kind if kind == "cpu" or torch.cuda.is_available() else "cpu")
