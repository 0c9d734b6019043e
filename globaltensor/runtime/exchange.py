"""An Exchange step (a change of placement, or pieces that cannot move by collectives alone).

Eager (:func:`exchange_eager`), an Exchange runs as a batch of isend/irecv and then broadcasts.
Under torch.compile (:func:`exchange_traced`) a traced graph has no point-to-point ops, so the
same moves become one ``all_to_all_single`` over the
whole world: every rank of the world runs every redistribution (SPMD), so every rank takes
part, with empty runs to and from the ranks it exchanges nothing with. A broadcast move sends
its region to each of its destinations. Each rank works out the same runs from the step alone:
to each peer, the regions in the order of the step's moves.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..layout import box_numel, box_shape, relative
from .groups import group_of_ranks, groups_frozen
from .pairwise import send_recv


def exchange_traced(step, local: torch.Tensor, rank: int, emit) -> torch.Tensor:
    """This rank's piece of ``step.after`` from its piece of ``step.before`` (traced: ``emit``
    is the traced emitter)."""
    before, after = step.before, step.after
    world = dist.get_world_size()
    have = before.box(before.placement.coord_of(rank)) if rank in before.placement else None
    mine = after.placement.coord_of(rank)
    shape = after.local_shape_of_rank(rank)
    out = local.new_zeros(shape) if after.is_partial or mine is None else local.new_empty(shape)
    want = after.box(mine) if mine is not None else None
    sends = [[] for _ in range(world)]   # per destination: the regions this rank sends it
    recvs = [[] for _ in range(world)]   # per source: the regions this rank receives from it
    for move in step.moves:
        for dst in move.dsts:
            if move.src == rank and dst == rank:
                out[relative(move.region, want)] = local[relative(move.region, have)]
            elif move.src == rank:
                sends[dst].append(move.region)
            elif dst == rank:
                recvs[move.src].append(move.region)
    send_splits = [sum(box_numel(r) for r in regions) for regions in sends]
    recv_splits = [sum(box_numel(r) for r in regions) for regions in recvs]
    send = _packed(local, have, sends)
    recv = emit.all_to_all(send, recv_splits, send_splits, None, _any_traffic(step))
    at = 0
    for regions in recvs:
        for region in regions:
            n = box_numel(region)
            out[relative(region, want)] = recv[at:at + n].view(box_shape(region))
            at += n
    return out


def _packed(local, have, sends) -> torch.Tensor:
    runs = [local[relative(region, have)].reshape(-1) for regions in sends for region in regions]
    return torch.cat(runs) if runs else local.new_empty(0)


def _any_traffic(step) -> bool:
    """Whether any move leaves its rank (the same answer on every rank)."""
    return any(dst != move.src for move in step.moves for dst in move.dsts)


def exchange_eager(step, local: torch.Tensor, rank: int, tag: int, emit) -> torch.Tensor:
    """Sends/recvs as one batch, then broadcasts in plan order (``emit``: the eager
    emitter); pieces land in a new tensor."""
    before, after = step.before, step.after
    broadcasts = step.broadcasts
    if groups_frozen():  # only some ranks run this (a pipeline's stage): no new groups
        broadcasts = ()
    for move in broadcasts:  # every rank creates every broadcast group, in order
        group_of_ranks(move.group)
    have = before.box(before.placement.coord_of(rank)) if rank in before.placement else None
    mine = after.placement.coord_of(rank)
    shape = after.local_shape_of_rank(rank)
    out = local.new_zeros(shape) if after.is_partial or mine is None else local.new_empty(shape)
    want = after.box(mine) if mine is not None else None
    ops, landing = [], []
    for move in step.moves:
        if move.is_broadcast and broadcasts:
            continue
        if move.src == rank and rank in move.dsts:
            out[relative(move.region, want)] = local[relative(move.region, have)]
        if move.src == rank:
            region = local[relative(move.region, have)].contiguous()
            ops += [(True, region, dst, tag) for dst in move.dsts if dst != rank]
        elif rank in move.dsts:
            buf = local.new_empty(box_shape(move.region))
            ops.append((False, buf, move.src, tag))
            landing.append((move.region, buf))
    send_recv(ops)
    for region, buf in landing:
        out[relative(region, want)] = buf
    for move in broadcasts:
        if rank == move.src:
            emit.broadcast(local[relative(move.region, have)].contiguous(), move.src,
                           group_of_ranks(move.group))
        elif rank in move.dsts:
            buf = local.new_empty(box_shape(move.region))
            emit.broadcast(buf, move.src, group_of_ranks(move.group))
            out[relative(move.region, want)] = buf
    return out
