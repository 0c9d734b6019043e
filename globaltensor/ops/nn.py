"""Neural-network ops: embedding, pooling, convolution, attention (norms.py and losses.py hold
the normalizations and the losses).

The common shape: a batch split passes through (weights whole, their gradients partial sums);
a split of the weights' own dims gives partial sums (embedding's vocabulary) or a split output
(convolution's output channels).
"""
from __future__ import annotations

import math

import torch

from .rules import B, P, S, Call, Ref, Row, broadcasting, fit, repeat, sig, with_arg

from .._cache import clear_all
from ..errors import GlobalTensorError
from .registry import register
from .ring import ring, ring_axis

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
    lo, hi = ctx.targets[0].range_of(ctx.coord, 0)
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


# how a split sequence's attention gets its keys: "auto" (by cost), "all_gather" or "ring"
# (gt.set_attention_method, which clears the cached choices)
METHODS = ("auto", "all_gather", "ring")
_METHOD = ["auto"]


def set_attention_method(method: str) -> str:
    """``gt.set_attention_method("ring")``: how attention over a split sequence gets its keys
    from now on, on this process (call it alike on every rank): ``"auto"`` (the default: the
    choice weighs both ways' costs), ``"all_gather"`` or ``"ring"``. Returns the one before;
    a change forgets the cached choices (as ``gt.set_costs`` does)."""
    if method not in METHODS:
        raise GlobalTensorError(
            f"set_attention_method expects one of {list(METHODS)}, found {method!r}; e.g. "
            f"gt.set_attention_method(\"ring\")")
    before, _METHOD[0] = _METHOD[0], method
    if before != method:
        clear_all()
    return before


def attention(nouts: int):
    """``_scaled_dot_product_flash_attention_for_cpu`` (and its backward): batch or head split,
    or the queries' sequence split (docs/long_context.md), two ways: q (and the output, its
    log-sum-exp, the gradient of the output) split on the sequence and k, v whole (the planner
    gathers them: Llama 3's all-gather), the kernel masking each rank's rows at their global
    positions, the backward's k and v gradients partial sums (each rank's rows' share); or q, k
    and v all split on one axis, the key/value chunks passed around it (ring attention,
    ops/ring.py: its shifts priced by ``sends``). The mask broadcasts against the scores,
    (batch, heads, L, S): a mask with one head (or no batch dims) stays whole on a head (or
    batch) split, and is split on its rows with the queries."""
    def rule(call: Call):
        n = len(call.shapes)
        first = 1 if call.packet.endswith("_backward") else 0  # grad_out comes first
        q, k = call.shapes[first], call.shapes[first + 1]
        seq = len(q) - 2
        rows = [Row(repeat(n, B), repeat(nouts, B))]
        rows += [Row(repeat(n, S(d)), repeat(nouts, S(d)), "attention_pieces") for d in (0, 1)]
        mask = call.get("attn_mask")
        inputs = (mask.index,) if isinstance(mask, Ref) else ()
        method = _METHOD[0]
        if (mask is None or inputs) and method != "ring":  # (a local mask: gathered rows only)
            rows.append(_sequence_row(n, first, seq))
        if (mask is None or inputs) and method != "all_gather" and q[seq] == k[seq]:
            rows.append(Row(repeat(n, S(seq)), repeat(nouts, S(seq)), "attention_pieces"))
        # q @ k^T and p @ v: 4 flops per (query, key, feature) per head; backward about 2.5x
        work = 4.0 * math.prod(q[:-1]) * k[-2] * q[-1] * (2.5 if first else 1.0)
        return broadcasting(rows, call.shapes, inputs=inputs, frame=q[:-1] + k[-2:-1],
                            work=work, check=_one_ring(first, seq), sends=_ring_sends(first, seq))
    return rule


def _one_ring(first: int, seq: int):
    """A candidate splits the keys' sequence on one axis at most (one ring)."""
    def check(call, grid, ins, outs):
        keys = ins[first + 1]
        return sum(1 for v, n in zip(keys, grid) if isinstance(v, S) and v.dim == seq
                   and n > 1) <= 1
    return check


