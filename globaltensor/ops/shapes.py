"""Shape ops whose result is a new tensor (views.py holds the ops whose result aliases its
input): cat, stack, tril/triu, constant padding, the scatters and backwards of the views, flips,
rolls, repeats, diagonals, windows, channel shuffles, and the ``*_copy`` forms of the view ops
(which take their view's rule).

    B    -> B, P -> P      these ops move values, never mix them (all linear)
    S(d) -> S(d')          a dim the op does not reorder keeps its split, at its new place:
        flip / roll / rot90        the flipped, rolled, rotated dims whole
        cat / stack                every dim but the joined one (stack: shifted past the new)
        tril / triu / pad          the masked or padded dims whole (pad: P only with value 0)
        *_scatter / *_backward     the view's other dims, split alike in base and src
        repeat                     a dim repeated once; new leading dims shift the others
        diag_embed                 every dim but the last (which becomes the diagonal)
        diagonal_backward          the grad's dims but the diagonal (local sizes rewritten)
        unfold                     every dim but the unfolded one (unfold_backward alike)
        channel_shuffle            every dim but the channels
        pixel_shuffle / unshuffle  a leading (batch) dim; the channel, height or width dim only
                                   where every piece maps to whole blocks of r x r (the
                                   dim's size in blocks, C or H or W of the smaller side,
                                   divisible by the ranks splitting it: an uneven split of
                                   H into [2, 1] gives pieces of [2r, r], not the output's
                                   own uneven split of H*r); kernel "blocks": torch gives an
                                   empty input's shape back unchanged (a piece of no rows,
                                   (0, 1, 6, 6) -> (0, 1, 6, 6) for r = 3), so an empty piece
                                   gets its empty output shape here (the wrong shape left the
                                   ranks waiting on pieces of other sizes: the sweep hung)
"""
from __future__ import annotations

import torch

import math

from . import views
from ..sbp import Split
from .rules import B, P, S, Call, Row, Rule, dim_of, dims_of, keep_whole, sig
from .rules import repeat as times
from .registry import register

aten = torch.ops.aten


def flip(call: Call):
    return keep_whole(call, dims_of(call.get("dims"), len(call.shapes[0])))


def roll(call: Call):
    """``roll(x, shifts, dims)``: the rolled dims whole (no dims: the flattened tensor rolls,
    every dim whole)."""
    nd = len(call.shapes[0])
    dims = call.get("dims") or ()
    return keep_whole(call, dims_of(dims, nd) if len(dims) else tuple(range(nd)))


def rot90(call: Call):
    nd = len(call.shapes[0])
    return keep_whole(call, dims_of(call.get("dims", [0, 1]), nd))


def repeat(call: Call):
    """``repeat(x, repeats)``: a dim repeated once keeps its split (shifted by the new leading
    dims)."""
    src, reps = call.shapes[0], list(call.get("repeats"))
    lead = len(reps) - len(src)
    rows = [sig("B -> B"), sig("P -> P")]
    return tuple(rows + [Row((S(d),), (S(d + lead),)) for d in range(len(src))
                         if reps[d + lead] == 1])


def _diag_rest(nd_out: int, dim1: int, dim2: int) -> list[int]:
    pair = {dim_of(dim1, nd_out), dim_of(dim2, nd_out)}
    return [k for k in range(nd_out) if k not in pair]


def diag_embed(call: Call):
    """``diag_embed(x, offset, dim1, dim2)``: x's last dim becomes the diagonal of (dim1, dim2);
    its other dims keep their order in the output's remaining dims."""
    nd = len(call.shapes[0])
    rest = _diag_rest(nd + 1, call.get("dim1", -2), call.get("dim2", -1))
    rows = [sig("B -> B"), sig("P -> P")]
    return tuple(rows + [Row((S(d),), (S(rest[d]),)) for d in range(nd - 1)])


def diagonal_backward(call: Call):
    """``diagonal_backward(grad, input_sizes, offset, dim1, dim2)``: grad holds the input's
    other dims then the diagonal; those dims keep their split."""
    nd = len(call.get("input_sizes"))
    rest = _diag_rest(nd, call.get("dim1"), call.get("dim2"))
    rows = [sig("B -> B"), sig("P -> P")]
    return tuple(rows + [Row((S(i),), (S(k),)) for i, k in enumerate(rest)])


def _rewrite_diagonal_backward(decision, largs, pieces):
    sizes = list(largs[1])
    rest = _diag_rest(len(sizes), largs[3], largs[4])
    for i, k in enumerate(rest):
        sizes[k] = pieces[0].shape[i]
    largs[1] = sizes


