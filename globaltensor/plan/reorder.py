"""Plans between layouts whose pieces hold a dim in different orders (a head-tail split holds
its dim permuted, docs/long_context.md "Head-tail").

A layout with a head-tail split is, piece for piece, its plain layout (:meth:`Layout.plain`) of
the tensor permuted along that dim; the permutation depends only on the dim's size and the
axis's ranks (:attr:`Layout.order`). Between two layouts of one order, a plan is the plain
layouts' plan: each piece moves as the permuted tensor's. Between orders, the dims whose order
changes are made whole on every rank (the axes splitting them gathered, in the source's order),
put in the target's order by a local :class:`Reorder`, then the plain plan to the target. Pure:
no torch.distributed, no rank.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from .._cache import memo
from ..layout import Layout, head_tail_order
from ..sbp import Split, broadcast, partial_sum
from . import cost as model
from .cost import SEARCH_ITEMSIZE
from .steps import Plan, Step


@dataclass(frozen=True, slots=True)
class Reorder(Step):
    """A local permutation of whole dims: ``dims`` holds (dim, ranks of the order before, ranks
    of the order after), 1 for a dim's own order. ``before`` and ``after`` are the same plain
    layout, in which no axis splits those dims."""

    dims: tuple
    before: Layout = field(repr=False)
    after: Layout = field(repr=False)
    kind = "reorder"
    collective = False

    def latency(self) -> int:
        return 0

    def group_size(self) -> int:
        return 1

    def elements_copied(self) -> int:
        return self.after.max_local_numel()

    def cost(self, itemsize: int = SEARCH_ITEMSIZE) -> float:
        written = self.after.max_local_numel()
        return model.seconds(0, 0, written, written, itemsize)

    def where(self) -> str:
        return "  ".join(f"dim {d} {_name(a)} -> {_name(b)}" for d, a, b in self.dims)

    def describe(self, itemsize: int) -> str:
        return f"{self.kind:<15} {self.where():<22} (local: no data moves between ranks)"

    def index(self, dim: int) -> tuple[int, ...]:
        """For dim ``dim`` (one of :attr:`dims`), the position in the piece before of each
        position of the piece after (``piece.index_select(dim, index)``)."""
        for d, a, b in self.dims:
            if d == dim:
                return _index(self.after.shape[d], a, b)
        raise KeyError(dim)


def reorder_piece(step: Reorder, piece):
    """One rank's piece put in the order a :class:`Reorder` step makes (the executor's and the
    oracle's)."""
    for d, a, b in step.dims:
        piece = piece.index_select(d, _index_tensor(step.after.shape[d], a, b).to(piece.device))
    return piece


@memo(1024)
def _index_tensor(n: int, a: int, b: int) -> torch.Tensor:
    return torch.tensor(_index(n, a, b), dtype=torch.long)


def _name(k: int) -> str:
    return "in order" if k == 1 else f"head-tail/{k}"


@memo(1024)
def _index(n: int, a: int, b: int) -> tuple[int, ...]:
    before, after = head_tail_order(n, a), head_tail_order(n, b)
    where = {pos: i for i, pos in enumerate(before)}
    return tuple(where[pos] for pos in after)


def reordered(src: Layout, dst: Layout, plan_of) -> Plan:
    """The plan from ``src`` to ``dst`` (either with a head-tail split), with ``plan_of`` the
    planner of plain layouts."""
    plain_src, plain_dst = src.plain(), dst.plain()
    before, after = dict(src.order), dict(dst.order)
    changed = sorted(d for d in set(before) | set(after) if before.get(d, 1) != after.get(d, 1))
    if not changed:
        return Plan(src, dst, plan_of(plain_src, plain_dst).steps)
    dims = tuple((d, before.get(d, 1), after.get(d, 1)) for d in changed)
    best = None
    for pivot in _pivots(plain_src, changed, plain_dst):
        step = Reorder(dims, pivot, pivot)
        # (on the source's placement; a change of placement then moves the reordered pieces)
        steps = plan_of(plain_src, pivot).steps + (step,) + plan_of(pivot, plain_dst).steps
        cost = sum(s.cost() for s in steps)
        if best is None or cost < best[0]:
            best = (cost, steps)
    return Plan(src, dst, best[1])


def _pivots(layout: Layout, changed, dst: Layout) -> list[Layout]:
    """The layouts, on ``layout``'s placement, in which no axis splits a dim of ``changed`` and
    every other axis is as in ``layout``: each axis splitting such a dim holds B there, or a
    split of another dim (S(0) -> S(1, head_tail) is a reorder of whole rows, then an
    all_to_all), or P where ``dst`` is P on that axis (a zero-fill: each piece is whole, and
    permuting the terms of a sum permutes the sum, so S(1, head_tail) -> P moves nothing)."""
    others = [Split(d) for d in range(layout.ndim) if d not in changed]
    same = dst.placement == layout.placement
    options = [[broadcast] + others + ([partial_sum] if same and dst.sbp[a] == partial_sum else [])
               if isinstance(v, Split) and v.dim in changed else [v]
               for a, v in enumerate(layout.sbp)]
    return [layout.with_sbp(sbp) for sbp in itertools.product(*options)]


__all__ = ["Reorder", "reorder_piece", "reordered"]
