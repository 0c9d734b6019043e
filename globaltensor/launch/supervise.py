"""The launcher's processes: start one per rank, pump their output, watch, stop, report.

Used by ``cli.py`` (and ``gt.spawn`` for the process tree); only the standard library, never
torch. A ``config`` here is a ``cli.LaunchConfig``.
"""
from __future__ import annotations

import collections
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from ..errors import LaunchError
from .reporting import (DIFFERENT_COLLECTIVES_HINT, describe_exit, failure_report,  # noqa: F401
                        first_failure, restart_note, stderr_tail)

STDERR_KEPT_LINES = 400  # how much is kept to find the last traceback in
HOLD_S = 3.0  # a rank still running this long after writing a traceback shows it
PARTIAL_LINE_S = 0.2  # a line with no newline yet (a progress bar) is shown after this long
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


def exit_status(code: int) -> int:
    """The launcher's exit status for a rank's return code: the code itself, or 128 + signal."""
    return 128 - code if code < 0 else code


class Console:
    """The launcher's stdout/stderr, shared by the output threads one whole line at a time.

    A rank's progress bar (text ended by ``\r``, or a partial line that waited) is an *open*
    line: shown without a newline, and its next update rewrites it in place (``\r``, the
    rank's prefix, the text, padded over the old one), as on the rank's own terminal. Anything
    else written while a line is open first ends it with a newline (the two streams share one
    terminal), so an interleaved line never lands in the middle of a bar."""

    def __init__(self, out, err):
        self.streams = {"stdout": out, "stderr": err}
        self.lock = threading.Lock()
        self.open: tuple[str, str, int] | None = None  # (stream, prefix, width) of an open line

    def write(self, stream: str, text: str) -> None:
        with self.lock:
            self._emit(stream, self._closing() + text)

    def line(self, stream: str, prefix: str, text: str, final: bool) -> None:
        """A rank's line: ``final`` ends it (newline); else it stays open for updates."""
        with self.lock:
            shown = prefix + text
            if self.open is not None and self.open[:2] == (stream, prefix):
                lead = "\r" + shown + " " * max(0, self.open[2] - len(shown))
            else:
                lead = self._closing() + shown
            self.open = None if final else (stream, prefix, len(shown))
            self._emit(stream, lead + ("\n" if final else ""))

    def note(self, text: str) -> None:
        self.write("stderr", "".join(f"[launch] {line}\n" for line in text.splitlines()))

    def _closing(self) -> str:
        """End an open line (on its own stream); the text that follows starts a new one."""
        if self.open is not None:
            self._emit(self.open[0], "\n")
            self.open = None
        return ""

    def _emit(self, stream: str, text: str) -> None:
        try:
            self.streams[stream].write(text)
            self.streams[stream].flush()
        except (OSError, ValueError):
            pass  # a closed console must not stop us from draining the ranks' pipes


class RankProcess:
    """One running rank: its process, the threads echoing its output, the tail of its stderr."""

    def __init__(self, rank: int, local_rank: int, proc: subprocess.Popen):
        self.rank, self.local_rank, self.proc = rank, local_rank, proc
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_KEPT_LINES)
        self.readers: list[threading.Thread] = []
        self.held = Held()
        self.ended: float | None = None  # when the supervisor saw it exit (monotonic)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def pump(self, stream: str, console: Console | None, log_path: str | None,
             append: bool = False) -> None:
        """Echo ``stream`` to ``console`` and copy it to ``log_path`` (appended to it with
        ``append``: a restarted job's ranks add to the files of the attempts before)."""
        pipe = getattr(self.proc, stream)
        tail = self.stderr_tail if stream == "stderr" else None
        held = self.held if stream == "stderr" else None
        t = threading.Thread(target=_pump, name=f"rank{self.rank}-{stream}", daemon=True,
                             args=(pipe, f"[rank {self.rank}] ", stream, console, log_path, tail,
                                   held, append))
        t.start()
        self.readers.append(t)

    def join_readers(self, deadline: float) -> None:
        for t in self.readers:
            t.join(max(0.0, deadline - time.monotonic()))


