"""Small metadata exchanges the tensor layer needs: piece shapes and broadcast syncs."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..placement import Placement
from ..errors import GlobalTensorError
from .groups import group_along, groups_along
from .guard import guard

MAX_NDIM = 16
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def dtype_of_code(code: int):
    return _DTYPES[code] if code < len(_DTYPES) else "another dtype"


def _world_of_one() -> bool:
    """True when no world was joined and none is expected (nothing to exchange); a job of
    several ranks that forgot gt.init() is told so."""
    if dist.is_initialized():
        return False
    from .. import env

    if env.get_world_size() == 1:
        return True
    raise GlobalTensorError(
        f"expected gt.init() before global operations in a job of {env.get_world_size()} ranks "
        f"(WORLD_SIZE is set), found no initialised world; call gt.init() first"
    )


def exchange_meta(shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[tuple[int, ...], int]]:
    """Every rank's (local shape, dtype code), indexed by world rank. Every rank must call it."""
    if len(shape) > MAX_NDIM:
        from ..errors import GlobalTensorError

        raise GlobalTensorError(f"expected a tensor of at most {MAX_NDIM} dims, found {len(shape)}")
    if _world_of_one():
        return [(tuple(shape), dtype_code(dtype))]
    row = torch.full((2 + MAX_NDIM,), -1, dtype=torch.int64)
    row[0], row[1] = len(shape), dtype_code(dtype)
    row[2:2 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
    world = dist.get_world_size()
    table = torch.empty((world * (2 + MAX_NDIM),), dtype=torch.int64)
    with guard("to_global: exchanging piece shapes (check_meta=True)"):
        dist.all_gather_single(table, row)
    out = []
    for r in table.reshape(world, 2 + MAX_NDIM).tolist():
        ndim = int(r[0])
        out.append((tuple(int(s) for s in r[2:2 + ndim]), int(r[1])))
    return out


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
        dist.broadcast(tensor, src=ranks[0], group=group)
