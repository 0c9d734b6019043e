"""SBP rules: which layouts each operator accepts, and the choice of the cheapest.

A rule turns a :class:`Call` (the op's name, the global shapes of its global-tensor inputs and
its other arguments) into *rows*. A row is a per-axis signature: for one placement axis, the sbp
each global input must have and the sbp each output then has. On an n-D grid a signature is one
row per axis (the product of the rows with themselves); :func:`choose` costs each candidate by
the redistribution its inputs need (``plan(src, dst).cost``) and returns the cheapest.

Two invariants the tables keep:
- an input is never asked to become P unless it is P already (no implicit partial sums);
- a row's outputs hold exactly the local results of the op run on the inputs' pieces (or of the
  named ``kernel``, for the few ops whose local computation differs from the op itself).

Pure: no torch.distributed, no rank. See docs/ops.md for the table of every op family.
"""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import Callable

from .errors import GlobalTensorError
from .layout import Layout
from .plan import plan
from .sbp import Broadcast, PartialSum, SbpValue, Split, broadcast, partial_sum

B, P = broadcast, partial_sum
S = Split


class _Keep:
    """In a row: the input keeps whatever sbp it has on this axis (its value is not used)."""

    __slots__ = ()

    def __repr__(self):
        return "KEEP"


KEEP = _Keep()


@dataclass(frozen=True, slots=True)
class Ref:
    """In a Call's args: the global-tensor input with this index."""

    index: int


class _Marker:
    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


# in a Call's args: a 0-dim local tensor (a constant) / a float whose value the rule must not use
LOCAL = _Marker("LOCAL")
NUMBER = _Marker("NUMBER")


@dataclass(frozen=True, slots=True)
class Row:
    """One per-axis signature: an sbp per global input, an sbp per output (one for all if
    ``outs`` has a single entry), and an optional local kernel name (see dispatch.KERNELS)."""

    ins: tuple
    outs: tuple
    kernel: str | None = None

    def __str__(self):
        ins = " ".join(str(v) for v in self.ins)
        outs = " ".join(str(v) for v in self.outs)
        return f"{ins} -> {outs}" + (f"  [{self.kernel}]" if self.kernel else "")


@dataclass(frozen=True, slots=True)
class Rule:
    """Rows plus an optional check of a whole n-D candidate: ``check(call, mesh, ins, outs)``
    where ``ins``/``outs`` hold one sbp tuple (one entry per axis) per input/output."""

    rows: tuple
    check: Callable | None = None


@dataclass(frozen=True, slots=True)
class Call:
    """What a rule sees of one operator call (hashable; built by dispatch from its cache key)."""

    op: str                                  # overload name, e.g. "add.Tensor"
    shapes: tuple[tuple[int, ...], ...]      # global shapes of the global-tensor inputs, in order
    args: tuple = ()                         # positional args; global tensors appear as Ref(i)
    kwargs: tuple = ()                       # sorted (name, value) pairs, marked the same way
    tags: frozenset = frozenset()            # torch tags: "pointwise", "inplace", ...

    @property
    def packet(self) -> str:
        return self.op.split(".")[0]

    def arg(self, pos: int, name: str, default=None):
        if pos < len(self.args):
            return self.args[pos]
        for k, v in self.kwargs:
            if k == name:
                return v
        return default

    def is_global(self, pos: int, name: str = "") -> bool:
        return isinstance(self.arg(pos, name), Ref)

    def shape_of(self, pos: int, name: str = ""):
        value = self.arg(pos, name)
        return self.shapes[value.index] if isinstance(value, Ref) else None


@dataclass(frozen=True, slots=True)
class Choice:
    """The signature chosen for a call: target input layouts and the outputs' sbp tuples."""

    ins: tuple[Layout, ...]
    outs: tuple[tuple[SbpValue, ...], ...]
    kernel: str | None
    cost: float


# ----------------------------------------------------------------------------- table syntax

_TOKEN = re.compile(r"S\((-?\d+)\)|B|P|\*|-")


def _token(text: str):
    if text == "B":
        return B
    if text == "P":
        return P
    if text == "*":
        return KEEP
    if text == "-":
        return None  # an absent optional input: dropped by fit()
    m = re.fullmatch(r"S\((-?\d+)\)", text)
    if not m:
        raise GlobalTensorError(f"bad sbp token {text!r} in a rule table")
    return S(int(m.group(1)))


def sig(text: str, kernel: str | None = None) -> Row:
    """``sig("S(1) S(0) -> P")``: a row from its compact text."""
    left, right = text.split("->")
    return Row(tuple(_token(t) for t in left.split()), tuple(_token(t) for t in right.split()),
               kernel)


