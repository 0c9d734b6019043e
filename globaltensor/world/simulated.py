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


# torch.distributed's process-wide state of a world: the default group (in ``_world``) and
# the module's maps of groups; a simulation inside a joined world sets them aside
_STATE = ("_world", "_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config",
          "_tags_to_pg", "_pg_to_tag", "_group_count")


def enter(world_size: int, rank: int):
    """Join a fake world of ``world_size`` as ``rank`` (no process, no store, no message). A
    world this process joined already (a notebook after ``gt.init()``, rank 0 of a real job)
    is set aside for the block, untouched, and comes back when it ends."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    aside = _set_aside() if dist.is_initialized() else None
    try:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    except BaseException:
        if aside is not None:
            _put_back(aside)
        raise
    return _SIMULATED.set(True), aside


def leave(entered) -> None:
    """Back to the process as it was: the fake world is dropped, a world set aside is back."""
    token, aside = entered
    _SIMULATED.reset(token)
    if aside is not None:
        _put_back(aside)  # destroying the fake world would unregister the real one's groups
    elif dist.is_initialized():
        dist.destroy_process_group()


def _set_aside() -> dict:
    c10d = dist.distributed_c10d
    aside = {name: getattr(c10d, name) for name in _STATE}
    for name in c10d._pg_names.values():  # the fake world registers its own under these
        torch._C._distributed_c10d._unregister_process_group(name)
    for name in _STATE:
        value = aside[name]
        setattr(c10d, name, c10d._World() if name == "_world" else
                0 if name == "_group_count" else type(value)())
    return aside


def _put_back(aside: dict) -> None:
    c10d = dist.distributed_c10d
    for name in c10d._pg_names.values():  # the fake world's
        torch._C._distributed_c10d._unregister_process_group(name)
    for name, value in aside.items():
        setattr(c10d, name, value)
    # the real world's groups are found by name again (functional collectives, compiled graphs)
    for pg, name in c10d._pg_names.items():
        torch._C._distributed_c10d._unregister_process_group(name)
        torch._C._distributed_c10d._register_process_group(name, pg)


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


def no_value_in_simulation(x: torch.Tensor) -> None:
    """Inside ``gt.simulate`` tensors hold no data: reading one's value (``item()``, ``print``,
    ``bool(x)``: HF's mask code reads position ids) is an error naming the user's line."""
    from .. import debug

    if _SIMULATED.get():
        raise GlobalTensorError(
            f"gt.simulate: {debug.user_call(2) or 'reading a value'} reads the value of a global "
            f"tensor (shape {list(x.shape)}), and inside a simulation tensors hold no data "
            f"({debug.user_line(2)}); keep value reads (item(), print, tolist, if x.any()) out "
            f"of the simulated block, or guard them with `if not gt.env.simulated():`")


KNOWABLE_NUMEL = 1 << 16  # positions of a 64k-token batch; larger integer tensors go to meta


def knowable(t) -> bool:
    """Whether a simulation keeps ``t``'s values (sim/knowable.py): a small integer or boolean
    tensor with data (positions, masks built from them), made by a deterministic factory."""
    return (not t.is_meta and not (t.is_floating_point() or t.is_complex())
            and t.numel() <= KNOWABLE_NUMEL)
