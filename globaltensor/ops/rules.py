"""What a rule is made of: rows, calls and their table syntax.

A rule turns a :class:`Call` (the op's name, the global shapes of its global-tensor inputs and
its other arguments) into *rows*. A row is a per-axis signature: for one placement axis, the sbp
each global input must have and the sbp each output then has. On an n-D grid a signature is one
row per axis (``choice/`` takes the product and picks by cost).

Two invariants every table keeps:
- an input is never asked to become P unless it is P already (no implicit partial sums);
- a row's outputs hold exactly the local results of the op run on the inputs' pieces (or of the
  named ``kernel``, for the few ops whose local computation differs from the op itself).

Broadcasting inputs name the frame they broadcast against (``Rule.frames``, :func:`broadcasting`);
:func:`aligned` turns a row written in the frame's dims into the input's own. The registry that
holds every family's rules is ``registry.py``.

Pure: no torch.distributed, no rank.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from .._cache import memo
from ..errors import GlobalTensorError
from ..sbp import Split, broadcast, partial_sum

B, P = broadcast, partial_sum
S = Split


class _Marker:
    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


KEEP = _Marker("KEEP")      # in a row: the input keeps whatever sbp it has on this axis
LOCAL = _Marker("LOCAL")    # in a Call's args: a 0-dim local tensor (a constant)
NUMBER = _Marker("NUMBER")  # in a Call's args: a float whose value the rule must not use


@dataclass(frozen=True, slots=True)
class Ref:
    """In a Call's args: the global-tensor input with this index."""

    index: int


@dataclass(frozen=True, slots=True)
class Row:
    """One per-axis signature: an sbp per global input, an sbp per output (one for all if
    ``outs`` has a single entry), and an optional local kernel name (registered with the op)."""

    ins: tuple
    outs: tuple
    kernel: str | None = None

    def __str__(self):
        ins = " ".join(str(v) for v in self.ins)
        outs = " ".join(str(v) for v in self.outs)
        return f"{ins} -> {outs}" + (f"  [{self.kernel}]" if self.kernel else "")


@dataclass(frozen=True, slots=True)
class Rule:
    """Rows plus an optional check of a whole n-D candidate: ``check(call, grid, ins, outs)``
    where ``ins``/``outs`` hold one sbp tuple (one entry per axis) per input/output.

    ``frames``: per input, the shape it broadcasts against (torch's rule: dims aligned from the
    right, a size-1 or missing dim repeats), or None. The rows' ``S(d)`` of an input with a
    frame name the frame's dim ``d``; :func:`rows_for` turns it into the input's own dim, or
    into B where the input has size 1 there or lacks the dim (docs/sbp.md, "Broadcasting").

    ``ragged``: the rows' kernel matches pieces of split dims of different sizes itself
    (embedding_bag's bags); otherwise such rows run only where each of those dims is cut
    evenly (ops/pieces.py).

    ``order_free``: the rows read no positions along the dims they split (True), or the
    rows for which that holds (a predicate over a row): they also run on head-tail pieces
    (ops/choice/balanced.py). False (the default): such inputs are put in order first.

    ``sends``: for a rule whose kernel communicates (ring attention), what a candidate's kernel
    sends on the busiest rank, from the candidate's input layouts: ``sends(targets, itemsizes,
    grads) -> ((messages, bytes) sent while it computes, (messages, bytes) not)``; the choice
    prices the first only where it outlasts the work's share, the second like a move.

    ``work``: the op's compute in flops, for an op whose compute outweighs what its rows send
    (attention, quadratic in the sequence): a candidate then also costs the share of it each
    rank computes (the whole, over the ranks its first output is split or partial along:
    ``cost.FLOP`` seconds each), so that gathering every input to compute the whole op
    everywhere, which sends least, does not win over splitting the work (docs/ops.md)."""

    rows: tuple
    check: Callable | None = None
    frames: tuple | None = None
    ragged: bool = False
    work: float = 0.0
    order_free: bool | Callable = False
    sends: Callable | None = None

    def plus(self, rows) -> Rule:
        """The same rule with ``rows`` (written like its own) appended."""
        return Rule(self.rows + tuple(rows), self.check, self.frames, self.ragged, self.work,
                    self.order_free, self.sends)


@memo(4096)
def arg_names(op: str) -> tuple[str, ...]:
    """The names of the positional arguments of op ``op`` ("sum.dim_IntList",
    "mylib::cube.default"), from its schema; ``()`` for a name that is not an op."""
    namespace, _, rest = op.rpartition("::")
    packet, _, overload = rest.partition(".")
    try:
        ops = getattr(torch.ops, namespace or "aten")
        schema = getattr(getattr(ops, packet), overload or "default")._schema
    except (AttributeError, RuntimeError):
        return ()
    return tuple(a.name for a in schema.arguments if not a.kwarg_only)