def unfold(call: Call):
    """``unfold(x, dimension, size, step)``: windows along ``dimension`` (whole); the other dims
    keep their split, the window dim is new and last."""
    nd = len(call.shapes[0])
    dim = dim_of(call.get("dimension"), nd)
    return tuple([sig("B -> B"), sig("P -> P")] +
                 [Row((S(d),), (S(d),)) for d in range(nd) if d != dim])


def unfold_backward(call: Call):
    """``unfold_backward(grad, input_sizes, dim, size, step)``: the other dims keep their split
    (local input sizes rewritten)."""
    nd = len(call.get("input_sizes"))
    dim = dim_of(call.get("dim"), max(nd, 1))
    return tuple([sig("B -> B"), sig("P -> P")] +
                 [Row((S(d),), (S(d),)) for d in range(nd) if d != dim])


def _rewrite_unfold_backward(decision, largs, pieces):
    sizes = list(largs[1])
    dim = largs[2] % max(len(sizes), 1)
    for d in range(len(sizes)):
        if d != dim:
            sizes[d] = pieces[0].shape[d]
    largs[1] = sizes


def channel_shuffle(call: Call):
    nd = len(call.shapes[0])
    return keep_whole(call, (1,) if nd > 1 else (0,))


def pixel_shuffle(call: Call):
    """``pixel_shuffle(x, r)``: (*, C r^2, H, W) -> (*, C, H r, W r); ``pixel_unshuffle`` the
    inverse. Any dim may split; the last three only in whole blocks (:func:`_whole_blocks`)."""
    nd = len(call.shapes[0])
    rows = [sig("B -> B", "blocks"), sig("P -> P", "blocks")]
    rows += [Row((S(d),), (S(d),), "blocks") for d in range(nd)]
    return Rule(tuple(rows), check=_whole_blocks)