def _ring_sends(first: int, seq: int):
    """What a ring candidate's shifts send on a rank, (messages, bytes) hidden behind its
    compute and (messages, bytes) not: the k and v shifts (n - 1 each) run while the chunk
    before is computed; in backward (or a forward whose k or v will get a gradient) the
    gradients' (n each) wait for the chunk's compute."""
    def sends(targets, itemsizes, grads):
        layout = targets[first + 1]
        axis = ring_axis(layout, seq)
        if axis is None:
            return (0, 0), (0, 0)
        n, piece = layout.placement.shape[axis], layout.max_local_numel() * itemsizes[first + 1]
        backward = first or (grads and (grads[first + 1] or grads[first + 2]))
        # (a forward whose backward will run: that backward's k/v shifts too)
        hidden = 2 * (n - 1) * (2 if backward and not first else 1)
        exposed = 2 * n if backward else 0
        return (hidden, hidden * piece), (exposed, exposed * piece)
    return sends


def _sequence_row(n: int, first: int, seq: int) -> Row:
    """q split on its sequence dim ``seq``, k and v whole; forward (q, k, v[, mask]) ->
    (out, lse) split; backward (grad, q, k, v, out, lse[, mask]) -> (gq split, gk, gv partial)."""
    if first == 0:
        return Row((S(seq), B, B) + repeat(n - 3, S(seq)), (S(seq), S(seq)), "attention_pieces")
    return Row((S(seq), S(seq), B, B, S(seq), S(seq)) + repeat(n - 6, S(seq)), (S(seq), P, P),
               "attention_pieces")


def _k_attention_pieces(ctx, largs, lkwargs):
    """Attention on a batch, head or query-sequence split. Queries split on the sequence (their
    rows [lo, hi) of the global L, the keys whole) are computed at their global positions: a
    causal mask row lo + i sees keys j <= lo + i, so the keys from hi on (masked for every row
    here) are left out, and the backward's k/v gradients are 0 there. Where an uneven split
    leaves this rank no batch entry, head or row, zeros of its output shapes; torch's CPU
    kernel traps (SIGFPE) on a piece with no head."""
    first = 1 if ctx.call.packet.endswith("_backward") else 0
    seq = len(ctx.targets[first].shape) - 2
    axis = ring_axis(ctx.targets[first + 1], seq)
    if axis is not None:  # k and v split too: ring attention (every rank shifts, ops/ring.py)
        return ring(ctx, largs, lkwargs, first, seq, axis, _merged)
    if ctx.coord is None:
        return ctx.empties()
    ranges = ctx.targets[first].ranges(ctx.coord)[seq]
    if len(ranges) == 2:  # a head-tail split: two runs of rows (docs/long_context.md)
        return _two_ranges(ctx, largs, lkwargs, first, seq, ranges)
    lo, hi = ranges[0]
    if (lo, hi) == (0, ctx.targets[first].shape[seq]):  # the whole sequence: no offset
        if any(p is not None and p.numel() == 0 for p in ctx.pieces):
            return ctx.zeros()
        return ctx.func(*largs, **lkwargs)
    return _attention_rows(ctx, largs, lkwargs, first, lo, hi)


def _two_ranges(ctx, largs, lkwargs, first: int, seq: int, ranges):
    """The rows of a head-tail piece, its head range then its tail range (each computed as
    :func:`_attention_rows`), joined: outputs along the rows, the k/v gradients summed."""
    if any(p is not None and p.numel() == 0 for p in ctx.pieces):
        return ctx.zeros()
    parts, start = [], 0
    for lo, hi in ranges:
        if hi > lo:
            part = _rows_of(ctx, largs, lkwargs, first, seq, start, start + hi - lo)
            parts.append(_attention_rows(ctx, *part, first, lo, hi))
        start += hi - lo
    if len(parts) == 1:
        return parts[0]
    (a0, a1), (b0, b1) = parts[0][:2], parts[1][:2]
    if first == 0:  # (out, lse): both along the rows
        return torch.cat([a0, b0], dim=seq), torch.cat([a1, b1], dim=seq)
    return torch.cat([a0, b0], dim=seq), a1 + b1, parts[0][2] + parts[1][2]


