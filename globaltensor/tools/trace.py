"""``gt.comm_trace()``: what communication a block of code runs, and why.

    with gt.comm_trace() as t:
        y = x @ w                 # the operator may move an input first
        print(y.sum().item())     # item() gathers
    print(t)                      # one row per redistribution, then counts per collective
    t.counts()                    # {'all_gather': 2, 'all_reduce': 1}

Every redistribution the block runs is recorded, whether asked for (``to_global``,
``full_tensor()``, ``item()``, ``print``) or chosen by an operator (``aten.mm.default``): the
call, source and target layouts, the plan's steps and the bytes each rank sends. ``gt.comm``
collectives called inside the block are counted too. Inside ``torch.profiler`` every
redistribution is a ``record_function`` range named ``gt.redistribute: <call>``.

What it costs when neither is on: one ContextVar read and one module attribute read per
redistribution (redistribute.py), nothing per operator that moves no data. The call's name is read
from the stack only while a trace, the profiler, a communication policy (policy.py) or
``gt.verify`` is on: they share one ContextVar (observe.py), which announces each event to the
active trace's methods (``moved``, ``sent``, ``comm_called``).
"""
from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass

import torch

from ..layout import Layout
from ..observe import current, watched, watching
from ..sbp import format_sbp
from ..world import world


_KINDS = ("redistribution", "gt.comm call", "gradient bucket", "fully_shard collective",
          "pipeline send", "expert exchange")
# a wire event's label (runtime/wire.py Why) -> the kind of its row
_KIND = {"gradient bucket": "gradient bucket", "sync_data": "redistribution", "fully_shard": "fully_shard collective",
         "pipeline": "pipeline send", "expert dispatch": "expert exchange",
         "metadata": "metadata exchange",
         "layout check": "metadata exchange", "cost probe": "metadata exchange"}


@dataclass(slots=True)
class Record:
    """One redistribution (or one ``gt.comm`` collective, with ``plan`` None)."""

    op: str                        # the call that ran it: item(), print, to_global, aten.mm.default
    source: Layout | None
    target: Layout | None
    steps: tuple[str, ...]         # the plan's steps, one line each
    collectives: tuple[str, ...]   # the collective of each step that communicates
    bytes_per_rank: int | None     # what the busiest rank sends; None for gt.comm calls
    dtype: torch.dtype | None
    kind: str = "redistribution"   # or "gt.comm call", "gradient bucket", "fully_shard
    #                                collective", "pipeline send": what announced it

    def layouts(self) -> str:
        if self.source is None:
            return "-"
        src, dst = self.source, self.target
        if src.placement == dst.placement:
            return f"{format_sbp(src.sbp)} -> {format_sbp(dst.sbp)}"
        return f"{format_sbp(src.sbp)} on {src.placement!r} -> {format_sbp(dst.sbp)} on {dst.placement!r}"


