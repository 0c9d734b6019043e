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

from .signature import B, P, S, Call, Row, fit, register, repeat, sig, with_arg

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
    """``mse_loss(x, target, reduction)`` & co: element-wise, then reduced. A split gives a
    split (none), a partial sum (sum) or a partial mean over the global count (mean)."""
    reduction = call.get("reduction", 1)
    nd = len(call.shapes[0])
    rows = [sig("B B -> B")]
    for d in range(nd):
        out = S(d) if reduction == 0 else P
        rows.append(Row((S(d), S(d)), (out,), "loss_mean" if reduction == 1 else None))
    return tuple(rows)


def pointwise_loss_backward(call: Call):
    """``mse_loss_backward(grad, x, target, reduction)``: linear in grad; a mean divides by the
    global count."""
    reduction = call.get("reduction", 1)
    nd = len(call.shapes[1])
    rows = [sig("B B B -> B"), sig("P B B -> P")]
    for d in range(nd):
        g = S(d) if reduction == 0 else B
        rows.append(Row((g, S(d), S(d)), (S(d),), "loss_mean" if reduction == 1 else None))
    return tuple(rows)


def _k_loss_mean(ctx, largs, lkwargs):
    """mse_loss & co (and their backward) with reduction='mean' on split inputs: the local
    result with reduction='sum', over the global element count."""
    if ctx.coord is None:
        return ctx.empties()
    largs = list(largs)
    lkwargs = with_arg(ctx.call.op, largs, lkwargs, "reduction", 2)  # sum
    x = 1 if ctx.call.packet.endswith("_backward") else 0  # backward: grad comes first
    return ctx.func(*largs, **lkwargs) / math.prod(ctx.targets[x].shape)


def convolution(call: Call):
    """``convolution(x, w, b, ...)``: batch split, or output channels split (groups == 1)."""
    present = (True, True, call.is_global("bias"))
    rows = [sig("B B B -> B"), sig("S(0) B B -> S(0)")]
    if not call.get("transposed", False) and call.get("groups", 1) == 1:
        rows.append(sig("B S(0) S(0) -> S(1)"))
    if not present[2]:
        rows.append(sig("P B - -> P"))
    return fit(rows, present)


def convolution_backward(call: Call):
    """``convolution_backward(grad, x, w, bias_sizes, ...) -> (gx, gw, gb)``."""
    rows = [sig("B B B -> B B B"), sig("S(0) S(0) B -> S(0) P P"), sig("P B B -> P P P")]
    if not call.get("transposed", False) and call.get("groups", 1) == 1:
        rows.append(sig("S(1) B S(0) -> P S(0) S(0)"))
    return tuple(rows)


def attention(nouts: int):
    """``_scaled_dot_product_flash_attention_for_cpu`` (and its backward): batch or head split."""
    def rule(call: Call):
        n = len(call.shapes)
        rows = [Row(repeat(n, B), repeat(nouts, B))]
        return tuple(rows + [Row(repeat(n, S(d)), repeat(nouts, S(d))) for d in (0, 1)])
    return rule


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
    rows = [sig("B B B B B -> B B B")]
    if nd >= 2:
        rows.append(Row((S(1), S(0), S(0), S(0), S(0)), (S(1), S(0), S(0))))
    for d in (0, *range(2, nd)):
        if training:
            rows.append(Row((S(d), B, B, B, B), (S(d), B, B), "sync_bn"))
        else:
            rows.append(Row((S(d), B, B, B, B), (S(d), B, B)))
    return fit(rows, present)


def _split_axes_partial(layout):
    """The sbp of a per-channel sum over ``layout``'s pieces: P where the input is split."""
    return tuple(P if isinstance(v, S) else v for v in layout.sbp)


def _channel_sums(ctx, local, dims, dst):
    """The per-channel sum of ``local`` over ``dims``, summed over every rank of the split
    axes (an all-reduce of C numbers; outside ranks take part with zeros)."""
    if ctx.coord is None:
        part = torch.zeros(dst.shape, dtype=local.dtype, device=local.device)
    else:
        part = local.sum(dim=dims)
    return ctx.redistribute(part, dst.with_sbp(_split_axes_partial(ctx.targets[0])), dst)


