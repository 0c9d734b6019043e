"""Ring attention: the queries, keys and values all split on the sequence along one axis; the
key/value chunks travel around the axis's ranks (n - 1 shifts of one chunk each, the
accumulated key/value gradients one more in backward, so they end where they started), and
each rank merges its rows' partial softmaxes by log-sum-exp (docs/long_context.md, "Ring").

A shift is a redistribution between two placements: the axis's ranks rolled by j and by j + 1
(the piece a rank holds of the first is the piece its predecessor holds of the second), so it
runs on the wire as point-to-point messages, counted by comm_trace and gt.simulate like any
other. Every rank makes every shift (a rank with no rows too, and ranks outside the placement:
empty pieces), so the calls match everywhere. Causal: a key chunk after all of a row range's
positions is passed on without compute, the diagonal one runs with torch's causal mask, the
earlier ones unmasked; chunks of one layout are identical or disjoint, so no rows x keys mask
is made. Works for head-tail splits too: a piece is then two ranges of rows and of keys.

The next chunk's messages overlap this chunk's compute: the shifts run, in order, on the
call's own thread (``KernelContext.start``, :class:`_Shifts`). Pure: communication only through ``ctx.redistribute``.
"""
from __future__ import annotations

import numpy as np
import torch

from .._cache import memo
from ..layout import Layout
from ..placement import Placement
from ..sbp import Split


def ring_axis(layout: Layout, seq: int):
    """The axis (of more than one rank) along which ``layout`` (the keys') splits the
    sequence dim ``seq``, or None (the keys are whole: the all-gather way)."""
    for a, (v, n) in enumerate(zip(layout.sbp, layout.placement.shape)):
        if isinstance(v, Split) and v.dim == seq and n > 1:
            return a
    return None


@memo(4096)
def _rolled(layout: Layout, axis: int, j: int) -> Layout:
    """``layout`` on its placement with ``axis`` rolled by ``j``: coordinate c held by the
    rank at c + j."""
    p = layout.placement
    ranks = np.roll(p.ranks, -j, axis=axis)
    return Layout(Placement(p.type, ranks, p.axes), layout.sbp, layout.shape)


def _runs(layout: Layout, coord, seq: int):
    """(start in the piece, [lo, hi) in the sequence) of each range ``coord``'s piece holds."""
    out, start = [], 0
    for lo, hi in layout.ranges(coord)[seq]:
        if hi > lo:
            out.append((start, lo, hi))
        start += hi - lo
    return out


def _visible(causal: bool, rows, keys) -> tuple[bool, bool]:
    """(compute this block?, with torch's causal mask?) for row and key ranges that are equal
    or disjoint."""
    (lo, hi), (a, b) = rows, keys
    if not causal or b <= lo:
        return True, False
    if (a, b) == (lo, hi):
        return True, True
    return False, False  # keys after every row here


def ring(ctx, largs, lkwargs, first: int, seq: int, axis: int, merged):
    """Attention (``first`` 0) or its backward (``first`` 1) with k and v split along
    ``axis``; ``merged(a, b)`` joins two (out, lse) of disjoint keys."""
    layout = ctx.targets[first + 1]
    n, coord = layout.placement.shape[axis], ctx.coord
    q, k, v = largs[first:first + 3]
    live = coord is not None and not any(p is not None and p.numel() == 0 for p in ctx.pieces)
    rows = _runs(ctx.targets[first], coord, seq) if live else []
    backward = first == 1
    # backward: (dq, dk, dv), dk and dv travelling with their chunk; forward: per row range,
    # the merged (out, lse) of the key chunks seen so far
    state = [torch.zeros_like(t) for t in (q, k, v)] if backward else [None] * len(rows)
    with _Shifts(ctx, layout, axis) as shifts:
        for j in range(n):
            # the held chunk goes on to the next rank while this rank computes with it
            coming = shifts.start((k, v), j) if j < n - 1 else None
            if live:
                held = tuple(coord[:axis]) + ((coord[axis] - j) % n,) + tuple(coord[axis + 1:])
                _step(ctx, largs, lkwargs, first, rows, _runs(layout, held, seq), k, v, state,
                      merged)
            if backward:  # the gradients travel with their chunk: n shifts bring them home
                state[1], state[2] = shifts.start((state[1], state[2]), j).result()
            if coming is not None:
                k, v = coming.result()
    if coord is None:
        return ctx.empties()
    if not live:
        return ctx.zeros()
    return tuple(state) if backward else _joined(state, seq)


