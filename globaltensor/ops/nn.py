"""Neural-network ops: embedding, pooling, convolution, attention (norms.py and losses.py hold
the normalizations and the losses).

The common shape: a batch split passes through (weights whole, their gradients partial sums);
a split of the weights' own dims gives partial sums (embedding's vocabulary) or a split output
(convolution's output channels).
"""
from __future__ import annotations

import torch

from .rules import B, P, S, Call, Ref, Row, broadcasting, fit, repeat, sig

from .registry import register

aten = torch.ops.aten


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

register("embedding", rule=embedding, kernels={"embedding_vocab": _k_embedding_vocab})
register("embedding_dense_backward", rule=embedding_backward)
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
