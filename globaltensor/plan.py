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
import threading

from ._cache import Bounded, memo
from .errors import GlobalTensorError
from .layout import (Box, Layout, _trusted, box_numel, boxes, grid_coords, intersect, overlap_numel,
                     split_sizes)
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


# --------------------------------------------------------------------------- the search's space
# The search works on the layouts of one (placement, shape) written as tuples of int codes, one
# per placement axis: S(d) -> d, B -> -1, P -> -2. Steps, their costs and the bounds come from
# per-dim facts (the lengths and ranges of nested pieces), not from a walk over every box, and
# Step and Layout values are built only for the plan returned. A step's cost here is its
# Step.cost() to the bit (tests/core/test_plan.py compares them on every step of many layouts).

_B, _P = -1, -2
_GATHER, _GATHERV, _ALL_TO_ALL, _ZERO_FILL, _SLICE, _ALL_REDUCE, _REDUCE_SCATTER = range(7)


def code(v) -> int:
    """An sbp value as the search's int code: S(d) is d, B is -1, P is -2 (see :class:`_Space`)."""
    return v.dim if isinstance(v, Split) else (_B if isinstance(v, Broadcast) else _P)


@memo(4096)
def _ranges(length: int, ns: tuple) -> tuple:
    """The [lo, hi) ranges of a dim of ``length`` split in turn into ``ns`` pieces (nested, the
    first split outermost), in mixed-radix order of the coordinates (the last split fastest)."""
    out = [(0, length)]
    for n in ns:
        cut = []
        for lo, hi in out:
            for size in split_sizes(hi - lo, n):
                cut.append((lo, lo + size))
                lo += size
        out = cut
    return tuple(out)


@memo(4096)
def _lengths(length: int, ns: tuple) -> tuple:
    return tuple(hi - lo for lo, hi in _ranges(length, ns))


@memo(4096)
def _all_to_all_factor(length_i: int, outer_i: tuple, length_j: int, outer_j: tuple, n: int) -> int:
    """The most elements of dims (i, j) a rank sends in S(i) -> S(j) along an axis of ``n``:
    its piece of i times the part of its parent range of j it gives away, at the worst
    coordinate (``outer_*``: the sizes of the earlier axes splitting each dim)."""
    pieces, parents = _lengths(length_i, outer_i + (n,)), _lengths(length_j, outer_j)
    return max(max(pieces[c::n]) * max(p - split_sizes(p, n)[c] for p in parents) for c in range(n))


@memo(4096)
def _overlaps(length: int, mine: tuple, theirs: tuple) -> tuple:
    """The ranges of a dim of ``length`` split into ``mine`` and into ``theirs`` (see
    :func:`_ranges`), and per range of theirs, how many non-empty ranges of mine it overlaps."""
    mine_ranges, their_ranges = _ranges(length, mine), _ranges(length, theirs)
    distinct = {r for r in mine_ranges if r[0] < r[1]}
    return mine_ranges, their_ranges, tuple(sum(1 for lo, hi in distinct if lo < b and a < hi)
                                            for a, b in their_ranges)


@memo(4096)
def _most_overlaps(length: int, mine: tuple, theirs: tuple) -> int:
    """The most non-empty ranges of a split into ``mine`` that one range of a split into
    ``theirs`` overlaps (see :func:`_ranges`)."""
    ranges = {r for r in _ranges(length, mine) if r[0] < r[1]}
    return max(sum(1 for lo, hi in ranges if lo < b and a < hi) for a, b in _ranges(length, theirs))