class CommTrace:
    """The records of one ``gt.comm_trace()`` block; ``str()`` is a table."""

    def __init__(self, parent: "CommTrace | None" = None):
        self.records: list[Record] = []
        self.metadata: list[Record] = []  # shape, layout and object exchanges: not the model's data
        self._parent = parent
        self._open: Record | None = None  # the redistribution running now
        self._rank = 0

    def add(self, record: Record) -> None:
        trace = self
        while trace is not None:  # an enclosing trace sees what an inner one saw
            (trace.metadata if record.kind == "metadata exchange" else trace.records).append(record)
            trace = trace._parent

    def counts(self, metadata: bool = False) -> dict[str, int]:
        """How many times each collective ran: {'all_gather': 2, 'gt.comm.all_reduce': 1};
        ``metadata``: with the shape, layout and object exchanges (``self.metadata``)."""
        rows = self.records + self.metadata if metadata else self.records
        return dict(collections.Counter(c for r in rows for c in r.collectives))

    @property
    def bytes_per_rank(self) -> int:
        """Bytes this rank sent (the busiest rank, for a redistribution's steps), summed over
        the records (the metadata exchanges apart: ``metadata_bytes``)."""
        return sum(r.bytes_per_rank or 0 for r in self.records)

    @property
    def metadata_bytes(self) -> int:
        """Bytes this rank sent in metadata exchanges (shapes, layouts, first-use checks)."""
        return sum(r.bytes_per_rank or 0 for r in self.metadata)

    def __len__(self):
        return len(self.records)

    def __iter__(self):
        return iter(self.records)

    def table(self) -> str:
        kinds = collections.Counter(r.kind for r in self.records)  # metadata: its own line
        parts = [f"{kinds[k]} {k}{'s' * (kinds[k] != 1)}" for k in _KINDS
                 if kinds[k] or k in ("redistribution", "gt.comm call")]
        lines = [f"comm_trace: {', '.join(parts)}, {_fmt_bytes(self.bytes_per_rank)} sent per rank"]
        if self.records:
            rows = [("#", "call", "source -> target", "shape", "bytes/rank", "steps")]
            for i, r in enumerate(self.records, 1):
                shape = str(list(r.source.shape)) if r.source is not None else "-"
                sent = _fmt_bytes(r.bytes_per_rank) if r.bytes_per_rank is not None else "-"
                rows.append((str(i), r.op, r.layouts(), shape, sent, "; ".join(r.steps) or "-"))
            widths = [max(len(row[k]) for row in rows) for k in range(5)]
            lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[5]
                      for row in rows]
        counts = self.counts()
        shown = ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"
        if self.metadata:
            lines.append(f"metadata exchanges (shapes, layouts, objects): {len(self.metadata)}, "
                         f"{_fmt_bytes(self.metadata_bytes)} sent")
        lines.append(f"collectives: {shown}")
        return "\n".join(lines)

    __str__ = table

    # --- the observer side (observe.py announces; these record) ------------------------------
    def moved(self, call: str, plan, local: torch.Tensor, rank: int) -> None:
        """A redistribution ``plan`` of ``local`` starts for ``call`` on ``rank``: its row,
        which the wire's events of its steps fill (none where the rank is in neither
        placement: it sends and receives nothing)."""
        self._rank = rank
        if rank not in plan.src.placement and rank not in plan.dst.placement:
            self._open = None
            return
        self._open = Record(
            op=call, source=plan.src, target=plan.dst,
            steps=tuple(" ".join(f"{s.kind} {s.where()}".split()) for s in plan.steps),
            collectives=(), bytes_per_rank=0, dtype=local.dtype)
        self.add(self._open)

    def moved_done(self) -> None:
        self._open = None

    def wire_event(self, event) -> None:
        """The wire's one event (runtime/wire.py ``Sent``): a step of the open redistribution
        adds to its row; any other call is a row of its own. Only this rank's part is kept."""
        rank = self._rank if event.why.label == "redistribution" else world.get_rank()
        if not event.involves(rank):
            return
        nbytes = event.sent_by(rank)
        if event.why.label == "redistribution":
            if self._open is not None:
                self._open.collectives += (event.collective,)
                self._open.bytes_per_rank += nbytes
            return
        self.add(Record(op=event.why.op or event.why.label, source=None, target=None,
                        steps=(event.collective,), collectives=(event.collective,),
                        bytes_per_rank=nbytes, dtype=event.dtype,
                        kind=_KIND.get(event.why.label, event.why.label)))

    def comm_called(self, name: str) -> None:
        """A ``gt.comm`` collective ran."""
        full = "gt.comm." + name
        self.add(Record(op=full, source=None, target=None, steps=(), collectives=(full,),
                        bytes_per_rank=None, dtype=None, kind="gt.comm call"))

    def __repr__(self):
        return f"<CommTrace: {len(self.records)} records, counts {self.counts()}>"


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


@contextlib.contextmanager
def comm_trace():
    """Record every redistribution and ``gt.comm`` collective run inside the block.

    >>> with gt.comm_trace() as t:
    ...     loss.item()
    >>> t.counts()
    {'all_gather': 1}
    >>> print(t)        # a table: call, source -> target, shape, bytes per rank, steps
    """
    watchers = current()
    trace = CommTrace(None if watchers is None else watchers.trace)
    with watched(trace=trace):
        yield trace


__all__ = ["CommTrace", "Record", "comm_trace", "watching"]
