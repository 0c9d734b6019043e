"""What an Exchange's moves cost the busiest rank, without building the moves: the elements it
sends and the messages it sends or receives, exactly as ``Exchange.traffic`` counts them on
``moves.exchange_moves``'s moves, worked out on arrays over (target piece, source piece)
pairs rather than Python objects over every pair of ranks (docs/performance.md, "gt.simulate at
scale").

The moves' rules (moves.py): a target piece takes from every source piece it overlaps; a
rank that holds that source piece copies it; the others (the need's receivers) get it by one
broadcast when there are three or more of them and more than hold it, else each from the least
loaded holder (then the nearest rank, then the lowest). A source piece's holders hold no other
piece, so the choices for one piece never touch another's: the greedy runs for every piece at
once, one pick per round. Pieces along a dim are the uneven rule's ranges, so a target range
overlaps a run of consecutive source ranges: the pairs come from searches per dim, not a scan.
Pure: no torch.distributed, no rank.
"""
from __future__ import annotations

import math

import numpy as np

from .._cache import memo
from ..layout import Layout
from ..sbp import Split


def grid_ranges(layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi), each (ndim, grid size): every coordinate's range per dim, row-major, cut axis
    by axis as ``layout.boxes`` cuts them (the first ``length % n`` pieces one longer)."""
    shape = layout.placement.shape
    coords = np.indices(shape, dtype=np.int64).reshape(len(shape), -1)
    size = coords.shape[1]
    lo = np.zeros((layout.ndim, size), dtype=np.int64)
    hi = np.repeat(np.array(layout.shape, dtype=np.int64).reshape(-1, 1), size, axis=1)
    for axis, value in enumerate(layout.sbp):
        n = shape[axis]
        if isinstance(value, Split) and n > 1:
            d, k = value.dim, coords[axis]
            length = hi[d] - lo[d]
            base, extra = length // n, length % n
            start = lo[d] + k * base + np.minimum(k, extra)
            lo[d], hi[d] = start, start + base + (k < extra)
    return lo, hi


@memo(4096)
def exchange_traffic(before: Layout, after: Layout) -> tuple[int, int, bool]:
    """(elements the busiest rank sends, messages of the busiest rank: sends or receives, the
    larger, at least 1; whether any element leaves a rank) of ``exchange(before, after)``.

    For one placement and a non-partial target (the planner's common case; the step counts
    the others on its moves, :func:`moves_traffic`)."""
    if before.placement != after.placement or after.is_partial:
        raise ValueError("exchange_traffic: one placement and a non-partial target only")
    ranks = np.asarray(before.placement.flat_ranks, dtype=np.int64)
    piece, keys, per_dim = _source_pieces(before)
    if not len(keys):
        return 0, 1, False
    tlo, thi = grid_ranges(after)
    if (piece >= 0).sum() == len(keys):  # every source piece has one holder: no choice to make
        found = _one_holder(before, after, piece, tlo, thi)
        if found is not None:
            return found
    pair_t, box, region = _pairs(per_dim, keys, tlo, thi)
    remote = piece[pair_t] != keys[box]  # a rank that holds the source piece copies it
    if not remote.any():
        return 0, 1, False
    pair_t, box, region = pair_t[remote], box[remote], region[remote]
    recvs = np.bincount(pair_t, minlength=len(ranks))
    # a need: one source piece and one target piece (its region); receivers in grid order
    target = np.zeros(tlo.shape[1], dtype=np.int64)  # each target coordinate's piece
    for lo in tlo:
        starts = np.unique(lo)
        target = target * len(starts) + np.searchsorted(starts, lo)
    _, need, inverse, n_dsts = np.unique(box * (int(target.max()) + 1) + target[pair_t],
                                         return_index=True, return_inverse=True,
                                         return_counts=True)
    inverse = inverse.reshape(-1)
    holders = np.bincount(np.searchsorted(keys, piece[piece >= 0]), minlength=len(keys))
    bcast = (n_dsts >= 3) & (n_dsts > holders[box[need]])
    sent = np.zeros(len(ranks), dtype=np.int64)
    # a broadcast: every member forwards the region once (the receivers here, the source below)
    in_bcast = bcast[inverse]
    np.add.at(sent, pair_t[in_bcast], region[in_bcast])
    # the picks, in the greedy's order: needs by first receiver, a need's receivers in order;
    # a broadcast is one pick, near its first receiver
    pick = ~in_bcast | (np.arange(len(pair_t)) == need[inverse])
    order = np.lexsort((np.flatnonzero(pick), need[inverse][pick], box[pick]))
    pick_box, pick_size = box[pick][order], region[pick][order]
    src = _greedy(piece, keys, ranks, pick_box, ranks[pair_t[pick]][order], pick_size)
    np.add.at(sent, src, pick_size)
    msgs = np.maximum(np.bincount(src, minlength=len(ranks)), recvs)
    return int(sent.max()), max(1, int(msgs.max())), True


def _source_pieces(before: Layout):
    """Per coordinate its source piece's key (-1 for an empty piece); the keys, sorted; per
    dim the distinct non-empty ranges (a partition: (starts, ends), sorted). A piece is one
    range per dim."""
    slo, shi = grid_ranges(before)
    full = np.all(shi > slo, axis=0)
    per_dim, index = [], np.zeros(full.shape, dtype=np.int64)
    for d in range(before.ndim):
        starts, ends = np.unique(slo[d][full]), np.unique(shi[d][full])
        per_dim.append((starts, ends))
        index = index * len(starts) + np.searchsorted(starts, slo[d])
    piece = np.where(full, index, -1)
    return piece, np.unique(piece[full]), per_dim


def _one_holder(before: Layout, after: Layout, piece, tlo, thi):
    """:func:`exchange_traffic` where each source piece has one holder, per coordinate from
    per-dim counts, never pair by pair; None where a need has three receivers or fewer (then
    whether it is a broadcast depends on the pair). The target pieces partition the tensor,
    so a holder sends its piece whole but for what its own target piece keeps, and receives
    its target piece whole but for that; each need has the F receivers of its target piece
    (F: the replicas of a piece, the sizes of the axes that split nothing), less the holder
    where that is its own target piece; three or more take one broadcast."""
    fiber = math.prod(n for v, n in zip(after.sbp, after.placement.shape)
                      if not (isinstance(v, Split) and n > 1))
    if fiber == 3:
        return None
    slo, shi = grid_ranges(before)
    full_s, full_t = piece >= 0, np.all(thi > tlo, axis=0)
    own = np.ones(len(piece), dtype=np.int64)  # what a coordinate's source piece gives its target
    src_n, tgt_n = own.copy(), own.copy()  # the pieces' numels
    k_src, k_tgt = own.copy(), own.copy()  # the targets one source piece meets, and vice versa
    for d in range(before.ndim):
        own *= np.maximum(0, np.minimum(shi[d], thi[d]) - np.maximum(slo[d], tlo[d]))
        src_n *= shi[d] - slo[d]
        tgt_n *= thi[d] - tlo[d]
        k_src *= _meets(tlo[d][full_t], thi[d][full_t], slo[d], shi[d])
        k_tgt *= _meets(slo[d][full_s], shi[d][full_s], tlo[d], thi[d])
    own = np.where(full_s & full_t, own, 0)
    keeps = own > 0
    share, near_share = (1 if fiber >= 3 else fiber), (1 if fiber - 1 >= 3 else fiber - 1)
    sent = np.where(full_s, share * (src_n - own) + near_share * own, 0)
    sends = np.where(full_s, share * (k_src - keeps) + near_share * keeps, 0)
    if fiber >= 3:  # every need a broadcast: a receiver forwards each region once
        sent = sent + np.where(full_t, tgt_n - own, 0)
    recvs = np.where(full_t, k_tgt - keeps, 0)
    if not recvs.any():
        return 0, 1, False
    return int(sent.max()), max(1, int(np.maximum(sends, recvs).max())), True


def _meets(lo, hi, a, b):
    """Per range [a, b) (non-empty), how many of the distinct ranges [lo, hi) (a partition of
    the dim, non-empty) it overlaps: a run, found by two searches."""
    starts, ends = np.unique(lo), np.unique(hi)
    return np.maximum(0, np.searchsorted(starts, b, side="left") - np.searchsorted(ends, a, side="right"))


def _pairs(per_dim, keys, tlo, thi):
    """Every (target coordinate, overlapping source piece) pair, targets in grid order: the
    target's grid position, the piece (an index into ``keys``) and the region's numel. Along
    each dim a target range overlaps a run of consecutive source ranges. (The moves take a
    target's pieces in holder order; the greedy never compares two pieces of one target: a
    piece's needs are ordered by their first receivers, each at another grid position.)"""
    pair_t = np.flatnonzero(np.all(thi > tlo, axis=0))
    pair_key = np.zeros(len(pair_t), dtype=np.int64)
    region = np.ones(len(pair_t), dtype=np.int64)
    for d, (starts, ends) in enumerate(per_dim):
        i0 = np.searchsorted(ends, tlo[d][pair_t], side="right")
        count = np.maximum(np.searchsorted(starts, thi[d][pair_t], side="left") - i0, 0)
        rep = np.repeat(np.arange(len(pair_t)), count)
        idx = i0[rep] + np.arange(len(rep)) - np.repeat(np.cumsum(count) - count, count)
        pair_t, pair_key, region = pair_t[rep], pair_key[rep] * len(starts) + idx, region[rep]
        region = region * (np.minimum(ends[idx], thi[d][pair_t])
                           - np.maximum(starts[idx], tlo[d][pair_t]))
    return pair_t, np.searchsorted(keys, pair_key), region


def _greedy(piece, keys, ranks, box, near, size) -> np.ndarray:
    """The grid position of each pick's source (picks sorted by box, in order within a box):
    the least loaded holder of its box, then the nearest rank to ``near``, then the lowest.

    A box whose picks are all of one size takes them in blocks of H (its holders): from equal
    loads, each pick goes to a holder not yet picked in the block, so every block gives each
    holder one pick, and only the last, partial block's choices need working out (which
    holder takes which pick of a full block changes no one's count)."""
    held = np.flatnonzero(piece >= 0)
    held = held[np.lexsort((held, np.searchsorted(keys, piece[held])))]
    per = len(held) // len(keys)  # every non-empty piece has as many holders
    assert per * len(keys) == len(held)
    table = held.reshape(len(keys), per)  # grid positions of each piece's holders
    if per == 1:
        return table[box, 0]
    count = np.bincount(box, minlength=len(keys))
    start = np.cumsum(count) - count
    rnd = np.arange(len(box)) - start[box]  # a pick's place in its box
    some = count > 0
    uniform = np.zeros(len(keys), dtype=bool)
    uniform[some] = (np.minimum.reduceat(size, start[some])
                     == np.maximum.reduceat(size, start[some]))
    blocks = np.where(uniform, count // per * per, 0)  # the picks of full blocks
    late = rnd >= blocks[box]
    column = rnd % per  # in a full block: one pick per holder, in any order
    if late.any():
        column[late] = _rounds(box[late], (rnd - blocks[box])[late], near[late], size[late],
                               ranks[table])
    return table[box, column]


def _rounds(box, rnd, near, size, held_ranks) -> np.ndarray:
    """Per pick, the column of ``held_ranks`` (its box's holders) the greedy picks: round r
    takes the r-th pick of every box that has one."""
    rounds = np.lexsort((box, rnd))
    bounds = np.searchsorted(rnd[rounds], np.arange(int(rnd.max()) + 2))
    load = np.zeros(held_ranks.shape, dtype=np.int64)
    out = np.empty(len(box), dtype=np.int64)
    far = np.int64(1) << 62
    scale = np.int64(int(held_ranks.max()) + 1)
    for r in range(len(bounds) - 1):
        at = rounds[bounds[r]:bounds[r + 1]]
        b = box[at]
        rows = load[b]
        least = rows == rows.min(axis=1, keepdims=True)
        key = np.where(least, np.abs(held_ranks[b] - near[at, None]) * scale + held_ranks[b], far)
        j = np.argmin(key, axis=1)
        load[b, j] += size[at]
        out[at] = j
    return out


def moves_traffic(moves) -> tuple[int, int, bool]:
    """:func:`exchange_traffic` counted on the moves (``Exchange.traffic``'s rules)."""
    sent, sends, recvs = {}, {}, {}
    for m in moves:
        if m.is_local:
            continue
        n = 1
        for lo, hi in m.region:
            n *= hi - lo
        for r in m.group if m.is_broadcast else (m.src,):
            sent[r] = sent.get(r, 0) + n
        sends[m.src] = sends.get(m.src, 0) + 1
        for r in m.dsts:
            recvs[r] = recvs.get(r, 0) + 1
    msgs = [max(sends.get(r, 0), recvs.get(r, 0)) for r in set(sends) | set(recvs)]
    return max(sent.values(), default=0), max(msgs, default=1), bool(msgs)


__all__ = ["exchange_traffic", "grid_ranges", "moves_traffic"]
