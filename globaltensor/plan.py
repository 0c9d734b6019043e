"""Redistribution plans: how to turn one layout of a logical tensor into another.

``plan(src, dst)`` returns a :class:`Plan`, a tuple of frozen step values, each of which knows
the layout before and after it, so an executor runs a plan with no search of its own::

    >>> p = placement("cpu", ranks=[0, 1])
    >>> print(plan(Layout(p, (split(0),), (4, 5)), Layout(p, (broadcast,), (4, 5))).describe(4))
    (S(0),) -> (B,)  on placement('cpu', ranks=[0, 1])  shape [4, 5]
      1. all_gather      axis 0  dim 0          sends 40 B per rank
    total: 40 B per rank, 1 collective

Pure: no torch.distributed, no rank. Plans depend only on (src, dst) and are cached.
The search (Dijkstra over one-sbp-per-axis states, α-β cost) is described in docs/planner.md.
"""
from __future__ import annotations

import heapq
import itertools

from ._cache import memo
from .errors import GlobalTensorError
from .layout import Box, Layout, box_numel, intersect
from .sbp import Broadcast, PartialSum, Split, broadcast, format_sbp, partial_sum
from .steps import (AllGather, AllGatherV, AllReduce, AllToAll, Exchange, LocalSlice, Move, Plan,
                    ReduceScatter, Step, ZeroFill, coords_and_ranks, holds_full, offers_gatherv)

# --------------------------------------------------------------------------- axis-local steps


def _innermost(layout: Layout, axis: int, dim: int) -> bool:
    """No placement axis after ``axis`` splits ``dim`` (nested splits: axis 0 outermost).

    An axis of size 1 splits nothing, so it never gets in the way."""
    later = zip(layout.sbp[axis + 1:], layout.placement.shape[axis + 1:])
    return not any(isinstance(v, Split) and v.dim == dim and n > 1 for v, n in later)


def _local_step(before: Layout, axis: int, new) -> Step | None:
    """The one step that changes ``axis`` of ``before`` to ``new``, or None if no single step
    does it while keeping every other axis's pieces where they are."""
    old, sbp, b = before.sbp[axis], before.sbp, before
    after = Layout(before.placement, sbp[:axis] + (new,) + sbp[axis + 1:], before.shape)
    match old, new:
        case Split(), Broadcast() if _innermost(b, axis, old.dim):
            return AllGather(axis, old.dim, before, after)
        case Split(), Split() if _innermost(b, axis, old.dim) and _innermost(b, axis, new.dim):
            return AllToAll(axis, old.dim, new.dim, before, after)
        case Split(), PartialSum() if _innermost(b, axis, old.dim):
            return ZeroFill(axis, before, after)
        case Broadcast(), Split() if _innermost(b, axis, new.dim):
            return LocalSlice(axis, new.dim, before, after)
        case Broadcast(), PartialSum():
            return ZeroFill(axis, before, after)
        case PartialSum(), Broadcast():
            return AllReduce(axis, before, after)
        case PartialSum(), Split() if _innermost(b, axis, new.dim):
            return ReduceScatter(axis, new.dim, before, after)
    return None


def _values(ndim: int):
    return [Split(d) for d in range(ndim)] + [broadcast, partial_sum]


@memo(16384)
def _local_steps(layout: Layout) -> tuple[Step, ...]:
    out = []
    for axis, old in enumerate(layout.sbp):
        for new in _values(layout.ndim):
            if new != old:
                step = _local_step(layout, axis, new)
                if step is not None:
                    out.append(step)
                if isinstance(step, AllGather) and offers_gatherv(step):
                    out.append(AllGatherV(step.axis, step.dim, step.before, step.after))
    return tuple(out)


# --------------------------------------------------------------------------- exchanges


def _pick(holders, load, near: int) -> int:
    """The least loaded holder, then the nearest rank, then the lowest: deterministic."""
    return min(holders, key=lambda r: (load.get(r, 0), abs(r - near), r))


@memo(16384)
def exchange(before: Layout, after: Layout) -> Exchange:
    """Point-to-point moves that build every piece of ``after`` from the pieces of ``before``.

    ``before`` must be non-partial. A region that three or more ranks need, and more than
    hold it, is broadcast from one holder; any other is sent by the least loaded holder. On
    the partial axes of ``after``, one partial coordinate per box (the one whose ranks already
    hold most of it) gets the value and every other rank holds zeros.
    """
    if before.is_partial:
        raise GlobalTensorError(
            f"expected a non-partial source for a point-to-point exchange, found "
            f"{format_sbp(before.sbp)}; reduce its partial axes first")
    holders: dict[Box, list[int]] = {}
    for coord, rank in coords_and_ranks(before):
        box = before.box(coord)
        if box_numel(box):
            holders.setdefault(box, []).append(rank)
    owners = _owners(before, after)
    moves, needs = [], {}
    for coord, rank in coords_and_ranks(after):
        target = after.box(coord)
        if not box_numel(target) or owners.get(_split_key(after, coord), ()) != _partial_key(after, coord):
            continue
        for box, ranks in holders.items():
            region = intersect(box, target)
            if region is None:
                continue
            if rank in ranks:
                moves.append(Move(rank, (rank,), region))
            else:
                needs.setdefault((box, region), []).append(rank)
    return Exchange(tuple(moves) + _assign(holders, needs), before, after)