class _Space:
    """The layouts of one tensor shape on one placement, as code tuples, with what the search
    asks of them: the largest piece, the axis-local steps and their costs, the elements a
    target lacks. Answers are kept (a space is cached per placement and shape, so the searches
    of a signature choice share them)."""

    __slots__ = ("placement", "shape", "mesh", "numel", "cpu", "values", "order", "_max", "_steps",
                 "_layouts", "_lacking", "_splits",
                 "_missing", "_rank_tables", "_groups", "_group_held", "_three", "_reduced", "_one", "_two", "_overlap_factors",
                 "_sizes")

    def __init__(self, placement, shape):
        self.placement, self.shape, self.mesh = placement, shape, placement.shape
        self.numel = math.prod(shape)
        self.cpu = placement.type == "cpu"
        self.values = tuple(Split(d) for d in range(len(shape))) + (partial_sum, broadcast)
        self.order = tuple(range(len(shape))) + (_B, _P)  # the order of _values: S(0).., B, P
        self._max, self._steps, self._layouts, self._lacking, self._splits = {}, {}, {}, {}, {}
        self._missing, self._rank_tables, self._groups, self._group_held = {}, {}, {}, {}
        self._three, self._reduced, self._one, self._two, self._overlap_factors = {}, {}, {}, {}, {}
        self._sizes = {}

    def codes(self, layout: Layout) -> tuple:
        return tuple(code(v) for v in layout.sbp)

    def layout(self, codes: tuple) -> Layout:
        found = self._layouts.get(codes)
        if found is None:
            values = self.values
            found = self._layouts[codes] = _trusted(self.placement, tuple(values[c] for c in codes),
                                                    self.shape)
        return found

    def max_local(self, codes: tuple) -> int:
        """Layout.max_local_numel: the product over dims of the longest nested range."""
        found = self._max.get(codes)
        if found is None:
            lengths = list(self.shape)
            for v, n in zip(codes, self.mesh):
                if v >= 0:
                    lengths[v] = -(-lengths[v] // n)
            found = 1
            for length in lengths:
                found *= length
            self._max[codes] = found
        return found

    def holds_full(self, codes: tuple) -> bool:
        return self.numel > 0 and self.max_local(codes) == self.numel

    def splits(self, codes: tuple, dim: int) -> tuple:
        """The axes (of size > 1) splitting ``dim``, outermost first."""
        return self.split_axes(codes)[dim]

    def even(self, codes: tuple, axis: int, dim: int, last_short: bool = False) -> bool:
        """steps._even: every piece has one length of ``dim`` (with ``last_short``, every piece
        but those at the last coordinate of ``axis``)."""
        mesh = self.mesh
        axes = self.splits(codes, dim)
        lengths = _lengths(self.shape[dim], tuple(mesh[a] for a in axes))
        if last_short:
            n = mesh[axis]
            if n == 1:
                return True  # every coordinate is the last
            if axis in axes:
                stride = math.prod(mesh[a] for a in axes[axes.index(axis) + 1:])
                lengths = [x for i, x in enumerate(lengths) if (i // stride) % n != n - 1]
        return len(set(lengths)) <= 1

    def _all_to_all_sent(self, codes: tuple, axis: int, i: int, j: int) -> int:
        """steps._all_to_all_sent: other dims' ranges are the same before and after and depend
        on other axes, so the worst coordinate is the worst of each, multiplied."""
        mesh, shape = self.mesh, self.shape
        lengths = list(shape)
        for v, n in zip(codes, mesh):
            if v >= 0:
                lengths[v] = -(-lengths[v] // n)
        others = 1
        for d, length in enumerate(lengths):
            if d != i and d != j:
                others *= length
        outer_i = tuple(mesh[a] for a in self.splits(codes, i) if a != axis)
        outer_j = tuple(mesh[a] for a in self.splits(codes, j))
        return others * _all_to_all_factor(shape[i], outer_i, shape[j], outer_j, mesh[axis])

    def steps(self, codes: tuple) -> tuple:
        """(cost, axis, new code, kind, codes after) of every axis-local step from ``codes``,
        in the order of :func:`_local_steps` (an exact gather after the padded one)."""
        found = self._steps.get(codes)
        if found is not None:
            return found
        mesh, out = self.mesh, []
        for axis, old in enumerate(codes):
            later = _later_splits(codes, mesh, axis)
            for new in self.order:
                if new == old:
                    continue
                kind = _kind(old, new, later)
                if kind is None:
                    continue
                after = codes[:axis] + (new,) + codes[axis + 1:]
                out.append((self._cost(codes, after, axis, old, new, kind), axis, new, kind, after))
                if kind == _GATHER and self.cpu and not self.even(codes, axis, old):
                    out.append((self._cost(codes, after, axis, old, new, _GATHERV), axis, new,
                                _GATHERV, after))
        found = self._steps[codes] = tuple(out)
        return found

    def _cost(self, codes, after, axis, old, new, kind) -> float:
        """Step.cost(SEARCH_ITEMSIZE) of the step, the same expression term by term."""
        n = self.mesh[axis]
        if n == 1:
            return 0.0
        before_max, after_max = self.max_local(codes), self.max_local(after)
        latency, sent, copied = 1, 0, 0
        if kind == _GATHER:
            sent = (n - 1) * before_max
            fits = old == 0 and self.even(codes, axis, old, last_short=True)
            copied = (0 if self.even(codes, axis, old) else before_max) + (0 if fits else after_max)
        elif kind == _GATHERV:
            sent = (n - 1) * before_max
            copied = 0 if old == 0 else after_max
        elif kind == _ALL_TO_ALL:
            sent = self._all_to_all_sent(codes, axis, old, new)
            copied = (before_max if new else 0) + (after_max if old else 0)
        elif kind == _ALL_REDUCE:
            sent = -(-2 * (n - 1) * before_max // n)
        elif kind == _REDUCE_SCATTER:
            sent = (n - 1) * after_max
            copied = 0 if new == 0 and self.even(after, axis, new) else before_max
        else:
            latency = 0
        size = SEARCH_ITEMSIZE
        return ALPHA * latency + BETA * (sent * size) + MEMORY * after_max * size + COPY * copied * size

    def step(self, codes, axis, new, kind, after) -> Step:
        """The Step value of a step found by :meth:`steps`."""
        before, then, old = self.layout(codes), self.layout(after), codes[axis]
        if kind in (_GATHER, _GATHERV):
            return (AllGather if kind == _GATHER else AllGatherV)(axis, old, before, then)
        if kind == _ALL_TO_ALL:
            return AllToAll(axis, old, new, before, then)
        if kind == _SLICE:
            return LocalSlice(axis, new, before, then)
        if kind == _REDUCE_SCATTER:
            return ReduceScatter(axis, new, before, then)
        return (ZeroFill if kind == _ZERO_FILL else AllReduce)(axis, before, then)

    def lacking(self, codes: tuple, dst: tuple) -> int:
        """:func:`_lacking` for two layouts of this space."""
        key = (codes, dst)
        found = self._lacking.get(key)
        if found is None:
            found = self._lacking[key] = self._count_lacking(codes, dst)
        return found

    def _count_lacking(self, c: tuple, t: tuple) -> int:
        """Summed over dst's groups of summands: the group's box less what its members hold of
        it. Σ |box| is numel times the replicas (B axes) of ``t``. What members hold is a sum
        over coordinates (at 0 on the axes where t is P and c is P or B: the first summand, one
        copy of each piece) of a product over dims of the overlap of c's and t's ranges; each
        dim's overlap depends only on the axes splitting it, so the sum factors into
        independent groups of axes (most often one dim each)."""
        mesh = self.mesh
        everything = self.numel
        for w, n in zip(t, mesh):
            if w == _B:
                everything *= n
        if c == t:
            return 0
        if any(v == _P and n > 1 and w != _P for v, w, n in zip(c, t, mesh)):
            return everything  # each group's members hold one summand
        held = 1
        for v, w, n in zip(c, t, mesh):
            if v == _B and w == _B:
                held *= n  # replicas that hold the same pieces in both
        pending = []
        for length, mine, theirs in zip(self.shape, self.split_axes(c), self.split_axes(t)):
            if mine == theirs:
                held *= length  # the same pieces on both sides: they cover the dim once
            else:
                pending.append((length, mine, theirs))
        groups = self._group_held
        while pending and held:
            group = (pending.pop(),)
            axes = set(group[0][1] + group[0][2])
            grown = bool(pending)
            while grown:  # dims linked by an axis that splits one in c and another in t
                grown = False
                for entry in pending:
                    if not axes.isdisjoint(entry[1]) or not axes.isdisjoint(entry[2]):
                        axes.update(entry[1] + entry[2])
                        group += (entry,)
                        pending.remove(entry)
                        grown = True
                        break
            if len(group) == 1 and _nests(*group[0][1:]):
                held *= group[0][0]  # one dim whose pieces in one layout are each cut into
                continue             # pieces of the other: each meets them once in all
            found = groups.get(group)
            if found is None:
                found = groups[group] = _held(*self._canonical(sorted(axes), group))
            held *= found
        return everything - held

    def missing(self, c: tuple, t: tuple) -> tuple[int, int, float]:
        """:func:`_missing` for two layouts of this space, coordinate by coordinate, from
        per-dim tables of ranges (only the dims either layout splits)."""
        key = (c, t)
        found = self._missing.get(key)
        if found is None:
            found = self._missing[key] = self._count_missing(c, t)
        return found

    def receives_two(self, c: tuple, t: tuple) -> bool:
        """Whether some rank's piece of non-partial ``t`` overlaps two or more pieces of
        non-partial ``c`` it does not hold (the messages it receives in an exchange from ``c``:
        :meth:`missing`'s, without the elements)."""
        key = (c, t)
        found = self._two.get(key)
        if found is None:
            found = self._two[key] = self._receives_two(c, t)
        return found

    def _receives_two(self, c: tuple, t: tuple) -> bool:
        _, tables = self._overlap_tables(c, t)
        for r in range(self.placement.size):
            count, own = 1, True
            for table in tables:
                length, overlap, k = table[r]
                if not length:
                    break  # an empty piece receives nothing
                count *= k
                own = own and overlap > 0
            else:
                if count - own >= 2:
                    return True
        return False

    def one_message(self, c: tuple, t: tuple) -> bool:
        """Whether no rank receives two or more messages in an exchange from non-partial ``c``
        to non-partial ``t``: per dim, the ranges overlapping a range of t depend on disjoint
        axes, so the most pieces of c one piece of t overlaps is the product over dims of the
        most ranges of c one range of t overlaps; under 2 none does, from 3 on some rank
        does whichever piece it holds, and at exactly 2 the ranks are counted one by one."""
        key = (c, t)
        found = self._one.get(key)
        if found is None:
            most = self._most_overlaps(c, t)
            found = self._one[key] = most < 2 or (most == 2 and not self.receives_two(c, t))
        return found

    def _most_overlaps(self, c: tuple, t: tuple) -> int:
        """The most pieces of ``c`` one piece of ``t`` overlaps (see :meth:`one_message`)."""
        return math.prod(self._dim_overlaps(c, t))

    def _dim_overlaps(self, c: tuple, t: tuple) -> tuple:
        """Per dim, the most ranges of ``c`` one range of ``t`` overlaps (1 where neither
        splits it): the factors of :meth:`_most_overlaps`."""
        key = (c, t)
        found = self._overlap_factors.get(key)
        if found is None:
            shape, factors = self.shape, [1] * len(self.shape)
            mine, theirs = self.split_sizes(c), self.split_sizes(t)
            for d in {v for v in c if v >= 0} | {v for v in t if v >= 0}:
                if mine[d] or theirs[d]:
                    factors[d] = _most_overlaps(shape[d], mine[d], theirs[d])
            found = self._overlap_factors[key] = tuple(factors)
        return found

    def _factor(self, d: int, mine: tuple, theirs: tuple) -> int:
        """Dim ``d``'s factor of :meth:`_dim_overlaps` for layouts splitting it by the axes
        ``mine`` and ``theirs`` (outermost first)."""
        if not mine and not theirs:
            return 1
        mesh = self.mesh
        return _most_overlaps(self.shape[d], tuple(mesh[b] for b in mine),
                              tuple(mesh[b] for b in theirs))

    def two_or_three(self, c: tuple, t: tuple) -> int:
        """The fewest collectives (2 or 3) of a route from non-partial ``c`` through one
        exchange into non-partial ``t``, when every such route takes two or more: 3 unless
        the exchange straight from ``c`` has every rank receive at most 2 messages, or one
        collective leads to a layout whose exchange sends each rank one. A collective changes
        one axis; the free steps around it only cut pieces finer (a local slice) or make a
        partial sum that another collective must reduce, and a finer source never lowers a
        rank's messages (each piece it needed is cut into parts it still needs): so the
        layouts that differ from ``c`` on one axis, by any value but P, cover every route
        with one collective, where that collective is a step of its own: one on axis a can
        neither take nor leave a dim a later axis splits (those splits stay until another
        collective, and slices only add splits), so such changes are not counted."""
        key = (c, t)
        found = self._three.get(key)
        if found is None:
            found = self._three[key] = (
                2 if self.missing(c, t)[1] < 3 or self._one_after_one(c, t) else 3)
        return found

    def after_reducing(self, c: tuple, t: tuple) -> int:
        """The fewest collectives (1 or 2) of a route from ``c`` through one exchange into
        ``t``, besides one reduction per partial axis of ``c`` (from a non-partial ``c``,
        :func:`_fewest_messages` into ``t`` or its cores): an exchange takes no partial
        sums, so every partial axis is reduced first (a partial axis ``t`` keeps too, made
        partial again after the exchange by a free zero-fill); 1 only if the exchange from
        ``c`` with every partial axis reduced to B sends each rank one message into ``t`` (or,
        for a partial ``t``, into one of its cores: each partial axis B or S(d)). B is the
        coarsest value a reduction leaves: P -> S(d) on axis a needs no later axis splitting d
        (:func:`_kind`), so a is innermost and cuts each range of d finer, as a free slice after
        an all_reduce would; and a finer source never lowers a rank's messages (each piece it
        needed is cut into parts it still needs). A further collective, or a second message,
        makes 2 (see :func:`_fewest_messages`)."""
        key = (c, t)
        found = self._reduced.get(key)
        if found is None:
            reduced = tuple(_B if v == _P else v for v in c)
            if _P in t:
                if t.count(_P) == 1 and self.numel:
                    found = self._reduced_one(reduced, t)
                else:
                    values = (_B,) + tuple(range(len(self.shape)))
                    targets = [t] + list(itertools.product(*((v,) if v != _P else values
                                                             for v in t)))
                    found = _fewest_messages(self, reduced, targets)
            else:
                found = 1 if self.one_message(reduced, t) else 2
            self._reduced[key] = found
        return found

    def after_reducing_deeper(self, c: tuple, t: tuple) -> int:
        """:meth:`after_reducing`, counted up to 3 into a non-partial ``t``: where it says 2,
        :meth:`two_or_three` from ``c`` with every partial axis reduced to B. The reductions
        leave that layout or a finer one (see :meth:`after_reducing`), and a collective then
        leaves a layout no coarser than the one it leaves from there, so a finer layout needs
        no fewer collectives and messages (the argument of :meth:`two_or_three`)."""
        found = self.after_reducing(c, t)
        if found == 2 and _P not in t:
            found = self.two_or_three(tuple(_B if v == _P else v for v in c), t)
        return found

    def _reduced_one(self, r: tuple, t: tuple) -> int:
        """:meth:`after_reducing` into a ``t`` with one partial axis, from ``r`` (its source with
        every partial axis reduced to B): per core of ``t`` (B or S(w) on that axis) the per-dim
        product of overlaps changes only at dim w, so it is worked out from the factors of
        ``r`` and ``t`` with B there; the rank-by-rank count only where it is 2."""
        pt = t.index(_P)
        t0 = t[:pt] + (_B,) + t[pt + 1:]
        mesh = self.mesh
        factors = self._dim_overlaps(r, t0)
        mine, theirs = self.split_axes(r), self.split_axes(t0)
        base = math.prod(factors)  # every factor is 1 or more (no dim is empty here)
        pending = []
        for w in (_B,) + tuple(range(len(self.shape))):
            if w == _B:
                most = base
            else:  # dim w split by pt too
                th = tuple(sorted(theirs[w] + (pt,))) if mesh[pt] > 1 else theirs[w]
                most = base // factors[w] * self._factor(w, mine[w], th)
            if most < 2:
                return 1
            if most == 2:
                pending.append(t[:pt] + (w,) + t[pt + 1:])
                if w == _B:
                    pending.append(t)
        return 1 if any(_fewest_messages(self, r, (k,)) == 1 for k in pending) else 2

    def _one_after_one(self, c: tuple, t: tuple) -> bool:
        """Whether one collective leads from non-partial ``c`` to a layout whose exchange into
        ``t`` sends each rank one message. Per axis a that splits some dim v no later axis
        splits (otherwise no step on a is legal), the coarsest layout a collective there
        leaves is ``c`` with B on a: an all_to_all to S(x), or a zero-fill reduced to S(x),
        needs no later axis splitting x, so it cuts that layout's ranges of x finer, and the
        free steps around the collective are slices, which cut finer too (a collective on
        a B axis, after a free slice or zero-fill there, leaves ``c`` or a layout finer
        than it, none one message away when :meth:`two_or_three` is asked: every route then
        takes two or more). Finer never lowers a rank's messages, so those layouts are
        enough: the per-dim product first (dim v loses axis a), the rank-by-rank count only
        where it says 2."""
        mesh = self.mesh
        factors, mine = self._dim_overlaps(c, t), self.split_axes(c)
        theirs = self.split_axes(t)
        base = math.prod(factors)
        pending = []
        for a, v in enumerate(c):
            if v < 0 or mesh[a] == 1 or v in _later_splits(c, mesh, a):
                continue
            f = factors[v]
            left = self._factor(v, tuple(b for b in mine[v] if b != a), theirs[v])
            most = base // f * left if f else math.prod(
                x for d, x in enumerate(factors) if d != v) * left
            if most < 2:
                return True
            if most == 2:
                pending.append(c[:a] + (_B,) + c[a + 1:])
        return any(not self.receives_two(n, t) for n in pending)

    def _overlap_tables(self, c: tuple, t: tuple) -> tuple:
        """(the product of the lengths of the dims neither layout splits, per dim either splits:
        :meth:`_rank_table`)."""
        base, tables = 1, []
        for d, (length, mine, theirs) in enumerate(zip(self.shape, self.split_axes(c),
                                                       self.split_axes(t))):
            if not mine and not theirs:
                base *= length
            else:
                tables.append(self._rank_table(d, mine, theirs))
        return base, tables

    def _count_missing(self, c: tuple, t: tuple) -> tuple[int, int, float]:
        base, tables = self._overlap_tables(c, t)
        groups: dict = {}
        for r, key in enumerate(self.group_keys(t)):
            size = own = base
            count = 1
            for table in tables:
                length, overlap, k = table[r]
                size *= length
                own *= overlap
                count *= k
            missing = size - own if size else 0
            others = count - (own > 0) if missing else 0
            total, most, region = groups.get(key, (0, 0, 0.0))
            groups[key] = (total + missing, max(most, others),
                           max(region, missing / others if others else 0.0))
        return _least(groups)

    def _rank_table(self, d: int, mine: tuple, theirs: tuple) -> tuple:
        """Per coordinate (row-major), for dim ``d`` split by the axes ``mine`` in one layout
        and ``theirs`` in another: (the length of its range in theirs, the length that range
        shares with its range in mine, how many non-empty ranges of mine the range in theirs
        overlaps). Kept per (dim, axes): layouts that split a dim alike share it."""
        key = (d, mine, theirs)
        found = self._rank_tables.get(key)
        if found is None:
            mesh = self.mesh
            mine_ranges, their_ranges, counts = _overlaps(
                self.shape[d], tuple(mesh[a] for a in mine), tuple(mesh[a] for a in theirs))
            rows = []
            for coord in grid_coords(self.placement):
                j = _radix(coord, theirs, mesh)
                (lo, hi), (lo2, hi2) = their_ranges[j], mine_ranges[_radix(coord, mine, mesh)]
                rows.append((hi - lo, max(0, min(hi, hi2) - max(lo, lo2)), counts[j]))
            found = self._rank_tables[key] = tuple(rows)
        return found

    def group_keys(self, codes: tuple) -> tuple:
        """Per coordinate (row-major), (its coordinates on the S axes, on the P axes)."""
        found = self._groups.get(codes)
        if found is None:
            split = [a for a, v in enumerate(codes) if v >= 0]
            partial = [a for a, v in enumerate(codes) if v == _P]
            found = self._groups[codes] = tuple(
                (tuple(coord[a] for a in split), tuple(coord[a] for a in partial))
                for coord in grid_coords(self.placement))
        return found

    def _canonical(self, axes, group) -> tuple:
        """(sizes of ``axes``, per dim (length, positions of c's and t's splitting axes))."""
        where = {a: k for k, a in enumerate(axes)}
        return (tuple(self.mesh[a] for a in axes),
                tuple(sorted((length, tuple(where[a] for a in mine), tuple(where[a] for a in theirs))
                             for length, mine, theirs in group)))

    def split_axes(self, codes: tuple) -> tuple:
        """Per tensor dim, the axes (of size > 1) splitting it, outermost first."""
        found = self._splits.get(codes)
        if found is None:
            found = [()] * len(self.shape)
            for a, (v, n) in enumerate(zip(codes, self.mesh)):
                if v >= 0 and n > 1:
                    found[v] += (a,)
            found = self._splits[codes] = tuple(found)
        return found

    def split_sizes(self, codes: tuple) -> tuple:
        """Per tensor dim, the sizes of :meth:`split_axes`' axes."""
        found = self._sizes.get(codes)
        if found is None:
            mesh = self.mesh
            found = self._sizes[codes] = tuple(tuple(mesh[a] for a in axes)
                                               for axes in self.split_axes(codes))
        return found


def _radix(coord, axes, sizes) -> int:
    """The index of ``coord``'s range in a dim split by ``axes`` in turn (the first outermost):
    its coordinates on those axes as one mixed-radix number (see :func:`_ranges`)."""
    i = 0
    for a in axes:
        i = i * sizes[a] + coord[a]
    return i


def _nests(mine: tuple, theirs: tuple) -> bool:
    """The nested ranges of one dim cut by the axes ``mine`` and by ``theirs`` (outermost
    first) sum their overlaps, over the coordinates of both, to the dim's length: when the
    axes are disjoint (for each of mine's ranges, theirs partition the dim) or one list starts
    with the other (each range of the longer lies in the range of the shorter that its
    coordinates name, and the longer's ranges partition the dim)."""
    if set(mine).isdisjoint(theirs):
        return True
    short, long_ = (mine, theirs) if len(mine) <= len(theirs) else (theirs, mine)
    return long_[:len(short)] == short


@memo(4096)
def _held(sizes: tuple, dims: tuple) -> int:
    """Σ over the coordinates of axes of ``sizes`` of the product over ``dims`` (length, the
    positions of the axes splitting it in one layout, in the other) of the overlap of the two
    layouts' ranges of that dim."""
    tables = [(_ranges(length, tuple(sizes[k] for k in mine)), mine,
               _ranges(length, tuple(sizes[k] for k in theirs)), theirs)
              for length, mine, theirs in dims]
    total = 0
    for coord in itertools.product(*(range(n) for n in sizes)):
        product = 1
        for mine_ranges, mine, their_ranges, theirs in tables:
            (lo, hi) = mine_ranges[_radix(coord, mine, sizes)]
            (lo2, hi2) = their_ranges[_radix(coord, theirs, sizes)]
            lo, hi = max(lo, lo2), min(hi, hi2)
            if hi <= lo:
                product = 0
                break
            product *= hi - lo
        total += product
    return total


def _later_splits(codes: tuple, mesh, axis: int) -> set:
    """The dims split by the axes after ``axis`` (of size > 1): a step on ``axis`` can
    neither take nor leave a split of them (:func:`_kind`)."""
    return {v for v, n in zip(codes[axis + 1:], mesh[axis + 1:]) if v >= 0 and n > 1}


def _kind(old: int, new: int, later: set):
    """The step from ``old`` to ``new`` on one axis (see :func:`_local_step`), or None; ``later``
    holds the dims split by later axes (of size > 1)."""
    if old >= 0:
        if old in later:
            return None
        if new == _B:
            return _GATHER
        if new == _P:
            return _ZERO_FILL
        return None if new in later else _ALL_TO_ALL
    if new >= 0 and new in later:
        return None
    if old == _B:
        return _SLICE if new >= 0 else _ZERO_FILL
    return _ALL_REDUCE if new == _B else _REDUCE_SCATTER


@memo(256)
def _space(placement, shape) -> _Space:
    return _Space(placement, shape)


# --------------------------------------------------------------------------- lower bounds


@memo(16384)
def _local_counts(codes: tuple, target: tuple, sizes) -> tuple[int, int]:
    """Collectives and steps every route of axis-local steps from ``codes`` to ``target``
    takes: a collective on each axis going S -> B, S(i) -> S(j), P -> B or P -> S (only
    LocalSlice and ZeroFill communicate nothing, and no sequence of them leaves S or P); a
    step on each axis that changes. Nested splits add more: an axis that is S(d) at both ends
    must leave S(d) and come back (two steps, one a collective) when an earlier axis gains or
    loses a split of d, since that step needs no later axis splitting d (docs/sbp.md)."""
    latency = steps = 0
    for a, (v, w) in enumerate(zip(codes, target)):
        if sizes[a] == 1:
            continue
        if v != w:
            steps += 1
            latency += v != _B and w != _P
        elif v >= 0 and any(sizes[b] > 1 and (codes[b] == v) != (target[b] == v) for b in range(a)):
            steps += 2
            latency += 1
    return latency, steps


def _fewest_messages(space: _Space, codes: tuple, targets) -> int:
    """Collectives (at most 2: :meth:`_Space.two_or_three` tells 3) of a route from
    non-partial ``codes`` through an exchange into one of ``targets`` (dst and, for a partial
    dst, its cores): after a collective, 2; else the
    exchange leaves a layout reached by local slices only (a zero-fill leaves a partial sum,
    which an exchange cannot take), whose pieces each lie in the piece of ``codes`` their rank
    holds: a rank receives one message per piece of ``codes`` its target piece overlaps and it
    does not hold (each such piece holds a part of the target only finer pieces not its own
    can send), so at least as many as it would from ``codes`` (:meth:`_Space.missing`).
    Worked out as :meth:`_Space.one_message` does (for a partial target, the cheapest
    partial coordinate of each box counts: :meth:`_Space.missing`)."""
    for target in targets:
        if _P not in target:
            if space.one_message(codes, target):
                return 1
            continue
        most = space._most_overlaps(codes, target)
        if most < 2 or (most == 2 and space.missing(codes, target)[1] < 2):
            return 1
    return 2


@memo(16384)
def fewest_collectives(src: Layout, sbp: tuple) -> int:
    """Collectives every plan from ``src`` to ``src.with_sbp(sbp)`` (``sbp`` resolved) runs at
    least (see :meth:`_Bound._bound`): on routes of axis-local steps, or reductions then an
    exchange. The signature choice bounds candidates with it."""
    space = _space(src.placement, src.shape)
    codes = space.codes(src)
    target = tuple(code(v) for v in sbp)
    sizes = space.mesh
    local = _local_counts(codes, target, sizes)[0]
    partial = sum(1 for v, n in zip(codes, sizes) if v == _P and n > 1)
    if local <= partial + 1:
        return local
    # a third collective after the reductions matters only where the axis-local count is
    # higher (from a non-partial layout the candidate table does not ask it: docs/planner.md)
    deeper = partial and local > partial + 2
    count = space.after_reducing_deeper if deeper else space.after_reducing
    return min(local, partial + count(codes, target))


class _Bound:
    """Admissible lower bounds on the cost of reaching ``dst`` (docs/planner.md, "The search").

    ``self(key)`` bounds every route from the layout ``key`` (a placement index and codes, see
    :class:`_Space`): α per collective the route cannot avoid, β per byte it must send, the
    memory of the steps it must take. Each term is a bound on its own part of the cost for
    *every* route (a minimum over the two kinds of route: axis-local steps only, or reductions
    then one exchange), so their sum is one too."""

    __slots__ = ("src", "dst", "itemsize", "union", "memory", "spaces", "on_dst", "target", "copies",
                 "small", "_memo", "_quick", "_deep")

    def __init__(self, src: Layout, dst: Layout, itemsize: int = SEARCH_ITEMSIZE):
        self.src, self.dst, self.itemsize = src, dst, itemsize
        self.union = len(set(src.placement.flat_ranks) | set(dst.placement.flat_ranks))
        # every step writes at least the smallest piece any layout of the tensor can have
        smallest = dst.numel() / max(src.placement.size, dst.placement.size)
        self.memory = MEMORY * itemsize * smallest
        here = _space(src.placement, src.shape)
        there = here if dst.placement == src.placement else _space(dst.placement, dst.shape)
        self.spaces, self.on_dst = (here, there), 0 if there is here else 1
        self.target = there.codes(dst)
        # on one placement, to a non-partial dst: the ranks that hold each element in dst
        self.copies = 0 if self.on_dst or _P in self.target else math.prod(
            n for n, v in zip(there.mesh, self.target) if v == _B)
        # where sending the whole tensor costs less than 20 α, α decides: the full bound counts
        # an exchange route's third collective (elsewhere the count costs more than it saves)
        self.small = BETA * itemsize * dst.numel() < 20 * ALPHA
        self._memo: dict = {}
        self._quick: dict = {}
        self._deep: dict = {}

    def key(self, layout: Layout) -> tuple:
        """The search's key of a layout on src's or dst's placement."""
        at = 0 if layout.placement == self.src.placement else 1
        return at, self.spaces[at].codes(layout)

    def __call__(self, key) -> float:
        h = self._memo.get(key)
        if h is None:
            h = self._memo[key] = self._bound(*key) * (1 - 1e-9)  # never above, rounding aside
        return h

    def quick(self, key) -> float:
        """The α and memory terms of ``self(key)`` alone (a few microseconds; the elements'
        term counts pieces rank by rank): a bound too, the search's first look at a layout."""
        counts = self._counts_of(key)
        return (ALPHA * counts[0] + self.memory * counts[1]) * (1 - 1e-9)

    def _counts_of(self, key) -> tuple:
        """:meth:`_counts` of ``key``, kept."""
        counts = self._quick.get(key)
        if counts is None:
            counts = self._quick[key] = self._counts(*key)
        return counts

    def _counts(self, at: int, codes: tuple) -> tuple:
        """(collectives, steps) every route from the layout takes, its partial axes, and the
        product of those a route may keep (dst is partial there too)."""
        sizes = self.spaces[at].mesh
        partial = [a for a, v in enumerate(codes) if v == _P and sizes[a] > 1]
        lat_local = steps_local = math.inf
        keep = 1
        if at == self.on_dst:
            lat_local, steps_local = self._local(codes, sizes)
            keep = math.prod(sizes[a] for a in partial if self.target[a] == _P)
        steps_exchange = lat_exchange = len(partial) + 1 if at == 0 else math.inf
        deeper = 0  # lat_local where the exchange's count may be higher (for the full bound alone)
        if lat_exchange == 1 and lat_local > 1 and self.on_dst == 0:
            lat_exchange = self._messages(codes)
            if lat_exchange == 2 and lat_local > 2 and _P not in self.target:
                deeper = lat_local
        elif partial and lat_local > lat_exchange and self.on_dst == 0:
            deeper = lat_local  # the exchange after the reductions may need two messages
        return (min(lat_local, lat_exchange), min(steps_local, steps_exchange), partial, keep,
                deeper)

    def deeper(self, key) -> float | None:
        """The α and memory terms of ``self(key)`` with the exchange route's deeper count
        (:meth:`_latency`), where there is one to ask (else None): the search's second look
        at a layout, before the elements' term."""
        counts = self._counts_of(key)
        if not (counts[4] and self.small):
            return None
        return (ALPHA * self._latency(key[1], counts) + self.memory * counts[1]) * (1 - 1e-9)

    def _latency(self, codes: tuple, counts) -> int:
        """Collectives every route takes: the first-stage count, or where an exchange route
        may take more than it says (``deeper``, tensors α decides), its count of two or three
        (from a partial layout, the reductions and then one or two)."""
        latency, _, partial, _, deeper = counts
        if deeper and self.small:
            found = self._deep.get(codes)
            if found is None:
                space = self.spaces[0]
                found = self._deep[codes] = min(
                    deeper, len(partial) + space.after_reducing_deeper(codes, self.target)
                    if partial else space.two_or_three(codes, self.target))
            latency = found
        return latency

    def _bound(self, at: int, codes: tuple) -> float:
        counts = self._counts_of((at, codes))
        _, steps, partial, keep, _ = counts
        return (ALPHA * self._latency(codes, counts)
                + BETA * self.itemsize * self._elements(at, codes, partial, keep)
                + self.memory * steps)

    def _messages(self, codes: tuple) -> int:
        """:func:`_fewest_messages` from non-partial ``codes`` into dst or one of its cores:
        :meth:`_Space.after_reducing` with nothing to reduce (kept per pair in the space)."""
        return self.spaces[0].after_reducing(codes, self.target)

    def _local(self, codes: tuple, sizes) -> tuple[int, int]:
        return _local_counts(codes, self.target, sizes)

    def _elements(self, at: int, codes: tuple, partial, keep: int) -> float:
        """Elements the busiest rank must send, summed over the steps of any route.

        Per step, the ranks receive no more than all of them send, so the steps send at least
        (elements some rank must receive, summed) / (ranks): see :func:`_lacking`. Partial
        axes of the layout must also each be reduced (unless dst keeps them), and a reduction
        along an axis of n ranks sends (n - 1) times a piece no smaller than numel / N times
        the product of the axes still partial then; summed in any order, numel (prod - keep) / N.
        On one placement to a non-partial dst, each element of R summands that D ranks hold
        in dst takes R - 1 transfers to be summed somewhere, then D - 1 to reach the others:
        numel (R + D - 2) / N (docs/planner.md, "(c)")."""
        space = self.spaces[at]
        if at == self.on_dst:
            lacking = space.lacking(codes, self.target) / space.placement.size
        else:
            lacking = _lacking(space.layout(codes), self.dst) / self.union
        if not partial:
            return lacking
        sizes = space.mesh
        summands = math.prod(sizes[a] for a in partial)
        if self.copies:  # one placement, dst not partial: reduce, then deliver (docs/planner.md)
            return space.numel * (summands + self.copies - 2) / space.placement.size
        reduced = space.numel * (summands - keep) / space.placement.size
        return max(lacking, reduced)

    def exchange(self, target: Layout) -> float:
        """A bound on any exchange into ``target``: one message, and writing its pieces."""
        piece = target.max_local_numel() * self.itemsize
        return ALPHA + (MEMORY + COPY) * piece

    def exchange_to(self, codes: tuple, target: Layout, key) -> float:
        """:meth:`exchange`, and where it is cheap to know (one placement, a non-partial
        target) the elements the target's pieces lack, spread over the ranks, as in
        :meth:`exchange_from`."""
        bound = self.exchange(target)
        if self.on_dst == 0 and not target.is_partial:
            space = self.spaces[0]
            lacking = space.lacking(codes, key[1]) / space.placement.size
            bound += (BETA + COPY) * self.itemsize * lacking * (1 - 1e-9)
        return bound

    def exchange_from(self, node: Layout, target: Layout) -> float:
        """A bound on ``exchange(node, target)``: the elements missing from each target piece
        are received, so the busiest of the ranks sends at least their sum over the ranks, and
        at least the largest region one message carries; a rank receives one message per
        other piece of ``node`` its target piece overlaps."""
        if self.on_dst == 0:
            space = self.spaces[0]
            missing, messages, region = space.missing(space.codes(node), space.codes(target))
        else:
            missing, messages, region = _missing(node, target)
        sent = max(missing / self.union, region)
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
def _missing(node: Layout, target: Layout) -> tuple[int, int, float]:
    """For an exchange from non-partial ``node``: the elements the ranks of ``target`` receive,
    summed; the most messages one of them receives (one per other piece of ``node`` its target
    piece overlaps); and the largest region one message must carry (a rank's missing elements
    over its messages: each region goes whole from one sender, who counts it as sent). A
    partial target fills one partial coordinate per box (its owner, not known here): only the
    cheapest coordinate of each box counts, for all three."""
    place = node.placement
    ranges = _dim_ranges(node)
    groups: dict = {}
    for coord, rank in coords_and_ranks(target):
        box = target.box(coord)
        missing = box_numel(box)
        mine = place.coord_of(rank)
        own = overlap_numel(node.box(mine), box) if mine is not None and missing else 0
        missing -= own
        others = 0
        if missing:
            others = math.prod(sum(1 for lo, hi in rs if lo < hi and lo < b and a < hi)
                               for rs, (a, b) in zip(ranges, box)) - (own > 0)
        key = (_split_key(target, coord), _partial_key(target, coord))
        total, most, region = groups.get(key, (0, 0, 0.0))
        groups[key] = (total + missing, max(most, others),
                       max(region, missing / others if others else 0.0))
    return _least(groups)


def _least(groups: dict) -> tuple[int, int, float]:
    """Per box (S coordinates) the cheapest partial coordinate of (missing, messages, region),
    then summed, the most and the largest over the boxes (see :func:`_missing`)."""
    least: dict = {}
    for (skey, _), (missing, most, region) in groups.items():
        known = least.get(skey)
        least[skey] = (missing, most, region) if known is None else (
            min(known[0], missing), min(known[1], most), min(known[2], region))
    return (sum(m for m, _, _ in least.values()), max([1] + [most for _, most, _ in least.values()]),
            max([0.0] + [region for _, _, region in least.values()]))


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
    bound = _Bound(src, dst, itemsize)
    return bound(bound.key(src))


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


def plan(src: Layout, dst: Layout) -> Plan:
    """The cheapest plan from ``src`` to ``dst`` (pure, cached, the same on every rank)."""
    found = _PLANS.get((src, dst))
    if found is not None:
        return found
    _check(src, dst)
    if src == dst:
        return _PLANS.put((src, dst), Plan(src, dst, ()))
    with _SEARCH_LOCK:  # a stopped search is shared state (thread-ranks share this module)
        search = _SEARCHES.pop((src, dst), None) or _Search(src, dst)
        steps = search.run()
    if steps is None:  # unreachable: all-B is always a way through
        raise GlobalTensorError(f"found no plan from {src!r} to {dst!r}; please report this")
    return _PLANS.put((src, dst), Plan(src, dst, steps))


def cost_above(src: Layout, dst: Layout, limit: float,
               itemsize: int = SEARCH_ITEMSIZE) -> tuple[float, bool]:
    """(``plan(src, dst).cost(itemsize)``, True), or, if that is more than ``limit``, maybe
    (a lower bound on it that is more than ``limit``, False): the search stops once every
    route left costs more (and is taken up again where it stopped if the plan is asked for
    later). The signature choice rules candidates out with it."""
    _check(src, dst)
    if src == dst:
        return 0.0, True
    found = _PLANS.get((src, dst))
    if found is not None:  # planned before (its search is gone from _SEARCHES)
        return found.cost(itemsize), True
    scale = min(1.0, itemsize / SEARCH_ITEMSIZE)  # costs at itemsize over those at the search's
    with _SEARCH_LOCK:
        search = _SEARCHES.get((src, dst))
        if search is None:
            search = _SEARCHES.put((src, dst), _Search(src, dst))
        if search.run(limit / scale) is None:
            return search.lower * scale * (1 - 1e-9), False
    return plan(src, dst).cost(itemsize), True


# searches stopped by cost_above, to be taken up again; one search runs at a time: two threads
# (thread-ranks of gt.testing) taking up the same stopped search would corrupt its queue and could
# choose differently, so ranks would run different collectives (a fuzz test aborted in gloo)
_SEARCHES = Bounded(512)
_PLANS = Bounded(8192)  # plan()'s results, which cost_above also looks up
_SEARCH_LOCK = threading.RLock()

# the kinds of entry in the search's queue: a layout reached (its key with the bound from it,
# or with one inherited from the step before, not yet worked out), an exchange costed only by
# the bound on any exchange into its target, one costed by the bound from its source
_NODE, _GUESSED, _QUICK, _DEEPER, _EXCHANGE, _EXCHANGE_FROM = 0, 1, 2, 3, 4, 5


class _Search:
    """A* from ``src`` to ``dst``. Unless ``dst`` has one, no intermediate layout may hold the
    whole tensor on a rank (docs/planner.md): such layouts are never queued. A route without
    one always exists then (except from a partial sum on one rank, searched with full copies
    allowed; :meth:`_restart` is a safety net, not a case), so this is the reference's first
    Dijkstra pass, and the least key in the queue bounds the plan's cost.

    Layouts are keys of :class:`_Bound` (a placement index and int codes). Work is deferred
    until an entry comes first: a layout is queued with the bound its predecessor implies (the
    predecessor's bound less the step's cost) and gets its own bound when it comes first, its
    α and memory terms before its elements'; an exchange is queued with a bound and built only
    when it comes first again. Steps only ever stay on src's or dst's placement. :meth:`run`
    may stop at a cost limit and go on later."""

    __slots__ = ("dst", "guard", "bound", "spaces", "goal", "targets", "best", "lengths", "heap",
                 "counter", "lower", "steps", "start")

    def __init__(self, src: Layout, dst: Layout):
        # on one rank, every layout holds the whole tensor: a partial src there can reach
        # another placement only through one (an exchange takes no partial sums)
        one_rank_sum = src.placement.size == 1 and src.is_partial
        self.dst, self.guard = dst, not holds_full(dst) and not one_rank_sum
        self.bound = bound = _Bound(src, dst)
        self.spaces = spaces = bound.spaces
        self.start, self.goal = (0, spaces[0].codes(src)), (bound.on_dst, bound.target)
        self.targets = [(dst, self.goal)] + _core_keys(spaces[bound.on_dst], bound.target, bound.on_dst)
        self.counter = itertools.count(1)
        self.lower, self.steps = 0.0, None
        self._begin()

    def _begin(self):
        start = self.start
        self.best, self.lengths = {start: 0.0}, {start: 0}
        self.heap = [(self.bound(start), 0, 0, _NODE, 0.0, start, (), None)]

    def _restart(self) -> bool:
        """Search again allowing full copies, if it did not (never needed: a route without one
        exists whenever dst is not full, see docs/planner.md)."""
        if not self.guard:
            return False
        self.guard = False
        self._begin()
        return True

    def _reach(self, node, cost, path, inherited):
        if self.guard and node != self.goal and self.spaces[node[0]].holds_full(node[1]):
            return
        known = self.best.get(node, math.inf)
        # ties (within rounding) go to the shorter route
        if cost < known - 1e-15 or (cost <= known + 1e-15 and len(path) < self.lengths[node]):
            self.best[node], self.lengths[node] = cost, len(path)
            heapq.heappush(self.heap, (cost + max(inherited, 0.0), len(path), next(self.counter),
                                       _GUESSED, cost, node, path, None))

    def run(self, limit: float = math.inf):
        """The steps of the cheapest plan, or None once every route left costs more than
        ``limit`` (then ``self.lower`` is a bound above ``limit``, and a later call goes on)."""
        if self.steps is not None:
            return self.steps
        bound, spaces, push, pop = self.bound, self.spaces, heapq.heappush, heapq.heappop
        while True:
            heap, best, lengths = self.heap, self.best, self.lengths
            while heap:
                if heap[0][0] > limit:
                    self.lower = heap[0][0]
                    return None
                entry = pop(heap)
                f, _, _, kind, cost, node, path, target = entry
                if kind <= _DEEPER:
                    if cost > best[node] or len(path) > lengths[node]:
                        continue  # a cheaper or shorter route reached it since
                    if kind == _GUESSED:  # first its α and memory terms: often enough to wait
                        h = bound.quick(node)
                        if cost + h > f:
                            push(heap, (cost + h, entry[1], entry[2], _QUICK) + entry[4:])
                            continue
                        kind = _QUICK
                    if kind == _QUICK:  # then the exchange route's deeper count, if any
                        h = bound.deeper(node)
                        if h is not None and cost + h > f:
                            push(heap, (cost + h, entry[1], entry[2], _DEEPER) + entry[4:])
                            continue
                        kind = _DEEPER
                    if kind == _DEEPER:
                        h = bound(node)
                        if cost + h > f:
                            push(heap, (cost + h, entry[1], entry[2], _NODE) + entry[4:])
                            continue
                    if node == self.goal:
                        self.steps = _steps_of(spaces, path)
                        return self.steps
                    h = bound(node)
                    at, codes = node
                    space = spaces[at]
                    length = len(path) + 1
                    guard, goal, counter = self.guard, self.goal, self.counter
                    for c, axis, new, step_kind, after in space.steps(codes):
                        # _reach, inlined: most successors are no improvement, and build nothing
                        nxt = (at, after)
                        total = cost + c
                        known = best.get(nxt, math.inf)
                        if total < known - 1e-15 or (total <= known + 1e-15 and length < lengths[nxt]):
                            if guard and nxt != goal and space.holds_full(after):
                                continue  # a full copy on the way: never (see the class)
                            best[nxt], lengths[nxt] = total, length
                            push(heap, (total + max(h - c, 0.0), length, next(counter), _GUESSED,
                                        total, nxt, path + ((at, codes, axis, new, step_kind, after),),
                                        None))
                    if at == 0 and _P not in codes:
                        for t, key in self.targets:
                            if key != node:  # an exchange is one of the routes the node's bound covers
                                f2 = cost + max(h, bound.exchange_to(codes, t, key) + bound(key))
                                push(heap, (f2, length, next(counter), _EXCHANGE, cost, node, path,
                                            (t, key)))
                elif kind == _EXCHANGE:
                    layout = spaces[0].layout(node[1])
                    f2 = cost + bound.exchange_from(layout, target[0]) + bound(target[1])
                    push(heap, (max(f, f2), len(path) + 1, next(self.counter), _EXCHANGE_FROM, cost,
                                node, path, target))
                else:
                    step = exchange(spaces[0].layout(node[1]), target[0])
                    c = _exchange_cost(step)
                    self._reach(target[1], cost + c, path + (step,), f - cost - c)
            if not self._restart():
                self.lower = math.inf
                return None


def _core_keys(space: _Space, target: tuple, at: int) -> list:
    """:func:`_cores` of ``target`` as (layout, key) pairs, in the same order."""
    if _P not in target:
        return []
    options = [(v,) if v != _P else (_B,) + tuple(range(len(space.shape))) for v in target]
    return [(space.layout(codes), (at, codes)) for codes in itertools.product(*options)]


def _exchange_cost(step: Exchange) -> float:
    """``step.cost()``, the same expression, with the moves' traffic counted once."""
    sent, messages = step._traffic()
    sent, latency = max(sent.values(), default=0), max(messages.values(), default=1)
    size = SEARCH_ITEMSIZE
    return (ALPHA * latency + BETA * (sent * size) + MEMORY * step.after.max_local_numel() * size
            + COPY * (sent + step.after.max_local_numel()) * size)


def _steps_of(spaces, path) -> tuple[Step, ...]:
    return tuple(entry if isinstance(entry, Step) else spaces[entry[0]].step(*entry[1:])
                 for entry in path)


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


__all__ = ["cost_above", "exchange", "fewest_collectives", "lower_bound", "plan", "reference_plan"]