def _step(ctx, largs, lkwargs, first: int, rows, keys, k, v, state, merged) -> None:
    """One chunk of keys against this rank's row ranges: the blocks that see a key computed,
    folded into ``state``."""
    q = largs[first]
    mask = ctx.arg(largs, lkwargs, "attn_mask")
    scale = ctx.arg(largs, lkwargs, "scale")
    dropout = ctx.arg(largs, lkwargs, "dropout_p", 0.0)
    causal = bool(ctx.arg(largs, lkwargs, "is_causal", False))
    for r, (rs, lo, hi) in enumerate(rows):
        for ks, a, b in keys:
            run, tri = _visible(causal, (lo, hi), (a, b))
            if not run:
                continue
            m = None if mask is None else _block(mask, rs, hi - lo, a, b)
            kb, vb = k.narrow(-2, ks, b - a), v.narrow(-2, ks, b - a)
            if first:
                grad, out, lse = largs[0], largs[4], largs[5]
                g = ctx.func(grad.narrow(-2, rs, hi - lo), q.narrow(-2, rs, hi - lo), kb, vb,
                             out.narrow(-2, rs, hi - lo), lse.narrow(-1, rs, hi - lo), dropout,
                             tri, attn_mask=m, scale=scale)
                state[0].narrow(-2, rs, hi - lo).add_(g[0])
                state[1].narrow(-2, ks, b - a).add_(g[1])
                state[2].narrow(-2, ks, b - a).add_(g[2])
            else:
                part = _no_keys(ctx.func(q.narrow(-2, rs, hi - lo), kb, vb, dropout, tri,
                                         attn_mask=m, scale=scale)[:2], m)
                state[r] = part if state[r] is None else merged(state[r], part)


def _joined(parts, seq: int):
    """The row ranges' (out, lse), in the piece's order, as one; a row the mask hides every
    key from: out 0 and lse 0, as torch's kernel gives it. (The log-sum-exp is (batch, heads,
    L): its sequence dim is the output's too.)"""
    outs = [(o, lse.masked_fill(torch.isneginf(lse), 0.0))
            for o, lse in (part for part in parts if part is not None)]
    if len(outs) == 1:
        return outs[0]
    return torch.cat([o for o, _ in outs], dim=seq), torch.cat([l for _, l in outs], dim=seq)


def _no_keys(part, mask):
    """A block's (out, lse) with the rows its mask hides every key from marked as such (lse
    -inf: they add nothing to the merge). torch's CPU kernel gives them 0 and an lse of 0,
    which a merge would weigh as a block of keys (a boolean mask's False, or -inf)."""
    if mask is None or mask.is_meta:  # (a meta piece: no values, the shapes are the same)
        return part
    hidden = ~mask if mask.dtype == torch.bool else torch.isneginf(mask)
    dead = hidden.all(-1)  # (..., rows), broadcast against (batch, heads, rows)
    if not bool(dead.any()):
        return part
    out, lse = part
    dead = dead.expand(lse.shape)
    return out.masked_fill(dead.unsqueeze(-1), 0.0), lse.masked_fill(dead, float("-inf"))


def _block(mask, start: int, length: int, a: int, b: int):
    """The mask's rows of this row range (its piece holds the queries' rows) and columns of
    the key range (whole)."""
    if mask.dim() >= 2 and mask.shape[-2] > 1:
        mask = mask.narrow(-2, start, length)
    return mask.narrow(-1, a, b - a) if mask.shape[-1] > 1 else mask


class _Shifts:
    """The ring's shifts, started in order on the call's own thread (``ctx.start``) while the
    caller computes (torch's kernels and the wire's messages release the GIL): every rank
    starts the same shifts in the same order and only that thread sends until the ring is
    done, so the messages pair up as they would one after another."""

    def __init__(self, ctx, layout: Layout, axis: int):
        self.ctx, self.layout, self.axis = ctx, layout, axis

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.ctx.close()
        return False

    def start(self, pieces, j: int):
        """The future of ``pieces`` as held at step ``j + 1``: each rank's to its successor."""
        return self.ctx.start(pieces, _rolled(self.layout, self.axis, j),
                              _rolled(self.layout, self.axis, j + 1))


__all__ = ["ring", "ring_axis"]