def _k_sync_bn(ctx, largs, lkwargs):
    """Training batch norm on a non-channel split: two all-reduces of per-channel sums give
    the batch mean and the biased variance exactly as one process computes them (mean first,
    then the mean squared deviation)."""
    x = largs[0]
    weight, bias = ctx.arg(largs, lkwargs, "weight"), ctx.arg(largs, lkwargs, "bias")
    running_mean = ctx.arg(largs, lkwargs, "running_mean")
    running_var = ctx.arg(largs, lkwargs, "running_var")
    momentum, eps = ctx.arg(largs, lkwargs, "momentum"), ctx.arg(largs, lkwargs, "eps")
    shape = ctx.targets[0].shape
    channels = shape[1]
    count = math.prod(shape) // max(channels, 1)
    dims = [d for d in range(len(shape)) if d != 1]
    view = [1, channels] + [1] * (len(shape) - 2)
    dst = ctx.outs[1].layout
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xs = x.to(acc)
    mean = _channel_sums(ctx, xs, dims, dst) / count
    centred = xs - mean.reshape(view) if ctx.coord is not None else xs
    var = _channel_sums(ctx, centred * centred, dims, dst) / count
    if ctx.coord is None:
        return ctx.empties()
    invstd = torch.rsqrt(var + eps)
    out = centred * invstd.reshape(view)
    if weight is not None:
        out = out * weight.reshape(view)
    if bias is not None:
        out = out + bias.reshape(view)
    if running_mean is not None:
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
    if running_var is not None:
        with torch.no_grad():
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
        rows.append(Row((S(1), S(1)) + repeat(5, S(0)), (S(1), S(0), S(0))))
    for d in (0, *range(2, nd)):
        if train:
            rows.append(Row((S(d), S(d)) + repeat(5, B), (S(d), B, B), "sync_bn_backward"))
        else:
            rows.append(Row((S(d), S(d)) + repeat(5, B), (S(d), P, P)))
    return fit(rows, present)


def _k_sync_bn_backward(ctx, largs, lkwargs):
    grad, x = largs[0], largs[1]
    weight = ctx.arg(largs, lkwargs, "weight")
    mean, invstd = ctx.arg(largs, lkwargs, "save_mean"), ctx.arg(largs, lkwargs, "save_invstd")
    mask = ctx.arg(largs, lkwargs, "output_mask")
    shape = ctx.targets[1].shape
    channels = shape[1]
    count = math.prod(shape) // max(channels, 1)
    dims = [d for d in range(len(shape)) if d != 1]
    view = [1, channels] + [1] * (len(shape) - 2)
    dst = next(o.layout for o in ctx.outs if o is not None and len(o.layout.shape) == 1) \
        if any(o is not None and len(o.layout.shape) == 1 for o in ctx.outs) else None
    if dst is None:  # neither weight nor bias gradient asked for: build the (C,) layout
        from ..layout import Layout
        dst = Layout(ctx.targets[1].placement, tuple(B for _ in ctx.targets[1].sbp), (channels,))
    inside = ctx.coord is not None
    xhat = (x - mean.reshape(view)) * invstd.reshape(view) if inside else x
    sum_g = _channel_sums(ctx, grad, dims, dst)
    sum_gx = _channel_sums(ctx, grad * xhat, dims, dst)
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
register("nll_loss_forward", rule=nll_loss, kernels={"nll_mean": _k_nll_mean})
register("nll_loss_backward", rule=nll_loss_backward)
# updates running_mean / running_var in training, though its schema marks neither (a!)
register("native_batch_norm", rule=batch_norm, kernels={"sync_bn": _k_sync_bn},
         mutates=("running_mean", "running_var"))
register("native_batch_norm_backward", rule=batch_norm_backward,
         kernels={"sync_bn_backward": _k_sync_bn_backward})
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
register("_scaled_dot_product_flash_attention_for_cpu", rule=attention(2))
register("_scaled_dot_product_flash_attention_for_cpu_backward", rule=attention(3))
