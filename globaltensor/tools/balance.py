"""``gt.attention_balance(q)``: how a layout of attention's queries spreads its work over the
ranks (pure: a Layout in, figures out; docs/long_context.md, "Head-tail").

Under causal attention the query at position p sees p + 1 keys, so a plain split of the
sequence over k ranks gives the last rank about 2k - 1 times the first one's work (7x on 4
ranks); the head-tail split (``S(d, "head_tail")``) gives every rank the same to within a row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import GlobalTensorError
from ..layout import Layout


@dataclass(frozen=True)
class Balance:
    """Per rank of the placement, the flops of the attention rows it holds (4 per query, key
    and feature: q @ k^T and p @ v); ``ratio``: the busiest rank's over the mean."""

    flops: dict
    layout: Layout
    causal: bool

    @property
    def ratio(self) -> float:
        values = list(self.flops.values())
        mean = sum(values) / len(values) if values else 0.0
        return max(values) / mean if mean else 1.0

    def __str__(self):
        total = sum(self.flops.values()) or 1.0
        lines = [f"attention work of queries {self.layout!r}"
                 f" ({'causal' if self.causal else 'full'}): busiest rank {self.ratio:.2f}x the mean"]
        lines += [f"  rank {r}: {f / 1e9:.3g} GFLOP ({f / total:.1%})" for r, f in self.flops.items()]
        return "\n".join(lines)


def attention_balance(q, causal: bool = True, keys: int | None = None) -> Balance:
    """The attention work each rank does for the queries ``q`` (a global tensor or a Layout
    of shape (..., L, E)) holds, against ``keys`` keys (default L, self-attention)."""
    layout = q if isinstance(q, Layout) else getattr(q, "_layout", None)
    if not isinstance(layout, Layout) or layout.ndim < 2:
        raise GlobalTensorError(
            f"attention_balance expects the queries as a global tensor (or Layout) of shape "
            f"(..., L, E), found {q!r:.80}; pass the q that reaches scaled_dot_product_attention")
    seq, features = layout.ndim - 2, layout.shape[-1]
    length = layout.shape[seq]
    keys = length if keys is None else keys
    flops = {}
    for coord, rank in zip(layout.placement.coords(), layout.placement.flat_ranks):
        ranges = layout.ranges(coord)
        batch = math.prod(sum(b - a for a, b in dim) for dim in ranges[:seq])
        seen = 0
        for lo, hi in ranges[seq]:
            if causal:  # rows p in [lo, hi) see min(p + 1 + keys - length, keys) keys
                offset = keys - length
                seen += sum(max(0, min(p + 1 + offset, keys)) for p in range(lo, hi))
            else:
                seen += (hi - lo) * keys
        flops[rank] = 4.0 * batch * seen * features
    return Balance(flops, layout, causal)


__all__ = ["Balance", "attention_balance"]
