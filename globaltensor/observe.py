"""What watches redistributions: ``gt.comm_trace`` (tools/trace.py), the communication policy
(tools/policy.py) and ``gt.verify``'s check of explicit ``to_global`` (tools/verify.py).

The core announces its events here (:func:`redistribution`, :func:`served_from_memo`,
:func:`sent`: the one event of every call that moves data, from runtime/wire.py;
:func:`comm_called`, :func:`storage_kind` for ``gt.memory()``) and never imports ``tools/``:
the watchers in this context's ContextVar are the tools' own objects (a trace's ``moved`` and
``wire_event``, a verifier's ``redistributed``), and the policy check is the one function
``tools/policy.py`` plugs in when it is imported (:func:`plug`, a registry filled once, like
the ops' registry).

All three live in one ContextVar, so a redistribution asks whether anything watches it with one
ContextVar read and one profiler flag read (:func:`watching`, read by redistribute.py and by
``to_global``'s warm path); operators that move nothing never ask. A thread-rank has its own
context. ``GT_COMMUNICATION`` is read the first time a context redistributes (the ContextVar starts
as ``UNREAD``, which counts as watching once) and the answer is kept in the context.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from dataclasses import dataclass, field

import torch
import torch.autograd.profiler as _profiler

from . import debug
from .errors import GlobalTensorError
from .sbp import format_sbp

POLICIES = ("implicit", "warn", "explicit")


@dataclass(frozen=True, slots=True)
class Watchers:
    """Who watches this context's redistributions; None stands for "nobody" in the ContextVar."""

    trace: object = None            # the innermost gt.comm_trace() (trace.CommTrace)
    policy: str = "implicit"        # gt.communication(...): implicit, warn or explicit
    warned: set = field(default_factory=set, compare=False)  # warn: (op, layouts, line) seen
    verifier: object = None         # the active gt.verify() (verify.Verifier)
    memory: object = None           # the active gt.memory() (memory.MemoryTracker)
    recorder: object = None         # the active gt.simulate()'s (sim/simulate.Recorder)

    def idle(self) -> bool:
        return (self.trace is None and self.policy == "implicit" and self.verifier is None
                and self.memory is None and self.recorder is None)

    def traces(self):
        """Who records collectives: the innermost gt.comm_trace() and a simulation's recorder."""
        return [t for t in (self.trace, self.recorder) if t is not None]


UNREAD = Watchers(policy="unread")  # GT_COMMUNICATION not read yet in this context
_WATCH: contextvars.ContextVar = contextvars.ContextVar("globaltensor_watch", default=UNREAD)


def watching() -> bool:
    """Whether a redistribution must be observed: a trace, a policy other than implicit or a
    verify block is active (or not looked up yet), or the profiler runs."""
    return _WATCH.get() is not None or _profiler._is_profiler_enabled


def check_policy(mode, where: str) -> str:
    if mode not in POLICIES:
        raise GlobalTensorError(
            f"{where}: expected a communication policy, one of {', '.join(POLICIES)}; found "
            f"{mode!r}. implicit: operators redistribute their inputs as needed (the default); "
            f"warn: log each such choice once; explicit: raise instead")
    return mode


def _from_env() -> Watchers | None:
    raw = os.environ.get("GT_COMMUNICATION", "").strip().lower() or "implicit"
    mode = check_policy(raw, "GT_COMMUNICATION")
    return None if mode == "implicit" else Watchers(policy=mode)


def current() -> Watchers | None:
    """This context's watchers (None: nobody), reading GT_COMMUNICATION on first use."""
    watchers = _WATCH.get()
    if watchers is UNREAD:
        watchers = _from_env()
        _WATCH.set(watchers)
    return watchers


def _changed(**changes) -> Watchers | None:
    base = current() or Watchers()
    if "policy" in changes:  # a new policy warns afresh
        changes["warned"] = set()
    new = dataclasses.replace(base, **changes)
    return None if new.idle() else new


def set_watchers(**changes) -> contextvars.Token:
    """Change some watchers for this context (until the token is reset)."""
    return _WATCH.set(_changed(**changes))


def reset(token: contextvars.Token) -> None:
    _WATCH.reset(token)


@contextlib.contextmanager
def watched(**changes):
    """Inside the block, ``changes`` apply (``trace=``, ``policy=``, ``verifier=``)."""
    token = set_watchers(**changes)
    try:
        yield
    finally:
        _WATCH.reset(token)


# --------------------------------------------------------------------------- the announcements

_PLUGGED: dict = {}  # "policy" -> on_move(watchers, call, plan, local, memo); set by tools/policy.py


def plug(role: str, fn) -> None:
    """A tool's behaviour the core calls without importing the tool (``"policy"``)."""
    _PLUGGED[role] = fn


