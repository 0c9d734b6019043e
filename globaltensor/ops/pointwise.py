"""Element-wise ops: split wherever the broadcast inputs agree, and the linear ones keep P.

    B    B    -> B       everything replicated
    S(d) S(d) -> S(d)    any output dim every input spans is split along (broadcast inputs: B)
    P    P    -> P       ops linear in their inputs together (add, sub, where's branches, ...)
    P    B    -> P       ops linear in one input on its own (mul, div's numerator, backward ops)
"""
from __future__ import annotations

from .rules import B, P, S, Call, Ref, Row, Rule, linear_in, repeat, sig

from .registry import register, register_tag
from .rules import broadcast_shapes, broadcasting

# ops linear in the named inputs together: all P -> P (the other inputs must be B)
JOINT_LINEAR = {
    "add": ("self", "other"), "sub": ("self", "other"), "add_": ("self", "other"),
    "sub_": ("self", "other"), "neg": ("self",), "neg_": ("self",), "positive": ("self",),
    "clone": ("self",), "alias": ("self",), "detach": ("self",), "conj": ("self",),
    "resolve_conj": ("self",), "resolve_neg": ("self",), "lift_fresh": ("self",),
    "where": ("self", "other"), "lerp": ("self", "end"), "lerp_": ("self", "end"),
}
# ops linear in each named input on its own: that one P, the others B -> P
EACH_LINEAR = {
    "mul": ("self", "other"), "mul_": ("self", "other"), "div": ("self",), "div_": ("self",),
    "threshold_backward": ("grad_output",), "native_dropout_backward": ("grad_output",),
    "sigmoid_backward": ("grad_output",), "tanh_backward": ("grad_output",),
    "gelu_backward": ("grad_output",), "silu_backward": ("grad_output",),
    "hardtanh_backward": ("grad_output",), "leaky_relu_backward": ("grad_output",),
    "elu_backward": ("grad_output",),
}


def _linear_rows(call: Call) -> list[Row]:
    n = len(call.shapes)
    joint = JOINT_LINEAR.get(call.packet)
    if joint is not None:
        refs = [call.get(name) for name in joint]
        if all(isinstance(r, Ref) for r in refs):
            want = {r.index for r in refs}
            return [Row(tuple(P if i in want else B for i in range(n)), (P,))]
        return []
    if call.packet in ("div", "div_") and call.get("rounding_mode") is not None:
        return []  # floor(a / b) and trunc(a / b) are not linear in a
    return [row for name in EACH_LINEAR.get(call.packet, ()) for row in linear_in(call, name)]


def pointwise(call: Call) -> Rule:
    """Element-wise ops with broadcasting: any dim of the broadcast shape splits, on every input
    that spans it (the framework keeps B an input that lacks the dim or has size 1 there)."""
    n = len(call.shapes)
    out = broadcast_shapes(call.shapes)
    rows = [Row(repeat(n, B), (B,))] + [Row(repeat(n, S(d)), (S(d),)) for d in range(len(out))]
    return broadcasting(rows + _linear_rows(call), call.shapes, frame=out, order_free=True)


def to_copy(call: Call) -> Rule:
    """``.to(dtype)``: element-wise; a partial sum survives only a cast to a floating dtype."""
    rule = pointwise(call)
    dtype = call.get("dtype")
    if dtype is None or getattr(dtype, "is_floating_point", False) or getattr(dtype, "is_complex", False):
        rule = rule.plus((sig("P -> P"),))
    return rule


register("_to_copy", rule=to_copy)
register("clone", "alias", "detach", "lift_fresh", rule=pointwise)
register("floor_divide", "floor_divide_", rule=pointwise)  # torch tags neither pointwise
register_tag("pointwise", rule=pointwise)  # every op torch tags pointwise (add, mul, relu, ...)
