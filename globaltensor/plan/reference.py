"""The exhaustive planner the search replaced (issue 14), kept as the tests' oracle of
optimality: Dijkstra over every layout (as values) and every exchange edge, each step costed by
its own Step.cost. Uncached; slow on 3-D grids and beyond.
"""
from __future__ import annotations

import heapq
import itertools

from .._cache import memo
from ..layout import Layout
from ..sbp import Split, broadcast, partial_sum
from .codes import build, code, kind, later_splits
from .exchange import cores, exchange
from .search import check
from .steps import AllGather, AllGatherV, Plan, Step, holds_full, offers_gatherv


def local_step(before: Layout, axis: int, new) -> Step | None:
    """The one step that changes ``axis`` of ``before`` to ``new`` while keeping every other
    axis's pieces where they are, or None (the table of :mod:`.codes`)."""
    codes = tuple(code(v) for v in before.sbp)
    old = codes[axis]
    found = kind(old, code(new), later_splits(codes, before.placement.shape, axis))
    if found is None:
        return None
    return build(found, axis, old, code(new), before, before.with_axis(axis, new))


@memo(64)
def _values(ndim: int) -> tuple:
    return tuple(Split(d) for d in range(ndim)) + (broadcast, partial_sum)


@memo(16384)
def local_steps(layout: Layout) -> tuple[Step, ...]:
    """Every axis-local step from ``layout`` (an exact gather after a padded one it is offered
    beside)."""
    out = []
    for axis, old in enumerate(layout.sbp):
        for new in _values(layout.ndim):
            if new != old:
                step = local_step(layout, axis, new)
                if step is not None:
                    out.append(step)
                if isinstance(step, AllGather) and offers_gatherv(step):
                    out.append(AllGatherV(step.axis, step.dim, step.before, step.after))
    return tuple(out)


def reference_plan(src: Layout, dst: Layout) -> Plan:
    """Dijkstra over every layout and every exchange edge, first avoiding full intermediate
    copies, then, if that finds nothing, again without the rule."""
    check(src, dst)
    if src == dst:
        return Plan(src, dst, ())
    steps = _dijkstra(src, dst, avoid_full=not holds_full(dst))
    if steps is None:
        steps = _dijkstra(src, dst, avoid_full=False)
    return Plan(src, dst, steps)


def _edges(node: Layout, src: Layout, dst: Layout, core_layouts: list[Layout]):
    yield from local_steps(node)
    if node.placement == src.placement and not node.is_partial:
        for core in [dst] + core_layouts if dst.is_partial else core_layouts:
            if core != node:
                yield exchange(node, core)


def _dijkstra(src: Layout, dst: Layout, avoid_full: bool):
    core_layouts = cores(dst)
    best = {src: 0.0}
    heap = [(0.0, 0, src, ())]
    counter = itertools.count(1)
    while heap:
        cost, _, node, path = heapq.heappop(heap)
        if node == dst:
            return path
        if cost > best.get(node, float("inf")):
            continue
        for step in _edges(node, src, dst, core_layouts):
            nxt = step.after
            if nxt.placement != dst.placement and nxt.placement != src.placement:
                continue
            if avoid_full and nxt != dst and holds_full(nxt):
                continue
            new = cost + step.cost()
            if new < best.get(nxt, float("inf")) - 1e-15:
                best[nxt] = new
                heapq.heappush(heap, (new, next(counter), nxt, path + (step,)))
    return None


__all__ = ["local_step", "local_steps", "reference_plan"]
