"""Losses: nll, pointwise (mse, smooth_l1, huber), elementwise (binary cross entropy, soft
margin) and per-sample (margin) losses, and their backwards.

A batch split passes through; a mean over a split batch is the local sum over the global count
(kernels "loss_mean", "nll_mean", "sample_loss").
"""
from __future__ import annotations

import math

import torch

from .rules import B, P, S, Call, Row, broadcast_shapes, broadcasting, fit, repeat, sig, with_arg

from .registry import register


def nll_loss(call: Call):
    """``nll_loss_forward(x, target, weight, reduction, ignore_index) -> (out, total_weight)``:
    batch split; a mean divides the local sum by the global total weight."""
    reduction = call.get("reduction", 1)
    present = (True, True, call.is_global("weight"))
    batched = len(call.shapes[0]) >= 2
    rows = [sig("B B B -> B B"), sig("P B B -> P B")]
    if batched and reduction == 0:
        rows.append(sig("S(0) S(0) B -> S(0) B"))
    elif batched and reduction == 2:
        rows.append(sig("S(0) S(0) B -> P P"))
    elif batched:
        rows.append(sig("S(0) S(0) B -> P B", "nll"))
    if not call.is_global("weight") and call.get("ignore_index", -100) < 0:
        # classes split (vocab-parallel logits): the rank that holds a row's target class picks
        # its value, the others add nothing (kernel "nll": other ranks' targets become ignored)
        classes = 1 if batched else 0
        rows.append(Row((S(classes), B, B), (P, B), "nll"))
    return fit(rows, present)


def _local_targets(ctx, x_layout, target, ignore_index):
    """``target`` as indices into this rank's piece of the classes (of ``x_layout``, the
    scores'): those it does not hold become ``ignore_index`` (they add nothing here)."""
    dim = 1 if len(x_layout.shape) >= 2 else 0
    if not any(isinstance(v, S) and v.dim == dim for v in x_layout.sbp):
        return target
    lo, hi = x_layout.range_of(ctx.coord, dim)
    held = (target >= lo) & (target < hi)
    return torch.where(held, target - lo, torch.full_like(target, ignore_index))


def _k_nll(ctx, largs, lkwargs):
    """nll_loss over a split batch and/or split classes: the local sum (each row's value by the
    rank holding its target class) and, for a mean, the global total weight (the count of rows
    not ignored: an all-reduce of one number over the batch's axes)."""
    largs = list(largs)
    reduction = ctx.arg(largs, lkwargs, "reduction", 1)
    ignore = ctx.arg(largs, lkwargs, "ignore_index", -100)
    if ctx.coord is None:
        total, count = largs[0].new_zeros(()), largs[0].new_zeros(())
    else:
        target = largs[1]
        local = _local_targets(ctx, ctx.targets[0], target, ignore)
        largs[1] = local
        kwargs = with_arg(ctx.call.op, largs, lkwargs, "reduction", 2 if reduction else 0)
        total, _ = ctx.func(*largs, **kwargs)
        count = (target != ignore).sum().to(total.dtype if total.is_floating_point() else torch.float32)
    dst = ctx.outs[1].layout
    if reduction == 1:  # the count over the batch's split axes (target S there, B elsewhere)
        partial = tuple(P if isinstance(v, S) else d for v, d in zip(ctx.targets[1].sbp, dst.sbp))
        count = ctx.redistribute(count.to(ctx.outs[1].dtype), dst.with_sbp(partial), dst)
    if ctx.coord is None:
        return ctx.empties()
    if reduction == 1:
        return total / count, count
    return total, count.to(ctx.outs[1].dtype) if reduction == 2 else largs[0].new_zeros(())


def _k_nll_backward(ctx, largs, lkwargs):
    """nll_loss_backward with split classes: only the rank holding a row's target class writes
    its gradient."""
    if ctx.coord is None:
        return ctx.empties()
    largs = list(largs)
    ignore = ctx.arg(largs, lkwargs, "ignore_index", -100)
    largs[2] = _local_targets(ctx, ctx.targets[1], largs[2], ignore)
    return ctx.func(*largs, **lkwargs)


