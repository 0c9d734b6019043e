"""What each rank waits in: the stall report (``GT_STALL_REPORT``) and ranks that left the job.

Every guarded collective (runtime/guard.py) and every GT_DEBUG check enters this rank's
``Watch``: one tuple stored, a clock read and a counter (the rank's collective number), well
under a microsecond and no communication. A daemon thread per world looks at it every ``tick``:

- a wait older than ``publish_s`` (a few seconds) is written once to the world's store under
  ``gt/wait/<generation>/<rank>`` (the operation, its number, the user's line, its ranks) and
  deleted when it ends;
- a rank outside any collective that has entered none for ``publish_s`` writes where it runs (its
  user line) under ``gt/run/<generation>/<rank>``, withdrawn at its next collective;
- a wait older than ``GT_STALL_REPORT`` seconds (default 30; 0 turns the report off): the other
  ranks' records are read, and when every other rank waits too, runs at one place without a
  collective (a rank stuck in user code: a sleep, a hung read, a long loop) or has left the job,
  the report is printed once on this rank's stderr, naming what each rank waits in or runs at.

Nothing is written while no wait lasts ``publish_s``. Ranks that left the job are read from the
keys ``exits.py`` writes as a rank leaves (``exits.left``): a rank still waiting for one of them
names it ("rank 1 finished (exit 0) after collective #30 while ranks [0] still run").
"""
from __future__ import annotations

import contextvars
import json
import os
import sys
import threading
import time

from .. import debug
from . import exits
from ..errors import GlobalTensorError

__all__ = ["Watch", "Waiting", "current", "start", "stop", "stall_seconds", "stall_report",
           "finished_message", "running_message"]

DEFAULT_STALL_S = 30.0
PUBLISH_S = 5.0  # a wait this old is written to the store (at most half the stall time)
_WATCH: contextvars.ContextVar["Watch | None"] = contextvars.ContextVar("gt_watch", default=None)


def current() -> "Watch | None":
    """This context's world's Watch (None outside a watched world)."""
    return _WATCH.get()


def stall_seconds(environ=os.environ) -> float:
    """GT_STALL_REPORT in seconds (default 30); 0 turns the stall report off."""
    raw = environ.get("GT_STALL_REPORT", "").strip()
    if not raw:
        return DEFAULT_STALL_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise GlobalTensorError(
            f"expected GT_STALL_REPORT to be a number of seconds >= 0, found {raw!r}; e.g. "
            f"GT_STALL_REPORT=10, 0 to turn the stall report off, or unset it ({DEFAULT_STALL_S:g}s)")
    return seconds


class Waiting:
    """A wait that is not a guarded collective (a GT_DEBUG check): its name and ranks."""

    __slots__ = ("name", "ranks")

    def __init__(self, name: str, ranks):
        self.name, self.ranks = name, ranks

    def waiting_in(self, frame, world_size: int) -> tuple[str, str]:
        return self.name, f"over {list(self.ranks)}"


class CompiledWait(Waiting):
    """A wait in a compiled graph's functional collective (no guard runs there)."""

    COMPILED = "a compiled graph's collective"

    __slots__ = ("op",)

    def __init__(self, op: str):
        super().__init__(self.COMPILED, ())
        self.op = op

    def waiting_in(self, frame, world_size: int) -> tuple[str, str]:
        return self.name, f"{self.op}, in a graph of torch.compile"


def _functional_collective(frame, depth: int = 4) -> str | None:
    """The functional collective op (``_c10d_functional.wait_tensor.default``) that one of
    ``frame``'s innermost calls runs (torch's ``OpOverload.__call__``), else None."""
    while frame is not None and depth > 0:
        if frame.f_code.co_name == "__call__" and frame.f_code.co_filename.endswith("_ops.py"):
            op = str(frame.f_locals.get("self", ""))
            return op if op.startswith("_c10d_functional.") else None
        frame, depth = frame.f_back, depth - 1
    return None


