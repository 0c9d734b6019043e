"""The reference executor: run a plan over every rank's local piece at once, in one process.

It is the oracle for tests (and for ``gt.explain``): each step does what its collective does,
group by group, using only the pieces of the ranks in that group::

    >>> layout = Layout(placement("cpu", [0, 1]), (split(0),), (4, 2))
    >>> locals = scatter(torch.arange(8.).reshape(4, 2), layout)   # [rank 0's rows, rank 1's]
    >>> target = layout.with_sbp(broadcast)
    >>> out = run(plan(layout, target), locals)
    >>> torch.equal(gather(out, target), torch.arange(8.).reshape(4, 2))
    True

``locals`` is a list indexed by global rank or a dict {rank: tensor}; ranks outside a placement
hold empty pieces of the right ndim. Pure: no torch.distributed, no rank.
"""
from __future__ import annotations

import torch

from ..errors import GlobalTensorError, ShapeMismatchError
from ..layout import Layout, box_shape, head_tail_order, relative
from .steps import (AllGather, AllReduce, AllToAll, Exchange, LocalSlice, Plan, ReduceScatter,
                    ZeroFill)
from ..sbp import Broadcast
from .reorder import Reorder, reorder_piece


def run(plan: Plan, locals):
    """Every rank's piece of ``plan.dst`` from every rank's piece of ``plan.src``."""
    pieces, as_list = _as_dict(locals)
    check_locals(pieces, plan.src)
    for step in plan.steps:
        pieces = _run_step(step, pieces)
    return [pieces[r] for r in range(len(pieces))] if as_list else pieces


def permuted(full: torch.Tensor, order, inverse: bool = False) -> torch.Tensor:
    """``full`` with each (dim, ranks) of a layout's ``order`` in the order its pieces hold it
    (head-tail), or back (``inverse``)."""
    for d, k in order:
        index = torch.tensor(head_tail_order(full.shape[d], k), dtype=torch.long,
                             device=full.device)
        if inverse:
            out = torch.empty_like(full)
            out.index_copy_(d, index, full)
            full = out
        else:
            full = full.index_select(d, index)
    return full


def _as_dict(locals):
    if isinstance(locals, dict):
        return dict(locals), False
    if isinstance(locals, (list, tuple)):
        return dict(enumerate(locals)), True
    raise GlobalTensorError(
        f"expected every rank's local tensor as a list (indexed by rank) or a dict "
        f"{{rank: tensor}}, found {type(locals).__name__}")


def check_locals(pieces: dict, layout: Layout) -> None:
    """Raise unless every rank of the placement is present with a piece of the right shape."""
    for rank in layout.placement.flat_ranks:
        if rank not in pieces:
            raise ShapeMismatchError(
                f"expected a local tensor for rank {rank} of {layout.placement!r}, found none; "
                f"pass one per rank (a list as long as the world)")
        want = layout.local_shape_of_rank(rank)
        if tuple(pieces[rank].shape) != want:
            raise ShapeMismatchError(
                f"expected rank {rank}'s piece of {layout!r} to have shape {list(want)}, found "
                f"{list(pieces[rank].shape)}")


def _empty_like(pieces: dict, ndim: int):
    t = next(iter(pieces.values()))
    return t.new_zeros((0,) * ndim)  # empty (a 0 for a scalar)


def _run_step(step, pieces: dict) -> dict:
    after = step.after
    out = {r: _empty_like(pieces, after.ndim) for r in pieces}
    match step:
        case AllGather() | ReduceScatter() | AllReduce() | AllToAll():
            for group in step.before.placement.groups_along(step.axis):
                out.update(_collective(step, [pieces[r] for r in group], group))
        case LocalSlice() | ZeroFill():
            for coord, rank in zip(after.placement.coords(), after.placement.flat_ranks):
                out[rank] = _local(step, pieces[rank], coord)
        case Exchange():
            out.update(_exchange(step, pieces))
        case Reorder():
            for rank in after.placement.flat_ranks:
                out[rank] = reorder_piece(step, pieces[rank])
        case _:
            raise GlobalTensorError(f"the simulator does not know the step {step!r}")
    return out


def _coord(layout: Layout, rank: int):
    return layout.placement.coord_of(rank)


def _collective(step, group_pieces: list, group: tuple) -> dict:
    """What each member of one group holds after the collective (from the members' pieces)."""
    before, after = step.before, step.after
    match step:
        case AllGather(dim=dim):
            whole = torch.cat(group_pieces, dim=dim)
            return {r: whole.clone() for r in group}
        case AllReduce():
            total = torch.stack(group_pieces).sum(0)
            return {r: total.clone() for r in group}
        case ReduceScatter():
            total = torch.stack(group_pieces).sum(0)
            return {r: total[relative(after.box(_coord(after, r)), before.box(_coord(before, r)))].clone()
                    for r in group}
        case AllToAll(src_dim=i):
            out = {}
            for r in group:
                want = after.box(_coord(after, r))
                parts = [p[_narrow_to(want, before.box(_coord(before, k)), step.dst_dim)]
                         for k, p in zip(group, group_pieces)]
                out[r] = torch.cat(parts, dim=i)
            return out
    raise GlobalTensorError(f"unknown collective step {step!r}")


