"""A global op whose local computation failed on some ranks only: the same error on every rank.

The local computation of a global op can fail on one rank alone: the data differ per rank (an
index out of bounds in one piece, a singular block), and torch's meta run, which checked shapes
and dtypes before, cannot see data. The failing rank cannot just raise: the others would go on to
the next collective and wait there for it until the world's timeout. So the failing rank

1. publishes its error under ``gt_failure`` in the world's store,
2. closes its process groups, which ends at once every collective a peer is waiting in with it
   (gloo: "connection closed by peer"; a rank arriving later fails the same way), and
3. raises ``LocalOpFailed`` with the error.

A peer whose collective ends that way (or times out) reads the store (``guard`` does) and raises
``LocalOpFailed`` with the same text, then closes its own groups too, so ranks that wait only on
it are released in turn. The world is over after such a failure, as after NCCL's abort: the job
ends with the same clear error on every rank instead of a hang (docs/reliability.md,
"Timeouts").

A rank that raises inside the executor outside any local op (a redistribution step's own code:
slicing, assembling, a collective's call) takes the same path (``executor_failure``).

The same key carries two other first failures: ranks found to disagree on a tensor they
redistribute (``publish_and_close``, from runtime/layoutcheck.py), and a rank whose program raised
(``report_exception``, from ``sys.excepthook``, before the rank's connections close): a peer that
then finds its collective closed raises "rank 1 left the job: its program raised ...", the rank's
own report, not a group and a network address nor a guess from the order of exits.
"""
from __future__ import annotations

import sys

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..world import world
from ..errors import GlobalTensorError

KEY = "gt_failure"
_KEEP: list = []  # stores of closed worlds: a TCPStore's server lives in its owner's object


class LocalOpFailed(GlobalTensorError):
    """A global op's local computation raised on some rank; every rank raises this."""


def local_failure(op: str, ranks, error: BaseException) -> LocalOpFailed:
    """This rank's local computation of global op ``op`` raised ``error``: tell the others, close
    this rank's groups, and return the error to raise."""
    me = world.get_rank()
    return _failed_here(
        f"{op}: the local computation failed on rank {me} ({type(error).__name__}: "
        f"{_first_line(error)}); the op runs on ranks {sorted(int(r) for r in ranks)}. "
        f"{_EVERY_RANK} Expected the op to succeed on every rank's piece; the data on rank {me} "
        f"made it fail (look at that rank's inputs, e.g. indices out of range), or run it on a "
        f"broadcast input to see the error on the full value.")


def executor_failure(where: str, ranks, error: BaseException) -> LocalOpFailed:
    """This rank raised ``error`` while running ``where`` (a redistribution step), outside any
    local op: the same path as :func:`local_failure`, so its peers fail at once instead of
    waiting in the step's collective until the world's timeout."""
    me = world.get_rank()
    return _failed_here(
        f"{where}: failed on rank {me} ({type(error).__name__}: {_first_line(error)}); the step "
        f"runs on ranks {sorted(int(r) for r in ranks)}. {_EVERY_RANK} Expected the step to run "
        f"on every rank; rank {me}'s traceback (its error output) shows where it stopped.")


_EVERY_RANK = ("Every rank raises this error and the job's process groups are closed: an SPMD "
               "program cannot go on with one rank missing.")


def stage_failure(where: str, error: BaseException) -> LocalOpFailed:
    """This rank raised ``error`` running ``where`` (a pipeline stage's task, gt.nn.Pipeline):
    the other stages wait on receives from it, so the same path as :func:`local_failure`."""
    me = world.get_rank()
    return _failed_here(
        f"{where} raised on rank {me}: {type(error).__name__}: {_first_line(error)}. "
        f"{_EVERY_RANK} Look at rank {me}'s traceback (its error output) for the cause.")


def _failed_here(message: str) -> LocalOpFailed:
    _publish(message)
    close_groups()
    return LocalOpFailed(message)


def publish_and_close(message: str) -> None:
    """Ranks found to disagree (this rank raises ``message`` itself): publish it for the peers
    that wait elsewhere (their guard raises it as LocalOpFailed) and close this rank's groups."""
    _publish(message)
    close_groups()


def seen() -> str | None:
    """The failure another rank published, if any (never waits)."""
    store = _store()
    if store is None:
        return None
    try:
        if store.check([KEY]):
            return store.get(KEY).decode()
    except Exception:  # noqa: BLE001 - the store may be gone with its owner: nothing to learn
        return None
    return None


def failed_elsewhere(message: str, where: str) -> LocalOpFailed:
    """A peer's failure, learnt while waiting in ``where``: close this rank's groups, and give
    the same error."""
    close_groups()
    return LocalOpFailed(f"{message} [rank {world.get_rank()} learnt it while waiting in {where}]")


def close_groups() -> None:
    if not dist.is_initialized():
        return
    store = _store()
    if store is not None:
        _KEEP.append(store)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a group a peer already broke may fail to close cleanly
        pass


def _publish(message: str) -> None:
    store = _store()
    if store is None:
        return
    try:  # atomic: the first failure is the cause; later ones follow from it
        store.compare_set(KEY, "", message)
    except Exception:  # noqa: BLE001 - publishing is best effort: the error is raised regardless
        pass


def report_exception(error: BaseException) -> None:
    """This rank's program raised ``error`` and the rank is about to leave: tell the others
    (through the store, before this rank's connections close) so that their errors name it
    instead of a group and a network address. Nothing in a world of one."""
    if not dist.is_initialized() or isinstance(error, KeyboardInterrupt):
        return
    try:
        me, n = dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001 - the world is already closing: nothing to tell
        return
    if n < 2 or isinstance(error, LocalOpFailed):  # a LocalOpFailed is already published
        return
    _publish(
        f"rank {me} left the job: its program raised {type(error).__name__}: "
        f"{_first_line(error)}. Every other rank stops with this error at its next "
        f"collective with rank {me}: an SPMD program cannot go on with one rank missing. Look at "
        f"rank {me}'s traceback (its error output) for the cause.")


def install_exception_report() -> None:
    """Chain ``sys.excepthook`` so an uncaught exception is reported (``report_exception``)
    before the process exits; installed once, when globaltensor is imported."""
    previous = sys.excepthook
    if getattr(previous, "globaltensor_reports", False):
        return

    def hook(kind, value, tb):
        try:
            report_exception(value)
        finally:
            previous(kind, value, tb)

    hook.globaltensor_reports = True
    sys.excepthook = hook


def _store():
    if not dist.is_initialized():
        return None
    try:
        return c10d._get_default_store()
    except Exception:  # noqa: BLE001
        return None


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:400] if lines else ""
