"""Joining and leaving the world together (docs/launcher.md, "What happens at exit").

Rank 0 hosts the TCPStore that every rank reaches the world through (launch.py, gt.spawn,
torchrun-style variables, srun): when rank 0's process ends, the store ends with it, and a rank
still talking to it (finishing ``init_process_group``, making a group) fails with "Gloo
connectFullMesh failed" or a reset connection, though its own work succeeded. So:

- ``gt.init`` ends with ``rendezvous``: it returns once every rank has joined.
- ``WorldExit`` (registered with atexit by ``gt.init``; gt.spawn's processes call it after
  ``fn``) closes this rank's process groups while the interpreter is whole (gloo's threads left
  to C++'s static destructors can abort a finished process: "terminate called without an active
  exception"), then a rank other than 0 writes that it left and exits at once, and rank 0 waits,
  up to the world's timeout, until every other rank has left. A rank 0 leaving with an uncaught
  exception does not wait (its error must reach the launcher now).
"""
from __future__ import annotations

import atexit
import contextvars
import datetime
import json
import os
import sys
import time

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..errors import GlobalTensorError

INIT_KEY = "gt/init"
POLL_S = (0.005, 0.1)  # rank 0 polls for the others at exit: first and longest pause
_CURRENT: contextvars.ContextVar["WorldExit | None"] = contextvars.ContextVar(
    "gt_world_exit", default=None)


def rendezvous(store, rank: int, world_size: int, timeout: datetime.timedelta) -> int:
    """Wait until every rank of a new world has come here; return the world's generation (the
    how-manieth world made on this store), the same on every rank."""
    arrived = store.add(INIT_KEY, 1)
    generation = (arrived - 1) // world_size
    done = f"{INIT_KEY}/{generation}"
    if arrived == (generation + 1) * world_size:
        store.set(done, "1")
    try:
        store.wait([done], timeout)
    except RuntimeError as e:  # DistStoreError: the wait timed out; DistNetworkError: no store
        raise GlobalTensorError(
            f"expected all {world_size} ranks to finish gt.init within "
            f"{timeout.total_seconds():g}s, found {_joined(store, generation, world_size)} "
            f"(rank {rank} waited); start every rank (or raise gt.init(timeout=...) / "
            f"GT_TIMEOUT)") from e
    return generation


def _joined(store, generation: int, world_size: int) -> str:
    try:
        return str(store.add(INIT_KEY, 0) - generation * world_size)
    except RuntimeError:
        return "the store gone (rank 0, which hosts it, ended)"


def exiting_with_error() -> bool:
    """At exit: did the script end with an uncaught exception? (Python keeps it in sys.last_value
    once it has printed it.) ``sys.exit(n)`` leaves no trace here and counts as success."""
    return getattr(sys, "last_value", None) is not None or \
        getattr(sys, "last_exc", None) is not None


def close_groups() -> None:
    """Destroy every process group of this process's world (gloo's threads stop here)."""
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - at exit a peer may be gone already: nothing to save
        pass


class WorldExit:
    """What this rank does when it leaves the world ``gt.init`` made; runs once."""

    def __init__(self, store, rank: int, world_size: int, timeout: datetime.timedelta,
                 generation: int):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout, self.generation = timeout, generation
        self.done, self.pid = False, os.getpid()  # a forked child exiting is not this rank
        self.progress = lambda: None  # this rank's collective number (world.py sets it)

    def key(self, rank: int) -> str:
        return f"gt/exit/{self.generation}/{rank}"

    def announce(self, store, failed: bool) -> None:
        """Before closing its groups: say where the others look (``left``) that this rank leaves,
        and after which collective, so a rank still waiting for it names it."""
        try:
            store.set(leaving_key(self.generation, self.rank),
                      json.dumps(["failed" if failed else "ok", self.progress()]))
        except Exception:  # noqa: BLE001 - rank 0 (the store) is gone: nothing left to tell
            pass

    def __call__(self, failed: bool | None = None) -> None:
        if self.done or os.getpid() != self.pid:
            return
        self.done = True
        failed = exiting_with_error() if failed is None else failed
        store, self.store = self.store, None
        if store is not None and self.world_size > 1:
            self.announce(store, failed)
        close_groups()
        if store is None or self.world_size == 1:
            return
        if self.rank != 0:
            try:
                store.set(self.key(self.rank), "failed" if failed else "ok")
            except Exception:  # noqa: BLE001 - rank 0 (the store) is gone: nothing left to tell
                pass
        elif not failed:
            self.wait_for_others(store)

    def wait_for_others(self, store) -> None:
        """Rank 0: keep the store up until every other rank has left, or the timeout passed.
        Polls (a store's own wait cannot be interrupted: Ctrl-C is seen between polls)."""
        keys = [self.key(r) for r in range(1, self.world_size)]
        start = time.monotonic()
        pause = POLL_S[0]
        release = [release_key(self.generation)]
        while time.monotonic() - start < self.timeout.total_seconds():
            try:
                if store.check(keys):
                    return
                if store.check(release):  # a rank waits in a collective this rank never joins
                    return
            except RuntimeError:  # the store itself is gone: nobody is left to wait for
                break
            time.sleep(pause)
            pause = min(pause * 2, POLL_S[1])
        missing = [r for r in range(1, self.world_size) if not _has(store, self.key(r))]
        print(f"globaltensor: rank 0 waited {time.monotonic() - start:.0f}s at exit for ranks "
              f"{missing} to finish; leaving without them (rank 0 hosts the store, which they "
              f"can no longer reach). Raise gt.init(timeout=...) or GT_TIMEOUT if they needed "
              f"longer", file=sys.stderr, flush=True)


def release_key(generation: int) -> str:
    """Set by a rank that waits in a collective with rank 0 after rank 0 finished (stalls.py):
    rank 0 stops waiting at exit, and its leaving ends that collective at once."""
    return f"gt/release/{generation}"


def leaving_key(generation: int, rank: int) -> str:
    return f"gt/leaving/{generation}/{rank}"


def left(store, generation: int, ranks) -> dict[int, tuple[str, int | None]]:
    """Which of ``ranks`` have left the world: rank -> ("ok" | "failed", its collective number
    when it left). Empty when the store is gone."""
    out = {}
    try:
        for r in ranks:
            key = leaving_key(generation, r)
            if store.check([key]):
                status, number = json.loads(store.get(key))
                out[r] = (status, number)
    except Exception:  # noqa: BLE001 - the store broke: nothing to learn from it
        return {}
    return out


def _has(store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:  # noqa: BLE001 - the store broke: count the rank as missing
        return False


def register(rank: int, world_size: int, timeout: datetime.timedelta | None) -> "WorldExit":
    """After gt.init made a world: the rendezvous, then the exit that replaces an earlier one."""
    timeout = timeout or c10d.default_pg_timeout
    store = c10d._get_default_store() if world_size > 1 else None
    generation = rendezvous(store, rank, world_size, timeout) if store is not None else 0
    previous = _CURRENT.get()
    if previous is not None:
        previous.done = True
        atexit.unregister(previous)
    leave = WorldExit(store, rank, world_size, timeout, generation)
    _CURRENT.set(leave)
    atexit.register(leave)
    return leave


def leave_world(failed: bool) -> None:
    """Leave now (gt.spawn's processes, after fn: forked ones never run atexit)."""
    current = _CURRENT.get()
    if current is not None:
        current(failed)
    else:
        close_groups()
