"""Run a plan on this rank's piece with real collectives (gloo on CPU, NCCL on CUDA).

SPMD: every rank of the world calls ``run`` with the same plan, in the same order. Every rank
makes the same process-group calls for every step (torch.distributed needs all ranks of the
world to create each group, in one order); a rank outside a step's group then skips its data
part. Uneven pieces are padded to the largest piece of the group and trimmed, except all_to_all,
which sends exact split sizes.

The result is a fresh, contiguous tensor: the caller's tensor is never modified or aliased.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..plan import (AllGather, AllReduce, AllToAll, Exchange, LocalSlice, Plan, ReduceScatter,
                    ZeroFill, box_shape, relative)
from ..sbp import Broadcast
from .groups import group_along, group_of_ranks, groups_along

# torch 2.13 renames the flat collectives; older versions only have the old names
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def run(plan: Plan, local: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's piece of ``plan.dst`` from its piece ``local`` of ``plan.src``."""
    if not plan.steps:
        return local
    out = local
    for step in plan.steps:
        out = _run_step(step, out, rank)
    if out.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
        return out.clone(memory_format=torch.contiguous_format)
    return out.contiguous()


def _run_step(step, local: torch.Tensor, rank: int) -> torch.Tensor:
    after = step.after
    if isinstance(step, Exchange):
        return _exchange(step, local, rank)
    # every rank of the world creates the axis's groups together, members or not
    n = after.placement.shape[step.axis]
    if n > 1 and not isinstance(step, (LocalSlice, ZeroFill)):
        groups_along(after.placement, step.axis)
    coord = after.placement.coord_of(rank)
    if coord is None:
        return local.new_empty(after.local_shape_of_rank(rank))
    match step:
        case LocalSlice():
            return local[relative(after.box(coord), step.before.box(coord))]
        case ZeroFill():
            return _zero_fill(step, local, coord)
    if n == 1:  # a group of one: the collective changes nothing
        return local.clone()
    group, ranks = group_along(after.placement, step.axis, coord)
    match step:
        case AllGather():
            return _all_gather(step, local, coord, group)
        case ReduceScatter():
            return _reduce_scatter(step, local, coord, group)
        case AllReduce():
            out = local.clone(memory_format=torch.contiguous_format)
            dist.all_reduce(out, group=group)
            return out
        case AllToAll():
            return _all_to_all(step, local, coord, group)
    raise TypeError(f"the executor does not know the step {step!r}")


def _member_coords(placement, axis: int, coord):
    """The coordinates of the group along ``axis`` through ``coord``, in axis order."""
    return [coord[:axis] + (k,) + coord[axis + 1:] for k in range(placement.shape[axis])]


def _sizes_along(layout, axis: int, coord, dim: int) -> list[int]:
    return [hi - lo for lo, hi in (layout.box(c)[dim] for c in _member_coords(layout.placement, axis, coord))]


def _all_gather(step: AllGather, local, coord, group) -> torch.Tensor:
    d = step.dim
    sizes = _sizes_along(step.before, step.axis, coord, d)
    n, big = len(sizes), max(sizes)
    moved = local.movedim(d, 0)
    if min(sizes) == big:
        send = moved.contiguous()
    else:  # pad to the largest piece, trim after
        send = moved.new_zeros((big,) + tuple(moved.shape[1:]))
        send[: moved.shape[0]] = moved
    buf = send.new_empty((n * big,) + tuple(send.shape[1:]))
    if buf.numel():
        _all_gather_flat(buf, send, group=group)
    if min(sizes) != big:
        buf = torch.cat([buf[k * big: k * big + s] for k, s in enumerate(sizes)])
    return buf.movedim(0, d).contiguous()


