"""What watches redistributions: ``gt.comm_trace`` (trace.py), the communication policy
(policy.py) and ``gt.verify``'s check of explicit ``to_global`` (verify.py).

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

import torch.autograd.profiler as _profiler

from .errors import GlobalTensorError

POLICIES = ("implicit", "warn", "explicit")


@dataclass(frozen=True, slots=True)
class Watchers:
    """Who watches this context's redistributions; None stands for "nobody" in the ContextVar."""

    trace: object = None            # the innermost gt.comm_trace() (trace.CommTrace)
    policy: str = "implicit"        # gt.communication(...): implicit, warn or explicit
    warned: set = field(default_factory=set, compare=False)  # warn: (op, layouts, line) seen
    verifier: object = None         # the active gt.verify() (verify.Verifier)

    def idle(self) -> bool:
        return self.trace is None and self.policy == "implicit" and self.verifier is None


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


__all__ = ["Watchers", "watching", "current", "watched", "set_watchers", "POLICIES"]
