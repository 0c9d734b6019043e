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
import math

from ._cache import memo
from .errors import GlobalTensorError
from .layout import Box, Layout, box_numel, boxes, intersect, overlap_numel
from .sbp import Broadcast, PartialSum, Split, broadcast, format_sbp, partial_sum
from .steps import (ALPHA, BETA, COPY, MEMORY, SEARCH_ITEMSIZE, AllGather, AllGatherV, AllReduce,
                    AllToAll, Exchange, LocalSlice, Move, Plan, ReduceScatter, Step, ZeroFill,
                    coords_and_ranks, holds_full, offers_gatherv)

# --------------------------------------------------------------------------- axis-local steps


def _innermost(layout: Layout, axis: int, dim: int) -> bool:
    """No placement axis after ``axis`` splits ``dim`` (nested splits: axis 0 outermost).

    An axis of size 1 splits nothing, so it never gets in the way."""
    later = zip(layout.sbp[axis + 1:], layout.placement.shape[axis + 1:])
    return not any(isinstance(v, Split) and v.dim == dim and n > 1 for v, n in later)


def _local_step(before: Layout, axis: int, new) -> Step | None:
    """The one step that changes ``axis`` of ``before`` to ``new``, or None if no single step
    does it while keeping every other axis's pieces where they are."""
    old, b = before.sbp[axis], before
    after = before.with_axis(axis, new)
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


@memo(64)
def _values(ndim: int) -> tuple:
    return tuple(Split(d) for d in range(ndim)) + (broadcast, partial_sum)


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
    ranges, order = _dim_ranges(before), {box: i for i, box in enumerate(holders)}
    moves, needs = [], {}
    for coord, rank in coords_and_ranks(after):
        target = after.box(coord)
        if not box_numel(target) or owners.get(_split_key(after, coord), ()) != _partial_key(after, coord):
            continue
        for box in _overlapping(order, ranges, target):
            ranks, region = holders[box], intersect(box, target)
            if rank in ranks:
                moves.append(Move(rank, (rank,), region))
            else:
                needs.setdefault((box, region), []).append(rank)
    return Exchange(tuple(moves) + _assign(holders, needs), before, after)


def _overlapping(order: dict, ranges, target: Box) -> list[Box]:
    """The boxes of ``order`` (box -> its place) that overlap ``target``, in that order: each is
    a product of one of ``ranges`` per dim, so only the overlapping ranges are combined."""
    near = [[r for r in rs if r[0] < r[1] and r[0] < hi and lo < r[1]] for rs, (lo, hi) in zip(ranges, target)]
    found = [box for box in itertools.product(*near) if box in order]
    if len(found) > 1:
        found.sort(key=order.__getitem__)
    return found


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


# --------------------------------------------------------------------------- lower bounds


