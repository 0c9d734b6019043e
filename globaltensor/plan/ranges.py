"""Per-dim facts of nested splits, as free functions of ints under a cache: the ranges a dim
is cut into, their lengths, and how the ranges of two splits of one dim overlap.

A dim of ``length`` split in turn by axes of sizes ``ns`` (the first outermost) is cut into
ranges in mixed-radix order of the coordinates (the last split fastest); :func:`radix` gives a
coordinate's range.
"""
from __future__ import annotations

import bisect
import itertools
import math

import numpy as np

from .._cache import memo
from ..layout import split_sizes


@memo(4096)
def nested_ranges(length: int, ns: tuple) -> tuple:
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
def nested_lengths(length: int, ns: tuple) -> tuple:
    return tuple(hi - lo for lo, hi in nested_ranges(length, ns))


@memo(4096)
def all_to_all_factor(length_i: int, outer_i: tuple, length_j: int, outer_j: tuple, n: int) -> int:
    """The most elements of dims (i, j) a rank sends in S(i) -> S(j) along an axis of ``n``:
    its piece of i times the part of its parent range of j it gives away, at the worst
    coordinate (``outer_*``: the sizes of the earlier axes splitting each dim)."""
    pieces, parents = nested_lengths(length_i, outer_i + (n,)), nested_lengths(length_j, outer_j)
    return max(max(pieces[c::n]) * max(p - split_sizes(p, n)[c] for p in parents) for c in range(n))


@memo(4096)
def overlaps(length: int, mine: tuple, theirs: tuple) -> tuple:
    """The ranges of a dim of ``length`` split into ``mine`` and into ``theirs`` (see
    :func:`nested_ranges`), and per range of theirs, how many non-empty ranges of mine it overlaps."""
    mine_ranges, their_ranges = nested_ranges(length, mine), nested_ranges(length, theirs)
    return mine_ranges, their_ranges, _counts(mine_ranges, their_ranges)


@memo(4096)
def most_overlaps(length: int, mine: tuple, theirs: tuple) -> int:
    """The most non-empty ranges of a split into ``mine`` that one range of a split into
    ``theirs`` overlaps (see :func:`nested_ranges`)."""
    return max(_counts(nested_ranges(length, mine), nested_ranges(length, theirs)))


def _counts(mine_ranges: tuple, their_ranges: tuple) -> tuple:
    """Per range of theirs, the non-empty ranges of mine it overlaps: nested ranges partition
    the dim in order, so those are a run, found by bisection (not a scan of every pair)."""
    starts = [lo for lo, hi in mine_ranges if lo < hi]
    ends = [hi for lo, hi in mine_ranges if lo < hi]
    return tuple(max(0, bisect.bisect_left(starts, b) - bisect.bisect_right(ends, a))
                 for a, b in their_ranges)


def radix(coord, axes, sizes) -> int:
    """The index of ``coord``'s range in a dim split by ``axes`` in turn (the first outermost):
    its coordinates on those axes as one mixed-radix number (see :func:`nested_ranges`)."""
    i = 0
    for a in axes:
        i = i * sizes[a] + coord[a]
    return i


def nests(mine: tuple, theirs: tuple) -> bool:
    """Whether the ranges of one dim cut by the axes ``mine`` and by ``theirs`` (outermost
    first) sum their overlaps to the dim's length (lemma "Nested overlaps")."""
    if set(mine).isdisjoint(theirs):
        return True
    short, long_ = (mine, theirs) if len(mine) <= len(theirs) else (theirs, mine)
    return long_[:len(short)] == short


@memo(4096)
def held_sum(sizes: tuple, dims: tuple) -> int:
    """Σ over the coordinates of axes of ``sizes`` of the product over ``dims`` (length, the
    positions of the axes splitting it in one layout, in the other) of the overlap of the two
    layouts' ranges of that dim: every coordinate at once, each dim's ranges looked up by its
    coordinates on the splitting axes."""
    if math.prod(sizes) * math.prod(length for length, _, _ in dims) >= 1 << 62:
        return _held_sum_ints(sizes, dims)  # past int64: Python's ints
    coords = np.indices(sizes, dtype=np.int64).reshape(len(sizes), -1)
    product = np.ones(coords.shape[1], dtype=np.int64)
    for length, mine, theirs in dims:
        ends = []
        for axes in (mine, theirs):
            ranges = np.array(nested_ranges(length, tuple(sizes[k] for k in axes)), dtype=np.int64)
            i = np.zeros(coords.shape[1], dtype=np.int64)
            for k in axes:
                i = i * sizes[k] + coords[k]
            ends.append(ranges[i])
        lo, hi = np.maximum(ends[0][:, 0], ends[1][:, 0]), np.minimum(ends[0][:, 1], ends[1][:, 1])
        product *= np.maximum(hi - lo, 0)
    return int(product.sum())


def _held_sum_ints(sizes: tuple, dims: tuple) -> int:
    """:func:`held_sum`, one coordinate at a time in Python ints (no bound on the sizes)."""
    tables = [(nested_ranges(length, tuple(sizes[k] for k in mine)), mine,
               nested_ranges(length, tuple(sizes[k] for k in theirs)), theirs)
              for length, mine, theirs in dims]
    total = 0
    for coord in itertools.product(*(range(n) for n in sizes)):
        product = 1
        for mine_ranges, mine, their_ranges, theirs in tables:
            (lo, hi) = mine_ranges[radix(coord, mine, sizes)]
            (lo2, hi2) = their_ranges[radix(coord, theirs, sizes)]
            lo, hi = max(lo, lo2), min(hi, hi2)
            if hi <= lo:
                product = 0
                break
            product *= hi - lo
        total += product
    return total


__all__ = ["all_to_all_factor", "held_sum", "most_overlaps", "nested_lengths", "nested_ranges",
           "nests", "overlaps", "radix"]
