"""Element-wise ops torch does not tag ``pointwise`` (activations and their backward ops,
rsub, complex helpers, bucketize & co): the pointwise rows, and linearity where it holds.

    B    B    -> B       everything replicated
    S(d) S(d) -> S(d)    any output dim every input spans (broadcast inputs B), as pointwise.py
    P    B    -> P       the backward ops are linear in the incoming gradient
    P    P    -> P       rsub(x, y) = y - alpha * x: linear in both together
glu (and its backward) halve one dim: that dim whole, other dims split.
bucketize / isin: the values split, the boundaries (test elements) whole.
"""
from __future__ import annotations

from .pointwise import pointwise
from .rules import B, P, S, Call, Ref, Row, dim_of, linear_in, sig
from .registry import register

# element-wise, not linear
PLAIN = ("hardswish", "log_sigmoid_forward", "masked_fill.Tensor", "masked_fill_.Tensor")
# element-wise, linear in their first argument (the incoming gradient)
BACKWARD = ("elu_backward", "hardtanh_backward", "leaky_relu_backward", "hardswish_backward",
            "softplus_backward", "hardsigmoid_backward", "softshrink_backward",
            "hardshrink_backward", "log_sigmoid_backward", "mish_backward",
            "rrelu_with_noise_backward")


def plain(call: Call):
    return pointwise(call)


def backward(call: Call):
    """Linear in the gradient (the first input) with the others B."""
    first = call.args[0]
    rule = pointwise(call)
    if isinstance(first, Ref) and first.index == 0:
        n = len(call.shapes)
        rule = rule.plus((Row((P,) + (B,) * (n - 1), (P,)),))
    return rule


def rsub(call: Call):
    """``rsub(x, y, alpha) = y - alpha * x``."""
    rule = pointwise(call)
    if call.is_global("self") and call.is_global("other"):
        return rule.plus((sig("P P -> P"),))
    return rule.plus(linear_in(call, "self"))


def glu(call: Call):
    """``glu(x, dim)`` / ``glu_backward(grad, x, dim)``: the halved dim whole."""
    nd = len(call.shapes[-1])
    dim = dim_of(call.get("dim", -1), nd)
    n = len(call.shapes)
    rows = [Row((B,) * n, (B,))]
    rows += [Row((S(d),) * n, (S(d),)) for d in range(nd) if d != dim]
    if n == 2:
        rows.append(sig("P B -> P"))
    return tuple(rows)


def values_split(values: str):
    """Ops whose output is shaped like the input ``values`` and reads the other input whole
    (bucketize's boundaries, isin's test elements)."""
    def rule(call: Call):
        ref = call.get(values)
        n = len(call.shapes)
        rows = [Row((B,) * n, (B,))]
        if isinstance(ref, Ref):
            nd = len(call.shapes[ref.index])
            rows += [Row(tuple(S(d) if i == ref.index else B for i in range(n)), (S(d),))
                     for d in range(nd)]
        return tuple(rows)
    return rule


def searchsorted(call: Call):
    """``searchsorted(sorted_sequence, values)``: a 1-D sequence whole, values split; an N-D
    sequence splits its leading dims alike with the values."""
    seq, vals = call.shapes[0], call.shapes[1] if len(call.shapes) > 1 else ()
    rows = [Row((B,) * len(call.shapes), (B,))]
    if len(call.shapes) == 2 and len(seq) == 1:
        rows += [Row((B, S(d)), (S(d),)) for d in range(len(vals))]
    elif len(call.shapes) == 2 and len(seq) == len(vals) and seq[:-1] == vals[:-1]:
        rows += [Row((S(d), S(d)), (S(d),)) for d in range(len(seq) - 1)]
    return tuple(rows)


register(*PLAIN, rule=plain, order_free=True)
register(*BACKWARD, rule=backward, order_free=True)
register("rsub.Tensor", rule=rsub, order_free=True)
register("glu", "glu_backward", rule=glu, order_free=True)
register("bucketize.Tensor", rule=values_split("self"))
register("isin.Tensor_Tensor", rule=values_split("elements"))
register("searchsorted.Tensor", rule=searchsorted)
