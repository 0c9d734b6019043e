"""Collectives that explain their timeouts.

``with guard(op, ranks=...)`` around a collective turns torch's timeout errors (gloo's "Timed out
waiting 5000ms for recv", a store's "Wait timeout", NCCL's watchdog) into a
``CollectiveTimeoutError`` naming the operation, its ranks and the timeout, and -- with GT_DEBUG on
-- where each of those ranks last checked in, so the ranks that never arrived are named::

    with guard(lambda: f"all_gather along axis 0 of {placement!r}", ranks=group_ranks):
        dist.all_gather_into_tensor(out, piece, group=group)

``op`` and ``ranks`` may be values or functions returning them (only called on failure, so the
hot path does not format). Entering and leaving a guard costs a few hundred nanoseconds.
"""
from __future__ import annotations

import functools
import inspect

import torch.distributed as dist

from .. import debug
from ..world import stalls as watch, world
from ..errors import CollectiveTimeoutError, GlobalTensorError
from . import failure
from .agreement import whereabouts

_TIMEOUT_WORDS = ("timed out", "timeout", "time out")
_PEER_LOST_WORDS = ("connection closed by peer", "connection reset by peer", "broken pipe")


def is_timeout(error: BaseException) -> bool:
    """Whether a torch.distributed error means a collective (or a store wait) ran out of time."""
    text = str(error).lower()
    return any(w in text for w in _TIMEOUT_WORDS)


def is_peer_lost(error: BaseException) -> bool:
    text = str(error).lower()
    return any(w in text for w in _PEER_LOST_WORDS)


class guard:
    """Context manager: re-raise a collective's timeout as a CollectiveTimeoutError that explains."""

    __slots__ = ("op", "ranks", "step", "watch")

    def __init__(self, op, ranks=None, step=None):
        self.op = op
        self.ranks = ranks
        self.step = step  # the plan step it runs, for the stall report

    def __enter__(self):
        self.watch = watch.current()  # the stall report's record of this rank's wait
        if self.watch is not None:
            self.watch.enter(self)
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.watch is not None:
            self.watch.leave()
        if exc is None or not isinstance(exc, RuntimeError) or isinstance(exc, GlobalTensorError):
            return False
        if is_timeout(exc) or is_peer_lost(exc):
            message = failure.seen()  # a peer's local computation failed: its error, not ours
            if message is not None:
                raise failure.failed_elsewhere(message, self._op()) from exc
            finished = watch.finished_message(self.watch, self._ranks() or [], self._op())
            if finished is not None:  # a peer finished its program while this rank waits
                raise GlobalTensorError(finished) from None
        if is_timeout(exc):
            raise CollectiveTimeoutError(timeout_message(self._op(), self._ranks(), exc)) from exc
        if is_peer_lost(exc):
            raise GlobalTensorError(peer_lost_message(self._op(), self._ranks(), exc)) from exc
        return False

    def waiting_in(self, frame, world_size: int) -> tuple[str, str]:
        """(name, detail) of this wait for the stall report, read from the waiting thread's
        ``frame`` by the watchdog thread: ``item()``, ``all_reduce over [0, 1]``."""
        if isinstance(self.op, str):
            name = self.op
        else:
            name = (debug.user_call(frame=frame) if frame is not None else None) or "a collective"
        try:
            ranks = self.ranks() if callable(self.ranks) else self.ranks
        except Exception:  # noqa: BLE001 - only for the report
            ranks = None
        ranks = list(range(world_size)) if ranks is None else [int(r) for r in ranks]
        kind = getattr(self.step, "kind", type(self.step).__name__) if self.step else ""
        return name, (f"{kind} over {ranks}" if kind else f"over {ranks}")

    def _op(self) -> str:
        return self.op() if callable(self.op) else str(self.op)

    def _ranks(self) -> list[int] | None:
        ranks = self.ranks() if callable(self.ranks) else self.ranks
        if ranks is None:
            return list(range(dist.get_world_size())) if world.is_initialized() else None
        return [int(r) for r in ranks]