def table(*texts: str) -> tuple[Row, ...]:
    return tuple(sig(t) for t in texts)


def fit(rows, present) -> tuple[Row, ...]:
    """Rows written over every tensor slot of an op, with the absent slots' columns removed."""
    out = []
    for r in rows:
        out.append(Row(tuple(v for v, keep in zip(r.ins, present) if keep), r.outs, r.kernel))
    return tuple(out)


# ----------------------------------------------------------------------------- helpers


def _dims(value, ndim: int) -> tuple[int, ...]:
    """A dim / list of dims / None (= all) normalised to sorted non-negative dims."""
    if value is None or value == () or value == []:
        return tuple(range(ndim))
    if isinstance(value, int):
        value = (value,)
    return tuple(sorted({d % max(ndim, 1) for d in value}))


def _dim(value, ndim: int) -> int:
    return value % max(ndim, 1)


def broadcast_shapes(shapes) -> tuple[int, ...]:
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for s in shapes:
        for i, n in enumerate(s):
            j = ndim - len(s) + i
            if n != 1:
                out[j] = n
    return tuple(out)


def _all(n: int, value) -> tuple:
    return (value,) * n


# ----------------------------------------------------------------------------- pointwise

# ops linear in all the listed positions together: all P -> P (the others must be B)
JOINT_LINEAR = {
    "add": (0, 1), "sub": (0, 1), "add_": (0, 1), "sub_": (0, 1),
    "neg": (0,), "neg_": (0,), "positive": (0,), "clone": (0,), "alias": (0,), "detach": (0,),
    "conj": (0,), "resolve_conj": (0,), "resolve_neg": (0,), "lift_fresh": (0,),
    "where": (1, 2), "lerp": (0, 1), "lerp_": (0, 1),
}
# ops linear in each listed position on its own: that one P, the others B -> P
EACH_LINEAR = {
    "mul": (0, 1), "mul_": (0, 1), "div": (0,), "div_": (0,),
    "threshold_backward": (0,), "native_dropout_backward": (0,), "sigmoid_backward": (0,),
    "tanh_backward": (0,), "gelu_backward": (0,), "silu_backward": (0,),
    "hardtanh_backward": (0,), "leaky_relu_backward": (0,), "elu_backward": (0,),
}


def _linear_rows(call: Call) -> list[Row]:
    n = len(call.shapes)
    joint = JOINT_LINEAR.get(call.packet)
    if joint is not None:
        refs = [call.arg(p, "") for p in joint]
        if all(isinstance(r, Ref) for r in refs):
            want = {r.index for r in refs}
            return [Row(tuple(P if i in want else B for i in range(n)), (P,))]
        return []
    rows = []
    for pos in EACH_LINEAR.get(call.packet, ()):
        ref = call.arg(pos, "")
        if isinstance(ref, Ref):
            rows.append(Row(tuple(P if i == ref.index else B for i in range(n)), (P,)))
    return rows


def pointwise(call: Call) -> tuple[Row, ...]:
    """Element-wise ops with broadcasting: split any output dim where every input that spans it
    is split along the same dim (inputs broadcast along it stay B)."""
    n = len(call.shapes)
    out = broadcast_shapes(call.shapes)
    rows = [Row(_all(n, B), (B,))]
    for d in range(len(out)):
        ins = []
        for shape in call.shapes:
            k = d - (len(out) - len(shape))
            ins.append(S(k) if k >= 0 and shape[k] == out[d] else B)
        rows.append(Row(tuple(ins), (S(d),)))
    return tuple(rows + _linear_rows(call))


def to_copy(call: Call) -> tuple[Row, ...]:
    """``.to(dtype)``: element-wise; a partial sum survives only a cast to a floating dtype."""
    rows = pointwise(call)
    dtype = call.arg(99, "dtype")
    if dtype is None or getattr(dtype, "is_floating_point", False) or getattr(dtype, "is_complex", False):
        rows += (sig("P -> P"),)
    return rows


def like(call: Call) -> tuple[Row, ...]:
    """``*_like``: a new full value shaped like the input; a P input gives a B output. The
    random ones (``rand_like`` & co) draw values consistent with the sbp."""
    nd = len(call.shapes[0])
    kernel = "random" if call.packet.startswith("rand") else None
    rows = [sig("B -> B", kernel), sig("P -> B", kernel)]
    return tuple(rows + [Row((S(d),), (S(d),), kernel) for d in range(nd)])