class _Bound:
    """Admissible lower bounds on the cost of reaching ``dst`` (docs/planner.md, "The search").

    ``self(node)`` bounds every route from ``node``: α per collective the route cannot avoid, β
    per byte it must send, the memory of the steps it must take. Each term is a bound on its own
    part of the cost for *every* route (a minimum over the two kinds of route: axis-local steps
    only, or reductions then one exchange), so their sum is one too."""

    __slots__ = ("src", "dst", "itemsize", "union", "memory", "_memo")

    def __init__(self, src: Layout, dst: Layout, itemsize: int = SEARCH_ITEMSIZE):
        self.src, self.dst, self.itemsize = src, dst, itemsize
        self.union = len(set(src.placement.flat_ranks) | set(dst.placement.flat_ranks))
        # every step writes at least the smallest piece any layout of the tensor can have
        smallest = dst.numel() / max(src.placement.size, dst.placement.size)
        self.memory = MEMORY * itemsize * smallest
        self._memo: dict = {}

    def __call__(self, node: Layout) -> float:
        h = self._memo.get(node)
        if h is None:
            h = self._memo[node] = self._bound(node) * (1 - 1e-9)  # never above, rounding aside
        return h

    def _bound(self, node: Layout) -> float:
        dst, sizes = self.dst, node.placement.shape
        partial = [a for a, v in enumerate(node.sbp) if isinstance(v, PartialSum) and sizes[a] > 1]
        inf = math.inf
        lat_local = steps_local = inf
        keep = 1  # product of the partial axes a route may keep (dst is partial there too)
        if node.placement == dst.placement:
            lat_local, steps_local = 0, 0
            for a, (v, w) in enumerate(zip(node.sbp, dst.sbp)):
                if sizes[a] == 1 or v == w:
                    continue
                steps_local += 1
                if not isinstance(v, Broadcast) and not isinstance(w, PartialSum):
                    lat_local += 1  # S -> B, S(i) -> S(j), P -> B / S: a collective on this axis
            keep = math.prod(sizes[a] for a in partial if isinstance(dst.sbp[a], PartialSum))
        lat_exchange = len(partial) + 1 if node.placement == self.src.placement else inf
        latency = min(lat_local, lat_exchange)
        steps = min(steps_local, lat_exchange)
        return (ALPHA * latency + BETA * self.itemsize * self._elements(node, partial, keep)
                + self.memory * steps)

    def _elements(self, node: Layout, partial, keep: int) -> float:
        """Elements the busiest rank must send, summed over the steps of any route.

        Per step, the ranks receive no more than all of them send, so the steps send at least
        (elements some rank must receive, summed) / (ranks): see :func:`_lacking`. Partial
        axes of ``node`` must also each be reduced (unless dst keeps them), and a reduction
        along an axis of n ranks sends (n - 1) times a piece no smaller than numel / N times
        the product of the axes still partial then; summed in any order, numel (prod - keep) / N.
        The larger of the two bounds holds."""
        ranks = node.placement.size if node.placement == self.dst.placement else self.union
        lacking = _lacking(node, self.dst) / ranks
        if not partial:
            return lacking
        sizes = node.placement.shape
        reduced = node.numel() * (math.prod(sizes[a] for a in partial) - keep) / node.placement.size
        return max(lacking, reduced)

    def exchange(self, target: Layout) -> float:
        """A bound on any exchange into ``target``: one message, and writing its pieces."""
        piece = target.max_local_numel() * self.itemsize
        return ALPHA + (MEMORY + COPY) * piece

    def exchange_from(self, node: Layout, target: Layout) -> float:
        """A bound on ``exchange(node, target)``: the elements missing from each target piece
        are received, so the busiest of the ranks sends at least their sum over the ranks; a
        rank receives one message per other piece of ``node`` its target piece overlaps."""
        missing, messages = _missing(node, target)
        sent = missing / self.union
        return (self.exchange(target) + ALPHA * (messages - 1)
                + (BETA + COPY) * self.itemsize * sent) * (1 - 1e-9)


@memo(16384)
def _lacking(node: Layout, dst: Layout) -> int:
    """Elements, summed over dst's groups of summands, that no member can make from what it
    holds in ``node``; each must reach the group in at least one received element.

    A group is the ranks of dst that share their coordinates on every non-partial axis (one
    rank for a non-partial dst): their pieces add up to the group's box. The group can make an
    element without receiving anything only if its members hold every summand of it in
    ``node`` (one summand for a non-partial node). On one placement, that needs every partial
    axis of ``node`` to be partial in dst too; then the members holding each summand hold the
    same boxes, so those of the first summand tell."""
    same = node.placement == dst.placement
    partial = tuple(a for a, (v, n) in enumerate(zip(node.sbp, node.placement.shape))
                    if isinstance(v, PartialSum) and n > 1)
    if partial and not same:
        return _lacking_anywhere(node, dst)
    groups, everything = _groups(dst, node.placement, partial)
    if partial and any(not isinstance(dst.sbp[a], PartialSum) for a in partial):
        return everything  # each group's members hold one summand
    pieces = boxes(node)
    total = 0
    for box, size, members in groups:
        if len(members) == 1:
            total += size - overlap_numel(pieces[members[0]], box)
        else:  # distinct pieces of a non-partial layout are disjoint
            total += size - sum(overlap_numel(p, box) for p in {pieces[m] for m in members})
    return total


