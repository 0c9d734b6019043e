"""Pipeline schedules as tables: which task (forward or backward of one micro-batch on one stage)
each placement runs, in what order (pure: no rank, no communication).

A schedule is a list of tasks per placement. Each placement runs its list in order; a task waits
only for what it needs (a forward for the previous stage's forward of the same micro-batch, a
backward for the next stage's backward and its own forward). :func:`clock` runs the lists against
those dependencies, one tick per task, and gives the table (stage x time step) that
``Pipeline.table()`` prints; a list that could wait forever is refused before any rank sends.

- ``gpipe``: every forward, then every backward (a stage keeps all micro-batches' activations).
- ``1f1b``: stage s runs ``stages - s`` forwards, then alternates one backward and one forward
  (it keeps at most ``stages - s`` micro-batches' activations).
- ``interleaved-1f1b`` (Megatron's): ``v`` stages per placement (stage i on placement
  ``i % k``), forwards in rounds of ``k`` micro-batches per local stage, a warm-up of
  ``(k - p - 1) * 2 + (v - 1) * k`` forwards on placement p, then one backward per forward.
"""
from __future__ import annotations

from typing import NamedTuple

from ..errors import GlobalTensorError

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


class Task(NamedTuple):
    kind: str   # "F" or "B"
    stage: int
    microbatch: int

    def __str__(self):
        return f"{self.kind}{self.microbatch}"


def orders(schedule: str, stages: int, places: int, microbatches: int,
           backward: bool = True) -> list[list[Task]]:
    """The tasks of each placement (stage i on placement ``i % places``), in the order it runs
    them; ``backward=False``: forwards only (inference), in micro-batch order."""
    check(schedule, stages, places, microbatches)
    if not backward:
        return [[Task("F", s, m) for m in range(microbatches) for s in range(p, stages, places)]
                for p in range(places)]
    if schedule == "gpipe":
        return [[Task("F", p, m) for m in range(microbatches)]
                + [Task("B", p, m) for m in range(microbatches)] for p in range(places)]
    if schedule == "1f1b":
        return [_one_f_one_b(p, stages, microbatches) for p in range(places)]
    return [_interleaved(p, places, stages // places, microbatches) for p in range(places)]


def check(schedule: str, stages: int, places: int, microbatches: int) -> None:
    if schedule not in SCHEDULES:
        raise GlobalTensorError(
            f"expected schedule to be one of {', '.join(map(repr, SCHEDULES))}, found {schedule!r}")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise GlobalTensorError(
            f"expected microbatches to be an int >= 1, found {microbatches!r}; e.g. "
            f"microbatches=8")
    if schedule != "interleaved-1f1b" and stages != places:
        raise GlobalTensorError(
            f"schedule {schedule!r} runs one stage per placement, found {stages} stages on "
            f"{places} placements; give each stage its own placement, or use "
            f"schedule='interleaved-1f1b' (stage i on placement i % {places})")
    if schedule == "interleaved-1f1b":
        if stages % places:
            raise GlobalTensorError(
                f"interleaved-1f1b puts stage i on placement i % {places}: expected a multiple of "
                f"{places} stages, found {stages}")
        if microbatches % places:
            raise GlobalTensorError(
                f"interleaved-1f1b runs micro-batches in rounds of one per placement: expected a "
                f"multiple of {places} micro-batches, found {microbatches}; e.g. "
                f"microbatches={places * max(1, -(-microbatches // places))}")


def _one_f_one_b(s: int, stages: int, microbatches: int) -> list[Task]:
    warm = min(stages - s, microbatches)
    out = [Task("F", s, m) for m in range(warm)]
    for m in range(microbatches):
        out.append(Task("B", s, m))
        if warm + m < microbatches:
            out.append(Task("F", s, warm + m))
    return out


def _interleaved(p: int, k: int, v: int, microbatches: int) -> list[Task]:
    total = v * microbatches

    def forward(i: int) -> Task:
        chunk = (i // k) % v
        return Task("F", chunk * k + p, (i // (k * v)) * k + i % k)

    def backward(i: int) -> Task:
        chunk = v - 1 - (i // k) % v
        return Task("B", chunk * k + p, (i // (k * v)) * k + i % k)

    warm = min((k - p - 1) * 2 + (v - 1) * k, total)
    out = [forward(i) for i in range(warm)]
    for j in range(total - warm):
        out.append(forward(warm + j))
        out.append(backward(j))
    out += [backward(j) for j in range(total - warm, total)]
    return out


def needs(task: Task, stages: int) -> list[Task]:
    """The tasks ``task`` waits for."""
    kind, s, m = task
    if kind == "F":
        return [Task("F", s - 1, m)] if s > 0 else []
    return [Task("F", s, m)] + ([Task("B", s + 1, m)] if s < stages - 1 else [])


def clock(lists: list[list[Task]], stages: int) -> list[list[Task | None]]:
    """Run each placement's list against the dependencies, one task per tick: the table
    ``[tick][placement] -> Task or None`` (idle). A task may start the tick after what it needs
    ends. Raises if the lists could wait for each other forever."""
    done: set[Task] = set()
    at = [0] * len(lists)
    table = []
    while any(i < len(tasks) for i, tasks in zip(at, lists)):
        row: list[Task | None] = []
        for p, tasks in enumerate(lists):
            task = tasks[at[p]] if at[p] < len(tasks) else None
            if task is not None and all(n in done for n in needs(task, stages)):
                row.append(task)
                at[p] += 1
            else:
                row.append(None)
        if all(t is None for t in row):
            waiting = {p: tasks[at[p]] for p, tasks in enumerate(lists) if at[p] < len(tasks)}
            raise GlobalTensorError(
                f"internal: a pipeline schedule waits forever (next tasks {waiting}); please "
                f"report this")
        done.update(t for t in row if t is not None)
        table.append(row)
    return table


def render(table: list[list[Task | None]], stages: int, places: int) -> str:
    """The table as text: one row per stage, one column per time step (``F3``: forward of
    micro-batch 3, ``B3`` its backward, ``.``: idle)."""
    width = max([len(str(t)) for row in table for t in row if t is not None] + [1])
    lines = []
    for s in range(stages):
        cells = []
        for row in table:
            task = row[s % places]
            cells.append((str(task) if task is not None and task.stage == s else ".").rjust(width))
        lines.append(f"stage {s} (placement {s % places}): " + " ".join(cells))
    busy = sum(1 for row in table for t in row if t is not None)
    lines.append(f"{len(table)} time steps, {busy} tasks, bubble "
                 f"{1 - busy / (len(table) * places):.0%} of placement-time")
    return "\n".join(lines)


def peak_in_flight(tasks: list[Task]) -> dict[int, int]:
    """Per stage, the most micro-batches whose forward ran and backward has not (the
    activations a stage keeps)."""
    live: dict[int, int] = {}
    peak: dict[int, int] = {}
    for kind, s, _ in tasks:
        live[s] = live.get(s, 0) + (1 if kind == "F" else -1)
        peak[s] = max(peak.get(s, 0), live[s])
    return peak