def nll_loss_backward(call: Call):
    """``nll_loss_backward(grad, x, target, weight, reduction, ignore_index, total_weight)``."""
    reduction = call.get("reduction", 1)
    present = (True, True, True, call.is_global("weight"), True)
    rows = [sig("B B B B B -> B"), sig("P B B B B -> P")]
    if len(call.shapes[1]) >= 2:
        if reduction == 0:
            rows.append(sig("S(0) S(0) S(0) B B -> S(0)"))
        else:
            rows.append(sig(f"B S(0) S(0) B {'P' if reduction == 2 else 'B'} -> S(0)"))
    if not call.is_global("weight") and call.get("ignore_index", -100) < 0:
        # split classes: the target's holder writes (kernel)
        classes = 1 if len(call.shapes[1]) >= 2 else 0
        rows.append(Row((B, S(classes), B, B, B), (S(classes),), "nll_back"))
    return fit(rows, present)


def pointwise_loss(call: Call):
    """``mse_loss(x, target, reduction)`` & co: element-wise (x and target broadcast against
    each other), then reduced. A split gives a split (none), a partial sum (sum) or a partial
    mean over the global count (mean)."""
    reduction = call.get("reduction", 1)
    frame = broadcast_shapes(call.shapes)
    rows = [sig("B B -> B")]
    for d in range(len(frame)):
        out = S(d) if reduction == 0 else P
        rows.append(Row((S(d), S(d)), (out,), "loss_mean" if reduction == 1 else None))
    return broadcasting(rows, call.shapes, frame=frame)


def pointwise_loss_backward(call: Call):
    """``mse_loss_backward(grad, x, target, reduction)``: linear in grad; a mean divides by the
    global count. x and target broadcast against each other (grad has their shape, or is 0-dim)."""
    reduction = call.get("reduction", 1)
    frame = broadcast_shapes(call.shapes[1:])
    rows = [sig("B B B -> B"), sig("P B B -> P")]
    for d in range(len(frame)):
        g = S(d) if reduction == 0 else B
        rows.append(Row((g, S(d), S(d)), (S(d),), "loss_mean" if reduction == 1 else None))
    return broadcasting(rows, call.shapes, inputs=(1, 2), frame=frame)


# losses whose mean is over the samples (dim 0 of a (N, C) input), not over every element
_PER_SAMPLE = ("multi_margin_loss", "multilabel_margin_loss")


def loss_count(call: Call) -> int:
    """The count a loss with reduction='mean' divides by: the element count of its
    reduction='none' result (global shapes). Element-wise losses: every element of the input;
    multi_margin / multilabel_margin: the samples (N of an (N, C) input, 1 of a (C,) one)."""
    x = call.shapes[1 if call.packet.endswith("_backward") else 0]  # backward: grad first
    if call.packet.startswith(_PER_SAMPLE):
        return x[0] if len(x) == 2 else 1
    return math.prod(x)


def _k_loss_mean(ctx, largs, lkwargs):
    """A loss (or its backward) with reduction='mean' on split inputs: the local result with
    reduction='sum', over the global count (:func:`loss_count`)."""
    if ctx.coord is None:
        return ctx.empties()
    if ctx.call.packet.startswith(_PER_SAMPLE):
        empty = _empty_sample_loss(ctx, largs)
        if empty is not None:
            return empty
    largs = list(largs)
    lkwargs = with_arg(ctx.call.op, largs, lkwargs, "reduction", 2)  # sum
    out = ctx.func(*largs, **lkwargs)
    count = loss_count(ctx.call)
    if isinstance(out, tuple):  # multilabel_margin_loss_forward: (loss, is_target)
        return (out[0] / count,) + tuple(out[1:])
    return out / count


def _empty_sample_loss(ctx, largs):
    """Zeros of the output shapes when this rank's piece of x has no sample: torch's CPU
    multi_margin / multilabel_margin kernels return uninitialised memory for a sum over an
    empty batch (seen on torch 2.13); None otherwise."""
    x = largs[1 if ctx.call.packet.endswith("_backward") else 0]
    if x.numel() != 0:
        return None
    outs = ctx.outs if isinstance(ctx.outs, (tuple, list)) else (ctx.outs,)
    out = tuple(torch.zeros(o.layout.local_shape(ctx.coord), dtype=o.dtype, device=x.device)
                for o in outs)
    return out if isinstance(ctx.outs, (tuple, list)) else out[0]


def _k_sample_loss(ctx, largs, lkwargs):
    """multi_margin / multilabel_margin (and backward) on a batch split with reduction 'none'
    or 'sum': the op on the piece, zeros for a piece with no sample."""
    if ctx.coord is None:
        return ctx.empties()
    empty = _empty_sample_loss(ctx, largs)
    return ctx.func(*largs, **lkwargs) if empty is None else empty


