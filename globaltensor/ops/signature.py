"""What a rule is made of, and the registry every op family registers into.

A rule turns a :class:`Call` (the op's name, the global shapes of its global-tensor inputs and
its other arguments) into *rows*. A row is a per-axis signature: for one placement axis, the sbp
each global input must have and the sbp each output then has. On an n-D grid a signature is one
row per axis (``choose.py`` takes the product and picks by cost).

Two invariants every table keeps:
- an input is never asked to become P unless it is P already (no implicit partial sums);
- a row's outputs hold exactly the local results of the op run on the inputs' pieces (or of the
  named ``kernel``, for the few ops whose local computation differs from the op itself).

Each family module (``pointwise.py``, ``views.py``, ...) owns its rows, kernels and size rewrites
and ends with its ``register(...)`` lines: the table of contents of what it covers.

Pure: no torch.distributed, no rank.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, fields, replace
from typing import Callable

import torch

from .._cache import memo
from ..errors import GlobalTensorError
from ..sbp import Split, broadcast, partial_sum
from .naming import op_key, qualified
from .pieces import (layouts_of, nothing_held, splits_size_one, splits_unequal,
                     unequal_splits_even, zero_pieces)

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
    evenly (ops/pieces.py)."""

    rows: tuple
    check: Callable | None = None
    frames: tuple | None = None
    ragged: bool = False

    def plus(self, rows) -> Rule:
        """The same rule with ``rows`` (written like its own) appended."""
        return Rule(self.rows + tuple(rows), self.check, self.frames, self.ragged)


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


# ----------------------------------------------------------------------------- the registry

@dataclass(frozen=True, slots=True)
class OpEntry:
    """What is known about one op, by overload ("sum.dim_IntList") or packet ("sum") name."""
    rule: Callable | None = None        # rule(call) -> rows or Rule
    kernels: tuple[str, ...] = ()       # the kernels (in KERNELS) its rows may name
    rewrite: Callable | None = None     # rewrite(decision, largs, pieces): global sizes -> local
    decompose: bool = False             # runs as its decomposition into ops with rules
    mutates: tuple[str, ...] = ()       # inputs it writes that its schema does not mark (a!)
    write_back: Callable | None = None  # a view: write_back(get, k) -> scatter(base, view)
    factory: str | None = None          # in global mode: "same", "uniform", "normal", "first"


OPS: dict[str, OpEntry] = {}          # op name -> its entry (every family registers here)
TAG_RULES: dict[str, Callable] = {}   # torch tag ("pointwise") -> rule, for ops not named above
KERNELS: dict[str, Callable] = {}     # kernel name (in rows) -> kernel(ctx, largs, lkwargs)
_EMPTY = OpEntry()


def register(*names: str, rule: Callable | None = None, kernels: dict | None = None,
             rewrite: Callable | None = None, decompose: bool = False, mutates: tuple = (),
             write_back: Callable | None = None, factory: str | None = None) -> None:
    """Register ops by overload or packet name: their rule (``rule(call) -> rows or Rule``),
    the local kernels its rows name, a rewrite of global sizes in their arguments, that they
    run as their decomposition (``decompose=True``), the inputs they write although their
    schema does not say so (``mutates``: argument names), how a write into a view they made
    from moved pieces reaches the base (``write_back``), and the role of a torch factory of
    that name in global mode (``factory``). An op may be registered in several lines, each
    giving what the others do not."""
    given = {"rule": rule, "kernels": tuple(kernels or ()), "rewrite": rewrite,
             "decompose": decompose, "mutates": tuple(mutates), "write_back": write_back,
             "factory": factory}
    given = {k: v for k, v in given.items() if v}
    lenient = given.keys() == {"factory"} or sys._getframe(1).f_globals.get(
        "__name__", "").startswith("globaltensor.")  # our tables name ops of other torch versions
    names = [op_key(n, lenient) for n in names]
    for name in names:
        entry = OPS.get(name, _EMPTY)
        twice = [k for k in given if getattr(entry, k)]
        if twice:
            raise GlobalTensorError(f"internal: op {name}'s {', '.join(twice)} registered twice")
        OPS[name] = replace(entry, **given)
    for kernel, fn in (kernels or {}).items():
        if KERNELS.setdefault(kernel, fn) is not fn:
            raise GlobalTensorError(f"internal: kernel {kernel} registered twice")


def register_tag(tag: str, *, rule: Callable) -> None:
    """The rule for ops with torch tag ``tag`` that no name was registered for."""
    TAG_RULES[tag] = rule


def entry(name: str) -> OpEntry:
    """``name``'s entry (an empty one for an op nobody registered)."""
    return OPS.get(name, _EMPTY)


def factory_roles() -> dict[str, str]:
    """torch factory name -> its role in global mode (``mode.py`` reads it)."""
    return {name: e.factory for name, e in OPS.items() if e.factory}


def rule_for(call: Call):
    """The rule function for ``call``, or None when the op has no rule."""
    fn = entry(call.op).rule or entry(call.packet).rule
    if fn is None:
        for tag, tag_rule in TAG_RULES.items():
            if tag in call.tags:
                return tag_rule
    return fn