def _reduce_scatter(step: ReduceScatter, local, coord, group) -> torch.Tensor:
    d, axis = step.dim, step.axis
    sizes = _sizes_along(step.after, axis, coord, d)
    n, big, mine = len(sizes), max(sizes), sizes[coord[axis]]
    moved = local.movedim(d, 0)
    if min(sizes) == big:
        send = moved.contiguous()
    else:  # chunk k at rows [k*big, k*big + sizes[k]) of a zero buffer
        send = moved.new_zeros((n * big,) + tuple(moved.shape[1:]))
        start = 0
        for k, s in enumerate(sizes):
            send[k * big: k * big + s] = moved[start: start + s]
            start += s
    out = send.new_empty((big,) + tuple(send.shape[1:]))
    if out.numel():
        _reduce_scatter_flat(out, send, group=group)
    return out[:mine].movedim(0, d).contiguous()


def _all_to_all(step: AllToAll, local, coord, group) -> torch.Tensor:
    """Member k sends member m its slice of dst_dim; received pieces concatenate along src_dim.

    Pieces go as flat runs of ``local`` with dst_dim moved first, so uneven sizes are exact."""
    i, j, axis = step.src_dim, step.dst_dim, step.axis
    before, after = step.before, step.after
    members = _member_coords(after.placement, axis, coord)
    send = local.movedim(j, 0).contiguous()
    row = _prod(send.shape[1:])
    send_splits = [(after.box(c)[j][1] - after.box(c)[j][0]) * row for c in members]
    mine = after.box(coord)
    recv_shapes = []
    for c in members:
        shape = list(box_shape(mine))
        shape[i] = before.box(c)[i][1] - before.box(c)[i][0]
        recv_shapes.append(shape)
    recv_splits = [_prod(s) for s in recv_shapes]
    recv = send.new_empty(sum(recv_splits))
    if before.numel():  # decided by the plan, so every member agrees
        dist.all_to_all_single(recv, send.reshape(-1), recv_splits, send_splits, group=group)
    parts = [p.view([s[j]] + s[:j] + s[j + 1:]).movedim(0, j)
             for p, s in zip(recv.split(recv_splits), recv_shapes)]
    return torch.cat(parts, dim=i)


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def _zero_fill(step: ZeroFill, local, coord) -> torch.Tensor:
    if isinstance(step.before.sbp[step.axis], Broadcast):
        return local if coord[step.axis] == 0 else torch.zeros_like(local)
    have, want = step.before.box(coord), step.after.box(coord)
    out = local.new_zeros(box_shape(want))
    out[relative(have, want)] = local
    return out


def _exchange(step: Exchange, local, rank: int) -> torch.Tensor:
    """Sends/recvs as one batch, then broadcasts in plan order; pieces land in a new tensor."""
    before, after = step.before, step.after
    for move in step.broadcasts:  # every rank creates every broadcast group, in order
        group_of_ranks(move.group)
    have = before.box(before.placement.coord_of(rank)) if rank in before.placement else None
    mine = after.placement.coord_of(rank)
    shape = after.local_shape_of_rank(rank)
    out = local.new_zeros(shape) if after.is_partial else local.new_empty(shape)
    want = after.box(mine) if mine is not None else None
    ops, landing = [], []
    for move in step.moves:
        if move.is_broadcast:
            continue
        if move.src == rank and move.is_local:
            out[relative(move.region, want)] = local[relative(move.region, have)]
        elif move.src == rank:
            ops.append(dist.P2POp(dist.isend, local[relative(move.region, have)].contiguous(), move.dsts[0]))
        elif move.dsts[0] == rank:
            buf = local.new_empty(box_shape(move.region))
            ops.append(dist.P2POp(dist.irecv, buf, move.src))
            landing.append((move.region, buf))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for region, buf in landing:
        out[relative(region, want)] = buf
    for move in step.broadcasts:
        if rank == move.src:
            dist.broadcast(local[relative(move.region, have)].contiguous(), src=move.src,
                           group=group_of_ranks(move.group))
        elif rank in move.dsts:
            buf = local.new_empty(box_shape(move.region))
            dist.broadcast(buf, src=move.src, group=group_of_ranks(move.group))
            out[relative(move.region, want)] = buf
    return out
