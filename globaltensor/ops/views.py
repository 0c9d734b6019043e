"""Views: the ops whose result aliases its input; a split follows its dim to where the op puts it.

    B    -> B, P -> P      a view moves values, never mixes them
    S(d) -> S(d')          d' is where dim d lands (permute, unsqueeze, a merged or split view)
A dim the op cuts, selects or removes (slice, select, split, unbind, diagonal's pair) must be
whole. Ops whose arguments name global sizes (view, expand) get this rank's local sizes through
their rewrite. Each view has its write-back (a write into a view made from moved pieces reaches
the base). Ops that make new tensors of other shapes (cat, stack, tril, pad, the scatters, the
views' backwards and ``*_copy`` forms) are in shapes.py.
"""
from __future__ import annotations

import math

import torch

from ..errors import GlobalTensorError
from ..sbp import Split
from .rules import S, Call, Row, Rule, dim_of, dims_of, keep_whole, sig
from .registry import register

aten = torch.ops.aten


def view_groups(src, dst) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """Pair runs of ``src`` dims with runs of ``dst`` dims of equal product, in order.

    Size-1 dims form groups of their own with an empty partner, so a split dim's group starts at
    a dim of size > 1. ``view_groups((4, 6), (2, 2, 6))`` is ``(((0,), (0, 1)), ((1,), (2,)))``.
    """
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1:
            groups.append(((i,), ()))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1:
            groups.append(((), (j,)))
            j += 1
            continue
        if i >= len(src) or j >= len(dst):
            raise GlobalTensorError(f"cannot view a tensor of shape {list(src)} as {list(dst)}")
        gi, gj, a, b = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while a != b:
            if a < b and i < len(src):
                a *= src[i]
                gi.append(i)
                i += 1
            elif b < a and j < len(dst):
                b *= dst[j]
                gj.append(j)
                j += 1
            else:
                raise GlobalTensorError(f"cannot view a tensor of shape {list(src)} as {list(dst)}")
        groups.append((tuple(gi), tuple(gj)))
    return tuple(groups)


def resolve_size(size, numel: int) -> tuple[int, ...]:
    size = list(size)
    if -1 in size:
        known = math.prod(s for s in size if s != -1)
        size[size.index(-1)] = numel // known if known else 0
    return tuple(size)


def view(call: Call) -> Rule:
    """``view(x, size)``: a split moves within its group of dims (``view_groups``). A dim kept
    as it is keeps any split; through a merge or a split of dims, the pieces must be the same
    elements in the same order on both sides (``_same_pieces``): ``(8, 4)`` as (S(0), S(0))
    viewed as ``(2, 4, 4)`` is (S(0), S(1)), and back."""
    src = call.shapes[0]
    dst = resolve_size(call.get("size", call.get("shape")), math.prod(src))
    rows = [sig("B -> B"), sig("P -> P")]
    if 0 in src:
        return Rule(tuple(rows))
    groups = view_groups(src, dst)
    rows += [Row((S(i),), (S(j),)) for gi, gj in groups if gi and gj for i in gi for j in gj]

    def check(call, grid, ins, outs):
        return all(_same_pieces(src, dst, gi, gj, grid, ins[0], outs[0]) for gi, gj in groups
                   if gi and gj)

    def order_free(row) -> bool:  # a head-tail dim viewed as a dim of its own size
        return all(not isinstance(i, Split) or src[i.dim] == dst[o.dim]
                   for i, o in zip(row.ins, row.outs))
    return Rule(tuple(rows), check, order_free=order_free)


