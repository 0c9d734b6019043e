"""Run a function on N ranks with real gloo collectives, fast, inside one process.

Each rank is a thread with its own torch.distributed world (a thread-local registry of process
groups), so real gloo collectives run over loopback with no process start-up cost::

    from globaltensor.testing import run_ranks

    def body(rank):
        t = torch.ones(2) * rank
        gt.comm.all_reduce(t)
        return t

    results = run_ranks(body, world_size=4)   # one result per rank
    assert results[0].tolist() == [6.0, 6.0]

A rank that raises fails the whole run with that rank's traceback; a run that does not finish
within ``timeout`` seconds fails naming the ranks that are still running.
"""
from __future__ import annotations

import datetime
import sys
import threading
import time
import traceback

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from . import env
from .errors import GlobalTensorError
from .world.threads import add_carrier

_install_lock = threading.Lock()
_installed = False


class _WorldData:
    def __init__(self):
        self.default_pg = None
        self.pg_map = {}
        self.pg_names = {}
        self.pg_group_ranks = {}
        self.pg_backend_config = {}
        self.group_count = 0
        self.tags_to_pg = {}
        self.pg_to_tag = {}
        self.pg_coalesce_state = {}
        self.comms = []


class _ThreadLocalWorld:
    """Stands in for torch's process-wide ``_world``: each thread gets its own registry."""

    _local = threading.local()

    def _data(self) -> _WorldData:
        data = getattr(self._local, "data", None)
        if data is None:
            data = self._local.data = _WorldData()
        return data


def _forward(name):
    return property(lambda self: getattr(self._data(), name),
                    lambda self, v: setattr(self._data(), name, v))


for _name in vars(_WorldData()):
    setattr(_ThreadLocalWorld, _name, _forward(_name))
_ThreadLocalWorld._default_pg = _forward("default_pg")  # torch's own attribute behind the property

_in_harness = threading.local()


def _install() -> None:
    """Make torch.distributed's registry per-thread (once per process)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        register, unregister = c10d._register_process_group, c10d._unregister_process_group

        # group names repeat across thread-worlds; the process-wide name registry must not see them
        def _register(name, pg):
            if not getattr(_in_harness, "on", False):
                register(name, pg)

        def _unregister(name):
            if not getattr(_in_harness, "on", False):
                unregister(name)

        c10d._world = _ThreadLocalWorld()
        c10d._register_process_group = _register
        c10d._unregister_process_group = _unregister
        add_carrier(_capture_world)
        _installed = True


def _capture_world():
    """This thread's world, for a thread a rank hands work to (world/threads.py)."""
    data, on = getattr(_ThreadLocalWorld._local, "data", None), getattr(_in_harness, "on", False)

    def adopt():
        _ThreadLocalWorld._local.data = data
        _in_harness.on = on
    return adopt


class RankFailed(GlobalTensorError):
    """A rank raised inside run_ranks; the message carries its traceback."""


class RanksHung(GlobalTensorError):
    """run_ranks did not finish in time; the message names the ranks still running."""


def run_ranks(fn, world_size: int, *args, timeout: float = 60.0, backend: str = "gloo",
              pass_rank: bool = True, local_world_size: int | None = None):
    """Run ``fn(rank, *args)`` on ``world_size`` thread-ranks with real gloo groups.

    Returns the list of results, indexed by rank. Raises ``RankFailed`` with the traceback of the
    rank that failed first, or ``RanksHung`` naming the ranks that did not finish within ``timeout``.
    """
    _install()
    hook = sys.excepthook  # init_process_group wraps it per rank; restore it when done
    try:
        return _run(fn, world_size, args, timeout, backend, pass_rank, local_world_size)
    finally:
        sys.excepthook = hook


