"""Every lower bound on the cost of a redistribution: the search's (:class:`Bound`, per layout it
reaches), ``lower_bound`` and ``fewest_collectives`` (one pair, without searching), and the
signature choice's per-axis bounds over many candidates at once (:func:`candidate_terms`).

Each term bounds its own part of the cost (α per collective, β per byte, the memory of the
steps) for *every* route, a minimum over the two kinds of route (axis-local steps only, or
reductions then one exchange), so their sum is a bound too (docs/planner.md, "The bound").
"""
from __future__ import annotations

import math

import numpy as np

from .._cache import kept, memo
from ..layout import Layout
from ..sbp import Split
from .codes import B, P, code
from . import cost
from .cost import SEARCH_ITEMSIZE
from .exchange import lacking, missing
from .messages import messages_of
from .ranges import most_overlaps
from .space import space_of


@memo(16384)
def local_counts(codes: tuple, target: tuple, grid) -> tuple[int, int]:
    """Collectives and steps every route of axis-local steps from ``codes`` to ``target``
    takes (lemma "Local counts": a collective per axis leaving S or P for another value, two
    steps where nested splits force a round trip)."""
    latency = steps = 0
    for a, (v, w) in enumerate(zip(codes, target)):
        if grid[a] == 1:
            continue
        if v != w:
            steps += 1
            latency += v != B and w != P
        elif v >= 0 and any(grid[b] > 1 and (codes[b] == v) != (target[b] == v) for b in range(a)):
            steps += 2
            latency += 1
    return latency, steps


@memo(16384)
def fewest_collectives(src: Layout, sbp: tuple) -> int:
    """Collectives every plan from ``src`` to ``src.with_sbp(sbp)`` (``sbp`` resolved) runs at
    least: on routes of axis-local steps, or reductions then an exchange."""
    messages = messages_of(src.placement, src.shape)
    codes = tuple(code(v) for v in src.sbp)
    target = tuple(code(v) for v in sbp)
    grid = messages.grid
    local = local_counts(codes, target, grid)[0]
    partial = sum(1 for v, n in zip(codes, grid) if v == P and n > 1)
    if local <= partial + 1:
        return local
    # a third collective after the reductions matters only where the axis-local count is
    # higher (from a non-partial layout the candidate table does not ask it: docs/planner.md)
    deeper = partial and local > partial + 2
    count = messages.after_reducing_deeper if deeper else messages.after_reducing
    return min(local, partial + count(codes, target))