def _same_pieces(src, dst, gi, gj, grid, sbp_in, sbp_out) -> bool:
    """Whether one group of a view keeps every rank's piece: the same elements, in the same
    order, so the local view of the piece is the output's piece.

    A dim kept whole as a dim (``gi``, ``gj`` of one dim each) keeps any split. Otherwise each
    dim of the group is read as mixed-radix digits: a dim of size ``n`` split by axes of sizes
    ``k1, k2`` (axis order, outermost first) is the digits ``(k1, k2, n/(k1 k2))``, and the
    group's flat index is the dims' digits in order. The piece at a coordinate fixes each
    splitting axis's digit, so it is the same set in the same order on both sides iff every
    axis's digit has the same stride in the flat index on both sides (``_digits``). Axes of
    size 1 cut nothing: they map to the group's first output dim."""
    if len(gi) == 1 and len(gj) == 1:
        return True
    for a, n in enumerate(grid):
        if n == 1 and sbp_in[a] in tuple(S(i) for i in gi) and sbp_out[a] != S(gj[0]):
            return False
    digits_in = _digits(src, gi, grid, sbp_in)
    return digits_in is not None and digits_in == _digits(dst, gj, grid, sbp_out)


def _digits(shape, dims, grid, sbp):
    """{axis: its digit} for the axes (of size > 1) that split ``dims``: ``(stride, k)`` for an
    even cut; the innermost cut of a dim may be uneven, ``(stride, k, length)``: ``k`` uneven
    pieces of a range of ``length`` at ``stride`` (the uneven rule, layout.py). None if an
    outer cut is uneven."""
    digits, stride = {}, 1
    for d in reversed(dims):
        axes = [a for a, v in enumerate(sbp) if v == S(d) and grid[a] > 1]
        outer = math.prod(grid[a] for a in axes[:-1])
        if shape[d] % outer:
            return None
        length = shape[d] // outer
        if axes and length % grid[axes[-1]]:
            digits[axes[-1]] = (stride, grid[axes[-1]], length)
            stride *= length
            axes = axes[:-1]
        else:
            stride *= length // grid[axes[-1]] if axes else length
        for a in reversed(axes):
            digits[a] = (stride, grid[a])
            stride *= grid[a]
    return digits


def rewrite_view(decision, largs, pieces):
    """The local size: a dim kept as it is keeps the piece's size; a dim of a merge or a split
    is its global size over the axes that cut it (``_same_pieces``), but for an uneven last cut,
    the size of the input dim that axis cuts alike.

    The global tensor is contiguous, its piece may not be (a slice, a transpose): a piece that
    torch can view as the new size as it is stays an alias of its base (an attention's q/k/v
    split off one projection, as on one device); only one that cannot is copied first."""
    piece = pieces[0]
    out = decision.outs.layout
    if _has_split(out):
        largs[1] = _local_view_size(decision, out, piece.shape)
    if not piece.is_contiguous() and (len(largs) < 2 or not _viewable(piece, largs[1])):
        largs[0] = piece.contiguous()


def _has_split(layout) -> bool:
    for v in layout.sbp:
        if isinstance(v, Split):
            return True
    return False


