"""Gather, scatter and indexing: split the dims the index does not reach.

    B    B    -> B        everything replicated
    S(d) S(d) -> S(d)     a dim other than the indexed one, where the tensors agree in size
    B    S(k) -> S(k)     x whole, the index split: each rank picks its own part
    P    B    -> P        reading with B indices is linear in x

masked_scatter(x, mask, source) fills the positions where mask (broadcast against x) holds,
in row-major order, with source's elements in order: which element lands where depends on
the mask before a position, so each split of the output runs kernel "mask_positions" with
mask and source whole (each rank numbers the mask's positions, then takes its own):

    S(k) B    B    -> S(d)   x split on the output's dim d (k: x's own dim), or B where x is
                             broadcast; the other dims' positions follow from the whole mask
    P    B    P    -> P      linear in (x, source) together
masked_scatter_backward(grad, mask, sizes) (source's gradient: grad at the mask's positions):
    S(d) B    -> P           [mask_positions] each rank puts its positions' values, zeros elsewhere
    P    B    -> P
"""
from __future__ import annotations

import math

import torch

from .rules import B, P, S, Call, Ref, Row, broadcast_shapes, broadcasting, dim_of, fit, repeat, sig

from .registry import register


def gather(call: Call):
    """``gather(x, dim, index)``: output shaped like index. Split a dim other than ``dim`` where
    x and index agree in size; or keep x whole and split the index along ``dim``."""
    x, idx = call.shapes[0], call.shapes[1]
    dim = dim_of(call.get("dim"), len(x))
    rows = [sig("B B -> B"), sig("P B -> P"), Row((B, S(dim)), (S(dim),))]
    rows += [Row((S(d), S(d)), (S(d),)) for d in range(len(x)) if d != dim and x[d] == idx[d]]
    return tuple(rows)


def scatter(call: Call):
    """``scatter(x, dim, index, src)`` (and scatter_add / value variants): split a dim other
    than ``dim`` where every tensor has the same size."""
    shapes = call.shapes
    n = len(shapes)
    dim = dim_of(call.get("dim"), len(shapes[0]))
    rows = [Row(repeat(n, B), (B,))]
    for d in range(len(shapes[0])):
        if d != dim and len({s[d] for s in shapes}) == 1:
            rows.append(Row(repeat(n, S(d)), (S(d),)))
    if call.packet in ("scatter_add", "scatter_add_") and n == 3:
        rows.append(sig("P B P -> P"))  # x + scatter(src): linear in (x, src) together
    return tuple(rows)


def index_add(call: Call):
    """``index_add(x, dim, index, source)`` (index_select's backward): split a dim other than
    ``dim`` on x and source alike; linear in (x, source) together."""
    x, src = call.shapes[0], call.shapes[2]
    dim = dim_of(call.get("dim"), len(x))
    rows = [sig("B B B -> B"), sig("P B P -> P")]
    rows += [Row((S(d), B, S(d)), (S(d),)) for d in range(len(x)) if d != dim and x[d] == src[d]]
    return tuple(rows)


def index_select(call: Call):
    """``index_select(x, dim, index)``: a dim other than ``dim`` splits x; or x whole and the
    (1-D) index split, giving ``dim`` split. A 0-dim x or index has no dim to split."""
    x, idx = call.shapes[0], call.shapes[1]
    dim = dim_of(call.get("dim"), len(x))
    rows = [sig("B B -> B"), sig("P B -> P")]
    if len(x) and len(idx):
        rows.append(Row((B, S(0)), (S(dim),)))
    rows += [Row((S(d), B), (S(d),)) for d in range(len(x)) if d != dim]
    return tuple(rows)


def index(call: Call):
    """``x[indices]``: all B, or P with B indices; with one index tensor on dim 0, x's other
    dims pass through and an index split passes to the output."""
    n = len(call.shapes)
    rows = [Row(repeat(n, B), (B,)), Row((P,) + repeat(n - 1, B), (P,))]
    indices = call.get("indices")
    if n == 2 and len(indices) == 1 and isinstance(indices[0], Ref):
        x, idx = call.shapes
        rows += [Row((S(d), B), (S(d - 1 + len(idx)),)) for d in range(1, len(x))]
        rows += [Row((B, S(k)), (S(k),)) for k in range(len(idx))]
    return tuple(rows)


def index_put(call: Call):
    """``index_put(x, indices, values, accumulate)``: linear in (x, values) together."""
    n = len(call.shapes)
    rows = [Row(repeat(n, B), (B,))]
    values = call.get("values")
    if isinstance(values, Ref) and call.is_global("self"):
        rows.append(Row(tuple(P if i in (0, values.index) else B for i in range(n)), (P,)))
    return tuple(rows)


def masked_scatter(call: Call):
    """``masked_scatter(x, mask, source)``: see the module's docstring."""
    present = tuple(call.is_global(n) for n in ("self", "mask", "source"))
    rows = [sig("B B B -> B"), sig("P B P -> P")]
    if not present[0]:
        return fit(rows, present)
    out = broadcast_shapes([call.shape_of("self"), call.shape_of("mask") or ()])
    rows += [Row((S(d), B, B), (S(d),), "mask_positions") for d in range(len(out))]
    return broadcasting(fit(rows, present), call.shapes, inputs=(0,), frame=out)


def masked_scatter_backward(call: Call):
    """``masked_scatter_backward(grad, mask, sizes)``: see the module's docstring."""
    rows = [sig("B B -> B"), sig("P B -> P")]
    rows += [Row((S(d), B), (P,), "mask_positions") for d in range(len(call.shapes[0]))]
    return fit(rows, (True, call.is_global("mask")))


def _k_mask_positions(ctx, largs, lkwargs):
    """masked_scatter (or its backward) on a split of the output (grad): the whole mask,
    broadcast to the output's shape, numbers its positions (a cumulative sum); this rank's
    positions take the source elements of their numbers (backward: put their grad values
    there, in a zero tensor of the source's shape: a partial sum)."""
    if ctx.coord is None:
        return ctx.empties()
    backward = ctx.call.packet == "masked_scatter_backward"
    layout = ctx.targets[0] if backward else ctx.outs.layout  # the output's (one OutSpec)
    mask = ctx.arg(largs, lkwargs, "mask").expand(layout.shape)
    number = (mask.reshape(-1).cumsum(0) - 1).reshape(layout.shape)
    box = layout.slices(ctx.coord)
    mine = mask[box]
    if backward:
        grad, sizes = largs[0], ctx.arg(largs, lkwargs, "sizes")
        out = grad.new_zeros(math.prod(sizes))
        out[number[box][mine]] = grad[mine]
        return out.view(sizes)
    x, source = ctx.arg(largs, lkwargs, "self"), ctx.arg(largs, lkwargs, "source")
    count = int(number.reshape(-1)[-1]) + 1 if number.numel() else 0
    if count > source.numel():
        raise RuntimeError(f"masked_scatter: expected source to have at least {count} elements "
                           f"(the mask's true positions), found {source.numel()}")
    x = torch.broadcast_to(x, mine.shape)
    return x.masked_scatter(mine, source.reshape(-1)[number[box][mine]])


register("gather", rule=gather)
register("scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", rule=scatter)
register("index_add", "index_add_", rule=index_add)
register("index_select", rule=index_select)
register("index", rule=index)
register("index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put", rule=index_put)
register("masked_scatter", rule=masked_scatter, kernels={"mask_positions": _k_mask_positions})
register("masked_scatter_backward", rule=masked_scatter_backward)