class Bound:
    """Admissible lower bounds on the cost of reaching ``dst`` from the search's keys (a
    placement index, 0 for src's and 1 for dst's, and int codes)."""

    def __init__(self, src: Layout, dst: Layout, itemsize: int = SEARCH_ITEMSIZE):
        self.src, self.dst, self.itemsize = src, dst, itemsize
        self.union = len(set(src.placement.flat_ranks) | set(dst.placement.flat_ranks))
        # every step writes at least the smallest piece any layout of the tensor can have
        smallest = dst.numel() / max(src.placement.size, dst.placement.size)
        self.memory = cost.MEMORY * itemsize * smallest
        here = messages_of(src.placement, src.shape)
        there = here if dst.placement == src.placement else messages_of(dst.placement, dst.shape)
        self.counts = (here, there)
        self.spaces, self.on_dst = (here.space, there.space), 0 if there is here else 1
        self.target = there.space.codes(dst)
        # on one placement, to a non-partial dst: the ranks that hold each element in dst
        self.copies = 0 if self.on_dst or P in self.target else math.prod(
            n for n, v in zip(there.grid, self.target) if v == B)
        # where sending the whole tensor costs less than 20 α, α decides: the full bound counts
        # an exchange route's third collective (elsewhere the count costs more than it saves)
        self.small = cost.BETA * itemsize * dst.numel() < 20 * cost.ALPHA

    def key(self, layout: Layout) -> tuple:
        """The search's key of a layout on src's or dst's placement."""
        at = 0 if layout.placement == self.src.placement else 1
        return at, self.spaces[at].codes(layout)

    @kept
    def full(self, key) -> float:
        """The bound from ``key``: α, β and memory terms."""
        counts = self.counts_of(key)
        _, steps, partial, keep, _ = counts
        at, codes = key
        return (cost.ALPHA * self._latency(codes, counts)
                + cost.BETA * self.itemsize * self._elements(at, codes, partial, keep)
                + self.memory * steps) * (1 - 1e-9)  # never above, rounding aside

    def quick(self, key) -> float:
        """The α and memory terms of :meth:`full` alone (a few microseconds; the elements'
        term counts pieces rank by rank): a bound too, the search's first look at a layout."""
        counts = self.counts_of(key)
        return (cost.ALPHA * counts[0] + self.memory * counts[1]) * (1 - 1e-9)

    def deeper(self, key) -> float | None:
        """The α and memory terms of :meth:`full` with the exchange route's deeper count,
        where there is one to ask (else None): the search's second look at a layout."""
        counts = self.counts_of(key)
        if not (counts[4] and self.small):
            return None
        return (cost.ALPHA * self._latency(key[1], counts) + self.memory * counts[1]) * (1 - 1e-9)

    @kept
    def counts_of(self, key) -> tuple:
        """(collectives, steps) every route from the layout takes, its partial axes, the
        product of those a route may keep (dst is partial there too), and the axis-local
        count where an exchange route may need more than its first count (else 0)."""
        at, codes = key
        grid = self.spaces[at].grid
        partial = [a for a, v in enumerate(codes) if v == P and grid[a] > 1]
        lat_local = steps_local = math.inf
        keep = 1
        if at == self.on_dst:
            lat_local, steps_local = local_counts(codes, self.target, grid)
            keep = math.prod(grid[a] for a in partial if self.target[a] == P)
        steps_exchange = lat_exchange = len(partial) + 1 if at == 0 else math.inf
        deeper = 0  # lat_local where the exchange's count may be higher (for the full bound alone)
        if lat_exchange == 1 and lat_local > 1 and self.on_dst == 0:
            lat_exchange = self.counts[0].after_reducing(codes, self.target)
            if lat_exchange == 2 and lat_local > 2 and P not in self.target:
                deeper = lat_local
        elif partial and lat_local > lat_exchange and self.on_dst == 0:
            deeper = lat_local  # the exchange after the reductions may need two messages
        return (min(lat_local, lat_exchange), min(steps_local, steps_exchange), partial, keep,
                deeper)

    def _latency(self, codes: tuple, counts) -> int:
        """Collectives every route takes: the first count, or where an exchange route may take
        more (``deeper``, tensors α decides), its count of two or three."""
        latency, _, partial, _, deeper = counts
        if deeper and self.small:
            latency = self._deep(codes, deeper, bool(partial), len(partial))
        return latency

    @kept
    def _deep(self, codes: tuple, deeper: int, partial: bool, reductions: int) -> int:
        counts = self.counts[0]
        return min(deeper, reductions + counts.after_reducing_deeper(codes, self.target)
                   if partial else counts.two_or_three(codes, self.target))

    def _elements(self, at: int, codes: tuple, partial, keep: int) -> float:
        """Elements the busiest rank must send, summed over the steps of any route: what the
        target's pieces lack, spread over the ranks, or the reductions partial axes owe, or,
        to a non-partial dst on one placement, numel (R + D - 2) / N (lemma "Reduce, then
        deliver")."""
        space = self.spaces[at]
        if at == self.on_dst:
            elements = self.counts[at].lacking(codes, self.target) / space.placement.size
        else:
            elements = lacking(space.layout(codes), self.dst) / self.union
        if not partial:
            return elements
        grid = space.grid
        summands = math.prod(grid[a] for a in partial)
        if self.copies:  # one placement, dst not partial: reduce, then deliver
            return space.numel * (summands + self.copies - 2) / space.placement.size
        reduced = space.numel * (summands - keep) / space.placement.size
        return max(elements, reduced)

    def exchange(self, target: Layout) -> float:
        """A bound on any exchange into ``target``: one message, and writing its pieces."""
        piece = target.max_local_numel() * self.itemsize
        return cost.ALPHA + (cost.MEMORY + cost.COPY) * piece

    def exchange_to(self, codes: tuple, target: Layout, key) -> float:
        """:meth:`exchange`, and where it is cheap to know (one placement, a non-partial
        target) the elements the target's pieces lack, spread over the ranks."""
        bound = self.exchange(target)
        if self.on_dst == 0 and not target.is_partial:
            lacks = self.counts[0].lacking(codes, key[1]) / self.spaces[0].placement.size
            bound += (cost.BETA + cost.COPY) * self.itemsize * lacks * (1 - 1e-9)
        return bound

    def exchange_from(self, node: Layout, target: Layout) -> float:
        """A bound on ``exchange(node, target)``: the busiest rank sends at least the missing
        elements spread over the ranks, and the largest region one message carries; a rank
        receives one message per other piece of ``node`` its target piece overlaps."""
        if self.on_dst == 0:
            space = self.spaces[0]
            missed, messages, region = self.counts[0].missing(space.codes(node), space.codes(target))
        else:
            missed, messages, region = missing(node, target)
        sent = max(missed / self.union, region)
        return (self.exchange(target) + cost.ALPHA * (messages - 1)
                + (cost.BETA + cost.COPY) * self.itemsize * sent) * (1 - 1e-9)


@memo(16384)
def lower_bound(src: Layout, dst: Layout, itemsize: int = SEARCH_ITEMSIZE) -> float:
    """A lower bound on ``plan(src, dst).cost(itemsize)``, without searching (microseconds to
    a few tens of them). The signature choice prunes with it."""
    if src == dst:
        return 0.0
    bound = Bound(src, dst, itemsize)
    return bound.full(bound.key(src))


