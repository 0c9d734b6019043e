"""``gt.verify()``: every global op also computed on the full tensors, and compared.

    with gt.verify():                    # raises at the first op that differs beyond rounding
        loss = model(x).sum(); loss.backward()
    with gt.verify(mode="report") as v:  # records every op; prints a table, worst first
        ...
    print(v.table())

Inside the block, every aten op on global tensors (forward and backward) runs as usual; then
every rank gathers the pieces of its inputs (as they were before the op) and of its outputs
from every rank of the world, assembles the full tensors, runs the same op on the full inputs
and compares (verify_values.py: tolerances per dtype, the rounding floor). A broadcast input
whose replicas differ, or a local tensor whose value differs between ranks, is reported at the
op that takes it. An explicit ``to_global`` (and its backward) is checked too: the value it
returns must be the value it was given. Every rank sees the same full tensors, and the verdict
is shared once more, so all ranks raise together: ``GlobalTensorError`` naming the op, the
user's line, the layouts, the errors and the rounding floor.

Not recomputed: random ops (dropout, ``rand_like``...: torch's tag ``nondeterministic_seeded``)
that draw (attention with ``dropout_p=0``, dropout with ``p=0`` or ``train=False`` draw nothing
and are checked like any other op).
Their values come from the counter-based generator at global indices (random.py), so one device
would need that same stream; they are recorded as skipped. ``detach``/``alias``-like ops, which
copy nothing, are not checked. Costs: a world all-gather of every op's outputs and of the inputs
no earlier op of the block produced (an output's full value is kept while its tensor lives and
nothing writes it: gathered once, not again as the next op's input), the op again on full
tensors; nothing at all outside the block (a TorchDispatchMode, not a hook in dispatch).
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from .. import debug, env
from ..plan import oracle
from ..errors import GlobalTensorError, ShapeMismatchError
from ..observe import reset, set_watchers
from ..ops.rules import arg_value
from ..runtime.meta import all_objects
from ..sbp import format_sbp
from ..tensor import GlobalTensor
from .verify_values import FLOOR_FACTOR, Diff, compare, floor_of, tolerance, widened

MODES = ("raise", "report")
_SKIP = frozenset(("detach", "alias", "lift_fresh"))


@dataclass(frozen=True, slots=True)
class Record:
    """One verified op: where it ran, its layouts, and how its worst output differs."""

    op: str
    line: str
    layouts: str
    diff: Diff
    origin: str | None = None

    def row(self) -> tuple:
        status = "ok" if self.diff.ok else "DIFFERS"
        floor = "-" if self.diff.floor is None else f"{self.diff.floor:.1e}"
        err = self.diff.note or f"{self.diff.max_abs:.1e} / {self.diff.max_rel:.1e}"
        return (status, self.op, self.line, self.layouts, err, floor)


class verify(TorchDispatchMode):  # noqa: N801 - a context manager named like a function
    """Check every global op in the block against the same op on full tensors.

    ``mode="raise"`` (default): raise ``GlobalTensorError`` on every rank at the first op that
    differs beyond the tolerance; ``mode="report"``: record every op and print a table, worst
    first, at the end of the block (``show=False`` to print nothing; ``v.table()``,
    ``v.records``, ``v.failures``). ``rtol``/``atol`` override the per-dtype defaults
    (``gt.verify_values.TOLERANCES``).
    """

    def __init__(self, mode: str = "raise", *, rtol: float | None = None,
                 atol: float | None = None, show: bool = True):
        super().__init__()
        if mode not in MODES:
            raise GlobalTensorError(f"gt.verify: expected mode 'raise' or 'report', found {mode!r}")
        for name, value in (("rtol", rtol), ("atol", atol)):
            if value is not None and (isinstance(value, bool) or not value >= 0):
                raise GlobalTensorError(f"gt.verify: expected {name} >= 0 or None, found {value!r}")
        self.mode, self.rtol, self.atol, self.show = mode, rtol, atol, show
        self.records: list[Record] = []
        self._token = None
        self.known = _Known()  # full values of outputs already gathered (see _Known)

    def __enter__(self):
        self._token = set_watchers(verifier=self)
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        reset(self._token)
        if self.mode == "report" and self.show:
            env.print0(self.table(limit=20))
        return False

    @property
    def failures(self) -> list[Record]:
        return [r for r in self.records if not r.diff.ok]

    def table(self, limit: int | None = None) -> str:
        """The records, worst first (those that differ on top): op, line, layouts, error
        (max abs / max rel), rounding floor."""
        ranked = sorted(self.records, key=lambda r: (r.diff.ok, -r.diff.ratio))
        shown = ranked if limit is None else ranked[:limit]
        head = (f"gt.verify: {len(self.records)} ops checked, {len(self.failures)} differ "
                f"beyond the tolerance")
        rows = [("", "op", "line", "layouts (inputs -> outputs)", "abs / rel error", "floor")]
        rows += [r.row() for r in shown]
        widths = [max(len(row[k]) for row in rows) for k in range(5)]
        lines = [head] + ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[5]
                          for row in rows]
        if len(shown) < len(ranked):
            lines.append(f"  ... {len(ranked) - len(shown)} more (v.table() shows all)")
        return "\n".join(lines)

    __str__ = table

    # --- operators ---------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves, spec = tree_flatten((args, kwargs))
        if (func.overloadpacket.__name__ in _SKIP
                or not any(isinstance(v, GlobalTensor) for v in leaves)):
            return func(*args, **kwargs)
        line, origin = debug.user_line(2), debug.backward_origin()
        before = [self.known.snapshot(v) for v in leaves]
        out = func(*args, **kwargs)
        name = str(func)  # aten.mm.default, gt_verify.planted_cube.default
        layouts = _layouts(leaves, tree_leaves(out))
        if _draws(func, args, kwargs):
            self._settle(Record(name, line, layouts, Diff(True, note="random: not recomputed"),
                                origin))
            return out
        written = _written(func, args, kwargs)
        after = [_snapshot(v) for v in tree_leaves(out) + written]
        everyone = all_objects((before, after), f"gt.verify: {name}")
        diff = _check_op(func, leaves, spec, tree_leaves(out) + written, everyone, self)
        self._settle(Record(name, line, layouts, diff, origin))
        return out

    def redistributed(self, call: str, plan, local, result) -> None:
        """An observed redistribution (trace.py): an explicit ``to_global`` or its backward must
        return the value it was given."""
        if call not in ("to_global", "backward of to_global"):
            return  # an operator's moves are checked with the operator
        with _disable_current_modes():
            line = debug.user_line(2)
            everyone = all_objects((local.detach().cpu(), result.detach().cpu()),
                                   f"gt.verify: {call}")
            try:
                src = oracle.gather({r: e[0] for r, e in enumerate(everyone)}, plan.src)
                dst = oracle.gather({r: e[1] for r, e in enumerate(everyone)}, plan.dst)
                diff = compare(dst, src, self.rtol, self.atol)
            except ShapeMismatchError as error:
                diff = Diff(False, math.inf, math.inf, note=f"pieces disagree: {error}")
            layouts = f"{format_sbp(plan.src.sbp)} -> {format_sbp(plan.dst.sbp)}"
            self._settle(Record(call, line, layouts, diff, debug.backward_origin()))

    def _settle(self, record: Record) -> None:
        """Keep the record; in raise mode, every rank learns whether any rank found a
        difference, and all raise the first such rank's message."""
        self.records.append(record)
        if self.mode == "report":
            return
        verdicts = all_objects(None if record.diff.ok else _message(record, self),
                               f"gt.verify: {record.op}")
        failed = [v for v in verdicts if v is not None]
        if failed:
            raise GlobalTensorError(failed[0])