def _whole_blocks(call: Call, grid, ins, outs) -> bool:
    """Each of the last three dims is cut into pieces of whole blocks: its size counted on the
    smaller side (C, H, W) divisible by the ranks that split it."""
    x = call.shapes[0]
    nd = len(x)
    shuffle = call.packet == "pixel_shuffle"
    r = call.get("upscale_factor" if shuffle else "downscale_factor")
    blocks = {nd - 3: x[nd - 3] // (r * r) if shuffle else x[nd - 3],
              nd - 2: x[nd - 2] if shuffle else x[nd - 2] // r,
              nd - 1: x[nd - 1] if shuffle else x[nd - 1] // r}
    for d, n in blocks.items():
        ranks = math.prod(m for m, v in zip(grid, ins[0]) if isinstance(v, Split) and v.dim == d)
        if n % ranks:
            return False
    return True


def _k_blocks(ctx, largs, lkwargs):
    """pixel_(un)shuffle on a piece; an empty piece gets the empty output of its shape."""
    return ctx.run_unless_empty(largs, lkwargs, lambda piece, shape: piece.new_empty(shape))


def narrow_copy(call: Call):
    shape = call.shapes[0]
    dim = dim_of(call.get("dim"), len(shape))
    whole = call.get("start") == 0 and call.get("length") == shape[dim]
    return keep_whole(call, () if whole else (dim,))


def cat(call: Call):
    n = len(call.shapes)
    nd = max(len(s) for s in call.shapes)
    dim = dim_of(call.get("dim", 0), nd)
    real = [len(s) == nd for s in call.shapes]  # legacy 1-D empty tensors are skipped by cat
    rows = [Row(times(n, B), (B,)), Row(times(n, P), (P,))]
    rows += [Row(tuple(S(d) if r else B for r in real), (S(d),)) for d in range(nd) if d != dim]
    return tuple(rows)


def stack(call: Call):
    n = len(call.shapes)
    nd = len(call.shapes[0])
    dim = call.get("dim", 0) % (nd + 1)
    rows = [Row(times(n, B), (B,)), Row(times(n, P), (P,))]
    rows += [Row(times(n, S(d)), (S(d + (d >= dim)),)) for d in range(nd)]
    return tuple(rows)


def tri(call: Call):
    """``tril`` / ``triu``: the masked (last two) dims whole."""
    nd = len(call.shapes[0])
    return keep_whole(call, (nd - 2, nd - 1) if nd >= 2 else ())


def select_backward(call: Call):
    """``select_backward(grad, input_sizes, dim, index)``: grad's dims map around ``dim``."""
    nd = len(call.get("input_sizes"))
    dim = dim_of(call.get("dim"), nd)
    rows = [sig("B -> B"), sig("P -> P")]
    rows += [Row((S(d),), (S(d + (d >= dim)),)) for d in range(nd - 1)]
    return tuple(rows)


def _rewrite_select_backward(decision, largs, pieces):
    sizes = list(largs[1])
    dim = largs[2] % len(sizes)
    local = list(pieces[0].shape)
    largs[1] = local[:dim] + [sizes[dim]] + local[dim:]


def slice_backward(call: Call):
    return keep_whole(call, (dim_of(call.get("dim"), len(call.shapes[0])),))


def _rewrite_slice_backward(decision, largs, pieces):
    sizes = list(largs[1])
    dim = largs[2] % len(sizes)
    local = list(pieces[0].shape)
    local[dim] = sizes[dim]
    largs[1] = local


def select_scatter(call: Call):
    """``select_scatter(x, src, dim, index)``: x's other dims split alike with src's; linear in
    (x, src) together (writes through a ``select`` view, dispatch/views.py)."""
    nd = len(call.shapes[0])
    dim = dim_of(call.get("dim"), nd)
    rows = [sig("B B -> B"), sig("P P -> P")]
    return tuple(rows + [Row((S(d), S(d - (d > dim))), (S(d),)) for d in range(nd) if d != dim])


def slice_scatter(call: Call):
    """``slice_scatter(x, src, dim, start, end, step)``: other dims split alike."""
    nd = len(call.shapes[0])
    dim = dim_of(call.get("dim", 0), nd)
    rows = [sig("B B -> B"), sig("P P -> P")]
    return tuple(rows + [Row((S(d), S(d)), (S(d),)) for d in range(nd) if d != dim])


def diagonal_scatter(call: Call):
    """``diagonal_scatter(x, src, offset, dim1, dim2)``: src holds x's other dims, then the
    diagonal; those other dims split alike."""
    rows = [sig("B B -> B"), sig("P P -> P")]
    return tuple(rows + [Row((S(d), S(k)), (S(d),)) for k, d in enumerate(views.diagonal_rest(call))])


def constant_pad(call: Call):
    """``constant_pad_nd(x, pad, value)``: the padded dims must be whole, the others may stay
    split; a partial sum passes only when the padding value is 0 (every rank pads with it)."""
    nd = len(call.shapes[0])
    pad = list(call.get("pad"))
    padded = {nd - 1 - i // 2 for i in range(len(pad)) if pad[i] != 0}
    rows = keep_whole(call, padded)
    if call.get("value", 0) != 0:
        rows = tuple(r for r in rows if r.ins[0] != P)
    return rows


register("flip", rule=flip, order_free=True)
register("roll", rule=roll, order_free=True)
register("rot90", rule=rot90)
register("repeat", rule=repeat, order_free=True)
register("diag_embed", rule=diag_embed)
register("diagonal_backward", rule=diagonal_backward, rewrite=_rewrite_diagonal_backward)
register("unfold", "unfold_copy", rule=unfold)
register("unfold_backward", rule=unfold_backward, rewrite=_rewrite_unfold_backward)
register("channel_shuffle", "native_channel_shuffle", rule=channel_shuffle)
register("narrow_copy", rule=narrow_copy, order_free=True)
register("pixel_shuffle", "pixel_unshuffle", rule=pixel_shuffle, kernels={"blocks": _k_blocks})
# the copy forms of view ops: their view's rows (and size rewrites); the result is a copy
register("view_copy", rule=views.view, rewrite=views.rewrite_view)
register("expand_copy", rule=views.expand, rewrite=views.rewrite_expand)
register("permute_copy", rule=views.permute)
register("transpose_copy", "t_copy", rule=views.transpose)
register("squeeze_copy", rule=views.squeeze)
register("unsqueeze_copy", rule=views.unsqueeze)
register("alias_copy", rule=lambda call: keep_whole(call, ()), order_free=True)
register("diagonal_copy", rule=views.diagonal)
register("unbind_copy", rule=views.unbind)
register("split_with_sizes_copy", "split_copy", rule=views.split)
register("select_copy", rule=views.select)
register("slice_copy", rule=views.slice_)
register("constant_pad_nd", rule=constant_pad, order_free=True)
register("cat", rule=cat, order_free=True)
register("stack", rule=stack, order_free=True)
register("tril", "triu", "tril_", "triu_", rule=tri, order_free=True)
register("select_backward", rule=select_backward, rewrite=_rewrite_select_backward,
         order_free=True)
register("slice_backward", rule=slice_backward, rewrite=_rewrite_slice_backward,
         order_free=True)
register("select_scatter", rule=select_scatter)
register("slice_scatter", rule=slice_scatter)
register("diagonal_scatter", rule=diagonal_scatter)
