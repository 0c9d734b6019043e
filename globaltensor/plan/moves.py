"""The moves of a point-to-point exchange, rank by rank: which rank sends which region of the
logical tensor to which ranks (:func:`exchange_moves`), for the runtime to run and the oracle
to check. Pure: no torch.distributed, no rank. What the moves cost is counted without them
(:mod:`.traffic`); :class:`.steps.Exchange` builds them when first read.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from .._cache import memo
from ..errors import GlobalTensorError
from ..layout import Box, Layout, box_numel, boxes, grid_coords, intersect
from ..sbp import PartialSum, Split, format_sbp


def coords_and_ranks(layout: Layout):
    return zip(grid_coords(layout.placement), layout.placement.flat_ranks)


@dataclass(frozen=True, slots=True)
class Move:
    """``region`` (a box of the logical tensor) goes from rank ``src`` to ranks ``dsts``.

    One destination equal to ``src`` is a local copy; one other destination a send/recv;
    several (three or more, more than hold it) a broadcast over the group ``src`` + ``dsts``.
    """

    src: int
    dsts: tuple[int, ...]
    region: Box

    @property
    def is_local(self) -> bool:
        return self.dsts == (self.src,)

    @property
    def is_broadcast(self) -> bool:
        return len(self.dsts) > 1

    @property
    def group(self) -> tuple[int, ...]:
        return tuple(sorted((self.src,) + self.dsts))


def _pick(holders, load, near: int) -> int:
    """The least loaded holder, then the nearest rank, then the lowest: deterministic."""
    return min(holders, key=lambda r: (load.get(r, 0), abs(r - near), r))


def non_partial(before: Layout) -> None:
    if before.is_partial:
        raise GlobalTensorError(
            f"expected a non-partial source for a point-to-point exchange, found "
            f"{format_sbp(before.sbp)}; reduce its partial axes first")


@memo(4096)
def exchange_moves(before: Layout, after: Layout) -> tuple[Move, ...]:
    """Point-to-point moves that build every piece of ``after`` from the pieces of ``before``.

    ``before`` must be non-partial. A region that three or more ranks need, and more than
    hold it, is broadcast from one holder; any other is sent by the least loaded holder. On
    the partial axes of ``after``, one partial coordinate per box (the one whose ranks already
    hold most of it) gets the value and every other rank holds zeros.
    """
    non_partial(before)
    holders: dict[Box, list[int]] = {}
    for coord, rank in coords_and_ranks(before):
        box = before.box(coord)
        if box_numel(box):
            holders.setdefault(box, []).append(rank)
    owners = _owners(before, after)
    ranges, order = dim_ranges(before), {box: i for i, box in enumerate(holders)}
    moves, needs = [], {}
    for coord, rank in coords_and_ranks(after):
        target = after.box(coord)
        if not box_numel(target) or owners.get(split_key(after, coord), ()) != partial_key(after, coord):
            continue
        for box in _overlapping(order, ranges, target):
            ranks, region = holders[box], intersect(box, target)
            if rank in ranks:
                moves.append(Move(rank, (rank,), region))
            else:
                needs.setdefault((box, region), []).append(rank)
    return tuple(moves) + _assign(holders, needs)


def _overlapping(order: dict, ranges, target: Box) -> list[Box]:
    """The boxes of ``order`` (box -> its place) that overlap ``target``, in that order: each is
    a product of one of ``ranges`` per dim, so only the overlapping ranges are combined."""
    near = [[r for r in rs if r[0] < r[1] and r[0] < hi and lo < r[1]] for rs, (lo, hi) in zip(ranges, target)]
    found = [box for box in itertools.product(*near) if box in order]
    if len(found) > 1:
        found.sort(key=order.__getitem__)
    return found


def split_key(layout: Layout, coord) -> tuple[int, ...]:
    return tuple(c for c, v in zip(coord, layout.sbp) if isinstance(v, Split))


def partial_key(layout: Layout, coord) -> tuple[int, ...]:
    return tuple(c for c, v in zip(coord, layout.sbp) if isinstance(v, PartialSum))


def _owners(before: Layout, after: Layout) -> dict:
    """For each split coordinate of ``after``, the partial coordinate that holds the value:
    the one whose ranks already hold the most of their boxes, then the lowest."""
    if not after.is_partial:
        return {}
    held: dict = {}
    for coord, rank in coords_and_ranks(after):
        key = (split_key(after, coord), partial_key(after, coord))
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


@memo(16384)
def dim_ranges(layout: Layout) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per tensor dim, the distinct ranges the pieces of ``layout`` cover."""
    return tuple(tuple(sorted({b[d] for b in boxes(layout).values()})) for d in range(layout.ndim))


__all__ = ["Move", "coords_and_ranks", "dim_ranges", "exchange_moves", "non_partial", "partial_key",
           "split_key"]
