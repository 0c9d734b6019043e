"""Per-dim facts of nested splits, as free functions of ints under a cache: the ranges a dim
is cut into, their lengths, and how the ranges of two splits of one dim overlap.

A dim of ``length`` split in turn by axes of sizes ``ns`` (the first outermost) is cut into
ranges in mixed-radix order of the coordinates (the last split fastest); :func:`radix` gives a
coordinate's range.
"""
from __future__ import annotations

import itertools

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
    distinct = {r for r in mine_ranges if r[0] < r[1]}
    return mine_ranges, their_ranges, tuple(sum(1 for lo, hi in distinct if lo < b and a < hi)
                                            for a, b in their_ranges)


@memo(4096)
def most_overlaps(length: int, mine: tuple, theirs: tuple) -> int:
    """The most non-empty ranges of a split into ``mine`` that one range of a split into
    ``theirs`` overlaps (see :func:`nested_ranges`)."""
    ranges = {r for r in nested_ranges(length, mine) if r[0] < r[1]}
    return max(sum(1 for lo, hi in ranges if lo < b and a < hi) for a, b in nested_ranges(length, theirs))


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
    layouts' ranges of that dim."""
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