class Watch:
    """This rank's current wait in one world, and what its watchdog thread knows."""

    def __init__(self, store, rank: int, world_size: int, generation: int, stall_s: float):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.generation, self.stall_s = generation, stall_s
        self.publish_s = min(PUBLISH_S, stall_s / 2) if stall_s else PUBLISH_S
        self.tick = min(1.0, stall_s / 4) if stall_s else 1.0
        self.count = 0  # collectives entered: the rank's collective number
        self.depth = 0
        self.now: tuple | None = None  # (number, what, thread id, since) of the current wait
        self.closed = False
        self.published = 0
        self.reported = 0
        self.ident = threading.get_ident()  # the rank's thread (compiled graphs run there)
        self.compiled: tuple | None = None  # (number, since) of a wait in a compiled graph
        self.running: tuple = (0, time.monotonic(), None)  # outside collectives: (count, since, line published)
        self.seen_running: tuple | None = None  # (other ranks' run records, first seen)
        # the ranks that had left when rank 0 (the store's host) finished while this rank waits
        # for it: read while the store is up (see ``look_for_rank_0``)
        self.finished_note: tuple | None = None  # (wait number, exits.left's answer)

    # -- the waiting thread: the hot path
    def enter(self, what) -> None:
        self.depth += 1
        if self.depth == 1:
            self.count += 1
            self.now = (self.count, what, threading.get_ident(), time.monotonic())

    def leave(self) -> None:
        self.depth -= 1
        if self.depth <= 0:
            self.depth, self.now = 0, None

    # -- the store
    def key(self, rank: int) -> str:
        return f"gt/wait/{self.generation}/{rank}"

    def left(self, ranks) -> dict[int, tuple[str, int | None]]:
        """Ranks among ``ranks`` that have left the job: rank -> (status, collective number)."""
        return exits.left(self.store, self.generation, [r for r in ranks if r != self.rank])

    # -- the watchdog thread
    def run(self) -> None:
        while not self.closed:
            time.sleep(self.tick)
            try:
                self.look()
            except Exception:  # noqa: BLE001 - the store went away with its owner: stop watching
                return

    def run_key(self, rank: int) -> str:
        return f"gt/run/{self.generation}/{rank}"

    def look(self) -> None:
        now = self.now or self.compiled_wait()
        self.look_running(now is None)
        if now is not None:
            self.look_for_rank_0(now)
        if now is None or time.monotonic() - now[3] < self.publish_s:
            if self.published:
                self.published = 0
                self.store.delete_key(self.key(self.rank))
            return
        number, what, ident, since = now
        if self.published != number:
            self.store.set(self.key(self.rank), json.dumps(self.describe(number, what, ident)))
            self.published = number
        if self.stall_s and self.reported != number and time.monotonic() - since >= self.stall_s:
            report = self.report(time.monotonic() - since)
            if report is not None:
                self.reported = number
                print(report, file=sys.stderr, flush=True)

    def look_for_rank_0(self, now) -> None:
        """Waiting (a tick or more) in a collective of rank 0's after rank 0 finished: rank 0 is
        waiting at exit for this rank to leave (it hosts the store), and this rank for rank 0
        in the collective, so both would wait until the world's timeout. Work out the message
        now (the store goes with rank 0), then ask rank 0 to leave (``exits.release_key``): its
        connections close, this rank's collective ends at once, and the guard raises it."""
        number, what, _, since = now
        if self.rank == 0 or time.monotonic() - since < self.tick:
            return
        if self.finished_note is not None and self.finished_note[0] == number:
            return
        ranks = _ranks_of(what, self.world_size)
        if 0 not in ranks or self.left([0]).get(0, ("",))[0] != "ok":
            return  # (one store read a tick; the others' only once rank 0 has left)
        left = self.left(ranks)
        self.finished_note = (number, left)
        self.store.set(exits.release_key(self.generation), str(self.rank))

    def look_running(self, outside: bool) -> None:
        """Outside any collective with no new one for ``publish_s``: publish where this rank
        runs (its user line), so a waiting rank's report can name a rank that never reaches
        the collective (user code that blocks or runs long); withdrawn at its next one."""
        count, since, line = self.running
        if not outside or count != self.count:
            if line is not None:
                self.store.delete_key(self.run_key(self.rank))
            self.running = (self.count, time.monotonic(), None)
            return
        if time.monotonic() - since < self.publish_s:
            return
        frame = sys._current_frames().get(self.ident)
        where = _short(debug.user_line(frame=frame)) if frame is not None else "<unknown line>"
        if where != line:
            self.store.set(self.run_key(self.rank), json.dumps({"number": count, "line": where}))
            self.running = (count, since, where)

    def compiled_wait(self) -> tuple | None:
        """A wait no guard records: the rank's thread inside a functional collective of a
        compiled graph (``torch.ops._c10d_functional.*``, e.g. its ``wait_tensor``), as
        (number, what, thread id, since); the number is the last guarded collective's."""
        frame = sys._current_frames().get(self.ident)
        op = _functional_collective(frame)
        if op is None:
            self.compiled = None
            return None
        if self.compiled is None or self.compiled[0] != self.count:
            self.compiled = (self.count, time.monotonic())
        return self.compiled[0], CompiledWait(op), self.ident, self.compiled[1]

    def describe(self, number: int, what, ident: int) -> dict:
        frame = sys._current_frames().get(ident)
        name, detail = what.waiting_in(frame, self.world_size)
        line = debug.user_line(frame=frame) if frame is not None else "<unknown line>"
        return {"number": number, "name": name, "detail": detail, "line": _short(line)}

    def report(self, waited: float) -> str | None:
        """The stall report, or None while some other rank makes progress (it entered a
        collective lately, or has not been at one line long enough to publish it)."""
        others = [r for r in range(self.world_size) if r != self.rank]
        left = self.left(others)
        waits = {self.rank: json.loads(self.store.get(self.key(self.rank)))}
        running = {}
        for r in others:
            if r in left:
                continue
            if self.store.check([self.key(r)]):
                waits[r] = json.loads(self.store.get(self.key(r)))
            elif self.store.check([self.run_key(r)]):
                running[r] = json.loads(self.store.get(self.run_key(r)))
            else:
                return None
        if running and not self.steady(running):
            return None
        return stall_report(waits, left, waited, running)

    def steady(self, running: dict) -> bool:
        """Whether the same ranks have been seen running at the same lines for ``publish_s``:
        a rank that has just entered the collective withdraws its record at its next tick."""
        seen = tuple(sorted((r, w["number"], w["line"]) for r, w in running.items()))
        if self.seen_running is None or self.seen_running[0] != seen:
            self.seen_running = (seen, time.monotonic())
        return time.monotonic() - self.seen_running[1] >= self.publish_s