@memo(1024)
def _groups(dst: Layout, where, first_of=()) -> tuple[list, int]:
    """dst's groups of summands (see :func:`_lacking`): per group its box, the box's numel and
    the coordinates its members have on placement ``where`` (members outside it hold nothing,
    and only those at coordinate 0 of the axes ``first_of`` count); and the sum of the boxes'
    numels."""
    found: dict = {}
    for coord, rank in coords_and_ranks(dst):
        key = tuple(c for c, v in zip(coord, dst.sbp) if not isinstance(v, PartialSum))
        box = dst.box(coord)
        entry = found.setdefault(key, (box, box_numel(box), []))
        mine = where.coord_of(rank)
        if mine is not None and not any(mine[a] for a in first_of):
            entry[2].append(mine)
    groups = [g for g in found.values() if g[1]]
    return groups, sum(size for _, size, _ in groups)


def _lacking_anywhere(node: Layout, dst: Layout) -> int:
    """:func:`_lacking` for a partial ``node`` on another placement than dst: per group, the
    elements inside the pieces of every summand its members hold."""
    groups, _ = _groups(dst, node.placement)
    tokens = math.prod(n for n, v in zip(node.placement.shape, node.sbp) if isinstance(v, PartialSum))
    total = 0
    for box, size, members in groups:
        held: dict = {}  # per summand: the distinct (so disjoint) parts of box members hold
        for mine in members:
            part = intersect(node.box(mine), box)
            if part:
                token = tuple(c for c, v in zip(mine, node.sbp) if isinstance(v, PartialSum))
                held.setdefault(token, set()).add(part)
        whole = []
        if len(held) == tokens:
            for parts in held.values():
                whole = list(parts) if not whole else [
                    x for a in whole for b in parts if (x := intersect(a, b)) is not None]
        total += size - sum(box_numel(b) for b in whole)
    return total


@memo(16384)
def _missing(node: Layout, target: Layout) -> tuple[int, int]:
    """For an exchange from non-partial ``node``: the elements the ranks of ``target`` receive,
    summed, and the most messages one of them receives (1 for a partial target, whose owners
    are not known here). A partial target fills one partial coordinate per box: only the
    cheapest coordinate of each box counts."""
    place = node.placement
    ranges = _dim_ranges(node)
    groups: dict = {}
    messages = 1
    for coord, rank in coords_and_ranks(target):
        box = target.box(coord)
        missing = box_numel(box)
        mine = place.coord_of(rank)
        own = overlap_numel(node.box(mine), box) if mine is not None and missing else 0
        missing -= own
        if missing and not target.is_partial:
            others = math.prod(sum(1 for lo, hi in rs if lo < hi and lo < b and a < hi)
                               for rs, (a, b) in zip(ranges, box)) - (own > 0)
            messages = max(messages, others)
        key = (_split_key(target, coord), _partial_key(target, coord))
        groups[key] = groups.get(key, 0) + missing
    if not target.is_partial:
        return sum(groups.values()), messages
    least: dict = {}
    for (skey, _), missing in groups.items():
        least[skey] = min(least.get(skey, missing), missing)
    return sum(least.values()), messages


