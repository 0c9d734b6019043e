"""The choice of a signature: candidates over the grid, costed by the moves they need.

On an n-D grid a candidate is one row per placement axis (the product of a rule's rows with
themselves). :func:`choose` costs each candidate by the redistribution its inputs need
(``plan(src, dst).cost``), plus the move each input's gradient will then need in backward, and
returns the cheapest as a :class:`Choice`.

Pure: no torch.distributed, no rank.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ..errors import GlobalTensorError
from ..layout import Layout
from ..plan import plan
from ..sbp import Broadcast, PartialSum, SbpValue
from .signature import KEEP, B, P, Call, Rule, rows_for


@dataclass(frozen=True, slots=True)
class Choice:
    """The signature chosen for a call: target input layouts and the outputs' sbp tuples."""

    ins: tuple[Layout, ...]
    outs: tuple[tuple[SbpValue, ...], ...]
    kernel: str | None
    cost: float


def _move_cost(src: Layout, dst: Layout, itemsize: int) -> float:
    """Estimated time to turn ``src`` into ``dst``; infinite when it would invent a P."""
    if src == dst:
        return 0.0
    for a, v in enumerate(dst.sbp):
        if isinstance(v, PartialSum) and not isinstance(src.sbp[a], PartialSum):
            return math.inf
    return plan(src, dst).cost(itemsize)


def _candidates(rule: Rule, n_in: int, mesh):
    for combo in itertools.product(rule.rows, repeat=len(mesh)):
        kernels = {r.kernel for r in combo if r.kernel}
        if len(kernels) > 1:
            continue
        yield combo, (kernels.pop() if kernels else None)


def choose(call: Call, layouts: tuple[Layout, ...], itemsizes: tuple[int, ...],
           fixed: tuple[int, ...] = (), grads: tuple[bool, ...] = (),
           free: tuple = ()) -> Choice | None:
    """The cheapest signature for ``call`` on inputs laid out as ``layouts``.

    ``fixed``: inputs that must keep their layout (the ``self`` of an in-place op, whose result
    must then have that layout too). ``grads``: per input, whether it will receive a gradient
    (it requires grad and grad mode is on): moving such an input also costs the move its
    gradient will need in backward (:func:`backward_cost`). ``free``: per input, layouts it is
    already available in at no cost (pieces moved earlier and remembered). Returns None
    when the op has no rule or no candidate fits (dispatch then falls back to broadcast inputs).
    Ties go to the candidate that changes fewest inputs, then to the earlier row.
    """
    rule = rows_for(call)
    if rule is None or not layouts:
        return None
    return _choose(rule, call, tuple(layouts), tuple(itemsizes), tuple(fixed), tuple(grads),
                   tuple(free))


def _choose(rule: Rule, call: Call, layouts, itemsizes, fixed, grads=(), free=()) -> Choice | None:
    placement = layouts[0].placement
    mesh = placement.shape
    best, best_key = None, None
    for order, (combo, kernel) in enumerate(_candidates(rule, len(layouts), mesh)):
        if any(len(r.ins) != len(layouts) for r in combo):
            raise GlobalTensorError(
                f"internal: a rule for {call.op} gave rows for {len(combo[0].ins)} inputs, the "
                f"call has {len(layouts)} global tensor inputs; please report this")
        ins = tuple(tuple(layouts[i].sbp[a] if r.ins[i] is KEEP else r.ins[i]
                          for a, r in enumerate(combo)) for i in range(len(layouts)))
        outs = outs_of(combo)
        if rule.check is not None and not rule.check(call, mesh, ins, outs):
            continue
        targets = _targets(layouts, ins)
        if targets is None or any(targets[i] != layouts[i] for i in fixed):
            continue
        if fixed and outs[0] != layouts[fixed[0]].sbp:
            continue  # an in-place result must land in self's own layout
        cost = _candidate_cost(layouts, targets, itemsizes, outs, grads, free)
        if math.isinf(cost):
            continue
        key = (cost, sum(1 for s, t in zip(layouts, targets) if s != t), order)
        if best_key is None or key < best_key:
            best, best_key = Choice(targets, outs, kernel, cost), key
    return best


def _candidate_cost(layouts, targets, itemsizes, outs, grads, free) -> float:
    cost = 0.0
    for i, (src, dst, n) in enumerate(zip(layouts, targets, itemsizes)):
        if src == dst:
            continue
        if not (free and dst in free[i]):
            cost += _move_cost(src, dst, n)
        if grads and grads[i]:
            cost += backward_cost(src, dst, outs, n)
    return cost


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
    return Layout(dst.placement, tuple(values), dst.shape)


def backward_cost(src: Layout, dst: Layout, outs, itemsize: int) -> float:
    """What moving an input ``src -> dst`` in forward implies for backward: its gradient
    arrives in :func:`grad_layout` and its producer takes it in the dual of ``src`` (S stays S,
    P wants B; a B source accepts any layout, as partial sums or not). The cost of that plan
    (0 when the gradient already fits): P -> S(d) costs a gather in backward, P -> B nothing."""
    grad = grad_layout(dst, outs)
    wanted = tuple(g if isinstance(s, Broadcast) else (B if isinstance(s, PartialSum) else s)
                   for s, g in zip(src.sbp, grad.sbp))
    if wanted == grad.sbp:
        return 0.0
    return plan(grad, grad.with_sbp(wanted)).cost(itemsize)


def outs_of(combo) -> tuple[tuple[SbpValue, ...], ...]:
    n = max(len(r.outs) for r in combo)
    return tuple(tuple(r.outs[k if len(r.outs) > 1 else 0] for r in combo) for k in range(n))


def _targets(layouts, ins):
    out = []
    for layout, sbp in zip(layouts, ins):
        try:
            out.append(layout if sbp == layout.sbp else layout.with_sbp(sbp))
        except GlobalTensorError:
            return None
    return tuple(out)


__all__ = ["Choice", "backward_cost", "choose", "grad_layout", "outs_of"]
