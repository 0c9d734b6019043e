"""``multinomial``: categorical draws from gt's counter-based stream (``random.py``).

    B    -> B          1-D probabilities, or rows replicated
    S(0) -> S(0)       rows split: each rank draws its own rows

A row's categories are never split (a draw reads the whole row). Every draw of row ``r`` comes
from counters at ``r``'s global index, so a row's tokens do not depend on how the rows are
split, and broadcast replicas draw the same:

- without replacement (HF's sampling, ``num_samples=1``): one counter per (row, category) at the
  category's global position in ``probs``; an exponential race, ``E / p`` with ``E`` standard
  exponential, picks the ``num_samples`` smallest keys, in order (the law of drawing one by one
  without replacement); categories without mass come last, in index order, as in torch;
- with replacement: one counter per (row, sample) at the sample's global position in the
  output, each the inverse of the row's cumulative distribution.
"""
from __future__ import annotations

import torch

from .. import random
from .rules import B, S, Call, Row
from .registry import register


def multinomial(call: Call) -> tuple[Row, ...]:
    """``multinomial(probs, n)``: rows split or replicated; the categories whole."""
    rows = [Row((B,), (B,), "multinomial")]
    if len(call.shapes[0]) == 2:
        rows.append(Row((S(0),), (S(0),), "multinomial"))
    return tuple(rows)


def _k_multinomial(ctx, largs, lkwargs):
    probs = largs[0]
    n = ctx.arg(largs, lkwargs, "num_samples")
    replacement = ctx.arg(largs, lkwargs, "replacement", False)
    counters = ctx.outs.layout if replacement else ctx.targets[0]
    u = random.uniform_piece(counters, ctx.coord, torch.float64, probs.device)
    if ctx.coord is None:
        return ctx.empties()
    return draw(probs, u, n, replacement)


def draw(probs: torch.Tensor, u: torch.Tensor, n: int, replacement: bool) -> torch.Tensor:
    """``n`` category indices per row of ``probs`` (1-D or 2-D) from uniforms ``u`` in [0, 1):
    shaped like ``probs`` without replacement, like the result with it."""
    p = probs.to(torch.float64)
    _check(p)
    if not replacement:
        keys = -torch.log1p(-u) / p  # p == 0: inf, after every category with mass (as torch)
        return torch.sort(keys, dim=-1, stable=True).indices[..., :n]
    cdf = torch.cumsum(p, dim=-1)
    index = torch.searchsorted(cdf, u * cdf[..., -1:], right=True)
    # rounding may put u * total at the total: the last category with mass
    last = p.shape[-1] - 1 - torch.argmax(torch.flip(p > 0, dims=(-1,)).to(torch.int8), dim=-1)
    return torch.minimum(index, last.unsqueeze(-1))


def _check(p: torch.Tensor) -> None:
    """torch's checks of the values (its meta function checks the shapes)."""
    if p.numel() == 0:
        return
    if not bool(torch.isfinite(p).all()) or bool((p < 0).any()):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    if bool((p.sum(dim=-1) <= 0).any()):
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")


register("multinomial", rule=multinomial, kernels={"multinomial": _k_multinomial})