def _viewable(piece, size) -> bool:
    """Whether torch's ``view`` takes ``piece`` to ``size`` without a copy: its strides allow
    it (torch's ``computeStride``, without raising and catching torch's error, which costs a
    C++ backtrace)."""
    shape, stride = piece.shape, piece.stride()
    numel = piece.numel()
    if numel == 0 or not shape:
        return True
    size = list(size)
    if -1 in size:
        known = 1
        for n in size:
            if n != -1:
                known *= n
        size[size.index(-1)] = numel // known if known else 0
    view_d = len(size) - 1
    chunk_base_stride = stride[-1]
    tensor_numel = view_numel = 1
    for d in range(len(shape) - 1, -1, -1):
        tensor_numel *= shape[d]
        if d == 0 or (shape[d - 1] != 1 and stride[d - 1] != tensor_numel * chunk_base_stride):
            while view_d >= 0 and (view_numel < tensor_numel or size[view_d] == 1):
                view_numel *= size[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return False
            if d > 0:
                chunk_base_stride = stride[d - 1]
                tensor_numel = view_numel = 1
    return view_d == -1


def _local_view_size(decision, out, local_in) -> list:
    grid, sbp_in = out.placement.shape, decision.targets[0].sbp
    size = list(out.shape)
    for gi, gj in view_groups(decision.targets[0].shape, out.shape):
        if len(gi) == 1 and len(gj) == 1:
            size[gj[0]] = local_in[gi[0]]
            continue
        for j in gj:
            axes = [a for a, v in enumerate(out.sbp) if v == S(j) and grid[a] > 1]
            if axes:
                length = size[j] // math.prod(grid[a] for a in axes[:-1])
                last = axes[-1]
                uneven = length % grid[last]
                size[j] = local_in[sbp_in[last].dim] if uneven else length // grid[last]
    return size


def _permute_rows(perm) -> tuple[Row, ...]:
    return (sig("B -> B"), sig("P -> P")) + tuple(Row((S(p),), (S(k),)) for k, p in enumerate(perm))


def permute(call: Call):
    nd = len(call.shapes[0])
    return _permute_rows([dim_of(d, nd) for d in call.get("dims")])


def transpose(call: Call):
    nd = len(call.shapes[0])
    perm = list(range(nd))
    if nd >= 2:
        a, b = dim_of(call.get("dim0", 0), nd), dim_of(call.get("dim1", 1), nd)
        perm[a], perm[b] = perm[b], perm[a]
    return _permute_rows(perm)


def _drop_dims(call: Call, removed) -> tuple[Row, ...]:
    """Rows for ops that remove ``removed`` dims (which must be whole) and keep the others."""
    nd = len(call.shapes[0])
    rows = [sig("B -> B"), sig("P -> P")]
    for d in range(nd):
        if d not in removed:
            rows.append(Row((S(d),), (S(d - sum(1 for r in removed if r < d)),)))
    return tuple(rows)


def _squeeze_dims(call: Call) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the dims ``squeeze`` names, those of them it removes: the ones of *global* size 1)."""
    shape = call.shapes[0]
    dims = call.get("dim")
    if not shape:  # a 0-dim tensor: squeeze(dim=0 or -1) is the tensor itself
        return (), ()
    named = tuple(range(len(shape))) if dims is None else dims_of(dims, len(shape))
    return named, tuple(d for d in named if shape[d] == 1)


def squeeze(call: Call):
    """Removed dims whole. Where it names a dim the tensor has more than one of, a piece may
    still have size 1 there (an uneven or fine split): kernel "squeeze" tells the local op which
    dims to remove."""
    named, removed = _squeeze_dims(call)
    kernel = "squeeze" if len(named) > len(removed) else None
    return tuple(Row(r.ins, r.outs, kernel) for r in _drop_dims(call, set(removed)))


def _k_squeeze(ctx, largs, lkwargs):
    if ctx.coord is None:
        return ctx.empties()
    return torch.ops.aten.squeeze.dims(largs[0], _squeeze_dims(ctx.call)[1])


def unsqueeze(call: Call):
    nd = len(call.shapes[0])
    dim = call.get("dim") % (nd + 1)
    return (sig("B -> B"), sig("P -> P")) + tuple(Row((S(d),), (S(d + (d >= dim)),)) for d in range(nd))


def select(call: Call):
    return _drop_dims(call, {dim_of(call.get("dim"), len(call.shapes[0]))})


def slice_(call: Call):
    shape = call.shapes[0]
    dim = dim_of(call.get("dim", 0), len(shape))
    start, end, step = call.get("start"), call.get("end"), call.get("step", 1)
    whole = start in (None, 0) and (end is None or end >= shape[dim]) and step == 1
    return keep_whole(call, () if whole else (dim,))


def split(call: Call):
    return keep_whole(call, (dim_of(call.get("dim", 0), len(call.shapes[0])),))


def unbind(call: Call):
    return _drop_dims(call, {dim_of(call.get("dim", 0), len(call.shapes[0]))})


def expand(call: Call):
    src = call.shapes[0]
    size = call.get("size")
    lead = len(size) - len(src)
    rows = [sig("B -> B"), sig("P -> P")]
    rows += [Row((S(d),), (S(d + lead),)) for d, n in enumerate(src) if size[d + lead] in (-1, n)]
    return tuple(rows)


def rewrite_expand(decision, largs, pieces):
    """A split dim keeps this piece's size (-1)."""
    size = list(largs[1])
    for v in decision.outs.layout.sbp:
        if isinstance(v, Split):
            size[v.dim] = -1
    largs[1] = size


