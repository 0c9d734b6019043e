"""The launcher's processes: start one per rank, pump their output, watch, stop, report.

Used by ``launch.py`` (and ``gt.spawn`` for the process tree); only the standard library, never
torch. A ``config`` here is a ``launch.LaunchConfig``.
"""
from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from .errors import LaunchError

STDERR_TAIL_LINES = 20  # how much of a failed rank's stderr the report shows
STOP_GRACE_S = 5.0  # after the first signal, how long ranks get to exit before SIGKILL
POLL_S = 0.05
EXIT_TIMEOUT = 124  # like coreutils `timeout`


def command(config) -> list[str]:
    """The command line every rank runs."""
    if config.no_python:
        return [config.script, *config.script_args]
    if config.module:
        return [sys.executable, "-u", "-m", config.script, *config.script_args]
    return [sys.executable, "-u", config.script, *config.script_args]


def rank_env(base: dict[str, str], *, rank: int, local_rank: int, world_size: int,
             local_world_size: int, node_rank: int, master_addr: str,
             master_port: int) -> dict[str, str]:
    """The environment of one rank: ``base`` plus the variables that place it in the world."""
    env = dict(base)
    env.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
               LOCAL_WORLD_SIZE=str(local_world_size), NODE_RANK=str(node_rank),
               GROUP_RANK=str(node_rank), MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    if local_world_size > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"  # ranks share the node's cores
    return env


# --------------------------------------------------------------------------- processes


def signal_tree(pid: int, sig: int) -> None:
    """Send ``sig`` to the session/process group led by ``pid`` (the rank and its children)."""
    try:
        os.killpg(pid, sig)
        return
    except ProcessLookupError:
        pass  # no such group (yet): fall back to the process itself
    except PermissionError:
        return
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def describe_exit(code: int) -> str:
    """'exited with code 3' / 'was killed by SIGKILL' for a Popen-style return code."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def exit_status(code: int) -> int:
    """The launcher's exit status for a rank's return code: the code itself, or 128 + signal."""
    return 128 - code if code < 0 else code


class Console:
    """The launcher's stdout/stderr, shared by the output threads one whole line at a time."""

    def __init__(self, out, err):
        self.streams = {"stdout": out, "stderr": err}
        self.lock = threading.Lock()

    def write(self, stream: str, text: str) -> None:
        with self.lock:
            try:
                self.streams[stream].write(text)
                self.streams[stream].flush()
            except (OSError, ValueError):
                pass  # a closed console must not stop us from draining the ranks' pipes

    def note(self, text: str) -> None:
        self.write("stderr", "".join(f"[launch] {line}\n" for line in text.splitlines()))


class RankProcess:
    """One running rank: its process, the threads echoing its output, the tail of its stderr."""

    def __init__(self, rank: int, local_rank: int, proc: subprocess.Popen):
        self.rank, self.local_rank, self.proc = rank, local_rank, proc
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self.readers: list[threading.Thread] = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    def pump(self, stream: str, console: Console | None, log_path: str | None) -> None:
        pipe = getattr(self.proc, stream)
        tail = self.stderr_tail if stream == "stderr" else None
        t = threading.Thread(target=_pump, name=f"rank{self.rank}-{stream}", daemon=True,
                             args=(pipe, f"[rank {self.rank}] ", stream, console, log_path, tail))
        t.start()
        self.readers.append(t)

    def join_readers(self, deadline: float) -> None:
        for t in self.readers:
            t.join(max(0.0, deadline - time.monotonic()))


def _pump(pipe, prefix, stream, console, log_path, tail) -> None:
    log = open(log_path, "wb") if log_path else None
    try:
        for raw in iter(pipe.readline, b""):
            if log:
                log.write(raw)
                log.flush()
            line = raw.decode("utf-8", "replace")
            line = line if line.endswith("\n") else line + "\n"
            if tail is not None:
                tail.append(line)
            if console:
                console.write(stream, prefix + line)
    finally:
        pipe.close()
        if log:
            log.close()


