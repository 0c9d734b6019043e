"""Reductions, scans and order statistics: ops that reduce a dim or mix values along it
(softmax, cumsum, sort, topk, median, index ops along a dim).

    B    -> B        everything replicated
    S(d) -> S(d')    a dim that is not reduced stays split (renumbered when dims go away:
                     keepdim=False)
    S(r) -> P        a reduced split dim gives partial sums, for sums (and means, kernel
                     "mean_partial": the local sum over the global count; nansum,
                     count_nonzero)
    P    -> P        sums are linear
Other reductions (max, norm, var, ...) and ops along a dim need the dim whole:
    cummax / cummin / logcumsumexp:   along ``dim``
    kthvalue / median / nanmedian / mode (.dim):   reduce ``dim`` (values and indices)
    aminmax:               reduce ``dim`` (or everything)
    index_fill / index_copy / index_reduce (self, dim, index, [source]):  a dim other than
                           ``dim`` split on self (and source) alike, index whole;
                           index_copy is linear in (self, source): P B P -> P
    take(x, index):        x whole, the index split: B S(d) -> S(d); P B -> P
    trace, vdot:           trace P -> P; vdot S(0) S(0) -> P (a dot product), P B / B P -> P
"""
from __future__ import annotations

import math

import torch

from .rules import B, P, S, Call, Ref, Row, dim_of, dims_of, linear_in, repeat, sig
from .registry import register
from ..layout import Layout


def reduced_rows(call: Call, nouts: int, partial: str | None) -> tuple[Row, ...]:
    """Reduce ``dims``: other split dims survive (renumbered); a split reduced dim gives P when
    the reduction is a sum (``partial`` names its kernel, "" for the op itself), else it must
    be gathered; a P input stays P only for sums."""
    nd = len(call.shapes[0])
    dims = dims_of(call.get("dim"), nd)
    keep = bool(call.get("keepdim", False))
    rows = [Row((B,), repeat(nouts, B))]
    for d in range(nd):
        if d not in dims:
            k = d if keep else d - sum(1 for r in dims if r < d)
            rows.append(Row((S(d),), repeat(nouts, S(k))))
        elif partial is not None:
            rows.append(Row((S(d),), repeat(nouts, P), partial or None))
    if partial is not None:
        rows.append(Row((P,), repeat(nouts, P)))
    return tuple(rows)


def all_reduced_rows(call: Call, nouts: int, partial: str | None) -> tuple[Row, ...]:
    """A reduction of every element (``sum.default`` & co)."""
    nd = len(call.shapes[0])
    rows = [Row((B,), repeat(nouts, B))]
    if partial is not None:
        rows += [Row((S(d),), repeat(nouts, P), partial or None) for d in range(nd)]
        rows.append(Row((P,), repeat(nouts, P)))
    return tuple(rows)


def reduction_sum(call: Call):
    if call.op == "sum.default":
        return all_reduced_rows(call, 1, "")
    return reduced_rows(call, 1, "")


def reduction_mean(call: Call):
    if call.op == "mean.default":
        return all_reduced_rows(call, 1, "mean_partial")
    return reduced_rows(call, 1, "mean_partial")


def reduction_gather(nouts: int):
    """Reductions that are not sums (max, norm, var, ...): reduced dims must be whole."""
    def rule(call: Call):
        if call.op.endswith(".default") and call.packet in ("max", "min", "prod", "any", "all"):
            return all_reduced_rows(call, nouts, None)
        return reduced_rows(call, nouts, None)
    return rule


def along_dim(linear: tuple[str, ...] = (), nouts: int = 1, default=None):
    """Ops that mix values along one dim (softmax, cumsum, sort): that dim must be whole; other
    splits pass through; linear ones keep P in the inputs named ``linear`` (others B)."""
    def rule(call: Call):
        nd = len(call.shapes[0])
        dim = call.get("dim", default)
        dim = dim_of(dim, nd) if dim is not None else None
        n = len(call.shapes)
        rows = [Row(repeat(n, B), repeat(nouts, B))]
        rows += [Row(repeat(n, S(d)), repeat(nouts, S(d))) for d in range(nd) if d != dim]
        for name in linear:
            rows += linear_in(call, name, nouts)
        return tuple(rows)
    return rule


def softmax_rule(call: Call):
    """``_softmax`` / ``_log_softmax(x, dim, half_to_float)``: other splits pass through; a split
    of ``dim`` itself stays split (kernel "softmax_split": each rank's row maximum and sum of
    exponentials, gathered, make the log-sum-exp: two numbers per row and rank are sent, not the
    logits: cross-entropy over vocabulary-split logits without gathering them)."""
    nd = len(call.shapes[0])
    dim = dim_of(call.get("dim"), nd)
    return along_dim()(call) + (Row((S(dim),), (S(dim),), "softmax_split"),)