def new_full(call: Call) -> tuple[Row, ...]:
    """``new_zeros(size)`` & co: a new B tensor; the input is only read for dtype and device."""
    return (sig("* -> B"),) if len(call.shapes) == 1 else ()


def random_inplace(call: Call) -> tuple[Row, ...]:
    """``uniform_`` / ``normal_`` / ``bernoulli_``: fill with values consistent with the sbp;
    a P tensor cannot take fresh values (convert it first)."""
    nd = len(call.shapes[0])
    n = len(call.shapes)
    rows = [Row(_all(n, B), (B,), "random")]
    for d in range(nd):
        others = tuple(S(d) if call.shapes[i] == call.shapes[0] else B for i in range(1, n))
        rows.append(Row((S(d),) + others, (S(d),), "random"))
    return tuple(rows)


def random_functional(call: Call) -> tuple[Row, ...]:
    """``bernoulli(probs)``: fresh values laid out like the input; no P."""
    nd = len(call.shapes[0])
    return (sig("B -> B", "random"),) + tuple(Row((S(d),), (S(d),), "random") for d in range(nd))


def dropout(call: Call) -> tuple[Row, ...]:
    """``native_dropout(x, p, train) -> (out, mask)``: the mask depends only on the global
    position, so every layout works; dropout is linear, so P -> P with a B mask."""
    nd = len(call.shapes[0])
    rows = [sig("B -> B B", "dropout"), sig("P -> P B", "dropout")]
    rows += [Row((S(d),), (S(d), S(d)), "dropout") for d in range(nd)]
    return tuple(rows)


# ----------------------------------------------------------------------------- reductions


def _reduction(call: Call, dims_arg, keepdim_arg, nouts: int, partial: str | None,
               all_default: bool = True) -> tuple[Row, ...]:
    """Reduce ``dims``: other split dims survive (renumbered); a split reduced dim gives P when
    the reduction is a sum (``partial`` names its kernel, "" for the op itself), else it must
    be gathered; a P input stays P only for sums."""
    shape = call.shapes[0]
    nd = len(shape)
    raw = call.arg(*dims_arg) if dims_arg else None
    if raw is None and not all_default:
        return _all_reduced_rows(call, nouts, partial)
    dims = _dims(raw, nd)
    keep = bool(call.arg(*keepdim_arg)) if keepdim_arg else False
    rows = [Row((B,), _all(nouts, B))]
    for d in range(nd):
        if d not in dims:
            k = d if keep else d - sum(1 for r in dims if r < d)
            rows.append(Row((S(d),), _all(nouts, S(k))))
        elif partial is not None:
            rows.append(Row((S(d),), _all(nouts, P), partial or None))
    if partial is not None:
        rows.append(Row((P,), _all(nouts, P)))
    return tuple(rows)


def _all_reduced_rows(call, nouts, partial):
    nd = len(call.shapes[0])
    rows = [Row((B,), _all(nouts, B))]
    if partial is not None:
        rows += [Row((S(d),), _all(nouts, P), partial or None) for d in range(nd)]
        rows.append(Row((P,), _all(nouts, P)))
    return tuple(rows)


def reduction_sum(call):
    if call.op == "sum.default":
        return _all_reduced_rows(call, 1, "")
    return _reduction(call, (1, "dim"), (2, "keepdim"), 1, "")


def reduction_mean(call):
    if call.op == "mean.default":
        return _all_reduced_rows(call, 1, "mean_partial")
    return _reduction(call, (1, "dim"), (2, "keepdim"), 1, "mean_partial")


def reduction_gather(nouts: int, dims_pos=1, keep_pos=2, dims_name="dim"):
    """Reductions that are not sums (max, norm, var, ...): reduced dims must be whole."""
    def rule(call):
        if call.op.endswith(".default") and call.packet in ("max", "min", "prod", "any", "all"):
            return _all_reduced_rows(call, nouts, None)
        return _reduction(call, (dims_pos, dims_name), (keep_pos, "keepdim"), nouts, None)
    return rule


def along_dim(dim_pos: int = 1, dim_name: str = "dim", linear_in=(), nouts=1, default=None):
    """Ops that mix values along one dim (softmax, cumsum, sort): that dim must be whole; other
    splits pass through; linear ones keep P in the positions ``linear_in`` (others B)."""
    def rule(call):
        nd = len(call.shapes[0])
        dim = call.arg(dim_pos, dim_name, default)
        dim = _dim(dim, nd) if dim is not None else None
        n = len(call.shapes)
        rows = [Row(_all(n, B), _all(nouts, B))]
        rows += [Row(_all(n, S(d)), _all(nouts, S(d))) for d in range(nd) if d != dim]
        for pos in linear_in:
            ref = call.arg(pos, "")
            if isinstance(ref, Ref):
                rows.append(Row(tuple(P if i == ref.index else B for i in range(n)), _all(nouts, P)))
        return tuple(rows)
    return rule


