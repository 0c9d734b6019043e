"""Work a rank hands to a thread of its own (ring attention's shifts, overlapping its compute):
the thread must see the rank's world as the rank does. ``carried()``, called in the rank's
thread, returns a runner that runs a function in another thread with the caller's context
variables and whatever else a world keeps per thread (gt.testing's thread-ranks keep torch's
process-group registry per thread: they add a carrier for it)."""
from __future__ import annotations

import contextvars
from typing import Callable

from .. import debug

_CARRIERS: list[Callable[[], Callable[[], None]]] = []


def add_carrier(capture: Callable[[], Callable[[], None]]) -> None:
    """``capture()`` runs in the handing thread and returns what, run in the other thread,
    makes it see the same (once per process: gt.testing)."""
    if capture not in _CARRIERS:
        _CARRIERS.append(capture)


def carried() -> Callable:
    """``run(fn)``: ``fn()`` in the calling thread's context, from any thread (its user-level
    call too: comm_trace names the op whose work it is)."""
    context = contextvars.copy_context()
    context.run(debug.HANDED.set, debug.user_call(2))
    adopt = [capture() for capture in _CARRIERS]

    def run(fn):
        for a in adopt:
            a()
        return context.run(fn)
    return run


__all__ = ["add_carrier", "carried"]
