"""Debug checks: every rank agrees on each global operation before it communicates.

With ``GT_DEBUG=1`` in the environment, or ``gt.set_debug(True)``, every global operation first
calls ``runtime.agreement.check(op, **facts)``: each rank publishes ``(sequence number, op, facts)`` and waits for the
same from every other rank. Ranks that disagree, or do not arrive within the timeout, make every
rank raise an error naming those ranks and what differs -- instead of a silent deadlock or
corrupted data::

    gt.set_debug(True)                      # this thread / context only
    y = x.to_global(sbp=gt.sbp.broadcast)   # raises on every rank if some rank skipped it

When debug is off, a hook costs one ContextVar read. The flag lives in a ContextVar (ranks may be
threads of one interpreter in tests); ``GT_DEBUG`` is read the first time a context asks
(``TORCH_DISTRIBUTED_DEBUG=DETAIL`` with GT_DEBUG unset turns the checks on as well).

This module is pure: the flag and the messages. The hook, ``runtime.agreement.check``, and the
store traffic behind it live in ``runtime/agreement.py``.
"""
from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import linecache
import os
import sys
from dataclasses import dataclass, field

import torch

from .errors import GlobalTensorError
from .sbp import SBP_TYPES, Split, format_sbp

# None: not decided in this context yet -> read GT_DEBUG once and remember it here
FLAG: contextvars.ContextVar = contextvars.ContextVar("globaltensor_debug", default=None)
# seconds a check waits for the other ranks; None: the world's collective timeout
_TIMEOUT: contextvars.ContextVar = contextvars.ContextVar("globaltensor_debug_timeout", default=None)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
_MAX_FACT = 1000  # characters kept of one fact's text


def _env_flag() -> bool:
    raw = os.environ.get("GT_DEBUG", "").strip().lower()
    if not raw and os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").strip().upper() == "DETAIL":
        return True  # torch's own "check everything" switch turns our checks on too
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise GlobalTensorError(
        f"expected GT_DEBUG to be one of 0/1/true/false/on/off, found {raw!r}; "
        f"set GT_DEBUG=1 to turn consistency checks on, or unset it"
    )


def is_debug() -> bool:
    """True when global operations check that every rank agrees on them."""
    flag = FLAG.get()
    if flag is None:
        flag = _env_flag()
        FLAG.set(flag)
    return flag


def _seconds(timeout) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise GlobalTensorError(
            f"expected a debug timeout in seconds > 0 (or a timedelta, or None for the world's "
            f"timeout), found {timeout!r}"
        )
    return float(timeout)


def set_debug(flag: bool | None = True, *, timeout=None) -> None:
    """Turn consistency checks on or off for this context (a thread-rank has its own).

    ``flag=None`` goes back to what ``GT_DEBUG`` says. ``timeout`` (seconds or a timedelta) is how
    long a check waits for the other ranks; None uses the world's timeout (``gt.init(timeout=...)``).

    >>> gt.set_debug(True, timeout=30)
    """
    if flag is not None and not isinstance(flag, bool):
        raise GlobalTensorError(f"set_debug expects True, False or None, found {flag!r}")
    _TIMEOUT.set(_seconds(timeout))
    FLAG.set(flag)


@contextlib.contextmanager
def debugging(flag: bool = True, *, timeout=None):
    """``with gt.debug.debugging():`` -- checks on inside the block, restored after it."""
    if not isinstance(flag, bool):
        raise GlobalTensorError(f"debugging expects True or False, found {flag!r}")
    tokens = (FLAG.set(flag), _TIMEOUT.set(_seconds(timeout)))
    try:
        yield
    finally:
        FLAG.reset(tokens[0])
        _TIMEOUT.reset(tokens[1])


def timeout_seconds() -> float | None:
    """The debug timeout set for this context, or None for the world's own."""
    return _TIMEOUT.get()


# ---------------------------------------------------------------------------------------------
# what a rank says it is about to do


