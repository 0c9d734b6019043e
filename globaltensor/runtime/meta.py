"""Small metadata exchanges: shapes and dtypes of pieces (one exchange, shared by
``to_global(check_meta=True)`` and value-style ``gt.comm.all_gather``), and broadcast syncs."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..world import world
from ..errors import GlobalTensorError
from ..placement import Placement
from .groups import all_gather_flat, byte_view, group_along, groups_along
from .guard import guard

MAX_NDIM = 64  # fixed-size records, so every rank's fit in one collective
DTYPES = tuple(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))
_CODE = {d: i for i, d in enumerate(DTYPES)}


def _world_of_one() -> bool:
    """True when no world was joined and none is expected (nothing to exchange); a job of
    several ranks that forgot gt.init() is told so."""
    if dist.is_initialized():
        return False
    if world.get_world_size() == 1:
        return True
    raise GlobalTensorError(
        f"expected gt.init() before global operations in a job of {world.get_world_size()} ranks "
        f"(WORLD_SIZE is set), found no initialised world; call gt.init() first"
    )


def _records(tensors, what: str) -> list[list[int]]:
    rows = []
    for t in tensors:
        if t.dim() > MAX_NDIM:
            raise GlobalTensorError(f"{what}: expected tensors of at most {MAX_NDIM} dims, found "
                                    f"{t.dim()}; reshape it first")
        rows.append([_CODE[t.dtype], t.dim(), *t.shape] + [0] * (MAX_NDIM - t.dim()))
    return rows


def exchange_meta(tensors, group=None, what: str = "to_global: exchanging piece shapes "
                  "(check_meta=True)") -> list[list[tuple[tuple[int, ...], torch.dtype]]]:
    """``[rank in group][i] = (shape, dtype)`` of every rank's ``tensors[i]``, in one all_gather
    over ``group`` (default: the world). Every rank of the group must call it with as many
    tensors."""
    rows = _records(tensors, what)
    if group is None and _world_of_one():
        return [[(tuple(t.shape), t.dtype) for t in tensors]]
    device = torch.device(c10d._get_object_coll_device(group))
    mine = torch.tensor(rows, dtype=torch.int64, device=device).reshape(len(rows), 2 + MAX_NDIM)
    n = dist.get_world_size(group)
    table = mine.new_empty((n,) + tuple(mine.shape))
    if mine.numel():
        with guard(what):
            all_gather_flat(table.view(-1), mine.reshape(-1), group=group)
    return [[(tuple(rec[2:2 + rec[1]]), DTYPES[rec[0]]) for rec in per_rank]
            for per_rank in table.cpu().tolist()]


def all_objects(value, what: str) -> list:
    """``[rank] = value`` of every rank of the world (picklable values; tensors on the CPU), in
    one all_gather_object; every rank must call it. For checks that need every rank's data
    (``gt.verify``), not for the hot path."""
    if _world_of_one():
        return [value]
    out = [None] * dist.get_world_size()
    with guard(what):
        dist.all_gather_object(out, value)
    return out


def object_from(src: int, value):
    """``value`` as rank ``src`` holds it, on every rank of the world (picklable objects; the
    other ranks pass anything)."""
    box = [value if world.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def broadcast_along(placement: Placement, axis: int, tensor: torch.Tensor, rank: int) -> None:
    """In place: every rank along ``axis`` gets the piece of the rank at coordinate 0 of that axis.

    Every rank of the world must call it (group creation is collective); ranks outside the
    placement only take part in creating the groups.
    """
    if _world_of_one():
        return
    groups_along(placement, axis)
    coord = placement.coord_of(rank)
    if coord is None or placement.shape[axis] == 1:
        return
    group, ranks = group_along(placement, axis, coord)
    with guard(lambda: f"to_global: broadcasting rank {ranks[0]}'s data along axis {axis} of "
                       f"{placement!r} (sync_data=True)", ranks=ranks):
        dist.broadcast(byte_view(tensor), src=ranks[0], group=group)  # any dtype: its bytes