def _draws(func, args, kwargs) -> bool:
    """Whether the op draws random numbers: torch's tag, unless its probability argument is 0
    or it is off (``dropout_p=0`` in attention, ``train=False`` in dropout): such a call is
    deterministic and is recomputed like any other."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    op = str(func).removeprefix("aten.")
    given = {a.name: arg_value(op, args, kwargs, a.name, a.default_value)
             for a in func._schema.arguments if a.name in ("dropout_p", "p", "train")}
    p = given.get("dropout_p", given.get("p"))
    return given.get("train") is not False and not (isinstance(p, (int, float)) and p == 0)


class _Seen:
    """In a snapshot: this input's full value is known already (gathered as an output)."""

    __slots__ = ()


class _Known:
    """The full values of the global outputs the block has gathered, by tensor: an op's input
    that an earlier op of the block produced (and nothing wrote since: the piece and its
    version are the same) is not gathered again. Entries go with their tensors."""

    def __init__(self):
        self.values: dict = {}  # id(tensor) -> (weakref, piece id, piece version, full value)

    def snapshot(self, value):
        if isinstance(value, GlobalTensor) and self.get(value) is not None:
            return _SEEN
        return _snapshot(value)

    def get(self, t):
        entry = self.values.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        ref, piece, version, full = entry
        return full if (piece, version) == (id(t._local), t._local._version) else None

    def remember(self, outs, fulls) -> None:
        for t, full in zip(outs, fulls):
            if isinstance(t, GlobalTensor):
                key = id(t)
                ref = weakref.ref(t, lambda _, key=key: self.values.pop(key, None))
                self.values[key] = (ref, id(t._local), t._local._version, full)


