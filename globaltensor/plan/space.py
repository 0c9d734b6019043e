"""The layouts of one tensor shape on one placement, as tuples of int codes (:mod:`.codes`), with
what the search asks of them: the largest piece, the axis-local steps and their costs, and
per-dim facts. Step and Layout values are built only for the plan returned. A space is cached
per (placement, shape), and keeps its answers, so the searches of a signature choice share them.
"""
from __future__ import annotations

import math

import numpy as np

from .._cache import kept, memo
from ..layout import Layout, trusted
from ..sbp import Split, broadcast, partial_sum
from . import cost as model
from .codes import (ALL_REDUCE, ALL_TO_ALL, GATHER, GATHERV, REDUCE_SCATTER, B, P, build, code, kind,
                    later_splits)
from .cost import SEARCH_ITEMSIZE
from .ranges import all_to_all_factor, nested_lengths, overlaps
from .steps import Step


class Space:
    """The layouts of ``shape`` on ``placement`` as code tuples (one code per placement axis)."""

    def __init__(self, placement, shape):
        self.placement, self.shape, self.grid = placement, shape, placement.shape
        self.numel = math.prod(shape)
        self.cpu = placement.type == "cpu"
        self.values = tuple(Split(d) for d in range(len(shape))) + (partial_sum, broadcast)
        self.order = tuple(range(len(shape))) + (B, P)  # the order of the steps: S(0).., B, P

    def codes(self, layout: Layout) -> tuple:
        return tuple(code(v) for v in layout.sbp)

    @kept
    def layout(self, codes: tuple) -> Layout:
        values = self.values
        return trusted(self.placement, tuple(values[c] for c in codes), self.shape)

    @kept
    def max_local(self, codes: tuple) -> int:
        """Layout.max_local_numel: the product over dims of the longest nested range."""
        lengths = list(self.shape)
        for v, n in zip(codes, self.grid):
            if v >= 0:
                lengths[v] = -(-lengths[v] // n)
        found = 1
        for length in lengths:
            found *= length
        return found

    def holds_full(self, codes: tuple) -> bool:
        return self.numel > 0 and self.max_local(codes) == self.numel

    def splits(self, codes: tuple, dim: int) -> tuple:
        """The axes (of size > 1) splitting ``dim``, outermost first."""
        return self.split_axes(codes)[dim]

    def even(self, codes: tuple, axis: int, dim: int, last_short: bool = False) -> bool:
        """steps.even: every piece has one length of ``dim`` (with ``last_short``, every piece
        but those at the last coordinate of ``axis``)."""
        grid = self.grid
        axes = self.splits(codes, dim)
        lengths = nested_lengths(self.shape[dim], tuple(grid[a] for a in axes))
        if last_short:
            n = grid[axis]
            if n == 1:
                return True  # every coordinate is the last
            if axis in axes:
                stride = math.prod(grid[a] for a in axes[axes.index(axis) + 1:])
                lengths = [x for i, x in enumerate(lengths) if (i // stride) % n != n - 1]
        return len(set(lengths)) <= 1

    def all_to_all_sent(self, codes: tuple, axis: int, i: int, j: int) -> int:
        """AllToAll.elements_sent: other dims' ranges are the same before and after and depend
        on other axes, so the worst coordinate is the worst of each, multiplied."""
        grid, shape = self.grid, self.shape
        lengths = list(shape)
        for v, n in zip(codes, grid):
            if v >= 0:
                lengths[v] = -(-lengths[v] // n)
        others = 1
        for d, length in enumerate(lengths):
            if d != i and d != j:
                others *= length
        outer_i = tuple(grid[a] for a in self.splits(codes, i) if a != axis)
        outer_j = tuple(grid[a] for a in self.splits(codes, j))
        return others * all_to_all_factor(shape[i], outer_i, shape[j], outer_j, grid[axis])

    @kept
    def steps(self, codes: tuple) -> tuple:
        """(cost, axis, new code, kind, codes after) of every axis-local step from ``codes``
        (an exact gather after the padded one, on CPU where pieces are uneven)."""
        grid, out = self.grid, []
        for axis, old in enumerate(codes):
            later = later_splits(codes, grid, axis)
            for new in self.order:
                if new == old:
                    continue
                kind_ = kind(old, new, later)
                if kind_ is None:
                    continue
                after = codes[:axis] + (new,) + codes[axis + 1:]
                out.append((self.step_cost(codes, after, axis, old, new, kind_), axis, new, kind_,
                            after))
                if kind_ == GATHER and self.cpu and not self.even(codes, axis, old):
                    out.append((self.step_cost(codes, after, axis, old, new, GATHERV), axis, new,
                                GATHERV, after))
        return tuple(out)

    def step_cost(self, codes, after, axis, old, new, kind_) -> float:
        """Step.cost(SEARCH_ITEMSIZE) of the step, from the same functions of :mod:`.cost`."""
        n = self.grid[axis]
        if n == 1:
            return 0.0
        piece, result = self.max_local(codes), self.max_local(after)
        latency, sent, copied = 1, 0, 0
        if kind_ == GATHER:
            sent = model.gather_sent(n, piece)
            lands = old == 0 and self.even(codes, axis, old, True)
            copied = model.gather_copied(piece, result, self.even(codes, axis, old), lands)
        elif kind_ == GATHERV:
            sent, copied = model.gather_sent(n, piece), model.gatherv_copied(old, result)
        elif kind_ == ALL_TO_ALL:
            sent = self.all_to_all_sent(codes, axis, old, new)
            copied = model.all_to_all_copied(old, new, piece, result)
        elif kind_ == ALL_REDUCE:
            sent = model.all_reduce_sent(n, piece)
        elif kind_ == REDUCE_SCATTER:
            sent = model.reduce_scatter_sent(n, result)
            copied = model.reduce_scatter_copied(piece, new == 0 and self.even(after, axis, new))
        else:
            latency = 0
        return model.seconds(latency, sent, result, copied, SEARCH_ITEMSIZE)

    def step(self, codes, axis, new, kind_, after) -> Step:
        """The Step value of a step found by :meth:`steps`."""
        return build(kind_, axis, codes[axis], new, self.layout(codes), self.layout(after))

    @kept
    def split_axes(self, codes: tuple) -> tuple:
        """Per tensor dim, the axes (of size > 1) splitting it, outermost first."""
        found = [()] * len(self.shape)
        for a, (v, n) in enumerate(zip(codes, self.grid)):
            if v >= 0 and n > 1:
                found[v] += (a,)
        return tuple(found)

    @kept
    def split_sizes(self, codes: tuple) -> tuple:
        """Per tensor dim, the sizes of :meth:`split_axes`' axes."""
        grid = self.grid
        return tuple(tuple(grid[a] for a in axes) for axes in self.split_axes(codes))

    @kept
    def group_index(self, codes: tuple) -> tuple:
        """Per coordinate (row-major, an array), the index of its coordinates on the S axes and
        of those on the P axes (mixed radix), and how many of each there are."""
        coords = self.coords()
        split = partial = np.zeros(coords.shape[1], dtype=np.int64)
        n_split = n_partial = 1
        for a, (v, n) in enumerate(zip(codes, self.grid)):
            if v >= 0:
                split, n_split = split * n + coords[a], n_split * n
            elif v == P:
                partial, n_partial = partial * n + coords[a], n_partial * n
        return split, partial, n_split, n_partial

    @kept
    def coords(self) -> np.ndarray:
        """Every coordinate, row-major: (placement ndim, size)."""
        return np.indices(self.grid, dtype=np.int64).reshape(len(self.grid), -1)

    @kept
    def rank_table(self, d: int, mine: tuple, theirs: tuple) -> np.ndarray:
        """Per coordinate (row-major; rows of an array), for dim ``d`` split by the axes ``mine``
        in one layout and ``theirs`` in another: (the length of its range in theirs, the length
        that range shares with its range in mine, how many non-empty ranges of mine it
        overlaps). The ranges repeat with the coordinates on those axes: looked up, not cut."""
        grid = self.grid
        mine_ranges, their_ranges, counts = overlaps(
            self.shape[d], tuple(grid[a] for a in mine), tuple(grid[a] for a in theirs))
        coords = self.coords()
        j, i = np.zeros(coords.shape[1], dtype=np.int64), np.zeros(coords.shape[1], dtype=np.int64)
        for a in theirs:
            j = j * grid[a] + coords[a]
        for a in mine:
            i = i * grid[a] + coords[a]
        theirs_, mine_ = np.array(their_ranges, dtype=np.int64), np.array(mine_ranges, dtype=np.int64)
        lo, hi = theirs_[j, 0], theirs_[j, 1]
        lo2, hi2 = mine_[i, 0], mine_[i, 1]
        shared = np.maximum(0, np.minimum(hi, hi2) - np.maximum(lo, lo2))
        return np.stack([hi - lo, shared, np.array(counts, dtype=np.int64)[j]])


@memo(256)
def space_of(placement, shape) -> Space:
    return Space(placement, shape)


__all__ = ["Space", "space_of"]
