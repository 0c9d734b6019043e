"""The layouts of backward: where an input's gradient arrives, and what moving it to where its
producer takes it costs (a signature choice weighs it for inputs that will get a gradient).

Pure: no torch.distributed, no rank.
"""
from __future__ import annotations

from ...layout import Layout, trusted
from ...plan import plan
from ...sbp import Broadcast, PartialSum, Split, balanced
from ..rules import B, P


def grad_layout(dst: Layout, outs) -> Layout:
    """The layout the gradient of an input used as ``dst`` (by an op whose outputs have the
    sbp tuples ``outs``) is expected to arrive in: per axis, S(d) stays S(d) (an elementwise
    or batched backward keeps the split), P gives B (the gradient of a sum is the same on every
    term), and B stays B when every output is B on that axis (a replicated computation has a
    replicated gradient), otherwise becomes P (each rank's outputs contribute a part)."""
    values = []
    for a, v in enumerate(dst.sbp):
        if isinstance(v, PartialSum):
            values.append(B)
        elif isinstance(v, Broadcast):
            replicated = all(o[a] is None or isinstance(o[a], Broadcast) for o in outs)
            values.append(B if replicated else P)
        else:
            values.append(v)
    return trusted(dst.placement, tuple(values), dst.shape)  # dst's own values, resolved


def backward_cost(src: Layout, dst: Layout, outs, itemsize: int) -> float:
    """What moving an input ``src -> dst`` in forward implies for backward: its gradient
    arrives in :func:`grad_layout` and its producer takes it in the dual of ``src`` (S stays S,
    P wants B; a B source accepts any layout, as partial sums or not). The cost of that plan
    (0 when the gradient already fits): P -> S(d) costs a gather in backward, P -> B nothing."""
    grad, wanted = backward_move(src, dst, outs)
    if wanted == grad.sbp:
        return 0.0
    return plan(grad, grad.with_sbp(wanted)).cost(itemsize)


def with_sbp(layout: Layout, sbp) -> Layout:
    """``layout.with_sbp(sbp)`` for resolved values of its own kind (no checks)."""
    return trusted(layout.placement, tuple(sbp), layout.shape)


def backward_move(src: Layout, dst: Layout, outs):
    """The gradient's layout and the sbp its producer takes it in (see :func:`backward_cost`)."""
    grad = grad_layout(dst, outs)
    wanted = tuple(g if isinstance(s, Broadcast) else (B if isinstance(s, PartialSum) else s)
                   for s, g in zip(src.sbp, grad.sbp))
    if balanced(wanted):  # no other axis may split a head-tail dim: B where a B source took
        grid = src.placement.shape  # the gradient's split of such a dim (it takes any)
        splits = [w.dim for w, n in zip(wanted, grid) if isinstance(w, Split) and n > 1]
        clash = {w.dim for w, n in zip(wanted, grid) if type(w) is Split and w.balance
                 and n > 1 and splits.count(w.dim) > 1}
        wanted = tuple(B if isinstance(s, Broadcast) and isinstance(w, Split) and w.dim in clash
                       else w for s, w in zip(src.sbp, wanted))
    return grad, wanted



__all__ = ["backward_cost", "backward_move", "grad_layout", "with_sbp"]
