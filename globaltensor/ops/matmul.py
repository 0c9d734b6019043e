"""Matrix products: split the free dims, or split the contracted dim into partial sums.

``mm``, ``bmm``, ``dot``, ``mv`` and ``addmm`` have rules; ``linear``, ``matmul``, ``einsum``
& co run as their decomposition into ops with rules.
"""
from __future__ import annotations

import torch

from .signature import B, P, S, Call, Row, broadcasting, register, table

MM = table(
    "S(0) B    -> S(0)",   # rows of the left operand split: each rank computes its rows
    "B    S(1) -> S(1)",   # columns of the right operand split: each rank computes its columns
    "S(1) S(0) -> P",      # the contracted dim split: local products are partial sums
    "P    B    -> P",      # linear in the left operand
    "B    P    -> P",      # ... and in the right one
    "B    B    -> B",      # everything replicated
)
BMM = table(
    "S(0) S(0) -> S(0)",   # batch split: independent matmuls
    "S(1) B    -> S(1)",   # rows split
    "B    S(2) -> S(2)",   # columns split
    "S(2) S(1) -> P",      # contracted dim split: partial sums
    "P    B    -> P",      # linear in the left operand
    "B    P    -> P",      # ... and in the right one
    "B    B    -> B",      # everything replicated
)
DOT = table(
    "S(0) S(0) -> P",      # both vectors split alike: partial sums
    "P    B    -> P",      # linear in either operand
    "B    P    -> P",
    "B    B    -> B",
)
MV = table(
    "S(0) B    -> S(0)",   # matrix rows split
    "S(1) S(0) -> P",      # contracted dim split
    "P    B    -> P",
    "B    P    -> P",
    "B    B    -> B",
)

def addmm(call: Call):
    """``addmm(bias, m1, m2, beta, alpha) = beta * bias + alpha * (m1 @ m2)`` (nn.Linear with a
    bias, GPT-2's Conv1D): mm's rows with the bias split as the output, in the output's dims
    (the bias broadcasts against (rows, columns): a (n,) or (1, n) bias stays whole for a row
    split), and for the partial-sum rows the bias added on one rank only (kernel
    "addmm_partial") or given as a partial sum itself.

        bias         m1    m2    -> out
        S(0)         S(0)  B     -> S(0)    bias split where it has the rows (else B)
        S(1)         B     S(1)  -> S(1)    bias split where it has the columns (else B)
        B            S(1)  S(0)  -> P       kernel: the bias on the first rank of the axis
        B            P     B     -> P       kernel, likewise
        B            B     P     -> P       kernel, likewise
        P            S(1)  S(0)  -> P       a partial bias plus partial products
        P            P     B     -> P
        P            B     P     -> P
        B            B     B     -> B
    """
    rows = (
        Row((S(0), S(0), B), (S(0),)),   # the bias in the output's dims: B where it lacks one
        Row((S(1), B, S(1)), (S(1),)),
        Row((B, S(1), S(0)), (P,), "addmm_partial"),
        Row((B, P, B), (P,), "addmm_partial"),
        Row((B, B, P), (P,), "addmm_partial"),
        Row((P, S(1), S(0)), (P,)),
        Row((P, P, B), (P,)),
        Row((P, B, P), (P,)),
        Row((B, B, B), (B,)),
    )
    frame = (call.shapes[1][0], call.shapes[2][1])
    return broadcasting(rows, call.shapes, inputs=(0,), frame=frame)


def _k_addmm_partial(ctx, largs, lkwargs):
    """A partial-sum addmm: every rank adds its product, the bias only once along each axis
    where the result is a partial sum of products (on that axis' first rank)."""
    if ctx.coord is None:
        return ctx.empties()
    bias, m1, m2 = largs[0], largs[1], largs[2]
    beta, alpha = ctx.arg(largs, lkwargs, "beta", 1), ctx.arg(largs, lkwargs, "alpha", 1)
    out_sbp = ctx.outs.layout.sbp
    kernel_axes = [a for a, v in enumerate(out_sbp)
                   if v == P and ctx.targets[0].sbp[a] != P]  # the bias is whole there
    if all(ctx.coord[a] == 0 for a in kernel_axes):
        return torch.addmm(bias, m1, m2, beta=beta, alpha=alpha)
    product = torch.mm(m1, m2)
    return product if alpha == 1 else product * alpha


register("mm", rule=lambda call: MM)
register("addmm", rule=addmm, kernels={"addmm_partial": _k_addmm_partial})
register("bmm", rule=lambda call: BMM)
register("dot", rule=lambda call: DOT)
register("mv", rule=lambda call: MV)
register("addmv", "baddbmm", "addbmm", "addmm_", "baddbmm_", "linear", "matmul", "einsum",
         decompose=True)