def elementwise_loss(call: Call):
    """``binary_cross_entropy(x, target, weight, reduction)``, ``binary_cross_entropy_with_logits
    (x, target, weight, pos_weight, reduction)``, ``soft_margin_loss(x, target, reduction)``:
    x and target alike, weight / pos_weight broadcast against x. Any dim splits: none -> S(d),
    sum -> P, mean -> P with kernel "loss_mean" (local sum / global element count)."""
    reduction = call.get("reduction", 1)
    x = call.shapes[0]
    n = len(call.shapes)
    rows = [Row(repeat(n, B), (B,))]
    for d in range(len(x)):
        out = S(d) if reduction == 0 else P
        rows.append(Row(repeat(n, S(d)), (out,), "loss_mean" if reduction == 1 else None))
    return broadcasting(rows, call.shapes, inputs=range(2, n), frame=x)


def elementwise_loss_backward(call: Call):
    """``binary_cross_entropy_backward(grad, x, target, weight, reduction)``,
    ``soft_margin_loss_backward(grad, x, target, reduction)``: linear in grad; a split of x
    splits the gradient (grad S(d) for none, B for sum and mean; mean over the global count)."""
    reduction = call.get("reduction", 1)
    x = call.shapes[1]
    n = len(call.shapes)
    rows = [Row(repeat(n, B), (B,)), Row((P,) + repeat(n - 1, B), (P,))]
    for d in range(len(x)):
        ins = (S(d) if reduction == 0 else B, S(d), S(d)) + repeat(n - 3, S(d))
        rows.append(Row(ins, (S(d),), "loss_mean" if reduction == 1 else None))
    return broadcasting(rows, call.shapes, inputs=range(3, n), frame=x)


def sample_loss(nouts: int):
    """``multi_margin_loss(x, target, p, margin, weight, reduction)`` (x (N, C), target (N,),
    weight (C,)) and ``multilabel_margin_loss_forward(x, target, reduction) -> (loss,
    is_target)`` (target (N, C)): a batch split S(0) on x and target, weight B; none -> S(0),
    sum -> P, mean -> P with kernel "loss_mean" (local sum / global N). is_target: S(0)."""
    def rule(call: Call):
        reduction = call.get("reduction", 1)
        n = len(call.shapes)
        rows = [Row(repeat(n, B), repeat(nouts, B))]
        if len(call.shapes[0]) == 2:
            out = S(0) if reduction == 0 else P
            rows.append(Row((S(0), S(0)) + repeat(n - 2, B), (out,) + repeat(nouts - 1, S(0)),
                            "loss_mean" if reduction == 1 else "sample_loss"))
        return tuple(rows)
    return rule


def sample_loss_backward(call: Call):
    """``multi_margin_loss_backward(grad, x, target, p, margin, weight, reduction)``,
    ``multilabel_margin_loss_backward(grad, x, target, reduction, is_target)``: linear in grad;
    a batch split gives S(0) (grad S(0) for none, B otherwise; mean over the global N)."""
    reduction = call.get("reduction", 1)
    n = len(call.shapes)
    rows = [Row(repeat(n, B), (B,)), Row((P,) + repeat(n - 1, B), (P,))]
    if len(call.shapes[1]) == 2:
        # the 4th tensor: multi_margin's weight (C,) whole, multilabel's is_target (N, C) split
        extra = S(0) if call.packet.startswith("multilabel") else B
        ins = (S(0) if reduction == 0 else B, S(0), S(0)) + repeat(n - 3, extra)
        rows.append(Row(ins, (S(0),), "loss_mean" if reduction == 1 else "sample_loss"))
    return tuple(rows)

register("mse_loss", "smooth_l1_loss", "huber_loss", rule=pointwise_loss,
         kernels={"loss_mean": _k_loss_mean}, order_free=True)
register("mse_loss_backward", "smooth_l1_loss_backward", "huber_loss_backward",
         rule=pointwise_loss_backward, order_free=True)
register("binary_cross_entropy", "binary_cross_entropy_with_logits", "soft_margin_loss",
         rule=elementwise_loss, order_free=True)
register("binary_cross_entropy_backward", "soft_margin_loss_backward",
         rule=elementwise_loss_backward, order_free=True)
register("multi_margin_loss", rule=sample_loss(1), kernels={"sample_loss": _k_sample_loss})
register("multilabel_margin_loss_forward", rule=sample_loss(2))
register("multi_margin_loss_backward", "multilabel_margin_loss_backward",
         rule=sample_loss_backward)
register("nll_loss_forward", rule=nll_loss, kernels={"nll": _k_nll}, order_free=True)
register("nll_loss_backward", rule=nll_loss_backward, kernels={"nll_back": _k_nll_backward}, order_free=True)