# ----------------------------------------------------------------------------- matmul

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

# ----------------------------------------------------------------------------- views


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


def _view(call: Call) -> Rule:
    src = call.shapes[0]
    dst = resolve_size(call.arg(1, "size"), math.prod(src))
    rows = [sig("B -> B"), sig("P -> P")]
    if 0 in src:
        return Rule(tuple(rows))
    groups = view_groups(src, dst)
    for gi, gj in groups:
        if gi and gj:
            rows.append(Row((S(gi[0]),), (S(gj[0]),)))

    def check(call, mesh, ins, outs):
        # a split through a merge or a split of dims must cut whole rows: even pieces only
        for gi, gj in groups:
            if not gi or not gj or (len(gi) == 1 and len(gj) == 1):
                continue
            k = math.prod(m for m, v in zip(mesh, ins[0]) if v == S(gi[0]))
            if k > 1 and (src[gi[0]] % k or dst[gj[0]] % k):
                return False
        return True
    return Rule(tuple(rows), check)


def _permute_rows(nd: int, perm) -> tuple[Row, ...]:
    rows = [sig("B -> B"), sig("P -> P")]
    rows += [Row((S(perm[k]),), (S(k),)) for k in range(nd)]
    return tuple(rows)


def _permute(call):
    nd = len(call.shapes[0])
    return _permute_rows(nd, [_dim(d, nd) for d in call.arg(1, "dims")])


def _transpose(call):
    nd = len(call.shapes[0])
    if nd < 2:
        return _permute_rows(nd, list(range(nd)))
    a, b = _dim(call.arg(1, "dim0", 0), nd), _dim(call.arg(2, "dim1", 1), nd)
    perm = list(range(nd))
    perm[a], perm[b] = perm[b], perm[a]
    return _permute_rows(nd, perm)


def _drop_dims(call, removed) -> tuple[Row, ...]:
    """Rows for ops that remove ``removed`` dims (which must be whole) and keep the others."""
    nd = len(call.shapes[0])
    rows = [sig("B -> B"), sig("P -> P")]
    for d in range(nd):
        if d not in removed:
            rows.append(Row((S(d),), (S(d - sum(1 for r in removed if r < d)),)))
    return tuple(rows)


def _squeeze(call):
    shape = call.shapes[0]
    dims = call.arg(1, "dim")
    cand = range(len(shape)) if dims is None else _dims(dims, len(shape))
    return _drop_dims(call, {d for d in cand if shape[d] == 1})


def _unsqueeze(call):
    nd = len(call.shapes[0])
    dim = call.arg(1, "dim") % (nd + 1)
    rows = [sig("B -> B"), sig("P -> P")]
    rows += [Row((S(d),), (S(d + (d >= dim)),)) for d in range(nd)]
    return tuple(rows)


def _select(call):
    nd = len(call.shapes[0])
    return _drop_dims(call, {_dim(call.arg(1, "dim"), nd)})


def _keep_dim_whole(call, dim) -> tuple[Row, ...]:
    nd = len(call.shapes[0])
    rows = [sig("B -> B"), sig("P -> P")]
    rows += [Row((S(d),), (S(d),)) for d in range(nd) if d != dim]
    return tuple(rows)


def _slice(call):
    shape = call.shapes[0]
    dim = _dim(call.arg(1, "dim", 0), len(shape))
    start, end, step = call.arg(2, "start"), call.arg(3, "end"), call.arg(4, "step", 1)
    whole = (start in (None, 0) and (end is None or end >= shape[dim]) and step == 1)
    return _keep_dim_whole(call, None if whole else dim)


def _split(call):
    return _keep_dim_whole(call, _dim(call.arg(2, "dim", 0), len(call.shapes[0])))


def _unbind(call):
    return _drop_dims(call, {_dim(call.arg(1, "dim", 0), len(call.shapes[0]))})


def _expand(call):
    src = call.shapes[0]
    size = call.arg(1, "size")
    lead = len(size) - len(src)
    rows = [sig("B -> B"), sig("P -> P")]
    for d, n in enumerate(src):
        if size[d + lead] in (-1, n):
            rows.append(Row((S(d),), (S(d + lead),)))
    return tuple(rows)


