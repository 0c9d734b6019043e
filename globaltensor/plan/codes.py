"""The legality table of axis-local steps, on sbp values written as int codes.

The search works on the layouts of one (placement, shape) as tuples of codes, one per placement
axis: S(d) -> d, B -> -1, P -> -2. A step changes one axis from ``old`` to ``new``:

    old    new     step             legal when (``later``: dims split by later axes of size > 1)
    S(i)   B       all_gather       i not in later
    S(i)   S(j)    all_to_all       i, j not in later
    S(i)   P       zero-fill        i not in later
    B      S(j)    local slice      j not in later
    B      P       zero-fill        always
    P      B       all_reduce       always
    P      S(j)    reduce_scatter   j not in later

A step on an axis can neither take nor leave a split that a later axis nests inside it
(docs/planner.md, "Nested splits"). Every planner here, on codes or on Layout values, asks
:func:`kind`; :func:`build` makes the Step value of a legal step.
"""
from __future__ import annotations

from ..sbp import Broadcast, Split
from .steps import AllGather, AllGatherV, AllReduce, AllToAll, LocalSlice, ReduceScatter, Step, ZeroFill

B, P = -1, -2
GATHER, GATHERV, ALL_TO_ALL, ZERO_FILL, SLICE, ALL_REDUCE, REDUCE_SCATTER = range(7)


def code(v) -> int:
    """An sbp value as its int code: S(d) is d, B is -1, P is -2."""
    return v.dim if isinstance(v, Split) else (B if isinstance(v, Broadcast) else P)


def later_splits(codes: tuple, grid, axis: int) -> set:
    """The dims split by the axes after ``axis`` (of size > 1)."""
    return {v for v, n in zip(codes[axis + 1:], grid[axis + 1:]) if v >= 0 and n > 1}


def kind(old: int, new: int, later: set):
    """The step from ``old`` to ``new`` on one axis (the table above), or None."""
    if old >= 0:
        if old in later:
            return None
        if new == B:
            return GATHER
        if new == P:
            return ZERO_FILL
        return None if new in later else ALL_TO_ALL
    if new >= 0 and new in later:
        return None
    if old == B:
        return SLICE if new >= 0 else ZERO_FILL
    return ALL_REDUCE if new == B else REDUCE_SCATTER


def build(kind_: int, axis: int, old: int, new: int, before, after) -> Step:
    """The Step value of a legal step of kind ``kind_`` from layout ``before`` to ``after``."""
    if kind_ in (GATHER, GATHERV):
        return (AllGather if kind_ == GATHER else AllGatherV)(axis, old, before, after)
    if kind_ == ALL_TO_ALL:
        return AllToAll(axis, old, new, before, after)
    if kind_ == SLICE:
        return LocalSlice(axis, new, before, after)
    if kind_ == REDUCE_SCATTER:
        return ReduceScatter(axis, new, before, after)
    return (ZeroFill if kind_ == ZERO_FILL else AllReduce)(axis, before, after)


__all__ = ["ALL_REDUCE", "ALL_TO_ALL", "B", "GATHER", "GATHERV", "P", "REDUCE_SCATTER", "SLICE",
           "ZERO_FILL", "build", "code", "kind", "later_splits"]