def _split_key(layout: Layout, coord) -> tuple[int, ...]:
    return tuple(c for c, v in zip(coord, layout.sbp) if isinstance(v, Split))


def _partial_key(layout: Layout, coord) -> tuple[int, ...]:
    return tuple(c for c, v in zip(coord, layout.sbp) if isinstance(v, PartialSum))


def _owners(before: Layout, after: Layout) -> dict:
    """For each split coordinate of ``after``, the partial coordinate that holds the value:
    the one whose ranks already hold the most of their boxes, then the lowest."""
    if not after.is_partial:
        return {}
    held: dict = {}
    for coord, rank in coords_and_ranks(after):
        key = (_split_key(after, coord), _partial_key(after, coord))
        mine = before.placement.coord_of(rank)
        part = intersect(before.box(mine), after.box(coord)) if mine is not None else None
        held[key] = held.get(key, 0) + (box_numel(part) if part else 0)
    best: dict = {}
    for (skey, pkey), amount in held.items():
        if skey not in best or (-amount, pkey) < (-best[skey][1], best[skey][0]):
            best[skey] = (pkey, amount)
    return {skey: pkey for skey, (pkey, _) in best.items()}


def _assign(holders, needs) -> tuple[Move, ...]:
    load: dict[int, int] = {}
    moves = []
    for (box, region), dsts in needs.items():
        ranks, size = holders[box], box_numel(region)
        if len(dsts) >= 3 and len(dsts) > len(ranks):
            groups = [tuple(dsts)]
        else:
            groups = [(d,) for d in dsts]
        for group in groups:
            src = _pick(ranks, load, group[0])
            load[src] = load.get(src, 0) + size
            moves.append(Move(src, group, region))
    return tuple(moves)


def _cores(dst: Layout) -> list[Layout]:
    """Non-partial layouts on dst's placement from which zero-fills reach ``dst``."""
    if not dst.is_partial:
        return [dst]
    options = [[v] if not isinstance(v, PartialSum) else [broadcast] + [Split(d) for d in range(dst.ndim)]
               for v in dst.sbp]
    return [dst.with_sbp(c) for c in itertools.product(*options)]


# --------------------------------------------------------------------------- the search


def _check(src: Layout, dst: Layout) -> None:
    if not isinstance(src, Layout) or not isinstance(dst, Layout):
        raise GlobalTensorError(
            f"plan(src, dst) expects two Layouts, found {type(src).__name__} and "
            f"{type(dst).__name__}")
    if src.shape != dst.shape:
        raise GlobalTensorError(
            f"expected source and target layouts of one logical shape, found {list(src.shape)} "
            f"and {list(dst.shape)}; redistribution never changes the shape (reshape first)")
    if src.placement.type != dst.placement.type:
        raise GlobalTensorError(
            f"expected source and target placements of one device type, found "
            f"{src.placement.type!r} and {dst.placement.type!r}; move the local pieces with "
            f".to(device) first, then redistribute")


@memo(8192)
def plan(src: Layout, dst: Layout) -> Plan:
    """The cheapest plan from ``src`` to ``dst`` (pure, cached, the same on every rank)."""
    _check(src, dst)
    if src == dst:
        return Plan(src, dst, ())
    steps = _search(src, dst, avoid_full=not holds_full(dst))
    if steps is None:
        steps = _search(src, dst, avoid_full=False)
    if steps is None:  # unreachable: all-B is always a way through
        raise GlobalTensorError(f"found no plan from {src!r} to {dst!r}; please report this")
    return Plan(src, dst, steps)


def _edges(node: Layout, src: Layout, dst: Layout, cores: list[Layout]):
    yield from _local_steps(node)
    if node.placement == src.placement and not node.is_partial:
        for core in [dst] + cores if dst.is_partial else cores:
            if core != node:
                yield exchange(node, core)


def _search(src: Layout, dst: Layout, avoid_full: bool):
    """Dijkstra from ``src``; with ``avoid_full``, no intermediate layout holds the whole
    tensor on one rank. Steps only ever stay on src's or dst's placement."""
    cores = _cores(dst)
    best = {src: 0.0}
    heap = [(0.0, 0, src, ())]
    counter = itertools.count(1)
    while heap:
        cost, _, node, path = heapq.heappop(heap)
        if node == dst:
            return path
        if cost > best.get(node, float("inf")):
            continue
        for step in _edges(node, src, dst, cores):
            nxt = step.after
            if nxt.placement != dst.placement and nxt.placement != src.placement:
                continue
            if avoid_full and nxt != dst and holds_full(nxt):
                continue
            new = cost + step.cost()
            if new < best.get(nxt, float("inf")) - 1e-15:
                best[nxt] = new
                heapq.heappush(heap, (new, next(counter), nxt, path + (step,)))
    return None


__all__ = ["exchange", "plan"]