def stall_report(waits: dict[int, dict], left: dict, waited: float,
                 running: dict | None = None) -> str:
    """The text: ranks grouped by what they wait in, then the ranks that run outside any
    collective, at their line (pure, for the tests)."""
    groups: dict[tuple, list[int]] = {}
    for rank, w in sorted(waits.items()):
        groups.setdefault((w["name"], w["number"], w["line"], w["detail"]), []).append(rank)
    parts = [f"{_ranks(ranks)} wait{'s' * (len(ranks) == 1)} in {name} (collective #{number}, "
             f"{detail}) at {line}" for (name, number, line, detail), ranks in groups.items()]
    parts += [f"rank {r} has not reached a collective since its #{w['number']}: it runs at "
              f"{w['line']}" for r, w in sorted((running or {}).items())]
    parts += [_left_words(r, status, n) for r, (status, n) in sorted(left.items())]
    if running:
        cause = ("a rank that never reaches the collective the others wait in: code that blocks "
                 "or runs long on that rank (see its line), or a collective only some ranks call")
    elif any(w["name"] == CompiledWait.COMPILED for w in waits.values()):
        cause = ("collectives of a compiled graph and of eager code (gradient hooks, code "
                 "between graph breaks) issued in another order on some ranks; globaltensor "
                 "means to keep one order: please report it with this message")
    else:
        cause = ("a read of a global value (x.item(), print(x)) under `if rank == 0:` is the "
                 "usual cause (use gt.print0); GT_DEBUG=1 names the first operation that differs")
    return (f"globaltensor: no rank has made progress for {waited:.0f}s (GT_STALL_REPORT): "
            + "; ".join(parts) + ". Expected every rank to reach the same collectives in the same "
            f"order (SPMD): {cause}. The job goes on waiting until the timeout (GT_TIMEOUT).")