def diagonal_rest(call: Call) -> list[int]:
    nd = len(call.shapes[0])
    pair = {dim_of(call.get("dim1", 0), nd), dim_of(call.get("dim2", 1), nd)}
    return [d for d in range(nd) if d not in pair]


def diagonal(call: Call):
    """``diagonal(x, offset, dim1, dim2)``: the two dims whole; the others keep their split
    (numbered in order, the diagonal last)."""
    rows = [sig("B -> B"), sig("P -> P")]
    return tuple(rows + [Row((S(d),), (S(k),)) for k, d in enumerate(diagonal_rest(call))])


# ----------------------------------------------------------------------------- write-backs
# A view op that moved its input made copies: a write into its output reaches the base through
# its scatter (dispatch/aliasing.py runs it). write_back(get(argument name, default), output
# index) -> scatter(base, view) -> the new base.

def _scatter_select(get, k):
    dim, index = get("dim"), get("index")
    return lambda base, view: aten.select_scatter.default(base, view, dim, index)


def _scatter_slice(get, k):
    dim, start, end, step = get("dim", 0), get("start"), get("end"), get("step", 1)
    return lambda base, view: aten.slice_scatter.default(base, view, dim, start, end, step)


def _scatter_diagonal(get, k):
    offset, dim1, dim2 = get("offset", 0), get("dim1", 0), get("dim2", 1)
    return lambda base, view: aten.diagonal_scatter.default(base, view, offset, dim1, dim2)


def _reshape_back(get, k):
    return lambda base, view: aten.reshape.default(view, list(base.shape))


def _permute_back(get, k):
    dims = get("dims")
    dims = [d % len(dims) for d in dims]
    inverse = sorted(range(len(dims)), key=lambda i: dims[i])
    return lambda base, view: aten.permute.default(view, inverse)


def _transpose_back(get, k):
    d0, d1 = get("dim0", 0), get("dim1", 1)  # t() is transpose(0, 1), or nothing below 2-D
    return lambda base, view: view if view.dim() < 2 else aten.transpose.int(view, d0, d1)


def _scatter_unbind(get, k):
    dim = get("dim", 0)
    return lambda base, view: aten.select_scatter.default(base, view, dim, k)


def _scatter_split(get, k):
    dim, size, sizes = get("dim", 0), get("split_size"), get("split_sizes")

    def scatter(base, view):
        n = base.shape[dim % base.dim()]
        parts = sizes if sizes is not None else [min(size, n - s) for s in range(0, n, size)]
        start = sum(parts[:k])
        return aten.slice_scatter.default(base, view, dim, start, start + parts[k], 1)
    return scatter


register("view", "_unsafe_view", "reshape", rule=view, rewrite=rewrite_view)
register("permute", rule=permute, order_free=True)
register("transpose", "t", rule=transpose, order_free=True)
register("squeeze", rule=squeeze, kernels={"squeeze": _k_squeeze}, order_free=True)
register("unsqueeze", rule=unsqueeze, order_free=True)
register("expand", rule=expand, rewrite=rewrite_expand, order_free=True)
register("select", rule=select, order_free=True)
register("slice", rule=slice_, order_free=True)
register("split", "split_with_sizes", rule=split, order_free=True)
register("unbind", rule=unbind, order_free=True)
register("diagonal", rule=diagonal, order_free=True)
# a write into the view reaches the base (the write-backs above)
register("select", write_back=_scatter_select)
register("slice", write_back=_scatter_slice)
register("diagonal", write_back=_scatter_diagonal)
register("view", "_unsafe_view", "reshape", "_reshape_alias", "unsqueeze", "squeeze", "alias",
         "detach", write_back=_reshape_back)
register("permute", write_back=_permute_back)
register("transpose", "t", write_back=_transpose_back)
register("unbind", write_back=_scatter_unbind)
register("split", "split_with_sizes", write_back=_scatter_split)