def rows_for(call: Call) -> Rule | None:
    """The rule of ``call`` with its rows in each input's own dims: frames resolved
    (:func:`aligned`), no row that splits a size-1 dim beside a longer one, and rows that
    split dims of different sizes kept to even cuts (ops/pieces.py)."""
    fn = rule_for(call)
    if fn is None:
        return None
    out = fn(call)
    rule = out if isinstance(out, Rule) else Rule(tuple(out))
    rows = rule.rows
    if rule.frames is not None:
        rows = tuple(Row(tuple(v if f is None else aligned(v, s, f)
                               for v, s, f in zip(r.ins, call.shapes, rule.frames)),
                         r.outs, r.kernel) for r in rows)
    rows = tuple(r for r in rows if not splits_size_one(r, call.shapes))
    check = rule.check
    if not rule.ragged and any(splits_unequal(r, call.shapes) for r in rows):
        check = _even_where_unequal(rule.check)
    return Rule(rows, check)


def _even_where_unequal(check):
    """``check`` (or none) and :func:`~globaltensor.ops.pieces.unequal_splits_even`."""
    def both(call, grid, ins, outs):
        return unequal_splits_even(call, grid, ins) and (
            check is None or check(call, grid, ins, outs))
    return both


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


def broadcasting(rows, shapes, inputs=None, frame=None) -> Rule:
    """A rule whose ``rows`` split dims of ``frame`` (default: the broadcast shape of
    ``shapes``) for the inputs listed in ``inputs`` (indices; default: all), the others'
    rows being in their own dims."""
    frame = broadcast_shapes(shapes) if frame is None else tuple(frame)
    chosen = range(len(shapes)) if inputs is None else tuple(inputs)
    return Rule(tuple(rows), frames=tuple(frame if i in chosen else None
                                          for i in range(len(shapes))))


def describe(op, call: Call | None = None) -> str:
    """What the registry knows about ``op`` (an overload or packet name, or a :class:`Call`),
    one fact per line; with a sample ``call``, the rows of its rule for that call.

        >>> print(describe("select"))  # doctest: +SKIP
        select
          rule: globaltensor.ops.views.select
          write_back: globaltensor.ops.views._scatter_select
    """
    if isinstance(op, Call):
        op, call = op.op, op
    names = tuple(dict.fromkeys((op, op.split(".")[0])))
    lines = [op]
    for f in fields(OpEntry):
        value = next((getattr(entry(n), f.name) for n in names if getattr(entry(n), f.name)), None)
        if value:
            lines.append(f"  {f.name}: {_shown(value)}")
    if len(lines) == 1:
        lines.append("  nothing registered (an op with a torch tag may have its tag's rule)")
    if call is not None:
        rule = rows_for(call)
        shapes = ", ".join(str(list(s)) for s in call.shapes)
        if rule is None:
            lines.append(f"  rows for ({shapes}): none, runs on broadcast inputs")
        else:
            lines.append(f"  rows for ({shapes}):")
            lines += [f"    {r}" for r in rule.rows]
    return "\n".join(lines)


def _shown(value) -> str:
    if callable(value):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, tuple):
        return ", ".join(value)
    return "yes" if value is True else str(value)


class KernelContext:
    """What a kernel gets besides the local arguments: the aten op and the Call, the target
    input layouts, the output specs (``.layout``, ``.dtype``), this rank's grid coordinate (None
    outside the placement) and the input pieces; ``redistribute(piece, src, dst)`` for the
    kernels that communicate, and ``empties()``: a rank outside the placement's result.

    Every rank calls a kernel, ranks outside the placement too: kernels that draw random numbers
    or communicate must do so on every rank alike, then return empty pieces there."""

    __slots__ = ("func", "call", "targets", "outs", "coord", "pieces", "redistribute", "empties")

    def __init__(self, func, call, targets, outs, coord, pieces, redistribute, empties):
        self.func, self.call, self.targets, self.outs = func, call, targets, outs
        self.coord, self.pieces = coord, pieces
        self.redistribute, self.empties = redistribute, empties

    def arg(self, largs, lkwargs, name: str, default=None):
        """Local argument ``name`` of this call (see :func:`arg_value`)."""
        return arg_value(self.call.op, largs, lkwargs, name, default)

    def zeros(self):
        """Zero pieces shaped as this rank's pieces of the outputs (nested as ``outs``): the
        result of a kernel whose pieces hold no element where torch's kernel would trap. Only
        where zeros are exact (ops/pieces.py, ``nothing_held``): a result that holds values
        here is never made up."""
        if not nothing_held(self.outs, self.coord):
            raise GlobalTensorError(
                f"internal: {self.call.op} has an empty input piece on this rank but its result "
                f"holds values here (outputs {layouts_of(self.outs)}); zeros would be a made-up "
                "result. Please report this with the op's input shapes and sbps.")
        device = next((p.device for p in self.pieces if p is not None), torch.device("cpu"))
        return zero_pieces(self.outs, self.coord, device)

    def run_unless_empty(self, largs, lkwargs, fill):
        """The op on the pieces; where the first piece has no element (an uneven split), its
        output is ``fill(piece, shape)`` of the output's local shape instead (torch's kernel
        refuses such a piece or gives a wrong shape); outside the placement, empties."""
        if self.coord is None:
            return self.empties()
        if largs[0].numel() == 0:
            return fill(largs[0], self.outs.layout.local_shape(self.coord))
        return self.func(*largs, **lkwargs)