def start_ranks(config, port: int, console: Console) -> list[RankProcess]:
    """Start every local rank in its own session, with its output pumped to console and logs."""
    if config.logdir:
        os.makedirs(config.logdir, exist_ok=True)
    ranks = []
    for local_rank in range(config.nproc_per_node):
        rank = config.global_rank(local_rank)
        env = rank_env(os.environ, rank=rank, local_rank=local_rank,
                       world_size=config.world_size, local_world_size=config.nproc_per_node,
                       node_rank=config.node_rank, master_addr=config.master_addr,
                       master_port=port)
        try:
            proc = subprocess.Popen(command(config), env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
        except OSError as e:
            stop(ranks, signal.SIGKILL, grace=0)
            raise LaunchError(f"expected to start {command(config)[0]!r} for rank {rank}, "
                              f"found {e}; check the script path (and --no_python / -m)") from e
        rp = RankProcess(rank, local_rank, proc)
        for stream in ("stdout", "stderr"):
            log = os.path.join(config.logdir, f"rank_{rank}.{stream}") if config.logdir else None
            rp.pump(stream, None if config.redirect else console, log)
        ranks.append(rp)
    return ranks


def stop(ranks: list[RankProcess], sig: int, grace: float, hurry=lambda: False) -> None:
    """Signal every running rank's tree, wait up to ``grace`` s, then SIGKILL every rank's tree.

    The final SIGKILL also reaches processes that a rank which already exited left behind.
    """
    for r in ranks:
        if r.proc.poll() is None:
            signal_tree(r.pid, sig)
    end = time.monotonic() + grace
    while time.monotonic() < end and not hurry() and any(r.proc.poll() is None for r in ranks):
        time.sleep(POLL_S)
    for r in ranks:
        signal_tree(r.pid, signal.SIGKILL)
    for r in ranks:
        r.proc.wait()


# --------------------------------------------------------------------------- supervision


@dataclass(frozen=True, slots=True)
class Outcome:
    """How the job ended: 'ok', 'failed' (rank), 'timeout' (running), 'signal' (signum)."""

    kind: str
    rank: int | None = None
    running: tuple[int, ...] = ()
    signum: int | None = None


class Signals:
    """SIGINT / SIGTERM to the launcher: remember them; the supervisor loop acts on them."""

    def __init__(self):
        self.received: list[int] = []
        self.saved = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.saved[sig] = signal.signal(sig, lambda s, _f: self.received.append(s))

    def restore(self) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)


def supervise(ranks: list[RankProcess], deadline: float | None, signals: Signals) -> Outcome:
    """Wait until every rank succeeds, one fails, the deadline passes or a signal arrives."""
    while True:
        if signals.received:
            return Outcome("signal", signum=signals.received[0])
        codes = {r.rank: r.proc.poll() for r in ranks}
        failed = [rank for rank, code in codes.items() if code not in (None, 0)]
        if failed:
            return Outcome("failed", rank=failed[0])
        running = tuple(rank for rank, code in codes.items() if code is None)
        if not running:
            return Outcome("ok")
        if deadline is not None and time.monotonic() > deadline:
            return Outcome("timeout", running=running)
        time.sleep(POLL_S)


def _still_running(ranks: list[RankProcess]) -> list[int]:
    return [r.rank for r in ranks if r.proc.poll() is None]


def finish(ranks: list[RankProcess], outcome: Outcome, signals: Signals, console: Console,
           config, port: int) -> int:
    """Stop whatever still runs, drain the output, report, and return the exit status."""
    running = _still_running(ranks)
    hurry = lambda: len(signals.received) > 1  # noqa: E731 - a second Ctrl-C skips the grace
    first = signal.SIGINT if outcome.kind == "signal" and outcome.signum == signal.SIGINT \
        else signal.SIGTERM
    if outcome.kind == "signal":
        console.note(f"received {signal.Signals(outcome.signum).name}: stopping ranks {running}")
    stop(ranks, first, STOP_GRACE_S if running else 0, hurry)
    for r in ranks:
        r.join_readers(time.monotonic() + 2.0)
    if outcome.kind == "ok":
        return 0
    if outcome.kind == "signal":
        return 128 + outcome.signum
    if outcome.kind == "timeout":
        done = sorted({r.rank for r in ranks} - set(outcome.running))
        console.note(f"timed out after {config.timeout:g}s: ranks {list(outcome.running)} were "
                     f"still running (ranks {done} had finished); stopped them. Raise --timeout "
                     f"if the job needs longer, or look for a rank stuck in a collective")
        return EXIT_TIMEOUT
    failed = next(r for r in ranks if r.rank == outcome.rank)
    stopped = [x for x in running if x != failed.rank]
    console.note(failure_report(failed, config, port, stopped))
    return exit_status(failed.proc.returncode) or 1


def failure_report(failed: RankProcess, config, port: int,
                   stopped: list[int]) -> str:
    """The lines the launcher prints when a rank fails."""
    how = describe_exit(failed.proc.returncode)
    lines = [f"rank {failed.rank} (local rank {failed.local_rank} on node {config.node_rank}, "
             f"pid {failed.pid}) {how}; stopped the other ranks still running: {stopped}"]
    tail = list(failed.stderr_tail)
    if tail:
        lines.append(f"last {len(tail)} line{'s' * (len(tail) > 1)} of rank {failed.rank}'s "
                     f"stderr:")
        lines += ["  | " + line.rstrip("\n") for line in tail]
    else:
        lines.append(f"rank {failed.rank} wrote nothing to stderr")
    if any("address already in use" in line.lower() for line in tail):
        lines.append(f"hint: master port {port} looks taken; pass "
                     f"another --master_port (or leave it out on a single node)")
    return "\n".join(lines)
