"""Normalizations: layer norm, group norm, batch norm (its running statistics and SyncBatchNorm's
statistics over a split batch: kernels "sync_bn", "bn_local").

A batch split passes through (weights whole, their gradients partial sums); the normalized dims
stay whole.
"""
from __future__ import annotations

import math

import torch

from ..layout import Layout
from .rules import B, P, S, Call, Row, arg_names, fit, repeat, sig
from .registry import register


def layer_norm(call: Call):
    """``native_layer_norm(x, normalized_shape, weight, bias, eps) -> (out, mean, rstd)``:
    split batch dims only; weight and bias whole."""
    nd = len(call.shapes[0])
    batch = nd - len(call.get("normalized_shape"))
    present = (True, call.is_global("weight"), call.is_global("bias"))
    rows = [sig("B B B -> B")]
    rows += [Row((S(d), B, B), (S(d),)) for d in range(batch)]
    return fit(rows, present)


def layer_norm_backward(call: Call):
    """``(grad_out, x, normalized_shape, mean, rstd, weight, bias, mask) -> (gx, gw, gb)``:
    batch split gives partial weight/bias grads; linear in grad_out."""
    nd = len(call.shapes[0])
    batch = nd - len(call.get("normalized_shape"))
    present = (True, True, True, True, call.is_global("weight"), call.is_global("bias"))
    rows = [sig("B B B B B B -> B"), sig("P B B B B B -> P")]
    rows += [Row((S(d), S(d), S(d), S(d), B, B), (S(d), P, P)) for d in range(batch)]
    return fit(rows, present)

def group_norm(call: Call):
    """``native_group_norm(x, weight, bias, N, C, HxW, group, eps) -> (out, mean, rstd)``:
    a batch split keeps each sample's groups local (mean, rstd (N, group) split alike); the
    op's N argument becomes the local batch size (rewrite)."""
    present = (True, call.is_global("weight"), call.is_global("bias"))
    return fit((sig("B B B -> B B B"), sig("S(0) B B -> S(0) S(0) S(0)")), present)


def group_norm_backward(call: Call):
    """``native_group_norm_backward(grad, x, mean, rstd, weight, N, C, HxW, group, mask) ->
    (gx, gw, gb)``: a batch split gives gx split and partial weight / bias grads; linear in
    grad (with x, mean, rstd whole)."""
    present = (True, True, True, True, call.is_global("weight"))
    return fit((sig("B B B B B -> B B B"), sig("P B B B B -> P P P"),
                sig("S(0) S(0) S(0) S(0) B -> S(0) P P")), present)


def _rewrite_group_norm(decision, largs, pieces):
    """N: this piece's batch size."""
    n = arg_names(decision.call.op).index("N")
    x = pieces[1] if decision.call.packet.endswith("_backward") else pieces[0]
    if n < len(largs) and x.dim() > 0:
        largs[n] = x.shape[0]

def _bn_present(call: Call, names):
    return tuple(call.is_global(n) for n in names)


_BN_IN = ("input", "weight", "bias", "running_mean", "running_var")


def batch_norm(call: Call):
    """``native_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps)
    -> (out, save_mean, save_invstd)``; x is (N, C, ...), the per-channel tensors (C,).

    A channel split keeps every statistic local. Any other split (the batch, a spatial dim)
    needs the statistics of the whole batch: in training the kernel "sync_bn" all-reduces the
    per-channel sums (sync-BN semantics: one process on the full batch), never the
    activations; in eval the running statistics make it per-element."""
    present = _bn_present(call, _BN_IN)
    nd = len(call.shapes[0])
    training = call.get("training")
    rows = [sig("B B B B B -> B B B", "bn_local")]
    if nd >= 2:
        rows.append(Row((S(1), S(0), S(0), S(0), S(0)), (S(1), S(0), S(0)), "bn_local"))
    for d in (0, *range(2, nd)):
        if training:
            rows.append(Row((S(d), B, B, B, B), (S(d), B, B), "sync_bn"))
        else:
            rows.append(Row((S(d), B, B, B, B), (S(d), B, B), "bn_local"))
    return fit(rows, present)


def _k_bn_local(ctx, largs, lkwargs):
    """Batch norm (or its backward) on pieces that need no communication; a piece with no
    element (an uneven split gave this rank no channel or no row) gets empty results without
    running torch's kernel, which divides by the element count and traps on an empty input."""
    if ctx.coord is None:
        return ctx.empties()
    shapes = [None if o is None else o.layout.local_shape(ctx.coord) for o in ctx.outs]
    if ctx.pieces[0].numel() == 0:  # x (forward) or grad_out (backward), the shape of x
        return tuple(None if o is None else
                     torch.zeros(shape, dtype=o.dtype, device=largs[0].device)
                     for o, shape in zip(ctx.outs, shapes))
    return ctx.func(*largs, **lkwargs)


def _channel_sums(ctx, parts, dims, index):
    """The per-channel sums of each tensor of ``parts`` over ``dims``, summed over the ranks
    of every axis that splits the batch (or a spatial dim) of input ``index``: one all-reduce
    of a (len(parts), C) buffer, which stays split by channels along the axes that split
    them (outside ranks take part with zeros). Returns one tensor of this rank's channels per
    part."""
    layout = ctx.targets[index]
    channel = tuple(S(1) if isinstance(v, S) and v.dim == 1 else B for v in layout.sbp)
    summed = tuple(P if isinstance(v, S) and v.dim != 1 else c for v, c in zip(layout.sbp, channel))
    whole = Layout(layout.placement, channel, (len(parts), layout.shape[1]))
    if ctx.coord is None:
        stacked = torch.zeros((0, 0), dtype=parts[0].dtype, device=parts[0].device)
    else:
        stacked = torch.stack([p.sum(dim=dims) for p in parts])
    stacked = ctx.redistribute(stacked, whole.with_sbp(summed), whole)
    return stacked.unbind(0)