def _cat(call):
    n = len(call.shapes)
    nd = max(len(s) for s in call.shapes)
    dim = _dim(call.arg(1, "dim", 0), nd)
    real = [len(s) == nd for s in call.shapes]  # legacy 1-D empty tensors are skipped by cat
    rows = [Row(_all(n, B), (B,)), Row(_all(n, P), (P,))]
    for d in range(nd):
        if d != dim:
            rows.append(Row(tuple(S(d) if r else B for r in real), (S(d),)))
    return tuple(rows)


def _stack(call):
    n = len(call.shapes)
    nd = len(call.shapes[0])
    dim = call.arg(1, "dim", 0) % (nd + 1)
    rows = [Row(_all(n, B), (B,)), Row(_all(n, P), (P,))]
    rows += [Row(_all(n, S(d)), (S(d + (d >= dim)),)) for d in range(nd)]
    return tuple(rows)


def _gather(call):
    """``gather(x, dim, index)``: output shaped like index. Split a dim other than ``dim`` where
    x and index agree in size; or keep x whole and split the index along ``dim``."""
    x, idx = call.shapes[0], call.shapes[1]
    dim = _dim(call.arg(1, "dim"), len(x))
    rows = [sig("B B -> B"), sig("P B -> P"), Row((B, S(dim)), (S(dim),))]
    rows += [Row((S(d), S(d)), (S(d),)) for d in range(len(x)) if d != dim and x[d] == idx[d]]
    return tuple(rows)


def _scatter(call):
    """``scatter(x, dim, index, src)`` (and scatter_add / value variants): split a dim other
    than ``dim`` where every tensor has the same size."""
    shapes = call.shapes
    n = len(shapes)
    dim = _dim(call.arg(1, "dim"), len(shapes[0]))
    rows = [Row(_all(n, B), (B,))]
    for d in range(len(shapes[0])):
        if d != dim and len({s[d] for s in shapes}) == 1:
            rows.append(Row(_all(n, S(d)), (S(d),)))
    if call.packet in ("scatter_add", "scatter_add_") and n == 3:
        rows.append(sig("P B P -> P"))  # x + scatter(src): linear in (x, src) together
    return tuple(rows)


def _index_add(call):
    """``index_add(x, dim, index, source)`` (index_select's backward): split a dim other than
    ``dim`` on x and source alike; linear in (x, source) together."""
    x, src = call.shapes[0], call.shapes[2]
    dim = _dim(call.arg(1, "dim"), len(x))
    rows = [sig("B B B -> B"), sig("P B P -> P")]
    rows += [Row((S(d), B, S(d)), (S(d),)) for d in range(len(x)) if d != dim and x[d] == src[d]]
    return tuple(rows)


def _index_select(call):
    x = call.shapes[0]
    dim = _dim(call.arg(1, "dim"), len(x))
    rows = [sig("B B -> B"), sig("P B -> P"), Row((B, S(0)), (S(dim),))]
    rows += [Row((S(d), B), (S(d),)) for d in range(len(x)) if d != dim]
    return tuple(rows)


def _index(call):
    """``x[indices]``: all B, or P with B indices; with one index tensor on dim 0, x's other
    dims pass through and an index split passes to the output."""
    n = len(call.shapes)
    rows = [Row(_all(n, B), (B,)), Row((P,) + _all(n - 1, B), (P,))]
    indices = call.arg(1, "indices")
    if n == 2 and len(indices) == 1 and isinstance(indices[0], Ref):
        x, idx = call.shapes
        rows += [Row((S(d), B), (S(d - 1 + len(idx)),)) for d in range(1, len(x))]
        rows += [Row((B, S(k)), (S(k),)) for k in range(len(idx))]
    return tuple(rows)


def _index_put(call):
    """``index_put(x, indices, values, accumulate)``: linear in (x, values) together."""
    n = len(call.shapes)
    rows = [Row(_all(n, B), (B,))]
    values = call.arg(2, "values")
    if isinstance(values, Ref) and isinstance(call.arg(0, "self"), Ref):
        rows.append(Row(tuple(P if i in (0, values.index) else B for i in range(n)), (P,)))
    return tuple(rows)


def _tri(call):
    nd = len(call.shapes[0])
    return _keep_dim_whole(call, None) if nd < 2 else tuple(
        r for r in _keep_dim_whole(call, None)
        if not (isinstance(r.ins[0], Split) and r.ins[0].dim >= nd - 2))


def _select_backward(call):
    """``select_backward(grad, input_sizes, dim, index)``: grad's dims map around ``dim``."""
    nd = len(call.arg(1, "input_sizes"))
    dim = _dim(call.arg(2, "dim"), nd)
    rows = [sig("B -> B"), sig("P -> P")]
    rows += [Row((S(d),), (S(d + (d >= dim)),)) for d in range(nd - 1)]
    return tuple(rows)