def fact_text(value) -> str:
    """A compact, rank-independent text for one fact (layout, shape, dtype, flag...)."""
    layout = getattr(value, "_layout", None)
    if layout is not None:  # a GlobalTensor: its layout and dtype, never its data
        text = f"global {layout!r} {value.dtype}"
    elif isinstance(value, torch.Tensor):
        text = f"tensor(shape={list(value.shape)}, dtype={value.dtype})"
    elif isinstance(value, tuple) and value and all(_is_sbp(v) for v in value):
        text = format_sbp(value)
    elif isinstance(value, (list, tuple)):
        inner = ", ".join(fact_text(v) for v in value)
        text = f"[{inner}]" if isinstance(value, list) else f"({inner})"
    else:
        text = str(value) if _is_sbp(value) else repr(value)
    return text if len(text) <= _MAX_FACT else text[:_MAX_FACT - 3] + "..."


def _is_sbp(value) -> bool:
    return isinstance(value, SBP_TYPES)


@dataclass(frozen=True, slots=True)
class Descriptor:
    """One rank's account of a global operation: its sequence number, name and facts, and
    ``where``: the user's source line that led to it (shown in messages, never compared: ranks
    may reach one operation from different lines)."""

    seq: int
    op: str
    facts: tuple[tuple[str, str], ...]
    where: str = field(default="", compare=False)

    @classmethod
    def of(cls, seq: int, op: str, facts: dict, where: str = "") -> "Descriptor":
        return cls(seq, op, tuple((k, fact_text(v)) for k, v in sorted(facts.items())), where)

    def encode(self) -> bytes:
        return json.dumps([self.seq, self.op, [list(f) for f in self.facts],
                           self.where]).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Descriptor":
        seq, op, facts, *where = json.loads(raw)
        return cls(int(seq), op, tuple((k, v) for k, v in facts), where[0] if where else "")

    def title(self) -> str:
        return f"#{self.seq} {self.op}"

    def __str__(self):
        shown = ", ".join(f"{k}={v}" for k, v in self.facts)
        return f"{self.title()}({shown})"


def _fields(d: Descriptor) -> dict:
    return {"seq": str(d.seq), "op": d.op, **dict(d.facts)}


def _ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def disagreement(descs: dict[int, Descriptor], scope: str = "the world") -> str | None:
    """None when every rank's descriptor is equal; otherwise the message every rank raises.

    The largest group of agreeing ranks (ties: the one holding the lowest rank) is the reference;
    the message names every other group and, field by field, what it has instead.
    """
    groups: dict[Descriptor, list[int]] = {}
    for rank, d in sorted(descs.items()):
        groups.setdefault(d, []).append(rank)
    if len(groups) == 1:
        return None
    ref = max(groups, key=lambda d: (len(groups[d]), -min(groups[d])))
    ref_fields = _fields(ref)
    lines = [f"GT_DEBUG: ranks of {scope} disagree about the next global operation.",
             f"  {_ranks_text(groups[ref])}: {ref}"] + _lines_of(descs, groups[ref])
    for d, ranks in groups.items():
        if d == ref:
            continue
        verb = "differs" if len(ranks) == 1 else "differ"
        if d.op != ref.op:
            lines.append(f"  {_ranks_text(ranks)} {verb}: op: {d.op} instead of {ref.op}, "
                         f"at {d}")
        else:
            fields = _fields(d)
            diffs = [f"{k}: {fields.get(k, '<missing>')} instead of "
                     f"{ref_fields.get(k, '<missing>')}"
                     for k in sorted(set(fields) | set(ref_fields), key=_field_order)
                     if fields.get(k) != ref_fields.get(k)]
            lines.append(f"  {_ranks_text(ranks)} {verb}: {'; '.join(diffs)}")
        lines += _lines_of(descs, ranks)
    lines.append("Expected every rank to run the same global operations, with the same layouts, "
                 "shapes and dtypes, in the same order (SPMD). Fix the code path that differs "
                 "between those ranks (an `if rank == ...` around a global operation, or "
                 "rank-dependent arguments).")
    return "\n".join(lines)