def arg_value(op: str, args, kwargs, name: str, default=None):
    """Argument ``name`` of a call of ``op``: by its schema position in ``args`` when passed
    positionally, else from ``kwargs`` (a dict or sorted pairs), else ``default``."""
    names = arg_names(op)
    if name in names:
        pos = names.index(name)
        if pos < len(args):
            return args[pos]
    items = kwargs.items() if isinstance(kwargs, dict) else kwargs
    for k, v in items:
        if k == name:
            return v
    return default


def with_arg(op: str, args: list, kwargs: dict, name: str, value) -> dict:
    """Set argument ``name`` to ``value``: in ``args`` (in place) when passed positionally,
    else in a copy of ``kwargs``, which is returned."""
    names = arg_names(op)
    if name in names and names.index(name) < len(args):
        args[names.index(name)] = value
        return kwargs
    return dict(kwargs, **{name: value})


@dataclass(frozen=True, slots=True)
class Call:
    """What a rule sees of one operator call (hashable; built by dispatch from its arguments)."""

    op: str                                  # overload name, e.g. "add.Tensor"
    shapes: tuple[tuple[int, ...], ...]      # global shapes of the global-tensor inputs, in order
    args: tuple = ()                         # positional args; global tensors appear as Ref(i)
    kwargs: tuple = ()                       # sorted (name, value) pairs, marked the same way
    tags: frozenset = frozenset()            # torch tags: "pointwise", "inplace", ...

    @property
    def packet(self) -> str:
        return self.op.split(".")[0]

    def get(self, name: str, default=None):
        """The argument named ``name`` in the op's schema (positional or keyword)."""
        return arg_value(self.op, self.args, self.kwargs, name, default)

    def is_global(self, name: str) -> bool:
        return isinstance(self.get(name), Ref)

    def shape_of(self, name: str):
        value = self.get(name)
        return self.shapes[value.index] if isinstance(value, Ref) else None


# ----------------------------------------------------------------------------- table syntax

_SPLIT = re.compile(r"S\((-?\d+)\)")
_TOKENS = {"B": B, "P": P, "*": KEEP, "-": None}  # "-": an absent optional input, see fit()


def _token(text: str):
    if text in _TOKENS:
        return _TOKENS[text]
    m = _SPLIT.fullmatch(text)
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
    return tuple(Row(tuple(v for v, keep in zip(r.ins, present) if keep), r.outs, r.kernel)
                 for r in rows)


# ----------------------------------------------------------------------------- row helpers


def dims_of(value, ndim: int) -> tuple[int, ...]:
    """A dim / list of dims / None (= all) normalised to sorted non-negative dims."""
    if value is None or value == () or value == []:
        return tuple(range(ndim))
    if isinstance(value, int):
        value = (value,)
    return tuple(sorted({d % max(ndim, 1) for d in value}))


def dim_of(value, ndim: int) -> int:
    return value % max(ndim, 1)


def repeat(n: int, value) -> tuple:
    return (value,) * n


def broadcast_shapes(shapes) -> tuple[int, ...]:
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for s in shapes:
        for i, n in enumerate(s):
            if n != 1:
                out[ndim - len(s) + i] = n
    return tuple(out)


def linear_in(call: Call, name: str, nouts: int = 1) -> tuple[Row, ...]:
    """The row of an op linear in the input ``name`` alone: that one P, the others B -> P."""
    ref = call.get(name)
    if not isinstance(ref, Ref):
        return ()
    n = len(call.shapes)
    return (Row(tuple(P if i == ref.index else B for i in range(n)), repeat(nouts, P)),)


def keep_whole(call: Call, dims) -> tuple[Row, ...]:
    """Rows that keep every dim of input 0 but ``dims`` splittable (B, P, and S(d) -> S(d))."""
    nd = len(call.shapes[0])
    return (sig("B -> B"), sig("P -> P")) + tuple(
        Row((S(d),), (S(d),)) for d in range(nd) if d not in dims)


def aligned(value, shape, frame):
    """The sbp of an input of ``shape`` broadcast against ``frame`` for a row value written in
    the frame's dims: ``S(d)`` becomes S of the input's dim lined up with ``d`` from the right,
    or B where the input lacks that dim or has size 1 there (it repeats along a longer frame
    dim: every rank needs all of it). Other values are kept."""
    if not isinstance(value, Split) or not frame:
        return value
    d = value.dim % len(frame)
    k = d - (len(frame) - len(shape))
    if k < 0 or (shape[k] == 1 and frame[d] != 1):
        return B
    return S(k)


def broadcasting(rows, shapes, inputs=None, frame=None, work: float = 0.0,
                 order_free=False, check=None, sends=None) -> Rule:
    """A rule whose ``rows`` split dims of ``frame`` (default: the broadcast shape of
    ``shapes``) for the inputs listed in ``inputs`` (indices; default: all), the others'
    rows being in their own dims."""
    frame = broadcast_shapes(shapes) if frame is None else tuple(frame)
    chosen = range(len(shapes)) if inputs is None else tuple(inputs)
    return Rule(tuple(rows), check, frames=tuple(frame if i in chosen else None
                                                 for i in range(len(shapes))), work=work,
                order_free=order_free, sends=sends)
