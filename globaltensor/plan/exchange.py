"""Point-to-point exchanges between layouts given as values (a change of placement, or where
the search prefers one; their moves are :mod:`.moves`', their cost :mod:`.traffic`'s), and
what an exchange must move, counted on those values: the oracle
of the int-coded counts of :mod:`.messages`, and the bound's terms across placements.
"""
from __future__ import annotations

import itertools
import math

from .._cache import memo
from ..errors import GlobalTensorError
from ..layout import Layout, box_numel, boxes, intersect, overlap_numel
from ..sbp import PartialSum, Split, broadcast
from .moves import (partial_key, split_key, coords_and_ranks, dim_ranges, exchange_moves,
                    non_partial)
from .steps import Exchange


@memo(16384)
def exchange(before: Layout, after: Layout) -> Exchange:
    """The point-to-point exchange from ``before`` to ``after``: its moves
    (:func:`exchange_moves`) are built when first read; what it costs is worked out without
    them (:mod:`.traffic`). ``before`` must be non-partial. Head-tail layouts of one order (a
    pipeline's stages, each splitting the sequence over as many ranks) exchange their plain
    layouts' pieces (docs/planner.md, "Head-tail splits"); of two orders, an error: the
    pieces would land in the wrong order."""
    non_partial(before)
    if before.order or after.order:
        if dict(before.order) != dict(after.order):
            raise GlobalTensorError(
                f"a point-to-point exchange from {before!r} to {after!r}: expected head-tail "
                f"splits of one order on both sides (the same dims over as many ranks), found "
                f"{dict(before.order)} and {dict(after.order)}; split the sequence over as "
                f"many ranks on both sides, or move it to a plain split first")
        return exchange(before.plain(), after.plain())
    return Exchange(before, after)


def cores(dst: Layout) -> list[Layout]:
    """Non-partial layouts on dst's placement from which zero-fills reach ``dst``."""
    if not dst.is_partial:
        return [dst]
    options = [[v] if not isinstance(v, PartialSum) else [broadcast] + [Split(d) for d in range(dst.ndim)]
               for v in dst.sbp]
    return [dst.with_sbp(c) for c in itertools.product(*options)]


@memo(16384)
def lacking(node: Layout, dst: Layout) -> int:
    """Elements, summed over dst's groups of summands (the ranks sharing their coordinates on
    dst's non-partial axes), that no member can make from what it holds in ``node``; each must
    reach the group in at least one received element (lemma "Lacking factors")."""
    same = node.placement == dst.placement
    partial = tuple(a for a, (v, n) in enumerate(zip(node.sbp, node.placement.shape))
                    if isinstance(v, PartialSum) and n > 1)
    if partial and not same:
        return lacking_anywhere(node, dst)
    groups, everything = summand_groups(dst, node.placement, partial)
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
def summand_groups(dst: Layout, where, first_of=()) -> tuple[list, int]:
    """dst's groups of summands (see :func:`lacking`): per group its box, the box's numel and
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


def lacking_anywhere(node: Layout, dst: Layout) -> int:
    """:func:`lacking` for a partial ``node`` on another placement than dst: per group, the
    elements inside the pieces of every summand its members hold."""
    groups, _ = summand_groups(dst, node.placement)
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
def missing(node: Layout, target: Layout) -> tuple[int, int, float]:
    """For an exchange from non-partial ``node``: the elements the ranks of ``target`` receive,
    summed; the most messages one of them receives (one per other piece of ``node`` its target
    piece overlaps); and the largest region one message must carry (a rank's missing elements
    over its messages: each region goes whole from one sender, who counts it as sent). A
    partial target fills one partial coordinate per box (its owner, not known here): only the
    cheapest coordinate of each box counts, for all three."""
    place = node.placement
    ranges = dim_ranges(node)
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
        key = (split_key(target, coord), partial_key(target, coord))
        total, most, region = groups.get(key, (0, 0, 0.0))
        groups[key] = (total + missing, max(most, others),
                       max(region, missing / others if others else 0.0))
    return least(groups)


def least(groups: dict) -> tuple[int, int, float]:
    """Per box (S coordinates) the cheapest partial coordinate of (missing, messages, region),
    then summed, the most and the largest over the boxes (see :func:`missing`)."""
    least: dict = {}
    for (skey, _), (missing, most, region) in groups.items():
        known = least.get(skey)
        least[skey] = (missing, most, region) if known is None else (
            min(known[0], missing), min(known[1], most), min(known[2], region))
    return (sum(m for m, _, _ in least.values()), max([1] + [most for _, most, _ in least.values()]),
            max([0.0] + [region for _, _, region in least.values()]))


__all__ = ["cores", "dim_ranges", "exchange", "exchange_moves", "summand_groups", "lacking", "least", "missing"]