def softmax_backward(call: Call):
    """``_softmax_backward_data(grad, out, dim, dtype)``: linear in grad; a split ``dim`` stays
    split (kernel "softmax_back_split": the row sums are all-reduced, one number per row)."""
    nd = len(call.shapes[0])
    dim = dim_of(call.get("dim"), nd)
    rows = [sig("B B -> B"), sig("P B -> P")]
    rows += [Row((S(d), S(d)), (S(d),)) for d in range(nd) if d != dim]
    rows.append(Row((S(dim), S(dim)), (S(dim),), "softmax_back_split"))
    return tuple(rows)


def _split_axes(layout, dim: int) -> tuple[int, ...]:
    return tuple(a for a, v in enumerate(layout.sbp) if isinstance(v, S) and v.dim == dim)


def _row_stats(ctx, piece, layout, dim: int, partial: bool):
    """Per-row statistics of ``dim`` (``piece``: this rank's, ``k`` values along ``dim``) from
    every rank that splits ``dim``: gathered side by side (``partial`` False: each rank's
    ``k`` values, in axis order) or summed (``partial`` True)."""
    axes = _split_axes(layout, dim)
    k = piece.shape[dim]
    n = math.prod(layout.placement.shape[a] for a in axes)
    shape = list(layout.shape)
    shape[dim] = k if partial else k * n
    sbp = list(layout.sbp)
    for a in axes:
        sbp[a] = P if partial else S(dim)
    src = Layout(layout.placement, tuple(sbp), tuple(shape))
    dst = src.with_sbp(tuple(B if a in axes else v for a, v in enumerate(sbp)))
    return ctx.redistribute(piece, src, dst)


def _k_softmax_split(ctx, largs, lkwargs):
    """softmax / log_softmax along a split dim: the log-sum-exp of each row from every rank's
    (max, sum of exp(x - max)) pair, one all-gather of two numbers per row."""
    x = largs[0]
    layout = ctx.targets[0]
    dim = dim_of(ctx.arg(largs, lkwargs, "dim"), len(layout.shape))
    work = x.float() if bool(ctx.arg(largs, lkwargs, "half_to_float", False)) else x
    if x.shape[dim]:
        top = work.amax(dim, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        total = (work - top).exp().sum(dim, keepdim=True)
    else:  # an empty piece of the dim (fewer classes than ranks): contributes nothing
        shape = list(work.shape)
        shape[dim] = 1
        top, total = work.new_zeros(shape), work.new_zeros(shape)
    pairs = _row_stats(ctx, torch.cat([top, total], dim), layout, dim, partial=False)
    if ctx.coord is None:
        return ctx.empties()
    pairs = pairs.unflatten(dim, (-1, 2))
    tops, totals = pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)
    best = tops.amax(dim, keepdim=True)
    lse = best + (totals * (tops - best).exp()).sum(dim, keepdim=True).log()
    out = work - lse
    return out if ctx.call.op.startswith("_log_softmax") else out.exp()


def _k_softmax_back_split(ctx, largs, lkwargs):
    """The backward of softmax / log_softmax along a split dim: each row's sum over the dim is
    a partial sum on the splitting axes, all-reduced (one number per row)."""
    grad, out = largs[0], largs[1]
    layout = ctx.targets[0]
    dim = dim_of(ctx.arg(largs, lkwargs, "dim"), len(layout.shape))
    log = ctx.call.op.startswith("_log_softmax")
    inner = grad if log else grad * out
    row = _row_stats(ctx, inner.sum(dim, keepdim=True), layout, dim, partial=True)
    if ctx.coord is None:
        return ctx.empties()
    result = grad - out.exp() * row if log else out * (grad - row)
    dtype = ctx.arg(largs, lkwargs, "input_dtype", None)
    return result.to(dtype) if dtype is not None else result


def _k_mean_partial(ctx, largs, lkwargs):
    """mean over a split dim: the local sum over the global count (a partial sum)."""
    if ctx.coord is None:
        return ctx.empties()
    x, shape = largs[0], ctx.targets[0].shape
    dtype = lkwargs.get("dtype")
    if ctx.call.op == "mean.default":
        dims, keepdim = tuple(range(len(shape))), False
    else:
        dims = dims_of(ctx.arg(largs, lkwargs, "dim"), len(shape))
        keepdim = bool(ctx.arg(largs, lkwargs, "keepdim", False))
    count = math.prod(shape[d] for d in dims)
    total = x.sum(dim=dims, keepdim=keepdim, dtype=dtype) if dims else x.to(dtype or x.dtype)
    return total / count


def _one_dim(call: Call, nouts: int, default=-1, partial=None):
    """Reduce one dim (``dim`` argument, ``default`` when absent); keepdim renumbers."""
    nd = len(call.shapes[0])
    dim = dim_of(call.get("dim", default), nd)
    keep = bool(call.get("keepdim", False))
    rows = [Row((B,), (B,) * nouts)]
    for d in range(nd):
        if d != dim:
            rows.append(Row((S(d),), (S(d if keep else d - (d > dim)),) * nouts))
    return tuple(rows)