def _narrow_to(want, have, dim: int) -> tuple[slice, ...]:
    """Slices of a piece holding ``have`` that keep only ``want``'s range of ``dim``."""
    lo, hi = want[dim]
    base = have[dim][0]
    return tuple(slice(lo - base, hi - base) if d == dim else slice(None) for d in range(len(have)))


def _local(step, piece: torch.Tensor, coord) -> torch.Tensor:
    before, after = step.before, step.after
    have, want = before.box(coord), after.box(coord)
    if isinstance(step, LocalSlice):
        return piece[relative(want, have)].clone()
    old = before.sbp[step.axis]
    if isinstance(old, Broadcast):
        return piece.clone() if coord[step.axis] == 0 else torch.zeros_like(piece)
    out = piece.new_zeros(box_shape(want))
    out[relative(have, want)] = piece
    return out


def _exchange(step: Exchange, pieces: dict) -> dict:
    before, after = step.before, step.after
    like = pieces[next(iter(pieces))]
    out = {r: like.new_zeros(after.local_shape_of_rank(r)) for r in after.placement.flat_ranks}
    filled = {r: 0 for r in out}
    for move in step.moves:
        part = pieces[move.src][relative(move.region, before.box(_coord(before, move.src)))]
        for dst in move.dsts:
            out[dst][relative(move.region, after.box(_coord(after, dst)))] = part
            filled[dst] += part.numel()
    for r, n in filled.items():
        if n != out[r].numel() and (n or not after.is_partial):
            raise GlobalTensorError(
                f"exchange left rank {r}'s piece incomplete ({n} of {out[r].numel()} elements); "
                f"this is a planner bug, please report it")
    return out


# --------------------------------------------------------------------------- test helpers


def scatter(full: torch.Tensor, layout: Layout, world_size: int | None = None,
            seed: int = 0) -> list:
    """Every rank's piece of ``full`` laid out as ``layout`` (a list indexed by global rank).

    Partial axes hold a random split of the value that sums back to it (small integers, so
    sums are exact in floating point too); ranks outside the placement hold empty pieces.
    """
    if tuple(full.shape) != layout.shape:
        raise ShapeMismatchError(
            f"expected a tensor of the layout's shape {list(layout.shape)}, found {list(full.shape)}")
    if layout.order:  # a head-tail split: the plain layout's pieces of the permuted tensor
        full, layout = permuted(full, layout.order), layout.plain()
    world = world_size or max(layout.placement.flat_ranks) + 1
    gen = torch.Generator().manual_seed(seed)
    out = [full.new_zeros((0,) * full.ndim) for _ in range(world)]
    shares: dict = {}
    for coord, rank in zip(layout.placement.coords(), layout.placement.flat_ranks):
        box = layout.box(coord)
        if box not in shares:
            shares[box] = _shares(full[tuple(slice(a, b) for a, b in box)], layout, gen)
        pcoord = tuple(coord[a] for a in layout.partial_axes)
        out[rank] = shares[box][_flat_index(pcoord, _partial_sizes(layout))].clone()
    return out


def _partial_sizes(layout: Layout) -> list[int]:
    return [layout.placement.shape[a] for a in layout.partial_axes]


def _shares(value: torch.Tensor, layout: Layout, gen) -> list:
    """One share of ``value`` per partial coordinate, summing to it: random small integers,
    except the first share, which makes up the difference."""
    n = _prod(_partial_sizes(layout))
    rest = [torch.randint(-4, 5, value.shape, generator=gen).to(value.dtype) for _ in range(n - 1)]
    return [value - sum(rest, torch.zeros_like(value))] + rest


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def _flat_index(coord, sizes) -> int:
    i = 0
    for c, s in zip(coord, sizes):
        i = i * s + c
    return i


def gather(locals, layout: Layout) -> torch.Tensor:
    """The logical value of every rank's pieces: boxes put in place, partial coordinates summed.

    Raises if pieces have the wrong shape or replicas (same box, same partial coordinate)
    disagree, so tests catch a broadcast axis that drifted.
    """
    pieces, _ = _as_dict(locals)
    check_locals(pieces, layout)
    if layout.order:
        return permuted(gather(pieces, layout.plain()), layout.order, inverse=True)
    first = pieces[layout.placement.flat_ranks[0]]
    totals: dict = {}
    seen: dict = {}
    for coord, rank in zip(layout.placement.coords(), layout.placement.flat_ranks):
        box, piece = layout.box(coord), pieces[rank]
        pcoord = tuple(coord[a] for a in layout.partial_axes)
        key = (box, pcoord)
        if key in seen:
            if not torch.equal(seen[key][1], piece):
                raise ShapeMismatchError(
                    f"expected rank {rank} to hold the same piece as rank {seen[key][0]} "
                    f"(box {list(box)} of {layout!r}), found different values")
            continue
        seen[key] = (rank, piece)
        total = totals.setdefault(pcoord, first.new_zeros(layout.shape))
        total[tuple(slice(a, b) for a, b in box)] = piece
    return sum(totals.values(), first.new_zeros(layout.shape)) if len(totals) > 1 \
        else next(iter(totals.values()))


__all__ = ["run", "scatter", "gather", "check_locals", "permuted"]