def _lines_of(descs: dict[int, Descriptor], ranks) -> list[str]:
    """The user's source lines the ``ranks`` reached their operation from (one line when they
    share it); none when the descriptors carry none."""
    wheres = {descs[r].where for r in ranks}
    if wheres == {""}:
        return []
    if len(wheres) == 1:
        return [f"    at {wheres.pop()}"]
    return [f"    rank {r} at {descs[r].where or '<unknown line>'}" for r in sorted(ranks)]


def _field_order(key: str):
    return (key != "op", key != "seq", key)


def missing_message(me: int, mine: Descriptor, missing: list[int], last: dict[int, Descriptor | None],
                    waited: float, scope: str = "the world") -> str:
    """What a rank raises when others did not reach its global operation in time."""
    where = "; ".join(
        f"rank {r} last checked in at {last[r].title()}" if last.get(r) is not None
        else f"rank {r} has not checked in at any global operation yet" for r in missing)
    lines = [f"rank {me} is at {mine.where}"] if mine.where else []
    lines += [f"rank {r} checked in last from {last[r].where}" for r in missing
              if last.get(r) is not None and last[r].where]
    return (
        f"GT_DEBUG: rank {me} waited {waited:g}s (the timeout) at global operation {mine} but "
        f"{_ranks_text(missing)} of {scope} did not arrive ({where}). Expected every rank to run "
        f"the same global operations in the same order (SPMD): {_ranks_text(missing)} skipped "
        f"this operation, is stuck, or has died. "
        + (f"Source lines: {'; '.join(lines)}. " if lines else "")
        + "Make every rank call it (no `if rank == ...` around global operations), or raise the "
        "timeout with gt.set_debug(True, timeout=...) if that rank is merely slow."
    )


def op_args(args, kwargs) -> "Verbatim":
    """An operator's arguments as every rank must share them: global tensors by layout and dtype,
    local tensors by shape and dtype, ints and flags by value. Floats and complex numbers by value
    too where a global input is broadcast or a partial sum on some axis (a per-rank number would
    make its replicas differ, or its sum depend on how it is split); on split-only inputs they are
    left out (a scale may rightly differ per rank, e.g. 1 / local batch size)."""
    numbers = _replicated(args) or _replicated(tuple((kwargs or {}).values()))
    parts = [_arg_text(a, numbers) for a in args]
    parts += [f"{k}={_arg_text(v, numbers)}" for k, v in (kwargs or {}).items()]
    return Verbatim("(" + ", ".join(parts) + ")")


def _replicated(values) -> bool:
    """Whether a global tensor among ``values`` (or in their lists) is B or P on some axis."""
    for value in values:
        layout = getattr(value, "_layout", None)
        if layout is not None and any(not isinstance(v, Split) for v in layout.sbp):
            return True
        if isinstance(value, (list, tuple)) and _replicated(value):
            return True
    return False


class Verbatim(str):
    """Text shown as is in a fact (a plain str fact is shown quoted)."""

    __slots__ = ()

    def __repr__(self):
        return str.__str__(self)


def _arg_text(value, numbers: bool = False) -> str:
    if isinstance(value, torch.Tensor):
        return fact_text(value)
    if isinstance(value, (float, complex)):
        return repr(value) if numbers else "<number>"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_arg_text(v, numbers) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if value is None or isinstance(value, (bool, int, str, torch.dtype, torch.device,
                                           torch.memory_format, torch.layout)):
        return str(value)
    return type(value).__name__  # generators and other objects: no rank-dependent addresses


def caller(module: str, skip: int = 1) -> str:
    """The name of the nearest public function of ``module`` on the call stack (for op names)."""
    frame = sys._getframe(skip)
    while frame is not None:
        code = frame.f_code
        if frame.f_globals.get("__name__") == module and not code.co_name.startswith("_"):
            return code.co_name
        frame = frame.f_back
    return module.rsplit(".", 1)[-1]