class Held:
    """A rank's traceback on stderr, held back from the console: a rank about to die shows it in
    the launcher's report instead (the first failing rank's in full, one line for the others).
    A rank still running HOLD_S after it, or ending with success, shows it after all."""

    def __init__(self):
        self.lines: list[str] = []
        self.last = 0.0
        self.failing = False  # the job is failing: keep holding, the report shows it

    def takes(self, line: str) -> bool:
        if not self.lines and not line.startswith("Traceback (most recent call"):
            return False
        self.lines.append(line)
        self.last = time.monotonic()
        return True

    def release(self, console, stream: str, prefix: str) -> None:
        lines, self.lines = self.lines, []
        for line in lines:
            if console:
                console.line(stream, prefix, line, final=True)


def _pump(pipe, prefix, stream, console, log_path, tail, held=None, append=False) -> None:
    """Echo a rank's pipe line by line with its prefix, as soon as a line ends (``\n``; or
    ``\r``: a progress bar's update, kept open on the console and rewritten in place by the
    next) or has waited PARTIAL_LINE_S without ending (shown open, then completed in place);
    the log file gets the bytes as written."""
    log = open(log_path, "ab" if append else "wb") if log_path else None
    fd = pipe.fileno()
    pending, shown = b"", b""
    open_text = [None]  # the open line last shown: its update, unchanged, is not shown again

    def show(raw: bytes, end: str) -> None:
        line = _strip_torch_prefix(raw.decode("utf-8", "replace"))
        if tail is not None and end == "\n":
            tail.append(line + "\n")
        if end == "\r" and (not line or line == open_text[0]):
            return
        if held is not None and end == "\n" and held.takes(line):
            return
        open_text[0] = line if end == "\r" else None
        if console:
            console.line(stream, prefix, line, final=end == "\n")

    try:
        while True:
            ready = select.select([fd], [], [], PARTIAL_LINE_S)[0]
            if held is not None and held.lines and not held.failing \
                    and time.monotonic() - held.last > HOLD_S:
                held.release(console, stream, prefix)  # the rank went on after its traceback
            if not ready:
                if pending != shown:  # a partial line (or a bar's update, its \r last): show
                    show(pending[:-1] if pending.endswith(b"\r") else pending, "\r")  # it open
                    shown = pending
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            if log:
                log.write(chunk)
                log.flush()
            pending += chunk
            for raw, end in _complete_lines(pending):
                show(raw, end)
            rest = _unfinished(pending)
            shown = b"" if rest != pending else shown
            pending = rest
        if pending:
            show(pending, "\n")
    finally:
        pipe.close()
        if log:
            log.close()


_LINE_END = re.compile(rb"\r\n|\n|\r(?!$)")


def _complete_lines(data: bytes):
    """(line, ending) for every complete line of ``data``; a ``\\r`` at the very end waits for
    the next read (it may be the first half of ``\\r\\n``)."""
    start = 0
    for m in _LINE_END.finditer(data):
        yield data[start:m.start()], "\r" if m.group() == b"\r" else "\n"
        start = m.end()


def _unfinished(data: bytes) -> bytes:
    last = None
    for last in _LINE_END.finditer(data):
        pass
    return data[last.end():] if last is not None else data


_TORCH_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")


def _strip_torch_prefix(line: str) -> str:
    """torch prefixes each line of an uncaught error with ``[rank0]:``; ours names the rank."""
    return _TORCH_RANK_PREFIX.sub("", line, count=1)