def _slice_backward(call):
    nd = len(call.shapes[0])
    dim = _dim(call.arg(2, "dim"), nd)
    return _keep_dim_whole(call, dim)


# ----------------------------------------------------------------------------- nn ops


def _layer_norm(call):
    """``native_layer_norm(x, normalized_shape, weight, bias, eps) -> (out, mean, rstd)``:
    split batch dims only; weight and bias whole."""
    nd = len(call.shapes[0])
    batch = nd - len(call.arg(1, "normalized_shape"))
    present = (True, call.is_global(2), call.is_global(3))
    rows = [sig("B B B -> B")]
    rows += [Row((S(d), B, B), (S(d),)) for d in range(batch)]
    return fit(rows, present)


def _layer_norm_backward(call):
    """``(grad_out, x, normalized_shape, mean, rstd, weight, bias, mask) -> (gx, gw, gb)``:
    batch split gives partial weight/bias grads; linear in grad_out."""
    nd = len(call.shapes[0])
    batch = nd - len(call.arg(2, "normalized_shape"))
    present = (True, True, True, True, call.is_global(5), call.is_global(6))
    rows = [sig("B B B B B B -> B"), sig("P B B B B B -> P")]
    rows += [Row((S(d), S(d), S(d), S(d), B, B), (S(d), P, P)) for d in range(batch)]
    return fit(rows, present)


def _embedding(call):
    """``embedding(weight, indices)``: vocab-split weights give P (rows a rank lacks are 0)."""
    nd = len(call.shapes[1])
    rows = [sig("B B -> B"), sig("P B -> P"), sig("S(1) B -> S(-1)"),
            sig("S(0) B -> P", "embedding_vocab")]
    rows += [Row((B, S(d)), (S(d),)) for d in range(nd)]
    return tuple(_fix_last(rows, nd + 1))


def _fix_last(rows, ndim):
    return [Row(r.ins, tuple(S(ndim - 1) if v == S(-1) else v for v in r.outs), r.kernel)
            for r in rows]


def _embedding_backward(call):
    """``embedding_dense_backward(grad, indices, num_weights, ...)``: index split gives
    partial sums of rows; an embedding-dim split stays split."""
    nd = len(call.shapes[1])
    rows = [sig("B B -> B"), sig("P B -> P"), Row((S(nd), B), (S(1),))]
    if not call.arg(4, "scale_grad_by_freq", False):
        rows += [Row((S(d), S(d)), (P,)) for d in range(nd)]
    return tuple(rows)


def _nll_loss(call):
    """``nll_loss_forward(x, target, weight, reduction, ignore_index) -> (out, total_weight)``:
    batch split; a mean divides the local sum by the global total weight."""
    reduction = call.arg(3, "reduction", 1)
    present = (True, True, call.is_global(2))
    batched = len(call.shapes[0]) >= 2
    rows = [sig("B B B -> B B"), sig("P B B -> P B")]
    if batched and reduction == 0:
        rows.append(sig("S(0) S(0) B -> S(0) B"))
    elif batched and reduction == 2:
        rows.append(sig("S(0) S(0) B -> P P"))
    elif batched:
        rows.append(sig("S(0) S(0) B -> P B", "nll_mean"))
    return fit(rows, present)


def _nll_loss_backward(call):
    """``nll_loss_backward(grad, x, target, weight, reduction, ignore_index, total_weight)``."""
    reduction = call.arg(4, "reduction", 1)
    present = (True, True, True, call.is_global(3), True)
    rows = [sig("B B B B B -> B"), sig("P B B B B -> P")]
    if len(call.shapes[1]) >= 2:
        if reduction == 0:
            rows.append(sig("S(0) S(0) S(0) B B -> S(0)"))
        else:
            rows.append(sig(f"B S(0) S(0) B {'P' if reduction == 2 else 'B'} -> S(0)"))
    return fit(rows, present)


def _pointwise_loss(call):
    """``mse_loss(x, target, reduction)`` & co: element-wise, then reduced. A split gives a
    split (none), a partial sum (sum) or a partial mean over the global count (mean)."""
    reduction = call.arg(2, "reduction", 1)
    nd = len(call.shapes[0])
    rows = [sig("B B -> B")]
    for d in range(nd):
        out = S(d) if reduction == 0 else P
        rows.append(Row((S(d), S(d)), (out,), "loss_mean" if reduction == 1 else None))
    return tuple(rows)


