"""Neural-network ops: layer norm, batch norm, pooling, embedding, losses, convolution,
attention.

The common shape: a batch split passes through (weights whole, their gradients partial sums);
a split of the weights' own dims gives partial sums (embedding's vocabulary) or a split output
(convolution's output channels). A mean over a split batch is the local sum over the global
count (kernels "loss_mean", "nll_mean").
"""
from __future__ import annotations

import math

import torch

from ..layout import Layout
from .signature import (B, P, S, Call, Ref, Row, arg_names, broadcast_shapes, broadcasting, fit,
                        register, repeat, sig, with_arg)

aten = torch.ops.aten


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


def embedding(call: Call):
    """``embedding(weight, indices)``: vocab-split weights give P (rows a rank lacks are 0)."""
    nd = len(call.shapes[1])
    rows = [sig("B B -> B"), sig("P B -> P"), Row((S(1), B), (S(nd),)),
            sig("S(0) B -> P", "embedding_vocab")]
    rows += [Row((B, S(d)), (S(d),)) for d in range(nd)]
    return tuple(rows)


def _k_embedding_vocab(ctx, largs, lkwargs):
    """embedding with a vocabulary-split weight: rows this rank lacks give 0 (a partial sum)."""
    if ctx.coord is None:
        return ctx.empties()
    weight, indices = largs[0], largs[1]
    lo, hi = ctx.targets[0].box(ctx.coord)[0]
    outside = (indices < lo) | (indices >= hi)
    local = (indices - lo).masked_fill(outside, 0)
    out = aten.embedding.default(weight, local)
    return out.masked_fill_(outside.unsqueeze(-1), 0)


def embedding_backward(call: Call):
    """``embedding_dense_backward(grad, indices, num_weights, ...)``: index split gives
    partial sums of rows; an embedding-dim split stays split."""
    nd = len(call.shapes[1])
    rows = [sig("B B -> B"), sig("P B -> P"), Row((S(nd), B), (S(1),))]
    if not call.get("scale_grad_by_freq", False):
        rows += [Row((S(d), S(d)), (P,)) for d in range(nd)]
    return tuple(rows)


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
        rows.append(sig("S(0) S(0) B -> P B", "nll_mean"))
    return fit(rows, present)


def _k_nll_mean(ctx, largs, lkwargs):
    """nll_loss with a batch split and reduction='mean': the local sum over the global total
    weight (an all-reduce of one number, on every rank)."""
    largs = list(largs)
    lkwargs = with_arg(ctx.call.op, largs, lkwargs, "reduction", 2)  # sum
    if ctx.coord is None:
        total, weight = largs[0].new_zeros(()), largs[0].new_zeros(())
    else:
        total, weight = ctx.func(*largs, **lkwargs)
    dst = ctx.outs[1].layout
    partial = tuple(P if isinstance(v, S) else d for v, d in zip(ctx.targets[0].sbp, dst.sbp))
    weight = ctx.redistribute(weight, dst.with_sbp(partial), dst)
    if ctx.coord is None:
        return ctx.empties()
    return total / weight, weight


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


def convolution(call: Call):
    """``convolution(x, w, b, ..., transposed, ..., groups)``: batch split, or output channels
    split (groups == 1): w is (C_out, C_in, k..) and splits on dim 0, or transposed (C_in,
    C_out, k..) and splits on dim 1; the bias (C_out,) alike."""
    present = (True, True, call.is_global("bias"))
    rows = [sig("B B B -> B"), sig("S(0) B B -> S(0)")]
    if call.get("groups", 1) == 1:
        rows.append(sig("B S(1) S(0) -> S(1)" if call.get("transposed", False)
                        else "B S(0) S(0) -> S(1)"))
    if not present[2]:
        rows.append(sig("P B - -> P"))
    return fit(rows, present)


def convolution_backward(call: Call):
    """``convolution_backward(grad, x, w, bias_sizes, ...) -> (gx, gw, gb)``. No
    output-channel row for a transposed convolution: on a 2x2 grid with uneven channels its
    bias gradient came back with the global size on a rank (the sweep hung), so a transposed
    forward split by output channels moves the gradient to a batch split instead."""
    rows = [sig("B B B -> B B B"), sig("S(0) S(0) B -> S(0) P P"), sig("P B B -> P P P")]
    if not call.get("transposed", False) and call.get("groups", 1) == 1:
        rows.append(sig("S(1) B S(0) -> P S(0) S(0)"))
    return tuple(rows)


def attention(nouts: int):
    """``_scaled_dot_product_flash_attention_for_cpu`` (and its backward): batch or head split.
    The mask broadcasts against the scores, (batch, heads, L, S): a mask with one head (or no
    batch dims) stays whole on a head (or batch) split."""
    def rule(call: Call):
        n = len(call.shapes)
        first = 1 if call.packet.endswith("_backward") else 0  # grad_out comes first
        q, k = call.shapes[first], call.shapes[first + 1]
        rows = [Row(repeat(n, B), repeat(nouts, B))]
        rows += [Row(repeat(n, S(d)), repeat(nouts, S(d)), "attention_pieces") for d in (0, 1)]
        mask = call.get("attn_mask")
        inputs = (mask.index,) if isinstance(mask, Ref) else ()
        return broadcasting(rows, call.shapes, inputs=inputs, frame=q[:-1] + k[-2:-1])
    return rule


