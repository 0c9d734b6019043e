"""What an exchange between two layouts of one space must move, counted on int codes: the
elements a target lacks or misses, and the messages a rank receives; and from those, the fewest
collectives of a route through an exchange. The bounds (:mod:`.bound`) ask these; the lemmas
they rest on are in docs/planner.md ("Lemmas").
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from .._cache import kept, memo
from .codes import B, P, later_splits
from .ranges import held_sum, most_overlaps, nests
from .space import Space, space_of


class Messages:
    """The exchange counts of one :class:`Space` (kept per pair of code tuples)."""

    def __init__(self, space: Space):
        self.space = space
        self.placement, self.shape, self.grid, self.numel = (space.placement, space.shape,
                                                             space.grid, space.numel)
        self.split_axes, self.split_sizes = space.split_axes, space.split_sizes
        self.group_index, self.rank_table = space.group_index, space.rank_table

    @kept
    def lacking(self, c: tuple, t: tuple) -> int:
        """exchange.lacking for two layouts of this space: summed over t's groups of summands,
        the group's box less what its members hold of it (lemma "Lacking factors")."""
        grid = self.grid
        everything = self.numel
        for w, n in zip(t, grid):
            if w == B:
                everything *= n
        if c == t:
            return 0
        if any(v == P and n > 1 and w != P for v, w, n in zip(c, t, grid)):
            return everything  # each group's members hold one summand
        held = 1
        for v, w, n in zip(c, t, grid):
            if v == B and w == B:
                held *= n  # replicas that hold the same pieces in both
        pending = []
        for length, mine, theirs in zip(self.shape, self.split_axes(c), self.split_axes(t)):
            if mine == theirs:
                held *= length  # the same pieces on both sides: they cover the dim once
            else:
                pending.append((length, mine, theirs))
        while pending and held:
            group = _linked(pending)
            if len(group) == 1 and nests(*group[0][1:]):
                held *= group[0][0]  # lemma "Nested overlaps": each range meets them once in all
                continue
            held *= self.group_held(group)
        return everything - held

    @kept
    def group_held(self, group: tuple) -> int:
        """What the members hold of a group of dims linked by their splitting axes."""
        axes = sorted({a for _, mine, theirs in group for a in mine + theirs})
        where = {a: k for k, a in enumerate(axes)}
        return held_sum(tuple(self.grid[a] for a in axes),
                        tuple(sorted((length, tuple(where[a] for a in mine),
                                      tuple(where[a] for a in theirs))
                                     for length, mine, theirs in group)))

    @kept
    def missing(self, c: tuple, t: tuple) -> tuple[int, int, float]:
        """exchange.missing for two layouts of this space, every coordinate at once, from
        per-dim tables of ranges (only the dims either layout splits)."""
        base, tables = self.overlap_tables(c, t)
        size = np.full(self.placement.size, base, dtype=np.int64)
        own, count = size.copy(), np.ones_like(size)
        for length, overlap, k in tables:
            size, own, count = size * length, own * overlap, count * k
        missing = np.where(size > 0, size - own, 0)
        others = np.where(missing > 0, count - (own > 0), 0)
        if int(missing.max(initial=0)) >= 1 << 53:  # past exact floats: the loop's own division
            region = np.array([m / o if o else 0.0 for m, o in zip(missing.tolist(), others.tolist())])
        else:
            region = np.where(others > 0, missing / np.maximum(others, 1), 0.0)
        split, partial, n_split, n_partial = self.group_index(t)
        key = split * n_partial + partial
        total = np.zeros(n_split * n_partial, dtype=np.int64)
        np.add.at(total, key, missing)
        most = np.zeros(n_split * n_partial, dtype=np.int64)
        np.maximum.at(most, key, others)
        largest = np.zeros(n_split * n_partial)
        np.maximum.at(largest, key, region)
        # per box (S coordinates), the cheapest partial coordinate of each (exchange.least)
        shape = (n_split, n_partial)
        total, most = total.reshape(shape).min(1), most.reshape(shape).min(1)
        largest = largest.reshape(shape).min(1)
        return int(total.sum()), max(1, int(most.max())), max(0.0, float(largest.max()))

    @kept
    def receives_two(self, c: tuple, t: tuple) -> bool:
        """Whether some rank's piece of non-partial ``t`` overlaps two or more pieces of
        non-partial ``c`` it does not hold (:meth:`missing`'s messages, without elements)."""
        _, tables = self.overlap_tables(c, t)
        count = np.ones(self.placement.size, dtype=np.int64)
        own = np.ones(self.placement.size, dtype=bool)
        full = own.copy()  # an empty piece receives nothing
        for length, overlap, k in tables:
            full &= length > 0
            count *= k
            own &= overlap > 0
        return bool(np.any(full & (count - own >= 2)))

    @kept
    def one_message(self, c: tuple, t: tuple) -> bool:
        """Whether no rank receives two or more messages in an exchange from non-partial ``c``
        to non-partial ``t`` (lemma "Overlaps multiply": the per-dim product, rank by rank
        only where it is exactly 2)."""
        most = self.most_overlaps(c, t)
        return most < 2 or (most == 2 and not self.receives_two(c, t))

    def most_overlaps(self, c: tuple, t: tuple) -> int:
        """The most pieces of ``c`` one piece of ``t`` overlaps."""
        return math.prod(self.dim_overlaps(c, t))

    @kept
    def dim_overlaps(self, c: tuple, t: tuple) -> tuple:
        """Per dim, the most ranges of ``c`` one range of ``t`` overlaps (1 where neither
        splits it): the factors of :meth:`most_overlaps`."""
        shape, factors = self.shape, [1] * len(self.shape)
        mine, theirs = self.split_sizes(c), self.split_sizes(t)
        for d in {v for v in c if v >= 0} | {v for v in t if v >= 0}:
            if mine[d] or theirs[d]:
                factors[d] = most_overlaps(shape[d], mine[d], theirs[d])
        return tuple(factors)

    def factor(self, d: int, mine: tuple, theirs: tuple) -> int:
        """Dim ``d``'s factor of :meth:`dim_overlaps` for layouts splitting it by the axes
        ``mine`` and ``theirs`` (outermost first)."""
        if not mine and not theirs:
            return 1
        grid = self.grid
        return most_overlaps(self.shape[d], tuple(grid[b] for b in mine),
                             tuple(grid[b] for b in theirs))

    @kept
    def two_or_three(self, c: tuple, t: tuple) -> int:
        """The fewest collectives (2 or 3) of a route from non-partial ``c`` through one
        exchange into non-partial ``t``, when every such route takes two or more (lemmas
        "Finer never helps" and "One collective before")."""
        return 2 if self.missing(c, t)[1] < 3 or self.one_after_one(c, t) else 3

    @kept
    def after_reducing(self, c: tuple, t: tuple) -> int:
        """The fewest collectives (1 or 2) of a route from ``c`` through one exchange into
        ``t``, besides one reduction per partial axis of ``c`` (lemma "Reduce to B")."""
        reduced = tuple(B if v == P else v for v in c)
        if P not in t:
            return 1 if self.one_message(reduced, t) else 2
        if t.count(P) == 1 and self.numel:
            return self.reduced_one(reduced, t)
        values = (B,) + tuple(range(len(self.shape)))
        targets = [t] + list(itertools.product(*((v,) if v != P else values for v in t)))
        return fewest_messages(self, reduced, targets)

    def after_reducing_deeper(self, c: tuple, t: tuple) -> int:
        """:meth:`after_reducing`, counted up to 3 into a non-partial ``t``: where it says 2,
        :meth:`two_or_three` from ``c`` with every partial axis reduced to B."""
        found = self.after_reducing(c, t)
        if found == 2 and P not in t:
            found = self.two_or_three(tuple(B if v == P else v for v in c), t)
        return found

    def reduced_one(self, r: tuple, t: tuple) -> int:
        """:meth:`after_reducing` into a ``t`` with one partial axis, from ``r`` (its source with
        every partial axis reduced to B): per core of ``t`` (B or S(w) on that axis) from the
        per-dim factors, rank by rank only where the product is 2."""
        pt = t.index(P)
        t0 = t[:pt] + (B,) + t[pt + 1:]
        grid = self.grid
        factors = self.dim_overlaps(r, t0)
        mine, theirs = self.split_axes(r), self.split_axes(t0)
        base = math.prod(factors)  # every factor is 1 or more (no dim is empty here)
        pending = []
        for w in (B,) + tuple(range(len(self.shape))):
            if w == B:
                most = base
            else:  # dim w split by pt too
                th = tuple(sorted(theirs[w] + (pt,))) if grid[pt] > 1 else theirs[w]
                most = base // factors[w] * self.factor(w, mine[w], th)
            if most < 2:
                return 1
            if most == 2:
                pending.append(t[:pt] + (w,) + t[pt + 1:])
                if w == B:
                    pending.append(t)
        return 1 if any(fewest_messages(self, r, (k,)) == 1 for k in pending) else 2

    def one_after_one(self, c: tuple, t: tuple) -> bool:
        """Whether one collective leads from non-partial ``c`` to a layout whose exchange into
        ``t`` sends each rank one message: per axis a that a step may leave, ``c`` with B on a
        is the coarsest such layout (lemma "One collective before")."""
        grid = self.grid
        factors, mine = self.dim_overlaps(c, t), self.split_axes(c)
        theirs = self.split_axes(t)
        base = math.prod(factors)
        pending = []
        for a, v in enumerate(c):
            if v < 0 or grid[a] == 1 or v in later_splits(c, grid, a):
                continue
            f = factors[v]
            left = self.factor(v, tuple(b for b in mine[v] if b != a), theirs[v])
            most = base // f * left if f else math.prod(
                x for d, x in enumerate(factors) if d != v) * left
            if most < 2:
                return True
            if most == 2:
                pending.append(c[:a] + (B,) + c[a + 1:])
        return any(not self.receives_two(n, t) for n in pending)

    def overlap_tables(self, c: tuple, t: tuple) -> tuple:
        """(the product of the lengths of the dims neither layout splits, per dim either splits:
        :meth:`Space.rank_table`)."""
        base, tables = 1, []
        for d, (length, mine, theirs) in enumerate(zip(self.shape, self.split_axes(c),
                                                       self.split_axes(t))):
            if not mine and not theirs:
                base *= length
            else:
                tables.append(self.rank_table(d, mine, theirs))
        return base, tables