def start_ranks(config, port: int, console: Console, restart: int = 0) -> list[RankProcess]:
    """Start every local rank in its own session, with its output pumped to console and logs.

    ``restart``: how many times the job was restarted before this attempt (torchrun's
    TORCHELASTIC_RESTART_COUNT, 0 on the first); a restart appends to the attempts' log files.
    """
    if config.logdir:
        os.makedirs(config.logdir, exist_ok=True)
    ranks = []
    for local_rank in range(config.nproc_per_node):
        rank = config.global_rank(local_rank)
        env = rank_env(os.environ, rank=rank, local_rank=local_rank,
                       world_size=config.world_size, local_world_size=config.nproc_per_node,
                       node_rank=config.node_rank, master_addr=config.master_addr,
                       master_port=port)
        env.update(TORCHELASTIC_RESTART_COUNT=str(restart),  # as torchrun sets them, also
                   TORCHELASTIC_MAX_RESTARTS=str(config.max_restarts))  # with no restarts
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
            shown = not config.redirect and (config.ranks_filter is None
                                              or rank in config.ranks_filter)
            rp.pump(stream, console if shown else None, log, append=restart > 0)
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
        for r in ranks:
            if r.ended is None and codes[r.rank] is not None:
                r.ended = time.monotonic()
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


def end_attempt(ranks: list[RankProcess], outcome: Outcome, signals: Signals,
                console: Console) -> list[int]:
    """Stop whatever still runs and drain the output; returns the ranks that were running."""
    running = _still_running(ranks)
    hurry = lambda: len(signals.received) > 1  # noqa: E731 - a second Ctrl-C skips the grace
    first = signal.SIGINT if outcome.kind == "signal" and outcome.signum == signal.SIGINT \
        else signal.SIGTERM
    for r in ranks:  # a failing job's tracebacks go to the report, not the console
        r.held.failing = outcome.kind == "failed"
    if outcome.kind == "signal":
        console.note(f"received {signal.Signals(outcome.signum).name}: stopping ranks {running}")
    stop(ranks, first, STOP_GRACE_S if running else 0, hurry)
    for r in ranks:
        r.join_readers(time.monotonic() + 2.0)
        if outcome.kind != "failed":
            r.held.release(console, "stderr", f"[rank {r.rank}] ")
    return running


def restart(ranks: list[RankProcess], outcome: Outcome, signals: Signals, console: Console,
            attempt: int, attempts: int) -> bool:
    """End a failed attempt before ``attempt`` (1-based, of ``attempts``) starts: stop every
    rank still running as a failing job does, and say which rank's failure restarts the job.
    False (and nothing said) when Ctrl-C / SIGTERM came meanwhile: the job ends instead."""
    end_attempt(ranks, outcome, signals, console)
    if signals.received:
        return False
    console.note(restart_note(first_failure(ranks, outcome.rank), attempt, attempts))
    return True


def finish(ranks: list[RankProcess], outcome: Outcome, signals: Signals, console: Console,
           config, port: int) -> int:
    """Stop whatever still runs, drain the output, report, and return the exit status."""
    running = end_attempt(ranks, outcome, signals, console)
    if outcome.kind == "ok":
        return 0
    if outcome.kind == "signal":
        return 128 + outcome.signum
    if outcome.kind == "timeout":
        done = sorted({r.rank for r in ranks} - set(outcome.running))
        had = f" (ranks {done} had finished)" if done else ""
        console.note(f"timed out after {config.timeout:g}s: ranks {list(outcome.running)} were "
                     f"still running{had}; stopped them. Raise --timeout if the job needs "
                     f"longer, or look for a rank stuck in a collective\n"
                     f"{DIFFERENT_COLLECTIVES_HINT}")
        return EXIT_TIMEOUT
    seen = next(r for r in ranks if r.rank == outcome.rank)
    failed = first_failure(ranks, outcome.rank)
    stopped = [x for x in running if x != failed.rank]
    after = seen if failed.rank in running else None  # the cause was still exiting: stopped
    console.note(failure_report(failed, config, port, stopped, others=ranks, after=after))
    return exit_status(seen.proc.returncode) or 1
