"""Synchronisation: ``barrier`` (torch's), ``rank_zero_first`` and ``monitored_barrier``.

``monitored_barrier`` meets through the job's store rather than a collective, so it works on every
backend and, when it fails, names the ranks that did not arrive.
"""
from __future__ import annotations

import contextlib
import datetime

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .. import env
from ..errors import CollectiveTimeoutError, GlobalTensorError
from .common import agree, ensure_world
from ..runtime.guard import guarded


@guarded("barrier")
def barrier(group=None, async_op: bool = False, device_ids=None, timeout=None):
    """Wait until every rank of ``group`` has reached this point."""
    ensure_world()
    agree("barrier", group)
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids,
                        timeout=_as_timedelta(timeout))


@contextlib.contextmanager
def rank_zero_first(local: bool = False, group=None):
    """Rank 0 (with ``local=True``: local rank 0 of each node) runs the block before the others
    enter it -- e.g. to download a data set once::

        with gt.comm.rank_zero_first():
            data = load_or_download()
    """
    ensure_world()
    first = (env.get_local_rank() if local else dist.get_rank()) == 0
    if not first:
        barrier(group)
    yield
    if first:
        barrier(group)


def _as_timedelta(timeout) -> datetime.timedelta | None:
    """None, or a timeout > 0 (seconds or a timedelta); anything else a clear error."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else (
        float(timeout) if isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
        else None)
    if seconds is None or not 0 < seconds < float("inf"):
        raise GlobalTensorError(
            f"expected timeout to be a number of seconds > 0 or a datetime.timedelta, found "
            f"{repr(timeout)[:80]} ({type(timeout).__name__}); e.g. timeout=30")
    return timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=seconds)


# ---------------------------------------------------------------------------------------------
# monitored_barrier: the group's first rank coordinates through the store
# ---------------------------------------------------------------------------------------------


def monitored_barrier(timeout=None, group=None, wait_all_ranks: bool = True) -> None:
    """A barrier that fails after ``timeout`` (seconds or timedelta; default 30 min), naming the
    ranks that did not arrive. Works on any backend: it meets through the job's store.

    The group's first rank coordinates: it waits for everyone, then releases them or tells them
    who is missing. Every rank raises CollectiveTimeoutError when the barrier fails.
    """
    ensure_world()
    timeout = _as_timedelta(timeout) or datetime.timedelta(minutes=30)
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    me, store = dist.get_rank(), c10d._get_default_store()
    if me not in ranks:
        return  # as torch: a rank outside the group has nothing to wait for
    base = "gt/monitored_barrier/" + ",".join(map(str, ranks))
    seq = store.add(f"{base}/seq/{me}", 1)
    key = f"{base}/{seq}"
    store.set(f"{key}/arrived/{me}", "1")
    if me == ranks[0]:
        _coordinate(store, key, ranks, timeout, seq)
    else:
        _await_release(store, key, ranks[0], timeout)


def _coordinate(store, key: str, ranks, timeout, seq: int) -> None:
    arrived = [f"{key}/arrived/{r}" for r in ranks]
    try:
        store.wait(arrived, timeout)
    except Exception:  # noqa: BLE001 - the store reports a timeout in its own way
        missing = [r for r, k in zip(ranks, arrived) if not store.check([k])]
        store.set(f"{key}/release", "missing " + ",".join(map(str, missing)))
        raise CollectiveTimeoutError(_missing_message(missing, ranks, timeout)) from None
    store.set(f"{key}/release", "ok")
    _forget_round(store, key.rsplit("/", 1)[0], seq - 1, ranks)


def _await_release(store, key: str, coordinator: int, timeout) -> None:
    grace = timeout + min(timeout, datetime.timedelta(seconds=1))
    try:
        store.wait([f"{key}/release"], grace)
    except Exception:  # noqa: BLE001
        raise CollectiveTimeoutError(
            f"expected rank {coordinator} (which coordinates monitored_barrier) to release this "
            f"rank within {grace.total_seconds():g}s, found no word from it; rank {coordinator} "
            f"did not arrive or failed") from None
    status = store.get(f"{key}/release").decode()
    if status != "ok":
        missing = [int(r) for r in status.split(" ", 1)[1].split(",")]
        raise CollectiveTimeoutError(_missing_message(missing, None, timeout))


def _missing_message(missing, ranks, timeout) -> str:
    group = f" of {list(ranks)}" if ranks is not None else ""
    return (f"expected every rank{group} at monitored_barrier within "
            f"{timeout.total_seconds():g}s, found ranks {missing} missing; they are stuck "
            f"earlier, skipped this barrier, or crashed")


def _forget_round(store, base: str, seq: int, ranks) -> None:
    """Delete the keys of round ``seq``: every rank is past it once round seq + 1 completes."""
    if seq < 1:
        return
    try:
        for r in ranks:
            store.delete_key(f"{base}/{seq}/arrived/{r}")
        store.delete_key(f"{base}/{seq}/release")
    except Exception:  # noqa: BLE001 - a store without delete_key keeps a few bytes per round
        pass