def _rows_of(ctx, largs, lkwargs, first: int, seq: int, a: int, b: int):
    """The local arguments with only the piece's rows [a, b): q, a mask's rows, and in
    backward the output's gradient, the output and its log-sum-exp."""
    largs = list(largs)
    rows = (first,) if first == 0 else (0, 1, 4, 5)
    for i in rows:
        largs[i] = largs[i].narrow(seq, a, b - a)
    mask = ctx.arg(largs, lkwargs, "attn_mask")
    if mask is not None and mask.dim() >= 2 and mask.shape[-2] > 1:
        lkwargs = with_arg(ctx.call.op, largs, lkwargs, "attn_mask", mask.narrow(-2, a, b - a))
    return largs, lkwargs


def _attention_rows(ctx, largs, lkwargs, first: int, lo: int, hi: int):
    """The query rows [lo, hi) of attention over whole keys (see _k_attention_pieces). Causal:
    two calls and no L x S mask, the keys before ``lo`` (seen by every row here: no mask) and
    the square block [lo, hi) (torch's own causal mask), merged by their log-sum-exps; the
    backward runs each block with the merged output and log-sum-exp (ring attention's way:
    each block's probabilities are then the whole softmax's), its k/v rows 0 elsewhere."""
    q, k, v = largs[first:first + 3]
    mask = ctx.arg(largs, lkwargs, "attn_mask")
    scale = ctx.arg(largs, lkwargs, "scale")
    dropout = ctx.arg(largs, lkwargs, "dropout_p", 0.0)  # (the CPU kernel refuses any but 0)
    causal = ctx.arg(largs, lkwargs, "is_causal", False)
    keys = min(hi, k.shape[-2]) if causal else k.shape[-2]
    if causal and keys < hi:  # fewer keys than query rows (L > S): the rows' mask itself
        rows = torch.arange(lo, hi, device=q.device).unsqueeze(-1)
        hidden = torch.arange(keys, device=q.device) > rows
        mask = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device)
        mask.masked_fill_(hidden, float("-inf"))
        causal = False
    blocks = [(0, lo, False), (lo, hi, True)] if causal else [(0, keys, False)]
    blocks = [b for b in blocks if b[1] > b[0]]
    empty = not blocks or any(p is not None and p.numel() == 0 for p in ctx.pieces)
    if first == 0:
        if empty:
            return ctx.zeros()
        parts = [ctx.func(q, k[..., a:b, :], v[..., a:b, :], dropout, tri, attn_mask=mask,
                          scale=scale) for a, b, tri in blocks]
        return parts[0] if len(parts) == 1 else _merged(*parts)
    grad, out, lse = largs[0], largs[4], largs[5]
    gk, gv = torch.zeros_like(largs[2]), torch.zeros_like(largs[3])
    gq = torch.zeros_like(q)
    if empty:  # no rows (or heads) here: no share of the k/v gradients
        return gq, gk, gv
    for a, b, tri in blocks:
        dq, dk, dv = ctx.func(grad, q, k[..., a:b, :], v[..., a:b, :], out, lse, dropout, tri,
                              attn_mask=mask, scale=scale)
        gq += dq
        gk[..., a:b, :] = dk
        gv[..., a:b, :] = dv
    return gq, gk, gv


def _merged(first, second):
    """Two blocks' (out, lse) over disjoint keys as one softmax's: the outputs weighed by
    exp(lse_i - lse), lse = log(exp(lse_1) + exp(lse_2)); a row neither block gives a key
    (both lse -inf) stays 0 with lse -inf."""
    (o1, l1), (o2, l2) = first, second
    lse = torch.logaddexp(l1, l2)
    safe = lse.masked_fill(torch.isneginf(lse), 0.0)
    wide = torch.promote_types(o1.dtype, torch.float32)  # (float64 stays float64)
    out = o1.to(wide) * torch.exp(l1 - safe).unsqueeze(-1).to(wide) + \
        o2.to(wide) * torch.exp(l2 - safe).unsqueeze(-1).to(wide)
    return out.to(o1.dtype), lse


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

register("embedding", rule=embedding, kernels={"embedding_vocab": _k_embedding_vocab}, order_free=True)
register("embedding_dense_backward", rule=embedding_backward, order_free=True)
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
         kernels={"attention_pieces": _k_attention_pieces}, order_free=True)
register("_scaled_dot_product_flash_attention_for_cpu_backward", rule=attention(3),
         order_free=True)