@memo(16384)
def _dim_ranges(layout: Layout) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per tensor dim, the distinct ranges the pieces of ``layout`` cover."""
    return tuple(tuple(sorted({b[d] for b in boxes(layout).values()})) for d in range(layout.ndim))


@memo(16384)
def lower_bound(src: Layout, dst: Layout, itemsize: int = SEARCH_ITEMSIZE) -> float:
    """A lower bound on ``plan(src, dst).cost(itemsize)``, without searching (microseconds to
    a few tens of them). The signature choice prunes with it."""
    if src == dst:
        return 0.0
    return _Bound(src, dst, itemsize)(src)


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
    steps = _search(src, dst)
    if steps is None:  # unreachable: all-B is always a way through
        raise GlobalTensorError(f"found no plan from {src!r} to {dst!r}; please report this")
    return Plan(src, dst, steps)


# the kinds of entry in the search's queue: a layout reached (its key with the bound from it,
# or with one inherited from the step before, not yet worked out), an exchange costed only by
# the bound on any exchange into its target, one costed by the bound from its source
_NODE, _GUESSED, _EXCHANGE, _EXCHANGE_FROM = 0, 1, 2, 3


def _search(src: Layout, dst: Layout):
    """A* from ``src`` over (layout, full) states: ``full`` marks routes through an intermediate
    layout in which a rank holds the whole tensor (allowed only when ``dst`` has one). The queue
    orders by (full, cost so far + lower bound), so a route with a full copy is only taken once
    no other exists: the two Dijkstra passes of the reference in one search.

    Work is deferred until an entry comes first: a layout is queued with the bound its
    predecessor implies (the predecessor's bound less the step's cost) and gets its own bound
    when it comes first; an exchange is queued with a bound and built only when it comes first
    again. Steps only ever stay on src's or dst's placement."""
    guard = not holds_full(dst)
    bound = _Bound(src, dst)
    targets = [dst] + _cores(dst) if dst.is_partial else [dst]
    best, lengths = {(src, False): 0.0}, {(src, False): 0}
    heap = [(False, bound(src), 0, 0, _NODE, 0.0, src, (), None)]
    counter = itertools.count(1)

    def reach(full, node, cost, path, inherited):
        full = full or (guard and node != dst and holds_full(node))
        known = best.get((node, full), math.inf)
        # ties (within rounding) go to the shorter route
        if cost < known - 1e-15 or (cost <= known + 1e-15 and len(path) < lengths[node, full]):
            best[node, full], lengths[node, full] = cost, len(path)
            heapq.heappush(heap, (full, cost + max(inherited, 0.0), len(path), next(counter), _GUESSED,
                                  cost, node, path, None))

    while heap:
        entry = heapq.heappop(heap)
        full, f, _, _, kind, cost, node, path, target = entry
        if kind <= _GUESSED:
            if cost > best[node, full] or len(path) > lengths[node, full]:
                continue  # a cheaper or shorter route reached it since
            if kind == _GUESSED:
                h = bound(node)
                if cost + h > f:
                    heapq.heappush(heap, (full, cost + h, entry[2], entry[3], _NODE) + entry[5:])
                    continue
            if node == dst:
                return path
            h = bound(node)
            for step in _local_steps(node):
                c = step.cost()
                reach(full, step.after, cost + c, path + (step,), h - c)
            if node.placement == src.placement and not node.is_partial:
                for t in targets:
                    if t != node:
                        key = cost + bound.exchange(t) + bound(t)
                        heapq.heappush(heap, (full, key, len(path) + 1, next(counter), _EXCHANGE, cost,
                                              node, path, t))
        elif kind == _EXCHANGE:
            f2 = cost + bound.exchange_from(node, target) + bound(target)
            heapq.heappush(heap, (full, max(f, f2), len(path) + 1, next(counter), _EXCHANGE_FROM, cost,
                                  node, path, target))
        else:
            step = exchange(node, target)
            c = step.cost()
            reach(full, target, cost + c, path + (step,), f - cost - c)
    return None


# --------------------------------------------------------------------------- the reference


def reference_plan(src: Layout, dst: Layout) -> Plan:
    """The exhaustive search this planner replaced (issue 14), kept as the test oracle of
    optimality: Dijkstra over every layout and every exchange edge, first avoiding full
    intermediate copies, then, if that finds nothing, again without the rule. Uncached; slow
    on 3-D grids and beyond."""
    _check(src, dst)
    if src == dst:
        return Plan(src, dst, ())
    steps = _dijkstra(src, dst, avoid_full=not holds_full(dst))
    if steps is None:
        steps = _dijkstra(src, dst, avoid_full=False)
    return Plan(src, dst, steps)


def _edges(node: Layout, src: Layout, dst: Layout, cores: list[Layout]):
    yield from _local_steps(node)
    if node.placement == src.placement and not node.is_partial:
        for core in [dst] + cores if dst.is_partial else cores:
            if core != node:
                yield exchange(node, core)


def _dijkstra(src: Layout, dst: Layout, avoid_full: bool):
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


__all__ = ["exchange", "lower_bound", "plan", "reference_plan"]
