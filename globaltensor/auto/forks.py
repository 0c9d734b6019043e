"""Work in forks of this process, a few at once: each task's ``fn(*task)`` runs in a child
forked for it, which sends its result (or its error) back pickled and leaves; nothing a task
leaves behind in its process reaches the next. Where there is no ``fork``, the tasks run here,
one after another. A child that has not answered in :data:`TIMEOUT_S` is stopped."""
from __future__ import annotations

import os
import pickle
import select
import signal
import time

from ..errors import GlobalTensorError

__all__ = ["TIMEOUT_S", "run_all"]

# a task that has not answered in this long is stopped (a fork that inherited a lock some
# other thread of this process held would wait for ever)
TIMEOUT_S = 900.0


def run_all(fn, tasks: list, describe=str) -> list:
    """``[fn(*task) for task in tasks]``, each in a fork, as many at once as this process may
    use cores; an error in a task is raised here (``describe(task)`` names it)."""
    if not hasattr(os, "fork"):
        return [fn(*t) for t in tasks]
    workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    results, running = [None] * len(tasks), []
    try:
        for i, task in enumerate(tasks):
            if len(running) >= max(1, workers):
                _collect(running.pop(0), results, describe)
            running.append((i, task, *_fork(fn, task)))
        while running:
            _collect(running.pop(0), results, describe)
    finally:
        for _, _, pid, read in running:  # an error left others running: stop them
            _stop(pid)
            os.close(read)
    return results


def _fork(fn, task):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, send the result (or the error), leave at once
        code = 0
        try:
            os.close(read)
            try:
                out = ("ok", fn(*task))
            except BaseException as e:  # noqa: BLE001 - raised again in the parent
                out, code = ("error", e if _picklable(e) else GlobalTensorError(repr(e))), 1
            with os.fdopen(write, "wb") as f:
                pickle.dump(out, f)
        finally:
            os._exit(code)
    os.close(write)
    return pid, read


def _collect(item, results, describe) -> None:
    i, task, pid, read = item
    chunks, deadline = [], time.monotonic() + TIMEOUT_S
    with os.fdopen(read, "rb", buffering=0) as f:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([f], [], [], left)[0]:
                _stop(pid)
                raise GlobalTensorError(
                    f"gt.auto_layout: expected the simulation of {describe(task)} to finish "
                    f"within {TIMEOUT_S:g} s, found it still running; stopped it")
            chunk = f.read(1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    os.waitpid(pid, 0)
    data = b"".join(chunks)
    if not data:
        raise GlobalTensorError(f"gt.auto_layout: the simulation of {describe(task)} ended "
                                f"without an answer (its process was killed: out of memory?)")
    kind, value = pickle.loads(data)
    if kind == "error":
        raise value
    results[i] = value


def _stop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _picklable(e) -> bool:
    try:
        pickle.loads(pickle.dumps(e))
        return True
    except Exception:  # noqa: BLE001 - any failure to round-trip
        return False
