"""Random ops: values drawn per *global* position, so every layout sees the same numbers.

    B    -> B          ``uniform_``, ``normal_``, ``rand_like``, ...: kernel "random"
    S(d) -> S(d)       each rank draws the values of its own box
    P    -> P B        ``native_dropout``: linear, with a mask drawn per global position
    S(d) S(d) -> S(d)  ``rrelu_with_noise(x, noise)`` in training: slopes drawn per global
                       position (the noise it writes is laid out like x)
A P tensor cannot take fresh values (convert it first); dispatch says so.
"""
from __future__ import annotations

import math

import torch

from .. import random
from .creation import like
from .signature import S, Call, Row, register, repeat, sig, B


def random_inplace(call: Call) -> tuple[Row, ...]:
    """``uniform_`` / ``normal_`` / ``bernoulli_``: fill with values consistent with the sbp;
    a P tensor cannot take fresh values (convert it first)."""
    nd = len(call.shapes[0])
    n = len(call.shapes)
    rows = [Row(repeat(n, B), (B,), "random")]
    for d in range(nd):
        others = tuple(S(d) if call.shapes[i] == call.shapes[0] else B for i in range(1, n))
        rows.append(Row((S(d),) + others, (S(d),), "random"))
    return tuple(rows)


def random_functional(call: Call) -> tuple[Row, ...]:
    """``bernoulli(probs)``: fresh values laid out like the input; no P."""
    nd = len(call.shapes[0])
    return (sig("B -> B", "random"),) + tuple(Row((S(d),), (S(d),), "random") for d in range(nd))


def dropout(call: Call) -> tuple[Row, ...]:
    """``native_dropout(x, p, train) -> (out, mask)``: the mask depends only on the global
    position, so every layout works; dropout is linear, so P -> P with a B mask."""
    nd = len(call.shapes[0])
    rows = [sig("B -> B B", "dropout"), sig("P -> P B", "dropout")]
    rows += [Row((S(d),), (S(d), S(d)), "dropout") for d in range(nd)]
    return tuple(rows)


def _k_dropout(ctx, largs, lkwargs):
    """native_dropout: the mask is drawn per global position, so replicas agree."""
    x, p = largs[0], ctx.arg(largs, lkwargs, "p")
    if ctx.arg(largs, lkwargs, "train", True) is False:
        return ctx.empties() if ctx.coord is None else ctx.func(*largs, **lkwargs)
    u = random.uniform_piece(ctx.outs[0].layout, ctx.coord, torch.float32, x.device)
    if ctx.coord is None:
        return ctx.empties()
    mask = u >= p
    scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
    return x * mask * scale, mask


def rrelu(call: Call) -> tuple[Row, ...]:
    """``rrelu_with_noise(x, noise, lower, upper, training)``: element-wise, x and the noise it
    writes split alike; in training the slopes are drawn per global position."""
    nd = len(call.shapes[0])
    rows = [Row(repeat(len(call.shapes), B), (B,), "rrelu")]
    return tuple(rows + [Row(repeat(len(call.shapes), S(d)), (S(d),), "rrelu") for d in range(nd)])


def _k_rrelu(ctx, largs, lkwargs):
    """torch's rrelu: where x <= 0 the output is x * r, r uniform in [lower, upper), and the
    noise holds r (1 elsewhere); r depends on the global position only, so replicas agree."""
    x, noise = largs[0], largs[1]
    if not ctx.arg(largs, lkwargs, "training", False):
        return ctx.empties() if ctx.coord is None else ctx.func(*largs, **lkwargs)
    lower, upper = ctx.arg(largs, lkwargs, "lower", 0.125), ctx.arg(largs, lkwargs, "upper", 1 / 3)
    u_dtype = x.dtype if x.dtype in (torch.float64, torch.float32) else torch.float32
    u = random.uniform_piece(ctx.outs.layout, ctx.coord, u_dtype, x.device)
    if ctx.coord is None:
        return ctx.empties()
    negative = x <= 0
    r = (lower + (upper - lower) * u).to(x.dtype)
    noise.copy_(torch.where(negative, r, torch.ones_like(r)))
    return torch.where(negative, x * r, x)


def _random_values(ctx, layout, dtype, device, largs, lkwargs):
    packet, coord = ctx.call.packet, ctx.coord

    def arg(name, default=None):
        return ctx.arg(largs, lkwargs, name, default)

    if packet in ("normal_", "randn_like"):
        z = random.normal_piece(layout, coord, dtype, device)
        return z * arg("std", 1.0) + arg("mean", 0.0) if packet == "normal_" else z
    if packet == "randint_like":
        return random.randint_piece(arg("low", 0), arg("high"), layout, coord, dtype, device)
    if packet == "random_":  # integers in [from, to), by default the dtype's whole range
        low, high = arg("from", 0), arg("to")
        return random.randint_piece(low, _top(dtype) if high is None else high, layout, coord,
                                    dtype, device)
    u_dtype = dtype if dtype in (torch.float64, torch.float32) else torch.float32
    u = random.uniform_piece(layout, coord, u_dtype, device)
    if packet == "uniform_":
        lo, hi = arg("from", 0.0), arg("to", 1.0)
        return u * (hi - lo) + lo
    if packet == "bernoulli_":
        return u < arg("p", 0.5)
    if packet == "bernoulli":  # bernoulli(probs) draws with the input's values as probabilities
        return u < arg("p", largs[0])
    if packet == "exponential_":
        return -torch.log1p(-u) / arg("lambd", 1.0)
    return u  # rand_like


def _top(dtype) -> int:
    """One past the largest value ``random_()`` draws for ``dtype`` (torch's bounds)."""
    if dtype == torch.bool:
        return 2
    if dtype.is_floating_point:  # [0, 2**digits], digits the mantissa's (eps = 2**(1 - digits))
        return 2 ** (1 - int(math.log2(torch.finfo(dtype).eps))) + 1
    return torch.iinfo(dtype).max + 1


def _k_random(ctx, largs, lkwargs):
    """Random fills and *_like draws: values depend on the global position only."""
    inplace = ctx.call.packet.endswith("_")
    spec = ctx.outs
    layout = ctx.targets[0] if inplace else spec.layout
    values = _random_values(ctx, layout, spec.dtype, ctx.pieces[0].device, largs, lkwargs)
    if ctx.coord is None:
        return None if inplace else ctx.empties()
    if inplace:
        largs[0].copy_(values)
        return largs[0]
    return values.to(spec.dtype)


_KERNELS = {"random": _k_random}
register("rand_like", "randn_like", "randint_like", rule=like, kernels=_KERNELS)
register("uniform_", "normal_", "bernoulli_", "exponential_", "random_", rule=random_inplace,
         kernels=_KERNELS)
register("bernoulli.default", "bernoulli.p", rule=random_functional, kernels=_KERNELS)
register("native_dropout", rule=dropout, kernels={"dropout": _k_dropout})
register("rrelu_with_noise", rule=rrelu, kernels={"rrelu": _k_rrelu})