# (module, function) -> the user-level call it stands for; the outermost one on the stack wins,
# so ``x.item()`` (which calls full_tensor) is named ``item()``
_USER_CALLS = {
    ("globaltensor.tensor", "item"): "item()",
    ("globaltensor.tensor", "tolist"): "tolist()",
    ("globaltensor.tensor", "numpy"): "numpy()",
    ("globaltensor.tensor", "full_tensor"): "full_tensor()",
    ("globaltensor.tensor", "__repr__"): "print",
    ("globaltensor.tensor", "__str__"): "print",
    ("globaltensor.tensor", "__format__"): "print",
    ("globaltensor.tensor", "backward"): "backward of to_global",
    ("globaltensor.convert", "to_global"): "to_global",
    ("globaltensor.grads", "*"): "gradient sync",
    ("globaltensor.checkpoint.hooks", "*"): "checkpoint",
    ("globaltensor.checkpoint.save_load", "*"): "checkpoint",
    ("globaltensor.checkpoint.storage", "*"): "checkpoint",
}


# the user-level call of the thread that handed this one its work (world/threads.py)
HANDED: contextvars.ContextVar[str | None] = contextvars.ContextVar("gt_handed_call",
                                                                    default=None)


def user_call(skip: int = 1, frame=None) -> str | None:
    """The user-level call that led here (``item()``, ``print``, ``full_tensor()``,
    ``to_global``, ``aten.mm`` for an operator), read from the call stack (in a thread a rank
    handed work to: the handing thread's call); None when none is known. Walks only globaltensor's and torch's own frames, so it costs microseconds: call it
    only when debugging or tracing, never on the warm path. ``frame``: start there instead (a
    waiting thread's, read by the stall report's watchdog)."""
    frame = sys._getframe(skip) if frame is None else frame
    found = None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(("globaltensor", "torch")):
            break  # the user's code
        name = frame.f_code.co_name
        if module == "globaltensor.dispatch" and name == "dispatch":
            func = frame.f_locals.get("func")
            found = str(func) if func is not None else found  # aten.mm.default, mylib.cube.default
        else:
            found = _USER_CALLS.get((module, name)) or _USER_CALLS.get((module, "*")) or found
        frame = frame.f_back
    return found or HANDED.get()


def user_line(skip: int = 1, frame=None) -> str:
    """The user's source line that led here: the innermost frame outside globaltensor and torch,
    as ``file:line (`code`)``; for an op inside backward, the line that called backward."""
    frame = sys._getframe(skip) if frame is None else frame
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(("globaltensor", "torch")) and not _generated(frame):
            code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
            return f"{where} (`{code}`)" if code else where
        frame = frame.f_back
    return "<unknown line>"


def _generated(frame) -> bool:
    """A frame of code torch.compile generated (an fx graph, inductor's output): not the user's."""
    name = frame.f_code.co_filename
    return (name.startswith("<eval_with_key") or "torchinductor" in name
            or f"{os.sep}torch{os.sep}" in name)  # AOTAutograd's wrappers name torch's files


def backward_origin() -> str | None:
    """None outside backward; inside, the autograd node running (``MmBackward0``) and, when the
    forward ran under ``torch.autograd.detect_anomaly()``, the forward's user line."""
    node = torch._C._current_autograd_node()
    if node is None:
        return None
    text = f"in backward, autograd node {node.name()}"
    stack = node.metadata.get("traceback_") if hasattr(node, "metadata") else None
    for entry in reversed(stack or []):
        lines = [l for l in str(entry).splitlines() if l.strip().startswith("File ")]
        for line in reversed(lines):
            if "/globaltensor/" not in line and "/torch/" not in line:
                return f"{text}, from the forward at {line.strip()}"
    return (text + " (run the forward under torch.autograd.detect_anomaly() to name the "
            "forward line)")


def user_frame(skip: int = 1) -> tuple[str, int] | None:
    """(file, line) of the nearest caller outside globaltensor and torch: the user's line."""
    frame = sys._getframe(skip)
    while frame is not None:
        if not frame.f_globals.get("__name__", "").startswith(("globaltensor", "torch")):
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back
    return None


def op_name(func) -> str:
    try:  # as dispatch names it in its own checks: aten.mm.default
        namespace, name = func._schema.name.split("::")  # as ops.qualified
        name = f"{name}.{func._overloadname}"
        return name if namespace == "aten" else f"{namespace}::{name}"
    except AttributeError:
        return str(func)


__all__ = ["set_debug", "is_debug", "debugging", "Descriptor", "disagreement"]