def _k_attention_pieces(ctx, largs, lkwargs):
    """Attention on a batch or head split: where an uneven split leaves this rank no batch
    entry or no head, zeros of its (empty) output shapes; torch's CPU kernel traps (SIGFPE)
    on a piece with no head."""
    if ctx.coord is None:
        return ctx.empties()
    if any(p is not None and p.numel() == 0 for p in ctx.pieces):
        return ctx.zeros()
    return ctx.func(*largs, **lkwargs)


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


def pooling(spatial: int, linear: bool):
    """Pools (max, avg, adaptive; forward): a split of a leading (batch or channel) dim passes
    through; an average is linear, so P passes too."""
    def rule(call: Call):
        n = len(call.shapes)
        nd = len(call.shapes[0])
        rows = [Row(repeat(n, B), (B,))]
        rows += [Row(repeat(n, S(d)), (S(d),)) for d in range(max(nd - spatial, 0))]
        if linear and n == 1:
            rows.append(sig("P -> P"))
        return tuple(rows)
    return rule


def pooling_with_indices(spatial: int):
    def rule(call: Call):
        nd = len(call.shapes[0])
        rows = [sig("B -> B B")]
        return tuple(rows + [Row((S(d),), (S(d), S(d))) for d in range(max(nd - spatial, 0))])
    return rule


def pooling_backward(spatial: int, linear: bool):
    """``*_pool*_backward(grad, x, ..., [indices])``: leading-dim splits pass; linear in grad
    for averages."""
    def rule(call: Call):
        n = len(call.shapes)
        nd = len(call.shapes[1])
        rows = [Row(repeat(n, B), (B,))]
        rows += [Row(repeat(n, S(d)), (S(d),)) for d in range(max(nd - spatial, 0))]
        if linear:
            rows.append(Row((P,) + repeat(n - 1, B), (P,)))
        return tuple(rows)
    return rule


register("native_layer_norm", rule=layer_norm)
register("native_layer_norm_backward", rule=layer_norm_backward)
register("embedding", rule=embedding, kernels={"embedding_vocab": _k_embedding_vocab})
register("embedding_dense_backward", rule=embedding_backward)
register("mse_loss", "smooth_l1_loss", "huber_loss", rule=pointwise_loss,
         kernels={"loss_mean": _k_loss_mean})
register("mse_loss_backward", "smooth_l1_loss_backward", "huber_loss_backward",
         rule=pointwise_loss_backward)
register("binary_cross_entropy", "binary_cross_entropy_with_logits", "soft_margin_loss",
         rule=elementwise_loss)
register("binary_cross_entropy_backward", "soft_margin_loss_backward",
         rule=elementwise_loss_backward)
register("multi_margin_loss", rule=sample_loss(1), kernels={"sample_loss": _k_sample_loss})
register("multilabel_margin_loss_forward", rule=sample_loss(2))
register("multi_margin_loss_backward", "multilabel_margin_loss_backward",
         rule=sample_loss_backward)
register("native_group_norm", rule=group_norm, rewrite=_rewrite_group_norm)
register("native_group_norm_backward", rule=group_norm_backward, rewrite=_rewrite_group_norm)
register("nll_loss_forward", rule=nll_loss, kernels={"nll_mean": _k_nll_mean})
register("nll_loss_backward", rule=nll_loss_backward)
# updates running_mean / running_var in training, though its schema marks neither (a!)
register("native_batch_norm", rule=batch_norm,
         kernels={"sync_bn": _k_sync_bn, "bn_local": _k_bn_local},
         mutates=("running_mean", "running_var"))
register("native_batch_norm_backward", rule=batch_norm_backward,
         kernels={"sync_bn_backward": _k_sync_bn_backward, "bn_local": _k_bn_local})
for _k in (1, 2, 3):
    register(f"max_pool{_k}d_with_indices", rule=pooling_with_indices(_k))
    register(f"max_pool{_k}d_with_indices_backward", rule=pooling_backward(_k, False))
    register(f"avg_pool{_k}d", f"_adaptive_avg_pool{_k}d", rule=pooling(_k, True))
    register(f"avg_pool{_k}d_backward", f"_adaptive_avg_pool{_k}d_backward",
             rule=pooling_backward(_k, True))
    register(f"adaptive_max_pool{_k}d", rule=pooling_with_indices(_k))
    register(f"adaptive_max_pool{_k}d_backward", rule=pooling_backward(_k, False))
register("convolution", rule=convolution)
register("convolution_backward", rule=convolution_backward)
register("_scaled_dot_product_flash_attention_for_cpu", rule=attention(2),
         kernels={"attention_pieces": _k_attention_pieces})
register("_scaled_dot_product_flash_attention_for_cpu_backward", rule=attention(3))