def _linked(pending: list) -> tuple:
    """Takes from ``pending`` its last entry and every entry linked to it by an axis that
    splits one dim in c and another in t, transitively; returns them."""
    group = (pending.pop(),)
    axes = set(group[0][1] + group[0][2])
    grown = bool(pending)
    while grown:
        grown = False
        for entry in pending:
            if not axes.isdisjoint(entry[1]) or not axes.isdisjoint(entry[2]):
                axes.update(entry[1] + entry[2])
                group += (entry,)
                pending.remove(entry)
                grown = True
                break
    return group


def fewest_messages(messages: Messages, codes: tuple, targets) -> int:
    """Collectives (1 or 2) of a route from non-partial ``codes`` through an exchange into one
    of ``targets`` (dst and, for a partial dst, its cores): 1 only where the exchange straight
    from ``codes`` sends each rank one message (lemma "Slices never help")."""
    for target in targets:
        if P not in target:
            if messages.one_message(codes, target):
                return 1
            continue
        most = messages.most_overlaps(codes, target)
        if most < 2 or (most == 2 and messages.missing(codes, target)[1] < 2):
            return 1
    return 2


@memo(256)
def messages_of(placement, shape) -> Messages:
    return Messages(space_of(placement, shape))


__all__ = ["Messages", "fewest_messages", "messages_of"]
