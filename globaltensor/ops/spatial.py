"""Padding (reflect, replicate) and interpolation (upsample_*): they read the last ``k``
(spatial) dims only, so the leading (batch, channel) dims keep their split; both are linear.

    B    -> B        everything replicated
    S(d) -> S(d)     d a leading dim (not one of the k spatial dims)
    P    -> P        linear in the input (the backward ops: linear in grad)
Backward ops take (grad, input or sizes): grad and input split alike on a leading dim; an
``input_size`` argument (upsample backward) names global sizes, rewritten to this piece's.

max_unpool{2,3}d(x, indices, output_size, ...) writes each value at its index within its own
(batch, channel) plane: x and indices split alike on a leading dim, ``P B -> P`` (kernel
"unpool": torch refuses a piece with no channel, which an uneven split can leave a rank).
"""
from __future__ import annotations

from .rules import B, P, S, Call, Row, arg_value, repeat, with_arg

from .registry import register


def leading(spatial: int, sized: bool = False):
    """``spatial`` trailing dims whole; ``sized``: the output shape comes from ``input_size``
    (upsample backward), else from the last tensor input."""
    def rule(call: Call):
        n = len(call.shapes)
        nd = len(call.get("input_size")) if sized else len(call.shapes[-1])
        kernel = "local_input_size" if sized else None
        rows = [Row(repeat(n, B), (B,), kernel)]
        rows += [Row(repeat(n, S(d)), (S(d),), kernel) for d in range(max(nd - spatial, 0))]
        rows.append(Row((P,) + repeat(n - 1, B), (P,), kernel))
        return tuple(rows)
    return rule


def unpool(spatial: int):
    """max_unpool: :func:`leading`'s rows, run by kernel "unpool"."""
    def rule(call: Call):
        return tuple(Row(r.ins, r.outs, "unpool") for r in leading(spatial)(call))
    return rule


def _k_unpool(ctx, largs, lkwargs):
    """max_unpool on a piece; a piece with no element gets the zeros of its output's shape."""
    return ctx.run_unless_empty(largs, lkwargs, lambda piece, shape: piece.new_zeros(shape))


def _k_local_input_size(ctx, largs, lkwargs):
    """upsample_*_backward(grad, output_size, input_size, ...): the op with this piece's
    leading sizes in ``input_size`` (positional or keyword)."""
    if ctx.coord is None:
        return ctx.empties()
    largs = list(largs)
    sizes = list(arg_value(ctx.call.op, largs, lkwargs, "input_size"))
    spatial = len(arg_value(ctx.call.op, largs, lkwargs, "output_size"))
    for d in range(len(sizes) - spatial):
        sizes[d] = largs[0].shape[d]
    lkwargs = with_arg(ctx.call.op, largs, lkwargs, "input_size", sizes)
    return ctx.func(*largs, **lkwargs)


for _k in (1, 2, 3):
    register(f"reflection_pad{_k}d", f"replication_pad{_k}d", rule=leading(_k))
    register(f"reflection_pad{_k}d_backward", f"replication_pad{_k}d_backward",
             rule=leading(_k))
for _name, _k in (("upsample_nearest1d", 1), ("upsample_nearest2d", 2), ("upsample_nearest3d", 3),
                  ("_upsample_nearest_exact1d", 1), ("_upsample_nearest_exact2d", 2),
                  ("_upsample_nearest_exact3d", 3), ("upsample_linear1d", 1),
                  ("upsample_bilinear2d", 2), ("upsample_bicubic2d", 2),
                  ("upsample_trilinear3d", 3), ("_upsample_bilinear2d_aa", 2),
                  ("_upsample_bicubic2d_aa", 2)):
    register(f"{_name}.default", rule=leading(_k))
    register(f"{_name}_backward.default", rule=leading(_k, sized=True))
register(kernels={"local_input_size": _k_local_input_size})
register("max_unpool2d", rule=unpool(2), kernels={"unpool": _k_unpool})
register("max_unpool3d", rule=unpool(3))