def _run(fn, world_size, args, timeout, backend, pass_rank, local_world_size):
    store = dist.HashStore()
    results = [None] * world_size
    failures: dict[int, tuple[float, BaseException, str]] = {}
    returned: set[int] = set()
    changed = threading.Condition()
    release = threading.Event()
    lws = local_world_size or world_size

    def body(rank: int):
        _in_harness.on = True
        env.set_local_info(env.LocalInfo(rank % lws, lws, rank // lws, max(1, world_size // lws)))
        try:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout))
            results[rank] = fn(rank, *args) if pass_rank else fn(*args)
            with changed:
                returned.add(rank)
                changed.notify_all()
            # keep this rank's groups open until every rank is through (or one failed), so a
            # rank that skipped a collective shows up as the others hanging, not as a reset
            release.wait(timeout)
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            with changed:
                failures[rank] = (time.monotonic(), e, traceback.format_exc())
                changed.notify_all()
        finally:
            try:
                if dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a failed peer may leave the group broken
                pass

    threads = [threading.Thread(target=body, args=(r,), name=f"gt-rank-{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    with changed:
        changed.wait_for(lambda: failures or len(returned) == world_size,
                         timeout=max(deadline - time.monotonic(), 0))
    release.set()
    _raise_if_failed(failures, returned, threads, world_size, timeout)
    for t in threads:
        t.join(timeout)
    return results


def _raise_if_failed(failures, returned, threads, world_size, timeout) -> None:
    """RankFailed with the traceback of the rank that failed first, or RanksHung naming the
    ranks that did not finish."""
    if failures:
        # let the other ranks notice too, then report the failure that came first
        for t in threads:
            t.join(0.5)
        first = min(failures, key=lambda r: failures[r][0])
        _, cause, tb = failures[first]
        others = sorted(set(failures) - {first})
        raise RankFailed(
            f"rank {first} of {world_size} raised {type(cause).__name__}: {cause}\n"
            f"--- traceback of rank {first} ---\n{tb}"
            + (f"(ranks {others} failed after it)" if others else "")
        ) from cause
    hung = [r for r in range(world_size) if r not in returned]
    if hung:
        raise RanksHung(
            f"expected all {world_size} ranks to finish within {timeout:g}s, found ranks {hung} "
            f"still running (ranks {sorted(returned)} finished); a rank likely skipped or "
            f"reordered a collective"
        )


# --------------------------------------------------------------------------- real processes
# For the few tests that need real processes (the launcher, environment variables, end-to-end
# scripts). Each process start costs seconds when it imports torch: check several things per run.
import os  # noqa: E402 - this section's imports stay with it
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from dataclasses import dataclass  # noqa: E402


@dataclass(frozen=True, slots=True)
class CompletedRun:
    """What a launched job left behind: the launcher's exit status and its (prefixed) output."""

    returncode: int
    stdout: str
    stderr: str

    def rank_lines(self, rank: int, stream: str = "stdout") -> list[str]:
        """The lines ``rank`` wrote to ``stream``, without the ``[rank R] `` prefix."""
        prefix = f"[rank {rank}] "
        text = self.stdout if stream == "stdout" else self.stderr
        return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


def run_script(path_or_source, nproc: int, args=(), timeout: float = 60.0, launcher_args=(),
               env: dict | None = None) -> CompletedRun:
    """Run a script on ``nproc`` real processes through the launcher and wait for it.

    ``path_or_source`` is a path to a script, or the script's source text (written to a temporary
    file). ``launcher_args`` are extra launcher options (e.g. ``["--logdir", d]``); ``env``
    replaces the environment the launcher inherits. The launcher stops the job after
    ``timeout`` seconds (exit status 124); a launcher that itself hangs fails with
    ``subprocess.TimeoutExpired`` a little later. Never raises for a failing job: check
    ``returncode`` and the output.

        run = run_script("print('hi')", 2, timeout=30)
        assert run.returncode == 0 and run.rank_lines(1) == ["hi"]
    """
    with tempfile.TemporaryDirectory(prefix="gt-run-") as tmp:
        path = _script_path(path_or_source, tmp)
        cmd = [sys.executable, "-m", "globaltensor.launch", "--nproc_per_node", str(nproc),
               "--timeout", str(timeout), *map(str, launcher_args), path, *map(str, args)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env,
                              timeout=timeout + 30, stdin=subprocess.DEVNULL)
    return CompletedRun(done.returncode, done.stdout, done.stderr)


def _script_path(path_or_source, folder: str) -> str:
    if isinstance(path_or_source, os.PathLike) or (
            "\n" not in path_or_source and os.path.isfile(path_or_source)):
        return os.fspath(path_or_source)
    path = os.path.join(folder, "script.py")
    with open(path, "w") as f:
        f.write(path_or_source)
    return path

def dispatches_in(fn, *args) -> int:
    """How many times globaltensor's ``__torch_dispatch__`` runs during ``fn(*args)`` (0 for a
    steady compiled step: the compiled graph holds local ops and collectives only)."""
    from .dispatch import dispatch

    count = [0]

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is dispatch.__code__:
            count[0] += 1

    sys.setprofile(profile)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return count[0]


__all__ = ["run_ranks", "run_script", "dispatches_in", "CompletedRun", "RankFailed", "RanksHung"]