def order_statistic(call: Call):
    """kthvalue / median.dim / nanmedian.dim / mode: values and indices along ``dim``."""
    if len(call.shapes[0]) == 0:
        return (sig("B -> B B"),)
    return _one_dim(call, 2)


def whole(nouts: int):
    def rule(call: Call):
        return all_reduced_rows(call, nouts, None)
    return rule


def aminmax(call: Call):
    if call.get("dim") is None or len(call.shapes[0]) == 0:
        return all_reduced_rows(call, 2, None)
    return _one_dim(call, 2)


def sum_like(call: Call):
    """nansum / count_nonzero: sums, so a reduced split dim gives P."""
    nd = len(call.shapes[0])
    dims = dims_of(call.get("dim"), nd)
    if nd == 0:
        return (sig("B -> B"),)
    rows = reduced_rows(call, 1, "") if len(dims) < nd or call.get("keepdim", False) else \
        all_reduced_rows(call, 1, "")
    # no P input: a count of partial sums is not the count of the sum, nor does a nansum of
    # parts skip the NaNs the sum has
    return tuple(r for r in rows if r.ins[0] != P)


def index_along(linear: bool):
    """``index_fill / index_copy / index_reduce(self, dim, index, [source], ...)``."""
    def rule(call: Call):
        x = call.shapes[0]
        nd = len(x)
        dim = dim_of(call.get("dim"), max(nd, 1))
        n = len(call.shapes)
        src = call.get("source")
        rows = [Row((B,) * n, (B,))]
        for d in range(nd):
            if d == dim:
                continue
            ins = []
            for i, shape in enumerate(call.shapes):
                if i == 0 or (isinstance(src, Ref) and i == src.index):
                    ins.append(S(d) if len(shape) == nd and shape[d] == x[d] else None)
                else:
                    ins.append(B)
            if None not in ins:
                rows.append(Row(tuple(ins), (S(d),)))
        if linear and isinstance(src, Ref):
            rows.append(Row(tuple(P if i in (0, src.index) else B for i in range(n)), (P,)))
        return tuple(rows)
    return rule


def take(call: Call):
    nd = len(call.shapes[1])
    return tuple([sig("B B -> B"), sig("P B -> P")] + [Row((B, S(d)), (S(d),)) for d in range(nd)])


def vdot(call: Call):
    return (sig("B B -> B"), sig("S(0) S(0) -> P"), sig("P B -> P"), sig("B P -> P"))


def histc(call: Call):
    """``histc(x, bins, min, max)``: counts per bin, a sum over the elements: a split of any dim
    gives partial counts (``S(d) -> P``). With ``min == max`` the range is the data's own
    (its min and max): only whole inputs."""
    rows = [sig("B -> B")]
    lo, hi = call.get("min", 0), call.get("max", 0)
    if lo != hi:
        rows += [Row((S(d),), (P,)) for d in range(len(call.shapes[0]))]
    return rows


register("histc", rule=histc, order_free=True)
register("sum", rule=reduction_sum, order_free=True)
register("mean", rule=reduction_mean, kernels={"mean_partial": _k_mean_partial}, order_free=True)
register("amax", "amin", "argmax", "argmin", "prod", "any", "all", "logsumexp",
         "linalg_vector_norm", "norm.ScalarOpt_dim", "norm.Scalar", "norm.ScalarOpt_dim_dtype",
         "var.correction", "std.correction", "max.default", "min.default",
         rule=reduction_gather(1), order_free=True)
register("max.dim", "min.dim", "var_mean.correction", "std_mean.correction",
         rule=reduction_gather(2), order_free=True)
register("_softmax", "_log_softmax", rule=softmax_rule, kernels={"softmax_split": _k_softmax_split}, order_free=True)
register("_safe_softmax", rule=along_dim(), order_free=True)
register("_softmax_backward_data", "_log_softmax_backward_data", rule=softmax_backward,
         kernels={"softmax_back_split": _k_softmax_back_split}, order_free=True)
register("cumsum", rule=along_dim(linear=("self",)), order_free=True)
register("cumprod", rule=along_dim(), order_free=True)
register("sort", "topk", rule=along_dim(nouts=2, default=-1), order_free=True)
register("cummax", "cummin", rule=along_dim(nouts=2), order_free=True)
register("logcumsumexp", rule=along_dim(), order_free=True)
register("kthvalue", "median.dim", "nanmedian.dim", "mode", rule=order_statistic, order_free=True)
register("median.default", "nanmedian.default", rule=whole(1), order_free=True)
register("aminmax", rule=aminmax, order_free=True)
register("nansum", "count_nonzero", rule=sum_like, order_free=True)
register("index_fill", "index_fill_", "index_reduce", "index_reduce_", rule=index_along(False))
register("index_copy", "index_copy_", rule=index_along(True))
register("take", rule=take)
register("trace", rule=lambda call: (sig("B -> B"), sig("P -> P")))
register("vdot", rule=vdot)