def running_message(watch: "Watch | None", ranks) -> str:
    """After a timeout: the ranks of ``ranks`` that run outside any collective at one line
    (stuck in user code), as their stall records say; "" when none is known."""
    if watch is None:
        return ""
    found = []
    for r in ranks:
        if r != watch.rank and watch.store.check([watch.run_key(r)]):
            w = json.loads(watch.store.get(watch.run_key(r)))
            found.append(f"rank {r} had not reached a collective since its #{w['number']}: it "
                         f"ran at {w['line']}")
    return ("; ".join(found) + ". ") if found else ""


def _ranks_of(what, world_size: int) -> list[int]:
    """The ranks of a wait (a guard or a :class:`Waiting`); every rank when it names none."""
    ranks = what._ranks() if hasattr(what, "_ranks") else getattr(what, "ranks", None)
    return list(range(world_size)) if not ranks else [int(r) for r in ranks]


def finished_message(watch: "Watch | None", ranks, where: str) -> str | None:
    """What a rank waiting in ``where`` with ``ranks`` raises when some of them finished (left
    with exit 0) while it still runs; None when none did. For a wait the watchdog saw rank 0
    leave (``look_for_rank_0``), what it read then is the answer: the store is gone with it."""
    if watch is None:
        return None
    note = watch.finished_note
    seen = note[1] if note is not None and note[0] == watch.count else watch.left(ranks)
    left = {r: v for r, v in seen.items() if v[0] == "ok" and r in ranks}
    if not left:
        return None
    gone = "; ".join(_left_words(r, status, n) for r, (status, n) in sorted(left.items()))
    still = [r for r in ranks if r not in left]
    if where.startswith(_VALUE_READS):
        why = ("Rank {me} reads a global value there, which is a collective: under `if rank == 0:` "
               "the other ranks never join it (use gt.print0, or read the value on every rank).")
    else:
        why = ("Expected every rank to run the same global operations (SPMD): a rank that runs "
               "out of data must stop with the others (gt.data.loader gives every rank the same "
               "number of batches; or agree on the number of steps first, e.g. with "
               "gt.comm.all_reduce of a count).")
    return (f"{where}: {gone} while {_ranks(still)} still run{'s' * (len(still) == 1)} (rank "
            f"{watch.rank} waits here, its collective #{watch.count}). "
            + why.format(me=watch.rank))


_VALUE_READS = ("item()", "print", "tolist()", "numpy()", "full_tensor()")


def _left_words(rank: int, status: str, number) -> str:
    how = "finished (exit 0)" if status == "ok" else "left with an error"
    at = f" after its collective #{number}" if number is not None else ""
    return f"rank {rank} {how}{at}"


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _short(line: str) -> str:
    """A user line with its file relative to the working directory when it is below it."""
    path, sep, rest = line.partition(":")
    rel = os.path.relpath(path) if os.path.isabs(path) else path
    return (rel if not rel.startswith("..") else path) + sep + rest


def start(store, rank: int, world_size: int, generation: int = 0,
          stall_s: float | None = None) -> Watch:
    """Watch this context's world (its guards and checks enter the Watch); a daemon thread
    reports stalls. Replaces an earlier world's Watch in this context."""
    previous = _WATCH.get()
    if previous is not None:
        previous.closed = True
    watch = Watch(store, rank, world_size, generation,
                  stall_seconds() if stall_s is None else stall_s)
    _WATCH.set(watch)
    if world_size > 1 and store is not None:
        threading.Thread(target=watch.run, name=f"gt-watch-{rank}", daemon=True).start()
    return watch


def stop() -> None:
    """This context's world is over: its watchdog thread ends."""
    watch = _WATCH.get()
    if watch is not None:
        watch.closed = True
        _WATCH.set(None)