def _pointwise_loss_backward(call):
    """``mse_loss_backward(grad, x, target, reduction)``: linear in grad; a mean divides by the
    global count."""
    reduction = call.arg(3, "reduction", 1)
    nd = len(call.shapes[1])
    rows = [sig("B B B -> B"), sig("P B B -> P")]
    for d in range(nd):
        g = S(d) if reduction == 0 else B
        rows.append(Row((g, S(d), S(d)), (S(d),), "loss_mean" if reduction == 1 else None))
    return tuple(rows)


def _softmax_backward(call):
    """``_softmax_backward_data(grad, out, dim, dtype)``: linear in grad."""
    nd = len(call.shapes[0])
    dim = _dim(call.arg(2, "dim"), nd)
    rows = [sig("B B -> B"), sig("P B -> P")]
    rows += [Row((S(d), S(d)), (S(d),)) for d in range(nd) if d != dim]
    return tuple(rows)


def _convolution(call):
    """``convolution(x, w, b, ...)``: batch split, or output channels split (groups == 1)."""
    present = (True, True, call.is_global(2))
    transposed, groups = call.arg(6, "transposed", False), call.arg(8, "groups", 1)
    rows = [sig("B B B -> B"), sig("S(0) B B -> S(0)")]
    if not transposed and groups == 1:
        rows.append(sig("B S(0) S(0) -> S(1)"))
    if not present[2]:
        rows.append(sig("P B - -> P"))
    return fit(rows, present)


def _convolution_backward(call):
    """``convolution_backward(grad, x, w, bias_sizes, ...) -> (gx, gw, gb)``."""
    transposed, groups = call.arg(7, "transposed", False), call.arg(9, "groups", 1)
    rows = [sig("B B B -> B B B"), sig("S(0) S(0) B -> S(0) P P"), sig("P B B -> P P P")]
    if not transposed and groups == 1:
        rows.append(sig("S(1) B S(0) -> P S(0) S(0)"))
    return tuple(rows)


def _sdpa_flash(call):
    """``_scaled_dot_product_flash_attention_for_cpu(q, k, v, ...) -> (out, logsumexp)``:
    batch or head split."""
    n = len(call.shapes)
    rows = [Row(_all(n, B), (B, B))]
    rows += [Row(_all(n, S(d)), (S(d), S(d))) for d in (0, 1)]
    return tuple(rows)


def _sdpa_flash_backward(call):
    n = len(call.shapes)
    rows = [Row(_all(n, B), (B, B, B))]
    rows += [Row(_all(n, S(d)), (S(d), S(d), S(d))) for d in (0, 1)]
    return tuple(rows)


# ----------------------------------------------------------------------------- the registry

