"""The registry every op family registers into, and the rows a call gets.

``OPS[name] -> OpEntry`` (rule, kernels, rewrite, decompose, mutates, write-back, factory role);
``register(...)`` fills it, ``describe(op)`` prints an entry. :func:`rows_for` is the rule of a
call with its rows in each input's own dims (frames resolved, rows that split a size-1 dim
dropped, rows that split dims of different sizes kept to even cuts: ``pieces.py``).
:class:`KernelContext` is what a kernel gets besides its local arguments.

Each family module (``pointwise.py``, ``views.py``, ...) owns its rows, kernels and size rewrites
and ends with its ``register(...)`` lines: the table of contents of what it covers.

Pure: no torch.distributed, no rank.
"""
from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from typing import Callable

import torch

from ..errors import GlobalTensorError
from ..world.threads import carried
from .naming import op_key
from .pieces import (layouts_of, nothing_held, splits_size_one, splits_unequal,
                     unequal_splits_even, zero_pieces)
from .rules import KEEP, LOCAL, Call, Ref, Row, Rule, aligned, arg_value
from ..sbp import Broadcast


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
    order_free: bool = False            # its rows read no positions along the dims they split


OPS: dict[str, OpEntry] = {}          # op name -> its entry (every family registers here)
TAG_RULES: dict[str, Callable] = {}   # torch tag ("pointwise") -> rule, for ops not named above
KERNELS: dict[str, Callable] = {}     # kernel name (in rows) -> kernel(ctx, largs, lkwargs)
_EMPTY = OpEntry()


def register(*names: str, rule: Callable | None = None, kernels: dict | None = None,
             rewrite: Callable | None = None, decompose: bool = False, mutates: tuple = (),
             write_back: Callable | None = None, factory: str | None = None,
             order_free: bool = False) -> None:
    """Register ops by overload or packet name: their rule (``rule(call) -> rows or Rule``),
    the local kernels its rows name, a rewrite of global sizes in their arguments, that they
    run as their decomposition (``decompose=True``), the inputs they write although their
    schema does not say so (``mutates``: argument names), how a write into a view they made
    from moved pieces reaches the base (``write_back``), and the role of a torch factory of
    that name in global mode (``factory``), and that its rows read no positions along the
    dims they split (``order_free``: they also run on head-tail pieces, ops/choice/balanced.py).
    An op may be registered in several lines, each giving what the others do not."""
    given = {"rule": rule, "kernels": tuple(kernels or ()), "rewrite": rewrite,
             "decompose": decompose, "mutates": tuple(mutates), "write_back": write_back,
             "factory": factory, "order_free": order_free}
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
    """torch factory name -> its role in global mode (``mode/global_mode.py`` reads it)."""
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
    rule = _over_global_inputs(out if isinstance(out, Rule) else Rule(tuple(out)), call)
    rows = rule.rows
    if rule.frames is not None:
        rows = tuple(Row(tuple(v if f is None else aligned(v, s, f)
                               for v, s, f in zip(r.ins, call.shapes, rule.frames)),
                         r.outs, r.kernel) for r in rows)
    rows = tuple(r for r in rows if not splits_size_one(r, call.shapes))
    check = rule.check
    if not rule.ragged and any(splits_unequal(r, call.shapes) for r in rows):
        check = _even_where_unequal(rule.check)
    order_free = rule.order_free or entry(call.op).order_free or entry(call.packet).order_free
    return Rule(rows, check, work=rule.work, order_free=order_free, sends=rule.sends)


def tensor_slots(call: Call) -> tuple:
    """The call's tensor arguments in schema order (nested lists flattened), each a
    :class:`~globaltensor.ops.rules.Ref` (a global input) or ``LOCAL`` (a 0-dim local tensor:
    a constant, the same on every rank). Absent optional tensors are not slots."""
    found = []

    def walk(value):
        if isinstance(value, Ref) or value is LOCAL:
            found.append(value)
        elif isinstance(value, tuple):
            for v in value:
                walk(v)

    for v in call.args:
        walk(v)
    order = _schema_order(call.op)
    for _, v in sorted(call.kwargs, key=lambda kv: order.get(kv[0], len(order))):
        walk(v)
    return tuple(found)


