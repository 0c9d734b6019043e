"""Random ops: values drawn per *global* position, so every layout sees the same numbers.

    B    -> B          ``uniform_``, ``normal_``, ``rand_like``, ...: kernel "random"
    S(d) -> S(d)       each rank draws the values of its own box
    P    -> P B        ``native_dropout``: linear, with a mask drawn per global position
    S(d) S(d) -> S(d)  ``rrelu_with_noise(x, noise)`` in training: slopes drawn per global
                       position (the noise it writes is laid out like x)
    S(d) S(d) -> S(d)  draws with tensor parameters, ``normal(mean, std)``, ``poisson(rates)``,
                       ``bernoulli(x, p)``: element-wise with broadcasting, each output element
                       drawn from its global position's counter and its own parameters
    S(0) -> S(0)       ``multinomial(probs, n)``: rows split, each row drawn whole from counters
                       at its global row index (``sampling.py``)
A P tensor cannot take fresh values (convert it first); dispatch says so.
"""
from __future__ import annotations

import math

import torch

from .. import random
from .creation import like
from .rules import S, Call, Row, Rule, broadcast_shapes, broadcasting, repeat, sig, B
from .registry import register


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


def random_pointwise(call: Call) -> Rule:
    """Draws with tensor parameters (``normal(mean, std)``, ``poisson``, ``bernoulli(x, p)``,
    ``exponential(x)``...): element-wise over the broadcast shape, every input that spans a
    split dim split alike; no P (a parameter is not a sum of pieces)."""
    n = len(call.shapes)
    out = broadcast_shapes(call.shapes)
    rows = [Row(repeat(n, B), (B,), "random")]
    rows += [Row(repeat(n, S(d)), (S(d),), "random") for d in range(len(out))]
    return broadcasting(rows, call.shapes, frame=out)


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
    packet, coord = ctx.call.packet.rstrip("_"), ctx.coord

    def arg(name, default=None):
        return ctx.arg(largs, lkwargs, name, default)

    if packet in ("normal", "randn_like", "log_normal"):
        z = random.normal_piece(layout, coord, torch.float64 if packet == "log_normal" else dtype,
                                device)
        if packet == "log_normal":
            return torch.exp(z * arg("std", 2.0) + arg("mean", 1.0))
        return z * arg("std", 1.0) + arg("mean", 0.0) if packet == "normal" else z
    if packet == "randint_like":
        return random.randint_piece(arg("low", 0), arg("high"), layout, coord, dtype, device)
    if packet == "random":  # integers in [from, to), by default the dtype's whole range
        low, high = arg("from", 0), arg("to")
        return random.randint_piece(low, _top(dtype) if high is None else high, layout, coord,
                                    dtype, device)
    precise = packet in ("poisson", "geometric", "cauchy")
    u_dtype = dtype if dtype in (torch.float64, torch.float32) and not precise else torch.float64
    u = random.uniform_piece(layout, coord, u_dtype, device)
    return _from_uniform(packet, u, arg, None if ctx.call.packet.endswith("_") else largs[0])


def _from_uniform(packet, u, arg, x):
    """The draw of ``packet`` from uniforms ``u`` in [0, 1) (inverse CDFs); ``x``: the
    functional form's input piece (None for the in-place forms)."""
    if packet == "uniform":
        lo, hi = arg("from", 0.0), arg("to", 1.0)
        return u * (hi - lo) + lo
    if packet == "bernoulli":  # bernoulli(probs) draws with the input's values as probabilities
        return u < arg("p", 0.5 if x is None else x)
    if packet == "exponential":
        return -torch.log1p(-u) / arg("lambd", 1.0)
    if packet == "cauchy":
        return arg("median", 0.0) + arg("sigma", 1.0) * torch.tan(math.pi * (u - 0.5))
    if packet == "geometric":  # trials up to the first success: P(K > k) = (1 - p)^k
        return torch.floor(torch.log1p(-u) / math.log1p(-arg("p"))) + 1
    if packet == "poisson":
        return random.poisson_from_uniform(u, x)
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
    if ctx.coord is None:  # outside the placement: take the counters alike, draw nothing
        random.uniform_piece(layout, None)
        return None if inplace else ctx.empties()
    values = _random_values(ctx, layout, spec.dtype, ctx.pieces[0].device, largs, lkwargs)
    if inplace:
        largs[0].copy_(values)
        return largs[0]
    return values.to(spec.dtype)


_KERNELS = {"random": _k_random}
register("rand_like", "randn_like", "randint_like", rule=like, kernels=_KERNELS)
register("uniform_", "normal_", "bernoulli_", "exponential_", "random_", "cauchy_", "geometric_",
         "log_normal_", rule=random_inplace, kernels=_KERNELS)
register("bernoulli.default", "bernoulli.p", "bernoulli.Tensor", "normal.Tensor_Tensor",
         "normal.Tensor_float", "normal.float_Tensor", "poisson.default", "uniform.default",
         "exponential.default", "cauchy.default", "geometric.default", "log_normal.default",
         rule=random_pointwise)
register("native_dropout", rule=dropout, kernels={"dropout": _k_dropout})
register("rrelu_with_noise", rule=rrelu, kernels={"rrelu": _k_rrelu})
