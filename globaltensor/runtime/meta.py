"""Small metadata exchanges: shapes, dtypes and sbps of pieces (one exchange, shared by
``to_global(check_meta=True)`` and value-style ``gt.comm.all_gather``), and broadcast syncs."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from ..world import world
from ..errors import GlobalTensorError
from ..placement import Placement
from ..sbp import Broadcast, PartialSum, Split
from . import wire
from .groups import group_along, groups_along
from .guard import guard

MAX_NDIM = 64  # fixed-size records, so every rank's fit in one collective
MAX_AXES = 16
ROW = 3 + MAX_NDIM + MAX_AXES  # dtype, ndim, shape, number of sbp axes, sbp codes
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


class Meta(NamedTuple):
    """One rank's record of one tensor: its shape and dtype, and the sbp that rank passed."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    sbp: tuple = ()


def _sbp_code(v) -> int:
    """B: 1, P: 2, S(d): 4d + 3 (negative d too: never 1 or 2 mod 4). A split dim past
    ``MAX_NDIM`` either way is no dim of any tensor the records carry (they refuse more dims):
    it travels as S(MAX_NDIM) or S(-MAX_NDIM - 1), so any int fits the int64 record and every
    rank still takes part in the one exchange; each rank's own sbp, resolved after it, raises
    the SbpError naming the dim it passed."""
    if not isinstance(v, Split):
        return 2 if isinstance(v, PartialSum) else 1
    return 4 * max(-MAX_NDIM - 1, min(v.dim, MAX_NDIM)) + 3


def _sbp_value(code: int):
    return Split((code - 3) // 4) if code % 4 == 3 else (PartialSum() if code == 2 else Broadcast())


def _records(tensors, sbp: tuple, what: str) -> list[list[int]]:
    if len(sbp) > MAX_AXES:
        raise GlobalTensorError(f"{what}: expected a placement of at most {MAX_AXES} axes, found "
                                f"{len(sbp)}; use fewer placement axes")
    tail = [len(sbp)] + [_sbp_code(v) for v in sbp] + [0] * (MAX_AXES - len(sbp))
    rows = []
    for t in tensors:
        if t.dim() > MAX_NDIM:
            raise GlobalTensorError(f"{what}: expected tensors of at most {MAX_NDIM} dims, found "
                                    f"{t.dim()}; reshape it first")
        rows.append([_CODE[t.dtype], t.dim(), *t.shape] + [0] * (MAX_NDIM - t.dim()) + tail)
    return rows


def _meta(rec: list[int]) -> Meta:
    axes = rec[2 + MAX_NDIM]
    sbp = tuple(_sbp_value(c) for c in rec[3 + MAX_NDIM:3 + MAX_NDIM + axes])
    return Meta(tuple(rec[2:2 + rec[1]]), DTYPES[rec[0]], sbp)


def exchange_meta(tensors, group=None, what: str = "to_global: exchanging piece shapes "
                  "(check_meta=True)", sbp=()) -> list[list[Meta]]:
    """``[rank in group][i] = (shape, dtype, sbp)`` of every rank's ``tensors[i]``, in one
    all_gather over ``group`` (default: the world); ``sbp`` is the sbp values this rank passed
    for them (unresolved: a negative split dim stays), for the caller to compare. Every rank of
    the group must call it with as many tensors."""
    sbp = tuple(sbp)
    rows = _records(tensors, sbp, what)
    if group is None and _world_of_one():
        return [[Meta(tuple(t.shape), t.dtype, sbp) for t in tensors]]
    mine = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), ROW)
    with guard(what):  # in gt.simulate every rank is taken to hold these same pieces
        table = wire.all_gather_rows(mine, group, wire.Why("metadata", what))
    if table.shape[0] > 1 and table.stride(0) == 0:  # one record seen by every rank: read once
        return [[_meta(rec) for rec in table[0].tolist()]] * table.shape[0]
    return [[_meta(rec) for rec in per_rank] for per_rank in table.cpu().tolist()]


def all_objects(value, what: str) -> list:
    """``[rank] = value`` of every rank of the world (picklable values; tensors on the CPU), in
    one all_gather_object; every rank must call it. For checks that need every rank's data
    (``gt.verify``), not for the hot path."""
    if _world_of_one():
        return [value]
    with guard(what):
        return wire.all_gather_object(value, wire.Why("metadata", what))


def object_from(src: int, value, what: str = "an object from one rank"):
    """``value`` as rank ``src`` holds it, on every rank of the world (picklable objects; the
    other ranks pass anything)."""
    return wire.broadcast_object(value, src, wire.Why("metadata", what))


def broadcast_along(placement: Placement, axis: int, tensor: torch.Tensor, rank: int,
                    nbytes: int | None = None) -> None:
    """In place: every rank along ``axis`` gets the piece of the rank at coordinate 0 of that axis.

    Every rank of the world must call it (group creation is collective); ranks outside the
    placement only take part in creating the groups and announce the broadcasts (the wire's
    event, ``nbytes`` the largest piece's: a simulation plays one rank for all).
    """
    if _world_of_one():
        return
    groups_along(placement, axis)
    if placement.shape[axis] == 1:
        return
    why = wire.Why("sync_data", "to_global (sync_data=True)", wire.axis_name(placement, axis))
    coord = placement.coord_of(rank)
    if coord is None:
        wire.announce("broadcast", why, placement, nbytes or 0, tensor.dtype)
        return
    group, ranks = group_along(placement, axis, coord)
    with guard(lambda: f"to_global: broadcasting rank {ranks[0]}'s data along axis {axis} of "
                       f"{placement!r} (sync_data=True)", ranks=ranks):
        wire.broadcast(tensor, ranks[0], group, why, placement, nbytes)  # any dtype: its bytes