# keyed by overload name ("sum.default") or packet name ("sum"); the first match wins
RULES: dict[str, Callable] = {
    "_to_copy": to_copy,
    "clone": pointwise, "alias": pointwise, "detach": pointwise, "lift_fresh": pointwise,
    "zeros_like": like, "ones_like": like, "empty_like": like, "full_like": like,
    "rand_like": like, "randn_like": like, "randint_like": like,
    "fill": like, "fill_": like, "zero": like, "zero_": like,
    "new_zeros": new_full, "new_ones": new_full, "new_empty": new_full, "new_full": new_full,
    "new_empty_strided": new_full,
    "uniform_": random_inplace, "normal_": random_inplace, "bernoulli_": random_inplace,
    "exponential_": random_inplace, "random_": random_inplace,
    "bernoulli.default": random_functional, "bernoulli.p": random_functional,
    "native_dropout": dropout,
    "sum": reduction_sum, "mean": reduction_mean,
    "amax": reduction_gather(1), "amin": reduction_gather(1),
    "max.dim": reduction_gather(2), "min.dim": reduction_gather(2),
    "max.default": reduction_gather(1), "min.default": reduction_gather(1),
    "argmax": reduction_gather(1), "argmin": reduction_gather(1),
    "prod": reduction_gather(1), "any": reduction_gather(1), "all": reduction_gather(1),
    "logsumexp": reduction_gather(1),
    "linalg_vector_norm": reduction_gather(1, 2, 3),
    "norm.ScalarOpt_dim": reduction_gather(1, 2, 3), "norm.Scalar": reduction_gather(1, 9, 9),
    "norm.ScalarOpt_dim_dtype": reduction_gather(1, 2, 3),
    "var.correction": reduction_gather(1), "std.correction": reduction_gather(1),
    "var_mean.correction": reduction_gather(2), "std_mean.correction": reduction_gather(2),
    "_softmax": along_dim(), "_log_softmax": along_dim(),
    "_softmax_backward_data": _softmax_backward, "_log_softmax_backward_data": _softmax_backward,
    "cumsum": along_dim(linear_in=(0,)), "cumprod": along_dim(),
    "sort": along_dim(nouts=2, default=-1), "topk": along_dim(2, "dim", nouts=2, default=-1),
    "mm": lambda call: MM, "bmm": lambda call: BMM, "dot": lambda call: DOT,
    "mv": lambda call: MV,
    "view": _view, "_unsafe_view": _view, "reshape": _view,
    "permute": _permute, "transpose": _transpose, "t": _transpose,
    "squeeze": _squeeze, "unsqueeze": _unsqueeze, "expand": _expand,
    "select": _select, "slice": _slice, "split": _split, "split_with_sizes": _split,
    "unbind": _unbind, "cat": _cat, "stack": _stack,
    "gather": _gather, "scatter": _scatter, "scatter_": _scatter, "scatter_add": _scatter,
    "scatter_add_": _scatter, "scatter_reduce": _scatter,
    "index_select": _index_select, "index": _index,
    "index_add": _index_add, "index_add_": _index_add,
    "index_put": _index_put, "index_put_": _index_put, "_index_put_impl_": _index_put,
    "_unsafe_index_put": _index_put,
    "tril": _tri, "triu": _tri, "tril_": _tri, "triu_": _tri,
    "select_backward": _select_backward, "slice_backward": _slice_backward,
    "native_layer_norm": _layer_norm, "native_layer_norm_backward": _layer_norm_backward,
    "embedding": _embedding, "embedding_dense_backward": _embedding_backward,
    "mse_loss": _pointwise_loss, "mse_loss_backward": _pointwise_loss_backward,
    "smooth_l1_loss": _pointwise_loss, "smooth_l1_loss_backward": _pointwise_loss_backward,
    "huber_loss": _pointwise_loss, "huber_loss_backward": _pointwise_loss_backward,
    "nll_loss_forward": _nll_loss, "nll_loss_backward": _nll_loss_backward,
    "convolution": _convolution, "convolution_backward": _convolution_backward,
    "_scaled_dot_product_flash_attention_for_cpu": _sdpa_flash,
    "_scaled_dot_product_flash_attention_for_cpu_backward": _sdpa_flash_backward,
}

# ops dispatch runs as a decomposition into ops with rules (e.g. addmm = mm, then add)
DECOMPOSE = frozenset({"addmm", "addmv", "baddbmm", "addbmm", "addmm_", "baddbmm_", "linear",
                       "matmul", "einsum"})


def rule_for(call: Call):
    """The rule function for ``call``, or None when the op has no rule."""
    fn = RULES.get(call.op) or RULES.get(call.packet)
    if fn is None and "pointwise" in call.tags:
        fn = pointwise
    return fn


def rows_for(call: Call) -> Rule | None:
    fn = rule_for(call)
    if fn is None:
        return None
    out = fn(call)
    return out if isinstance(out, Rule) else Rule(tuple(out))


# ----------------------------------------------------------------------------- the choice


def _move_cost(src: Layout, dst: Layout, itemsize: int) -> float:
    """Estimated time to turn ``src`` into ``dst``; infinite when it would invent a P."""
    if src == dst:
        return 0.0
    for a, v in enumerate(dst.sbp):
        if isinstance(v, PartialSum) and not isinstance(src.sbp[a], PartialSum):
            return math.inf
    return plan(src, dst).cost(itemsize)


def _resolve_row_value(value, current):
    return current if value is KEEP else value


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
        ins = tuple(tuple(_resolve_row_value(r.ins[i], layouts[i].sbp[a])
                          for a, r in enumerate(combo)) for i in range(len(layouts)))
        outs = _outs(combo)
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


def _outs(combo) -> tuple[tuple[SbpValue, ...], ...]:
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


def describe(call: Call) -> str:
    """The rows of ``call``'s rule, one per line (for docs and error messages)."""
    rule = rows_for(call)
    if rule is None:
        return f"{call.op}: no rule (runs on broadcast inputs)"
    return "\n".join(f"{call.op}: {r}" for r in rule.rows)


__all__ = ["B", "P", "S", "KEEP", "LOCAL", "NUMBER", "Call", "Choice", "Ref", "Row", "Rule",
           "RULES", "DECOMPOSE", "backward_cost", "broadcast_shapes", "choose", "describe", "fit",
           "grad_layout", "pointwise", "resolve_size", "rule_for", "rows_for", "sig", "table",
           "view_groups"]