_SEEN = _Seen()


def _snapshot(value):
    """What every rank shares of one argument: a global tensor's piece (a copy, on the CPU),
    a local tensor itself (a copy), anything else nothing."""
    if isinstance(value, GlobalTensor):
        return value._local.detach().cpu().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    return None


def _written(func, args, kwargs, kind=GlobalTensor) -> list:
    """The tensors of type ``kind`` the op writes (``Tensor(a!)`` arguments)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        out += [v for v in tree_leaves(value) if isinstance(v, kind)]
    return out


def _layout_text(value) -> str:
    if isinstance(value, GlobalTensor):
        return f"{format_sbp(value.sbp)}{list(value.shape)}"
    return f"local{list(value.shape)}"


def _layouts(ins, outs) -> str:
    text = lambda vs: ", ".join(_layout_text(v) for v in vs if isinstance(v, torch.Tensor)) or "-"
    return f"{text(ins)} -> {text(outs)}"


def _full(i: int, value, everyone, which: int, what: str, known=None):
    """The full value of argument/output ``i`` from every rank's copies (or ``known``'s, when
    every rank had it); raises ValueError naming what differs between ranks."""
    pieces = {r: e[which][i] for r, e in enumerate(everyone)}
    if any(isinstance(p, _Seen) for p in pieces.values()):  # (pickled: a copy, not _SEEN)
        full = known.get(value) if known is not None else None
        if full is None or not all(isinstance(p, _Seen) for p in pieces.values()):
            raise ValueError(f"{what} {i}: the ranks disagree on whether an earlier op made it")
        return full
    if isinstance(value, GlobalTensor):
        try:
            return oracle.gather(pieces, value._layout)
        except ShapeMismatchError as error:
            raise ValueError(f"{what} {i} ({format_sbp(value.sbp)}, shape {list(value.shape)}) "
                             f"holds pieces that disagree between ranks: {error}") from None
    if isinstance(value, torch.Tensor):
        mine = pieces[0]
        for r, other in pieces.items():
            if not (other.shape == mine.shape and torch.equal(other, mine)):
                gap = _gap(other, mine)
                raise ValueError(
                    f"{what} {i} is a local tensor (shape {list(value.shape)}) taken as the same "
                    f"value on every rank, but rank {r} holds another value than rank 0 ({gap}); "
                    f"make it equal on every rank (the same seed or data) or build it as a global "
                    f"tensor (gt factories, or to_global with the sbp that describes it)")
        return mine.to(value.device)
    return value


def _gap(a, b) -> str:
    if a.shape != b.shape:
        return f"shape {list(a.shape)} against {list(b.shape)}"
    return f"up to {float((a.double() - b.double()).abs().max()):.2e} apart"


def _check_op(func, leaves, spec, outs, everyone, verifier) -> Diff:
    """Assemble the full inputs and outputs, run ``func`` on the full inputs, compare."""
    try:
        full_in = [_full(i, v, everyone, 0, "input", verifier.known) for i, v in enumerate(leaves)]
        full_out = [_full(i, v, everyone, 1, "output") for i, v in enumerate(outs)]
    except ValueError as error:
        return Diff(False, math.inf, math.inf, note=str(error))
    verifier.known.remember(outs, full_out)
    device = next((v.device for v in leaves if isinstance(v, torch.Tensor)), None)
    refs = _reference(func, full_in, spec, device, lambda t: t)
    if isinstance(refs, str):
        return Diff(False, math.inf, math.inf, note=refs)
    floors = _Floors(func, full_in, spec, device, refs)
    if len(refs) != len(full_out):
        return Diff(False, math.inf, math.inf, note=f"{len(full_out)} outputs instead of {len(refs)}")
    worst = None
    for k, (out, ref) in enumerate(zip(full_out, refs)):
        diff = compare(out, ref, verifier.rtol, verifier.atol, floor=lambda k=k: floors(k))
        if verifier.mode == "report" and diff.floor is None and diff.ok:
            diff = _with_floor(diff, floors(k))
        if worst is None or (diff.ok, -diff.ratio) < (worst.ok, -worst.ratio):
            worst = diff
    return worst or Diff(True)


def _reference(func, full_in, spec, device, cast):
    """The op on the full inputs (fresh copies, cast by ``cast``), as a list of its outputs
    and the inputs it wrote; a string when the op refuses them."""
    fresh = [cast(v.clone().to(device) if isinstance(v, torch.Tensor) else v) for v in full_in]
    args, kwargs = tree_unflatten(fresh, spec)
    try:
        out = func(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - reported as what the full op says
        return f"the op on the full tensors raised {type(error).__name__}: {error}"
    return tree_leaves(out) + _written(func, args, kwargs, torch.Tensor)


class _Floors:
    """The rounding floor of each output: the op again in float64, run once when first asked."""

    def __init__(self, func, full_in, spec, device, refs):
        self.func, self.full_in, self.spec, self.device, self.refs = func, full_in, spec, device, refs
        self.wide = None

    def __call__(self, k: int) -> float | None:
        if self.wide is None:
            wide = _reference(self.func, self.full_in, self.spec, self.device, widened)
            self.wide = wide if isinstance(wide, list) else []
        return floor_of(self.refs[k], self.wide[k]) if k < len(self.wide) else None


def _with_floor(diff: Diff, floor) -> Diff:
    return Diff(diff.ok, diff.max_abs, diff.max_rel, floor, diff.ratio, diff.note)


def _message(record: Record, verifier) -> str:
    diff = record.diff
    where = record.line + (f" ({record.origin})" if record.origin else "")
    lines = [f"gt.verify: {record.op} at {where} differs from the same op on the full tensors.",
             f"  layouts: {record.layouts}"]
    if diff.note:
        lines.append(f"  {diff.note}")
    else:
        floor = diff.floor or 0.0
        times = f"{diff.max_abs / floor:.1e} times the floor" if floor > 0 else "the floor is 0"
        lines.append(f"  max abs error {diff.max_abs:.2e}, max rel error {diff.max_rel:.2e}; "
                     f"rounding floor {floor:.2e} (the op in float64 against its own dtype): "
                     f"beyond rounding ({times})")
        rt, at = tolerance(torch.float32, verifier.rtol, verifier.atol)
        lines.append(f"  tolerance: rtol/atol of the dtype (float32: {rt:g}/{at:g}; "
                     f"gt.verify_values.TOLERANCES) plus {FLOOR_FACTOR:g} x the floor; change "
                     f"with gt.verify(rtol=..., atol=...)")
    lines.append("Expected every global op to compute what one device computes on the full "
                 "tensors. Look at this op's inputs (a local tensor or a broadcast value that "
                 "differs between ranks) and at the op's rule (docs/ops.md); gt.verify("
                 "mode='report') lists every op.")
    return "\n".join(lines)


__all__ = ["verify", "Record"]