def _bn_shape(ctx, index):
    shape = ctx.targets[index].shape
    count = math.prod(shape) // max(shape[1], 1)
    dims = [d for d in range(len(shape)) if d != 1]
    view = [1, -1] + [1] * (len(shape) - 2)
    return count, dims, view


def _k_sync_bn(ctx, largs, lkwargs):
    """Training batch norm on a non-channel split: one all-reduce of the per-channel sums of
    (x - K) and (x - K)^2 gives the batch mean and biased variance (the shifted-data formula;
    K, the same on every rank, is the running mean where there is one, so the difference of
    squares does not cancel), the sync-BN statistics of one process on the whole batch."""
    x = largs[0]
    weight, bias = ctx.arg(largs, lkwargs, "weight"), ctx.arg(largs, lkwargs, "bias")
    running_mean = ctx.arg(largs, lkwargs, "running_mean")
    running_var = ctx.arg(largs, lkwargs, "running_var")
    momentum, eps = ctx.arg(largs, lkwargs, "momentum"), ctx.arg(largs, lkwargs, "eps")
    count, dims, view = _bn_shape(ctx, 0)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xs = x.to(acc)
    if running_mean is not None and ctx.coord is not None:
        shifted = xs - running_mean.to(acc).reshape(view)
    else:
        shifted = xs
    total, squares = _channel_sums(ctx, [shifted, shifted * shifted], dims, 0)
    if ctx.coord is None:
        return ctx.empties()
    offset = total / count
    var = (squares / count - offset * offset).clamp_(min=0)
    mean = offset + (running_mean.to(acc) if running_mean is not None else 0)
    invstd = torch.rsqrt(var + eps)
    out = (xs - mean.reshape(view)) * invstd.reshape(view)
    if weight is not None:
        out = out * weight.reshape(view)
    if bias is not None:
        out = out + bias.reshape(view)
    with torch.no_grad():
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = var * count / max(count - 1, 1)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return out.to(x.dtype), mean.to(x.dtype), invstd.to(x.dtype)


_BN_BACKWARD_IN = ("grad_out", "input", "weight", "running_mean", "running_var", "save_mean",
                   "save_invstd")


def batch_norm_backward(call: Call):
    """``native_batch_norm_backward(grad, x, weight, running_mean, running_var, save_mean,
    save_invstd, train, eps, mask) -> (gx, gw, gb)``. A channel split is local; another split
    in training needs the batch sums of grad and grad * x_hat (kernel "sync_bn_backward",
    which all-reduces them and so gives gw, gb whole); in eval gx is per-element and gw, gb
    are partial sums."""
    present = _bn_present(call, _BN_BACKWARD_IN)
    nd = len(call.shapes[1])
    train = call.get("train")
    rows = [sig("B B B B B B B -> B B B"), sig("P B B B B B B -> P P P")]
    if nd >= 2:
        rows.append(Row((S(1), S(1)) + repeat(5, S(0)), (S(1), S(0), S(0)), "bn_local"))
    for d in (0, *range(2, nd)):
        if train:
            rows.append(Row((S(d), S(d)) + repeat(5, B), (S(d), B, B), "sync_bn_backward"))
        else:
            rows.append(Row((S(d), S(d)) + repeat(5, B), (S(d), P, P), "bn_local"))
    return fit(rows, present)


def _k_sync_bn_backward(ctx, largs, lkwargs):
    """One all-reduce of the per-channel sums of grad and grad * x_hat over the whole batch;
    they are the bias and weight gradients (whole), and give the input gradient locally."""
    grad, x = largs[0], largs[1]
    weight = ctx.arg(largs, lkwargs, "weight")
    mean, invstd = ctx.arg(largs, lkwargs, "save_mean"), ctx.arg(largs, lkwargs, "save_invstd")
    mask = ctx.arg(largs, lkwargs, "output_mask")
    count, dims, view = _bn_shape(ctx, 1)
    inside = ctx.coord is not None
    xhat = (x - mean.reshape(view)) * invstd.reshape(view) if inside else x
    sum_g, sum_gx = _channel_sums(ctx, [grad, grad * xhat], dims, 1)
    if not inside:
        return ctx.empties()
    gx = None
    if mask[0]:
        scale = invstd if weight is None else invstd * weight
        gx = (grad - (sum_g / count).reshape(view) - xhat * (sum_gx / count).reshape(view))
        gx = gx * scale.reshape(view)
    return gx, (sum_gx if mask[1] else None), (sum_g if mask[2] else None)

register("native_layer_norm", rule=layer_norm, order_free=True)
register("native_layer_norm_backward", rule=layer_norm_backward, order_free=True)
register("native_group_norm", rule=group_norm, rewrite=_rewrite_group_norm)
register("native_group_norm_backward", rule=group_norm_backward, rewrite=_rewrite_group_norm)
# updates running_mean / running_var in training, though its schema marks neither (a!)
register("native_batch_norm", rule=batch_norm,
         kernels={"sync_bn": _k_sync_bn, "bn_local": _k_bn_local},
         mutates=("running_mean", "running_var"))
register("native_batch_norm_backward", rule=batch_norm_backward,
         kernels={"sync_bn_backward": _k_sync_bn_backward, "bn_local": _k_bn_local})