def _policy(watchers, call, plan, local, memo=False) -> None:
    if watchers is not None and watchers.policy != "implicit" and "policy" in _PLUGGED:
        _PLUGGED["policy"](watchers, call, plan, local, memo)


def redistribution(run, plan, local: torch.Tensor, rank: int) -> torch.Tensor:
    """``run(plan, local, rank)``, checked by the communication policy, recorded in the active
    trace, shown to the profiler and checked by ``gt.verify``."""
    watchers = current()
    if watchers is None and not _profiler._is_profiler_enabled:
        return run(plan, local, rank)  # GT_COMMUNICATION was just read: nothing watches
    call = debug.user_call(2) or "redistribute"
    _policy(watchers, call, plan, local)
    row = watchers.trace if watchers is not None else None
    if row is not None:  # comm_trace's row; the wire's events of the plan's steps fill it
        row.moved(call, plan, local, rank)
    try:
        with counted_inside(watchers, "communication"):
            if not _profiler._is_profiler_enabled:
                result = run(plan, local, rank)
            else:
                with torch.profiler.record_function(
                        f"gt.redistribute: {call}",
                        f"{format_sbp(plan.src.sbp)} -> {format_sbp(plan.dst.sbp)}"):
                    result = run(plan, local, rank)
    finally:
        if row is not None:
            row.moved_done()
    if watchers is not None and watchers.memory is not None:
        watchers.memory.weigh(result, plan.dst, local)
    if watchers is not None and watchers.verifier is not None:
        watchers.verifier.redistributed(call, plan, local, result)
    return result


def counted_inside(watchers=None, kind: str = "activations"):
    """A block inside an operator (its inputs' moves: ``kind`` communication; its kernel's own
    torch calls): under ``gt.memory()`` what the torch calls in it make is counted too (the
    moves' buffers, the kernels' temporaries, freed when the block ends), as the allocator
    sees them."""
    watchers = current() if watchers is None else watchers
    if watchers is None or watchers.memory is None:
        return contextlib.nullcontext()
    return watchers.memory.counting(kind)


def workspace(nbytes: int):
    """A collective's backend holds a buffer of its own of ``nbytes`` from now (runtime/wire.py
    ``Workspace``: gloo's): gt.memory counts it as communication until the call returned is
    made. None where nobody counts memory."""
    watchers = current()
    if watchers is None or watchers.memory is None or not nbytes:
        return None
    return watchers.memory.workspace(nbytes)


def backend_running():
    """Inside: a collective's backend runs (its copies in and out of its own buffer), counted
    by its workspace, not by gt.memory's operators."""
    watchers = current()
    if watchers is None or watchers.memory is None:
        return contextlib.nullcontext()
    return watchers.memory.backend()


def served_from_memo(plan, piece: torch.Tensor) -> None:
    """An operator's move served from the memo of an earlier one (redistribute.moved): nothing
    is sent now (no trace record), but the communication policy hears of it: the op still
    needs the move, and a changed tensor would make it send again."""
    watchers = current()
    if watchers is not None and watchers.policy != "implicit":
        _policy(watchers, debug.user_call(2) or "redistribute", plan, piece, memo=True)


def sent(event) -> None:
    """The one event of every call that moves data (runtime/wire.py ``Sent``): each trace
    (gt.comm_trace's, a simulation's recorder) hears it."""
    watchers = current()
    for trace in watchers.traces() if watchers is not None else ():
        trace.wire_event(event)


def comm_called(name: str) -> None:
    """A ``gt.comm`` collective ran (counted in the active gt.comm_trace(), if any)."""
    watchers = current()
    for trace in watchers.traces() if watchers is not None else ():
        trace.comm_called(name)


def holds_no_data(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage holds no data in the run being measured (a simulation's model
    built on meta): what it sends is nothing, as in the real run."""
    watchers = current()
    if watchers is None or watchers.memory is None:
        return False
    return watchers.memory.holds_no_data(t)


def storage_kind(t: torch.Tensor, kind: str, parts=None) -> None:
    """``t``'s storage holds ``kind`` (``"communication"``, ``"gradients"``...), at its size
    now (a resized storage is announced again): what ``gt.memory()`` counts it as. ``parts``:
    the global tensors whose pieces it concatenates (a simulation weighs it on each rank so)."""
    watchers = current()
    if watchers is not None and watchers.memory is not None:
        watchers.memory.classify(t, kind, parts)


__all__ = ["Watchers", "watching", "current", "watched", "set_watchers", "POLICIES", "plug",
           "redistribution", "served_from_memo", "sent", "comm_called", "holds_no_data",
           "storage_kind", "workspace", "backend_running"]
