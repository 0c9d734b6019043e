"""Matrix products: split the free dims, or split the contracted dim into partial sums.

``mm``, ``bmm``, ``dot`` and ``mv`` have rules; ``addmm``, ``linear``, ``matmul``, ``einsum`` & co
run as their decomposition into ops with rules (``addmm`` = ``mm``, then ``add``).
"""
from __future__ import annotations

from .signature import register, table

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

register("mm", rule=lambda call: MM)
register("bmm", rule=lambda call: BMM)
register("dot", rule=lambda call: DOT)
register("mv", rule=lambda call: MV)
register("addmm", "addmv", "baddbmm", "addbmm", "addmm_", "baddbmm_", "linear", "matmul",
         "einsum", decompose=True)