def move_bounds(layout: Layout, itemsize: int, sbp, free=()) -> tuple[float, float]:
    """The two bounds the signature choice's table (ops/choice/candidates.py) puts on moving
    ``layout`` to ``sbp`` (resolved): the first stage's and the refined one (with
    :func:`fewest_collectives`)."""
    collectives, rest = candidate_terms(layout, itemsize, free,
                                     np.array([[code(v)] for v in sbp], dtype=np.int64))
    collectives, rest = int(collectives[0]), float(rest[0])
    refined = cost.ALPHA * fewest_collectives(layout, tuple(sbp)) if collectives else 0.0
    return (cost.ALPHA * collectives + rest) * (1 - 1e-9), (refined + rest) * (1 - 1e-9)


def candidate_terms(layout: Layout, itemsize: int, free, codes) -> tuple:
    """(collectives, the memory and β terms) of the bound on moving ``layout`` to the target
    sbp of each candidate, ``codes`` holding the targets' codes, one row per axis: the terms
    of :class:`Bound` per axis, vectorised over the candidates, with the exchange's messages
    from :func:`overlap_products` (no rank-by-rank count: lemma "Candidate bound"). Both 0 for
    a target that is the layout's own sbp or one of ``free``'s."""
    grid = layout.placement.shape
    own = [code(v) for v in layout.sbp]
    partial = [a for a, v in enumerate(own) if v == P and grid[a] > 1]
    numel, ranks = layout.numel(), layout.placement.size
    smallest = numel / ranks
    big = [a for a, n in enumerate(grid) if n > 1]
    w = codes[big]
    v = np.array([own[a] for a in big], dtype=np.int64)[:, None]
    n = np.array([grid[a] for a in big], dtype=np.int64)[:, None]
    split, summed, from_p = w >= 0, w == P, v == P
    splits = np.where(split, n, 1).prod(axis=0)
    sums = np.where(summed, n, 1).prod(axis=0)
    changes = w != v
    steps = changes.sum(axis=0)  # from P, every change but to P is a reduction
    comm = (changes & (from_p | ((v >= 0) & ~summed))).sum(axis=0)  # from B: slices, zero-fills
    if partial:
        exchange = len(partial) + 1
        several = (comm > exchange) & (sums == 1)  # into a non-partial target, where it counts
        if several.any():  # the exchange after the reductions (Messages.after_reducing)
            exchange = np.where(several & (overlap_products(layout, codes) > 2), exchange + 1,
                                exchange)
        reduce = math.prod(grid[a] for a in partial)
        keep = np.where(from_p & summed, n, 1).prod(axis=0)
        kept = ~(from_p & ~summed).any(axis=0)  # every partial axis stays partial
        wanted = numel / (splits * sums)  # per rank, on average, the target's groups need
        elements = np.where(sums == 1, smallest * (reduce + ranks / splits - 2),
                            np.maximum(smallest * (reduce - keep), np.where(kept, 0.0, wanted)))
    else:
        exchange = np.ones_like(comm)
        several = comm > 1
        if several.any():  # some rank receives two messages (Messages.one_message)
            exchange = np.where(several & (overlap_products(layout, codes) > 2), 2, 1)
        held = numel / math.prod(m for m, c in zip(grid, own) if c >= 0)
        elements = np.maximum(numel / (splits * sums) - held, 0.0)
    collectives = np.minimum(comm, exchange)
    rest = itemsize * (cost.MEMORY * smallest * np.minimum(steps, exchange) + cost.BETA * elements)
    same = np.zeros(codes.shape[1], dtype=bool)
    for sbp in (layout.sbp,) + tuple(f.sbp for f in free):
        same |= (codes == np.array([code(x) for x in sbp], dtype=np.int64)[:, None]).all(axis=0)
    return np.where(same, 0, collectives), np.where(same, 0.0, rest)


def overlap_products(layout: Layout, codes) -> np.ndarray:
    """Per candidate, the most pieces of ``layout`` one piece of its target overlaps: the
    product over dims of ranges.most_overlaps, each dim's from the axes splitting it (a
    bitmask of them, in axis order), worked out for the (dim, mask) pairs that occur."""
    grid = layout.placement.shape
    mine = [()] * layout.ndim
    for v, n in zip(layout.sbp, grid):
        if isinstance(v, Split) and n > 1:
            mine[v.dim] += (n,)
    axes = [a for a, n in enumerate(grid) if n > 1]
    width = 1 << len(axes)
    weights = np.array([1 << k for k in range(len(axes))], dtype=np.int64)[:, None]
    dims = np.arange(layout.ndim, dtype=np.int64)[:, None, None]
    masks = ((codes[axes][None] == dims) * weights).sum(axis=1)  # (dim, candidate)
    keys = masks + np.arange(layout.ndim, dtype=np.int64)[:, None] * width
    table = np.ones(layout.ndim * width, dtype=np.int64)
    for key in np.flatnonzero(np.bincount(keys.ravel(), minlength=table.size)).tolist():
        d, m = divmod(key, width)
        if mine[d] or m:
            table[key] = most_overlaps(layout.shape[d], mine[d],
                                        tuple(grid[a] for k, a in enumerate(axes) if m >> k & 1))
    return table[keys].prod(axis=0)


__all__ = ["Bound", "candidate_terms", "fewest_collectives", "local_counts", "lower_bound",
           "move_bounds", "overlap_products"]
