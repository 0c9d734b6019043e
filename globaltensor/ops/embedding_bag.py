"""embedding_bag: sums, means or maxima of embedding rows over bags of indices.

``_embedding_bag(weight, indices, offsets, ..., mode, ..., per_sample_weights,
include_last_offset, padding_idx) -> (out, offset2bag, bag_size, max_indices)``: ``indices``
is flat, bag ``k`` holds ``indices[offsets[k]:offsets[k + 1]]``; ``out`` is (bags, D),
``offset2bag`` the bag of each index, ``bag_size`` per bag, ``max_indices`` (bags, D) in mode
max, else per bag. Mode 0 sum, 1 mean, 2 max; columns: weight, indices, offsets, psw.

    B    B    B B    -> B    B B B       replicated
    S(1) B    B B    -> S(1) B B S(1)|B  embedding dim split: each column is its own bag op
    P    B    B B    -> P    B B B       sum, mean: linear in the weight
    B    B    B P    -> P    B B B       sum: linear in the per-sample weights
    B    S(0) B S(0) -> S(0) B S(0) S(0) bags split [bag_split]: the indices (integers, not
                                         embeddings) gathered, each rank runs its own bags
                                         (offset2bag whole, from a run on a 0-wide weight)

``_embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, max_indices, ...,
psw) -> grad_weight``: ``S(1)`` grad (and max_indices in mode max) ``-> S(1)``; linear in grad
``P -> P``; bags split ``S(0) S(0) B B S(0) S(0) S(0) -> P`` [bag_split]: each rank's bags
give their rows' sums (not with scale_grad_by_freq, which counts over every bag).
``_embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag)``:
``S(1) S(1) B B B -> P`` (a dot over the split dim), linear in grad or weight, bags split
``S(0) B S(0) B B -> P`` [bag_split]: each rank fills its bags' indices, zeros elsewhere.
"""
from __future__ import annotations

from ..errors import GlobalTensorError
from ..sbp import Split
from .rules import B, Call, Ref, Rule, fit, sig, with_arg
from .registry import register

_SUM, _MAX = 0, 2  # modes (1: mean)


def embedding_bag(call: Call):
    """``_embedding_bag`` (and ``_embedding_bag_forward_only``): the module's first table."""
    mode = call.get("mode", _SUM)
    present = (True, True, True, call.is_global("per_sample_weights"))
    rows = [sig("B B B B -> B B B B"),
            sig("S(1) B B B -> S(1) B B S(1)" if mode == _MAX else "S(1) B B B -> S(1) B B B")]
    if mode != _MAX:
        rows.append(sig("P B B B -> P B B B"))
    if mode == _SUM and present[3]:
        rows.append(sig("B B B P -> P B B B"))
    rows.append(sig("B S(0) B S(0) -> S(0) B S(0) S(0)", "bag_split"))
    return fit(rows, present)


def embedding_bag_backward(call: Call):
    """``_embedding_bag_backward``: a dense gradient only (sparse=True is an error)."""
    if call.get("sparse", False):
        raise GlobalTensorError(
            f"{call.op}: expected a dense gradient (sparse=False), as every global tensor is; "
            f"found sparse=True. Call embedding_bag with sparse=False on global tensors")
    mode = call.get("mode", _SUM)
    present = (True,) * 6 + (call.is_global("per_sample_weights"),)
    rows = [sig("B B B B B B B -> B"), sig("P B B B B B B -> P"),
            sig("S(1) B B B B S(1) B -> S(1)" if mode == _MAX else "S(1) B B B B B B -> S(1)")]
    if not call.get("scale_grad_by_freq", False):
        rows.append(sig("S(0) S(0) B B S(0) S(0) S(0) -> P", "bag_split"))
    return Rule(fit(rows, present), ragged=True)  # bag_split matches bags to indices


def per_sample_weights_backward(call: Call):
    """``_embedding_bag_per_sample_weights_backward`` (mode sum only, as torch)."""
    return Rule((sig("B B B B B -> B"), sig("P B B B B -> P"), sig("B P B B B -> P"),
                 sig("S(1) S(1) B B B -> P"), sig("S(0) B S(0) B B -> P", "bag_split")),
                ragged=True)  # bag_split matches bags to indices


# ----------------------------------------------------------------------------- the bag split


def _whole(ctx, largs, lkwargs, name):
    """Input ``name`` gathered along the axes that split it (every rank takes part; a partial
    sum stays partial), or its local value when it is not a global tensor."""
    ref = ctx.call.get(name)
    value = ctx.arg(largs, lkwargs, name)
    if not isinstance(ref, Ref):
        return value
    layout = ctx.targets[ref.index]
    whole = tuple(B if isinstance(v, Split) else v for v in layout.sbp)  # a P axis stays P
    return ctx.redistribute(value, layout, layout.with_sbp(whole))


def _span(offsets, lo: int, hi: int, n: int) -> tuple[int, int]:
    """The [start, end) range of the indices of bags [lo, hi)."""
    edge = lambda k: int(offsets[k]) if k < len(offsets) else n  # noqa: E731
    return edge(lo), edge(hi)


def _with(ctx, largs, lkwargs, values: dict):
    """Copies of the local arguments with ``values`` put in by name."""
    args, kwargs = list(largs), dict(lkwargs)
    for name, value in values.items():
        kwargs = with_arg(ctx.call.op, args, kwargs, name, value)
    return args, kwargs


def _k_bag_split(ctx, largs, lkwargs):
    """Bags split over the ranks: the indices (and per-sample weights) gathered, then the op on
    this rank's bags only (see the module's docstring for each op)."""
    indices = _whole(ctx, largs, lkwargs, "indices")
    psw = _whole(ctx, largs, lkwargs, "per_sample_weights")
    if ctx.coord is None:
        return ctx.empties()
    packet = ctx.call.packet
    forward = not packet.endswith("backward")
    offsets = ctx.arg(largs, lkwargs, "offsets")
    bags = ctx.outs[0].layout if forward else ctx.targets[0]  # out, or the grad of out
    lo, hi = bags.box(ctx.coord)[0]
    last = len(offsets) == bags.shape[0] + 1  # include_last_offset: one more offset
    start, end = _span(offsets, lo, hi, len(indices))
    local = {"indices": indices[start:end], "offsets": offsets[lo:hi + last] - start}
    if psw is not None:
        local["per_sample_weights"] = psw[start:end]
    if not forward:  # the bag of each of these indices, numbered from this rank's first
        local["offset2bag"] = ctx.arg(largs, lkwargs, "offset2bag")[start:end] - lo
    args, kwargs = _with(ctx, largs, lkwargs, local)
    out = ctx.func(*args, **kwargs)
    if packet == "_embedding_bag_per_sample_weights_backward":
        full = out.new_zeros(len(indices))
        full[start:end] = out
        return full
    if not forward:
        return out
    # offset2bag of every index (the outputs' B): the op on a weight of no columns
    weight = ctx.arg(largs, lkwargs, "weight")
    whole = {"weight": weight.new_empty((weight.shape[0], 0)), "indices": indices}
    if psw is not None:
        whole["per_sample_weights"] = psw
    args, kwargs = _with(ctx, largs, lkwargs, whole)
    return out[0], ctx.func(*args, **kwargs)[1], out[2], out[3]


register("_embedding_bag", "_embedding_bag_forward_only", rule=embedding_bag,
         kernels={"bag_split": _k_bag_split})
register("_embedding_bag_backward", rule=embedding_bag_backward)
register("_embedding_bag_per_sample_weights_backward", rule=per_sample_weights_backward)