def _schema_order(op: str) -> dict:
    """Argument name -> its position in op ``op``'s schema (keyword-only ones included)."""
    namespace, _, rest = op.rpartition("::")
    packet, _, overload = rest.partition(".")
    try:
        schema = getattr(getattr(getattr(torch.ops, namespace or "aten"), packet),
                         overload or "default")._schema
    except (AttributeError, RuntimeError):
        return {}
    return {a.name: i for i, a in enumerate(schema.arguments)}


def _over_global_inputs(rule: Rule, call: Call) -> Rule:
    """``rule`` with one column per *global* input of ``call``, whichever way its rows were
    written: over the global inputs (kept as they are), or over every tensor argument, 0-dim
    local ones included (a rule with a fixed table, e.g. nll_loss_backward's ``total_weight``,
    which a trace or autograd may pass as a plain 0-dim tensor). A local 0-dim tensor is a
    constant, the same value on every rank: it stands as B, so rows that ask it for a split or
    a partial sum cannot run and are dropped, and its column is removed. Rows of any other
    length are a rule bug, reported as such (the property test in tests/core/ops runs every
    rule on calls whose 0-dim inputs are partly local)."""
    n = len(call.shapes)
    if all(len(r.ins) == n for r in rule.rows):
        return rule
    slots = tensor_slots(call)
    if any(len(r.ins) not in (n, len(slots)) for r in rule.rows) or len(slots) == n:
        raise GlobalTensorError(
            f"internal: a rule for {call.op} gave rows for "
            f"{sorted({len(r.ins) for r in rule.rows})} inputs, the call has {n} global tensor "
            f"inputs ({len(slots) - n} more 0-dim local tensor arguments); please report this")
    keep = [s is not LOCAL for s in slots]
    rows = []
    for r in rule.rows:
        if len(r.ins) == n:
            rows.append(r)
            continue
        local = [v for v, k in zip(r.ins, keep) if not k]
        if all(v is None or v is KEEP or isinstance(v, Broadcast) for v in local):
            rows.append(Row(tuple(v for v, k in zip(r.ins, keep) if k), r.outs, r.kernel))
    frames = rule.frames
    if frames is not None and len(frames) == len(slots):
        frames = tuple(f for f, k in zip(frames, keep) if k)
    return Rule(tuple(rows), rule.check, frames, rule.ragged, rule.work, rule.order_free,
                rule.sends)


def _even_where_unequal(check):
    """``check`` (or none) and :func:`~globaltensor.ops.pieces.unequal_splits_even`."""
    def both(call, grid, ins, outs):
        return unequal_splits_even(call, grid, ins) and (
            check is None or check(call, grid, ins, outs))
    return both


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
    kernels that communicate, ``start(pieces, src, dst)``: the same for several pieces, moving
    on a thread of the call's own while the kernel computes (a future: ``.result()``; every
    rank starts the same moves in the same order, and they run in that order), and
    ``empties()``: a rank outside the placement's result.

    Every rank calls a kernel, ranks outside the placement too: kernels that draw random numbers
    or communicate must do so on every rank alike, then return empty pieces there."""

    __slots__ = ("func", "call", "targets", "outs", "coord", "pieces", "redistribute", "empties",
                 "carried", "_pool")

    def __init__(self, func, call, targets, outs, coord, pieces, redistribute, empties,
                 carried=carried):
        self.func, self.call, self.targets, self.outs = func, call, targets, outs
        self.coord, self.pieces = coord, pieces
        self.redistribute, self.empties = redistribute, empties
        self.carried, self._pool = carried, None

    def start(self, pieces, src, dst):
        """A future of ``pieces`` (a tuple) moved from ``src`` to ``dst``: on the call's own
        thread, in the order started."""
        move = self.redistribute
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gt-kernel")
        return self._pool.submit(self.carried(), lambda: tuple(move(p, src, dst) for p in pieces))

    def close(self) -> None:
        """Wait for the moves started; a kernel that starts moves closes (ring's _Shifts)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

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