def _me() -> str:
    return f"rank {dist.get_rank()}" if world.is_initialized() else "this rank"


def timeout_message(op: str, ranks: list[int] | None, error: BaseException) -> str:
    among = f" among ranks {ranks}" if ranks is not None else ""
    try:
        stuck = watch.running_message(watch.current(), ranks or [])
    except RuntimeError:  # the store is gone too
        stuck = ""
    return (
        f"{op}: timed out on {_me()}{among} ({_first_line(error)}). "
        f"{stuck}{_arrivals(ranks)}Expected every rank of the group to reach this collective within the "
        f"timeout (gt.init(timeout=...) or GT_TIMEOUT=seconds); a rank skipped it, reordered its "
        f"collectives, is stuck or has died. A read of a global value (x.item(), print(x)) is a "
        f"collective too: under `if rank == 0:` the other ranks never join it (use gt.print0)."
    )


def peer_lost_message(op: str, ranks: list[int] | None, error: BaseException) -> str:
    among = f" among ranks {ranks}" if ranks is not None else ""
    return (
        f"{op}: a peer left the collective on {_me()}{among} ({_first_line(error)}). "
        f"Another rank has probably failed or exited early; look at its error first."
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def _arrivals(ranks) -> str:
    """With debug on: who got past this operation, and who is still in it."""
    if ranks is None or not debug.is_debug():
        return "Run with GT_DEBUG=1 to learn where each rank was. "
    try:
        seen = whereabouts(ranks)
    except RuntimeError:  # the store is gone too
        return ""
    if not seen:
        return ""
    mine = seen.get(dist.get_rank())
    ahead = [r for r, d in seen.items() if d is not None and mine is not None and d.seq > mine.seq]
    parts = [f"rank {r}: {'no check yet' if d is None else d.title()}" for r, d in seen.items()]
    text = "Last global operation each rank checked in at: " + ", ".join(parts) + ". "
    if ahead:
        text += (f"Ranks {ahead} had already moved past this operation, so they did not take "
                 f"part in this collective. ")
    return text


def step_guard(plan, index: int) -> guard:
    """The guard for step ``index`` of a redistribution plan (its words are built only on failure)."""
    return guard(lambda: step_words(plan, index), ranks=lambda: step_ranks(plan.steps[index]),
                 step=plan.steps[index])


def step_words(plan, index: int) -> str:
    step = plan.steps[index]
    kind = getattr(step, "kind", type(step).__name__)
    where = step.where() if callable(getattr(step, "where", None)) else ""
    src, dst = plan.src, plan.dst
    call = debug.user_call(2)  # only on failure: item(), print, aten.mm.default...
    return ((f"{call}: " if call else "")
            + f"redistribution {src!r} -> {dst!r}, step {index + 1} of {len(plan.steps)} "
            f"({kind} {where})").replace("  ", " ")


def step_ranks(step) -> list[int]:
    ranks = set(step.before.placement.flat_ranks) | set(step.after.placement.flat_ranks)
    return sorted(ranks)


def guarded(name: str):
    """Decorator for a user collective of ``gt.comm``: a timeout names it (``gt.comm.<name>``)
    and the ranks of its ``group`` argument. Only starting a collective is covered: with
    ``async_op=True`` a timeout in ``work.wait()`` is torch's own error."""
    def wrap(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            with guard("gt.comm." + name, ranks=lambda: _group_ranks(signature, args, kwargs)):
                return fn(*args, **kwargs)
        return call
    return wrap


def _group_ranks(signature, args, kwargs) -> list[int] | None:
    try:
        group = signature.bind_partial(*args, **kwargs).arguments.get("group")
        if group is None or group is dist.group.WORLD:
            return None  # the world's ranks
        return list(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - only for the message: never hide the timeout itself
        return None
