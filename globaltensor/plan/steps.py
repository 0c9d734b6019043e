"""The steps of a redistribution plan, and the Plan: frozen values that know their cost.

Each step changes one placement axis (or, for an Exchange, the placement) and knows the layout
before and after it, so an executor runs a plan with no search of its own. Costs follow the α-β
model of :mod:`.cost`. Pure: no torch.distributed, no rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .._cache import memo
from ..layout import Layout, box_numel, boxes, overlap_numel
from . import cost as model
from .cost import SEARCH_ITEMSIZE
from .moves import Move, coords_and_ranks, exchange_moves
from .traffic import exchange_traffic, moves_traffic


def _max_local(layout: Layout) -> int:
    return layout.max_local_numel()


def holds_full(layout: Layout) -> bool:
    """Whether some rank holds (a full-size piece of) the whole logical tensor."""
    return layout.numel() > 0 and _max_local(layout) == layout.numel()


def _fmt_sbp(sbp) -> str:
    """``(S(0),)`` for one axis, ``(S(0), B)`` for two: the tuple a user would write."""
    return "(" + ", ".join(str(v) for v in sbp) + (",)" if len(sbp) == 1 else ")")


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# --------------------------------------------------------------------------- steps


class Step:
    """A step of a plan. Subclasses are frozen dataclasses with ``before`` and ``after`` layouts.

    ``elements_sent()`` is what the busiest rank sends (elements), ``latency()`` the number of
    α terms (collectives or messages on the busiest rank).
    """

    __slots__ = ()
    kind = "step"
    collective = True

    def elements_sent(self) -> int:
        return 0

    def elements_copied(self) -> int:
        return 0

    def latency(self) -> int:
        return 1 if self.collective and self.group_size() > 1 else 0

    def group_size(self) -> int:
        return self.after.placement.shape[self.axis]

    def bytes_sent(self, itemsize: int) -> int:
        return self.elements_sent() * itemsize

    def communicates(self) -> bool:
        return self.latency() > 0

    def cost(self, itemsize: int = SEARCH_ITEMSIZE) -> float:
        return model.axis_step(self.group_size(), self.latency(), self.elements_sent(),
                               _max_local(self.after), self.elements_copied(), itemsize)

    def where(self) -> str:
        return f"axis {self.axis}"

    def describe(self, itemsize: int) -> str:
        if self.group_size() == 1:
            return f"{self.kind:<15} {self.where():<22} (axis of size 1: relabel, no data moves)"
        return f"{self.kind:<15} {self.where():<22} sends {_fmt_bytes(self.bytes_sent(itemsize))} per rank"


@dataclass(frozen=True, slots=True)
class AllGather(Step):
    """S(dim) -> B along ``axis``: each group concatenates its pieces along ``dim``."""

    axis: int
    dim: int
    before: Layout = field(repr=False)
    after: Layout = field(repr=False)
    kind = "all_gather"

    def elements_sent(self) -> int:  # ring, pieces padded to the largest
        return model.gather_sent(self.group_size(), _max_local(self.before))

    def elements_copied(self) -> int:
        lands = self.dim == 0 and even(self.before, self.axis, self.dim, last_short=True)
        return model.gather_copied(_max_local(self.before), _max_local(self.after),
                                   even(self.before, self.axis, self.dim), lands)

    def where(self) -> str:
        return f"axis {self.axis}  dim {self.dim}"


@dataclass(frozen=True, slots=True)
class AllGatherV(AllGather):
    """S(dim) -> B along ``axis`` for uneven pieces, without padding: every member sends its
    own piece, as it is, to every other member, all messages posted at once (gloo runs its
    all_to_all the same way); each piece lands directly in its place in the result.

    Offered next to the padded ``AllGather`` on CPU placements whose pieces along the axis are
    uneven; the cost model picks it there because it copies less (no padded send buffer, and
    along dim 0 no unpacking whatever the group's rank order)."""

    kind = "all_gatherv"

    def elements_sent(self) -> int:  # exact: the largest piece, to each other member
        return model.gather_sent(self.group_size(), _max_local(self.before))

    def elements_copied(self) -> int:
        return model.gatherv_copied(self.dim, _max_local(self.after))


def offers_gatherv(step: AllGather) -> bool:
    """Whether an exact gather is worth offering instead of ``step``: uneven pieces on CPU
    (gloo). On CUDA the padded NCCL all_gather stays: its ring is pipelined, the point-to-point
    version is not (and is untested there)."""
    before = step.before
    return before.placement.type == "cpu" and not even(before, step.axis, step.dim)


@dataclass(frozen=True, slots=True)
class ReduceScatter(Step):
    """P -> S(dim) along ``axis``: sum over the group, each keeps its slice of ``dim``."""

    axis: int
    dim: int
    before: Layout = field(repr=False)
    after: Layout = field(repr=False)
    kind = "reduce_scatter"

    def elements_sent(self) -> int:
        return model.reduce_scatter_sent(self.group_size(), _max_local(self.after))

    def elements_copied(self) -> int:
        lands = self.dim == 0 and even(self.after, self.axis, self.dim)
        return model.reduce_scatter_copied(_max_local(self.before), lands)

    def where(self) -> str:
        return f"axis {self.axis}  dim {self.dim}"


@dataclass(frozen=True, slots=True)
class AllReduce(Step):
    """P -> B along ``axis``: sum over the group."""

    axis: int
    before: Layout = field(repr=False)
    after: Layout = field(repr=False)
    kind = "all_reduce"

    def elements_sent(self) -> int:
        return model.all_reduce_sent(self.group_size(), _max_local(self.before))

    # its one copy (the caller's piece is never reduced in place) stands for the receive buffer
    # every other collective writes, so it counts as nothing extra


@dataclass(frozen=True, slots=True)
class AllToAll(Step):
    """S(src_dim) -> S(dst_dim) along ``axis``: member k sends member m its slice of ``dst_dim``."""

    axis: int
    src_dim: int
    dst_dim: int
    before: Layout = field(repr=False)
    after: Layout = field(repr=False)
    kind = "all_to_all"

    def elements_sent(self) -> int:  # exact: everything but the part a rank keeps
        return _all_to_all_sent(self.before, self.after)

    def elements_copied(self) -> int:
        return model.all_to_all_copied(self.src_dim, self.dst_dim, _max_local(self.before),
                                       _max_local(self.after))

    def where(self) -> str:
        return f"axis {self.axis}  dim {self.src_dim} -> {self.dst_dim}"


@memo(16384)
def even(layout: Layout, axis: int, dim: int, last_short: bool = False) -> bool:
    """Whether every piece along ``axis`` has one length of ``dim`` (or, with ``last_short``,
    every piece but the last along the axis)."""
    last = layout.placement.shape[axis] - 1
    lengths = {b[dim][1] - b[dim][0] for c, b in boxes(layout).items()
               if not (last_short and c[axis] == last)}
    return len(lengths) <= 1


@memo(16384)
def _all_to_all_sent(before: Layout, after: Layout) -> int:
    ahead = boxes(after)
    most = 0
    for coord, mine in boxes(before).items():
        most = max(most, box_numel(mine) - overlap_numel(mine, ahead[coord]))
    return most


@dataclass(frozen=True, slots=True)
class LocalSlice(Step):
    """B -> S(dim) along ``axis``: each rank keeps its slice; no communication."""

    axis: int
    dim: int
    before: Layout = field(repr=False)
    after: Layout = field(repr=False)
    kind = "local slice"
    collective = False

    def where(self) -> str:
        return f"axis {self.axis}  dim {self.dim}"


@dataclass(frozen=True, slots=True)
class ZeroFill(Step):
    """B -> P or S -> P along ``axis``: the value stays at coordinate 0 of the axis (B) or in
    each rank's own slice (S); every other element becomes zero. No communication."""

    axis: int
    before: Layout = field(repr=False)
    after: Layout = field(repr=False)
    kind = "zero-fill"
    collective = False

    def where(self) -> str:
        return f"axis {self.axis}  from {self.before.sbp[self.axis]}"


@dataclass(frozen=True, slots=True)
class Exchange(Step):
    """Point-to-point exchange of box intersections (and broadcasts of pieces several ranks
    need), from a non-partial layout to any layout, on the same or another placement. A rank
    of a partial target that no move reaches holds zeros.

    Every region of every target piece is covered by exactly one move: sends/recvs run as one
    batch, then broadcasts in order. The moves (``exchange.exchange_moves``, a function of the
    two layouts) are built when first read: pricing the step counts them on arrays
    (:mod:`.traffic`), so a simulated world of thousands of ranks never builds them.
    """

    before: Layout = field(repr=False)
    after: Layout = field(repr=False)
    kind = "send/recv"

    @property
    def moves(self) -> tuple[Move, ...]:
        return exchange_moves(self.before, self.after)

    def traffic(self):
        """Elements each rank sends, and the messages it sends or receives (the larger),
        counted on the moves (the reference :func:`.traffic.exchange_traffic` equals)."""
        sent, sends, recvs = {}, {}, {}
        for m in self.moves:
            if m.is_local:
                continue
            # a pipelined broadcast has every member forward the piece once
            for r in m.group if m.is_broadcast else (m.src,):
                sent[r] = sent.get(r, 0) + box_numel(m.region)
            sends[m.src] = sends.get(m.src, 0) + 1
            for r in m.dsts:
                recvs[r] = recvs.get(r, 0) + 1
        msgs = {r: max(sends.get(r, 0), recvs.get(r, 0)) for r in set(sends) | set(recvs)}
        return sent, msgs

    def _summary(self) -> tuple[int, int, bool]:
        """(the busiest rank's elements sent, its messages, whether anything leaves a rank)."""
        before, after = self.before, self.after
        if before.placement == after.placement and not after.is_partial:
            return exchange_traffic(before, after)
        return moves_traffic(self.moves)  # placement changes, partial targets: rarer, smaller

    def elements_sent(self) -> int:
        return self._summary()[0]

    def elements_copied(self) -> int:  # packing what is sent, placing every piece
        return self.elements_sent() + _max_local(self.after)

    def latency(self) -> int:  # at least one: an exchange is never free, even all local
        return self._summary()[1]

    def cost(self, itemsize: int = SEARCH_ITEMSIZE) -> float:  # the traffic counted once
        sent, messages, _ = self._summary()
        return model.exchange(messages, sent, _max_local(self.after), itemsize)

    def communicates(self) -> bool:
        return self._summary()[2]

    @property
    def broadcasts(self) -> tuple[Move, ...]:
        return tuple(m for m in self.moves if m.is_broadcast)

    @property
    def transfers(self) -> tuple[Move, ...]:
        return tuple(m for m in self.moves if not m.is_local and not m.is_broadcast)

    def where(self) -> str:
        src, dst = self.before.placement.ranks.tolist(), self.after.placement.ranks.tolist()
        return f"ranks {src} -> {dst}"

    def describe(self, itemsize: int) -> str:
        parts = [f"{len(self.transfers)} sends"] if self.transfers else []
        parts += [f"{len(self.broadcasts)} broadcasts"] if self.broadcasts else []
        kind = "broadcast" if self.broadcasts and not self.transfers else self.kind
        kind = kind if self.communicates() else "local copy"
        what = ", ".join(parts) or "no data leaves a rank"
        return (f"{kind:<15} {self.where()} ({what})  "
                f"sends {_fmt_bytes(self.bytes_sent(itemsize))} per rank")


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True, slots=True)
class Plan:
    """The steps that turn ``src`` into ``dst``; empty when they are equal."""

    src: Layout
    dst: Layout
    steps: tuple[Step, ...]

    def __len__(self):
        return len(self.steps)

    def __iter__(self):
        return iter(self.steps)

    def cost(self, itemsize: int = SEARCH_ITEMSIZE) -> float:
        """Estimated seconds under the α-β model (see docs/planner.md)."""
        return sum(s.cost(itemsize) for s in self.steps)

    def bytes_per_rank(self, itemsize: int = SEARCH_ITEMSIZE) -> int:
        """Bytes the busiest rank of each step sends, summed over the steps."""
        return sum(s.bytes_sent(itemsize) for s in self.steps)

    def collectives(self) -> int:
        return sum(1 for s in self.steps if s.communicates())

    def describe(self, itemsize: int = SEARCH_ITEMSIZE, dtype_name: str | None = None) -> str:
        """One line per step with its axis, dims and bytes each rank sends, then a total."""
        lines = [self._header(dtype_name)]
        lines += [f"  {i}. {s.describe(itemsize)}" for i, s in enumerate(self.steps, 1)]
        n = self.collectives()
        lines.append(f"total: {_fmt_bytes(self.bytes_per_rank(itemsize))} per rank, "
                     f"{n} collective{'' if n == 1 else 's'}"
                     + ("" if self.steps else " (same layout: nothing to do)"))
        return "\n".join(lines)

    def _header(self, dtype_name) -> str:
        src, dst = self.src, self.dst
        dtype = f" {dtype_name}" if dtype_name else ""
        shape = f"shape {list(src.shape)}{dtype}"
        if src.placement == dst.placement:
            return f"{_fmt_sbp(src.sbp)} -> {_fmt_sbp(dst.sbp)}  on {src.placement!r}  {shape}"
        return (f"{_fmt_sbp(src.sbp)} on {src.placement!r} -> {_fmt_sbp(dst.sbp)} on "
                f"{dst.placement!r}  {shape}")

    def __str__(self):
        return self.describe()


__all__ = ["AllGather", "AllGatherV", "AllReduce", "AllToAll", "Exchange", "LocalSlice", "Move",
           "Plan", "ReduceScatter", "Step", "ZeroFill", "coords_and_ranks", "even", "holds_full",
           "offers_gatherv"]
