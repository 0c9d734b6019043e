"""``plan(src, dst)``: the cheapest plan, by A* over one-sbp-per-axis states with the admissible
bounds of :mod:`.bound`; ``cost_above``: the same search stopped at a cost limit.

The skeleton is a Dijkstra loop (pop the cheapest entry, expand it, push what it reaches); the
stages around it defer work until an entry comes first: a layout is queued with the bound its
predecessor implies and gets its own bound in three stages (α and memory, the exchange route's
deeper count, the elements), an exchange is queued with a bound and built only when it comes
first again (docs/planner.md, "The search").
"""
from __future__ import annotations

import heapq
import itertools
import math
import threading

from .._cache import Bounded
from ..errors import GlobalTensorError
from ..layout import Layout
from .bound import Bound
from .codes import B, P
from .cost import SEARCH_ITEMSIZE
from .exchange import exchange
from .reorder import reordered
from .steps import Plan, Step, holds_full


def check(src: Layout, dst: Layout) -> None:
    """Raises unless ``src`` and ``dst`` are Layouts of one shape on one device type."""
    if not isinstance(src, Layout) or not isinstance(dst, Layout):
        raise GlobalTensorError(
            f"plan(src, dst) expects two Layouts, found {type(src).__name__} and "
            f"{type(dst).__name__}")
    if src.shape != dst.shape:
        raise GlobalTensorError(
            f"expected source and target layouts of one logical shape, found {list(src.shape)} "
            f"and {list(dst.shape)}; redistribution never changes the shape (reshape first)")
    if src.placement.type != dst.placement.type:
        raise GlobalTensorError(
            f"expected source and target placements of one device type, found "
            f"{src.placement.type!r} and {dst.placement.type!r}; move the local pieces with "
            f".to(device) first, then redistribute")


def plan(src: Layout, dst: Layout) -> Plan:
    """The cheapest plan from ``src`` to ``dst`` (pure, cached, the same on every rank)."""
    found = _PLANS.get((src, dst))
    if found is not None:
        return found
    check(src, dst)
    if src == dst:
        return _PLANS.put((src, dst), Plan(src, dst, ()))
    if src.plain() is not src or dst.plain() is not dst:  # a head-tail split (reorder.py)
        return _PLANS.put((src, dst), reordered(src, dst, plan))
    with _SEARCH_LOCK:  # a stopped search is shared state (thread-ranks share this module)
        search = _SEARCHES.pop((src, dst), None) or Search(src, dst)
        steps = search.run()
    if steps is None:  # unreachable: all-B is always a way through
        raise GlobalTensorError(f"found no plan from {src!r} to {dst!r}; please report this")
    return _PLANS.put((src, dst), Plan(src, dst, steps))


def cost_above(src: Layout, dst: Layout, limit: float,
               itemsize: int = SEARCH_ITEMSIZE) -> tuple[float, bool]:
    """(``plan(src, dst).cost(itemsize)``, True), or, if that is more than ``limit``, maybe
    (a lower bound on it that is more than ``limit``, False): the search stops once every
    route left costs more, and is taken up again where it stopped if the plan is asked for."""
    check(src, dst)
    if src == dst:
        return 0.0, True
    found = _PLANS.get((src, dst))
    if found is not None:  # planned before (its search is gone from _SEARCHES)
        return found.cost(itemsize), True
    if src.plain() is not src or dst.plain() is not dst:  # a head-tail split: plan it
        return plan(src, dst).cost(itemsize), True
    scale = min(1.0, itemsize / SEARCH_ITEMSIZE)  # costs at itemsize over those at the search's
    with _SEARCH_LOCK:
        search = _SEARCHES.get((src, dst))
        if search is None:
            search = _SEARCHES.put((src, dst), Search(src, dst))
        if search.run(limit / scale) is None:
            return search.lower * scale * (1 - 1e-9), False
    return plan(src, dst).cost(itemsize), True


# searches stopped by cost_above, to be taken up again; one search runs at a time: two threads
# (thread-ranks of gt.testing) taking up the same stopped search would corrupt its queue and could
# choose differently, so ranks would run different collectives (a fuzz test aborted in gloo)
_SEARCHES = Bounded(512)
_PLANS = Bounded(8192)  # plan()'s results, which cost_above also looks up
_SEARCH_LOCK = threading.RLock()

# the kinds of entry in the search's queue: a layout reached (its key with the bound from it,
# or with one inherited from the step before, not yet worked out), an exchange costed only by
# the bound on any exchange into its target, one costed by the bound from its source
_NODE, _GUESSED, _QUICK, _DEEPER, _EXCHANGE, _EXCHANGE_FROM = 0, 1, 2, 3, 4, 5


class Search:
    """A* from ``src`` to ``dst`` over the keys of :class:`Bound`. Unless ``dst`` holds the
    whole tensor on a rank, no intermediate layout may (lemma "No full copies"): such layouts
    are never queued. :meth:`run` may stop at a cost limit and go on later. A queue entry is
    (key, route length, counter, kind, cost so far, node, path, exchange target)."""

    __slots__ = ("dst", "guard", "bound", "spaces", "goal", "targets", "best", "lengths", "heap",
                 "counter", "lower", "steps", "start")

    def __init__(self, src: Layout, dst: Layout):
        # on one rank, every layout holds the whole tensor: a partial src there can reach
        # another placement only through one (an exchange takes no partial sums)
        one_rank_sum = src.placement.size == 1 and src.is_partial
        self.dst, self.guard = dst, not holds_full(dst) and not one_rank_sum
        self.bound = bound = Bound(src, dst)
        self.spaces = spaces = bound.spaces
        self.start, self.goal = (0, spaces[0].codes(src)), (bound.on_dst, bound.target)
        self.targets = [(dst, self.goal)] + _core_keys(spaces[bound.on_dst], bound.target, bound.on_dst)
        self.counter = itertools.count(1)
        self.lower, self.steps = 0.0, None
        self._begin()

    def _begin(self):
        start = self.start
        self.best, self.lengths = {start: 0.0}, {start: 0}
        self.heap = [(self.bound.full(start), 0, 0, _NODE, 0.0, start, (), None)]

    def _restart(self) -> bool:
        """Search again allowing full copies, if it did not (a safety net, not a case)."""
        if not self.guard:
            return False
        self.guard = False
        self._begin()
        return True

    def run(self, limit: float = math.inf):
        """The steps of the cheapest plan, or None once every route left costs more than
        ``limit`` (then ``self.lower`` is a bound above ``limit``, and a later call goes on)."""
        if self.steps is not None:
            return self.steps
        pop = heapq.heappop
        while True:
            heap = self.heap
            while heap:
                if heap[0][0] > limit:
                    self.lower = heap[0][0]
                    return None
                entry = pop(heap)
                kind = entry[3]
                if kind <= _DEEPER:
                    if not self._settled(entry):
                        continue
                    if entry[5] == self.goal:
                        self.steps = _steps_of(self.spaces, entry[6])
                        return self.steps
                    self._expand(entry)
                elif kind == _EXCHANGE:
                    self._price_exchange(entry)
                else:
                    self._take_exchange(entry)
            if not self._restart():
                self.lower = math.inf
                return None

    def _settled(self, entry) -> bool:
        """Whether ``entry``'s layout still comes first with its own bound, worked out in stages
        (α and memory, the deeper count, then the elements); at the first stage that lifts it
        above its key, it is queued again with that stage's bound."""
        f, _, _, kind, cost, node, path, _ = entry
        if cost > self.best[node] or len(path) > self.lengths[node]:
            return False  # a cheaper or shorter route reached it since
        bound, push = self.bound, heapq.heappush
        if kind == _GUESSED:  # first its α and memory terms: often enough to wait
            h = bound.quick(node)
            if cost + h > f:
                push(self.heap, (cost + h, entry[1], entry[2], _QUICK) + entry[4:])
                return False
            kind = _QUICK
        if kind == _QUICK:  # then the exchange route's deeper count, if any
            h = bound.deeper(node)
            if h is not None and cost + h > f:
                push(self.heap, (cost + h, entry[1], entry[2], _DEEPER) + entry[4:])
                return False
            kind = _DEEPER
        if kind == _DEEPER:
            h = bound.full(node)
            if cost + h > f:
                push(self.heap, (cost + h, entry[1], entry[2], _NODE) + entry[4:])
                return False
        return True

    def _expand(self, entry):
        """Queues every axis-local step from the entry's layout that improves on the best route
        to where it leads, and from src's placement every exchange into dst or a core."""
        _, _, _, _, cost, node, path, _ = entry
        bound, best, lengths, heap, push = self.bound, self.best, self.lengths, self.heap, heapq.heappush
        h = bound.full(node)
        at, codes = node
        space = self.spaces[at]
        length = len(path) + 1
        guard, goal, counter = self.guard, self.goal, self.counter
        for c, axis, new, step_kind, after in space.steps(codes):
            # most successors are no improvement, and build nothing
            nxt = (at, after)
            total = cost + c
            known = best.get(nxt, math.inf)
            if total < known - 1e-15 or (total <= known + 1e-15 and length < lengths[nxt]):
                if guard and nxt != goal and space.holds_full(after):
                    continue  # a full copy on the way: never (see the class)
                best[nxt], lengths[nxt] = total, length
                push(heap, (total + max(h - c, 0.0), length, next(counter), _GUESSED, total, nxt,
                            path + ((at, codes, axis, new, step_kind, after),), None))
        if at == 0 and P not in codes:
            for t, key in self.targets:
                if key != node:  # an exchange is one of the routes the node's bound covers
                    f2 = cost + max(h, bound.exchange_to(codes, t, key) + bound.full(key))
                    push(heap, (f2, length, next(counter), _EXCHANGE, cost, node, path, (t, key)))

    def _price_exchange(self, entry):
        """Queues an exchange again with the bound from its source."""
        f, _, _, _, cost, node, path, target = entry
        layout = self.spaces[0].layout(node[1])
        f2 = cost + self.bound.exchange_from(layout, target[0]) + self.bound.full(target[1])
        heapq.heappush(self.heap, (max(f, f2), len(path) + 1, next(self.counter), _EXCHANGE_FROM,
                                   cost, node, path, target))

    def _take_exchange(self, entry):
        """Builds an exchange that came first again, and reaches its target."""
        f, _, _, _, cost, node, path, target = entry
        step = exchange(self.spaces[0].layout(node[1]), target[0])
        c = step.cost()
        self._reach(target[1], cost + c, path + (step,), f - cost - c)

    def _reach(self, node, cost, path, inherited):
        if self.guard and node != self.goal and self.spaces[node[0]].holds_full(node[1]):
            return
        known = self.best.get(node, math.inf)
        # ties (within rounding) go to the shorter route
        if cost < known - 1e-15 or (cost <= known + 1e-15 and len(path) < self.lengths[node]):
            self.best[node], self.lengths[node] = cost, len(path)
            heapq.heappush(self.heap, (cost + max(inherited, 0.0), len(path), next(self.counter),
                                       _GUESSED, cost, node, path, None))


def _core_keys(space, target: tuple, at: int) -> list:
    """exchange.cores of ``target`` as (layout, key) pairs, in the same order."""
    if P not in target:
        return []
    options = [(v,) if v != P else (B,) + tuple(range(len(space.shape))) for v in target]
    return [(space.layout(codes), (at, codes)) for codes in itertools.product(*options)]


def _steps_of(spaces, path) -> tuple[Step, ...]:
    return tuple(entry if isinstance(entry, Step) else spaces[entry[0]].step(*entry[1:])
                 for entry in path)


__all__ = ["Search", "check", "cost_above", "plan"]
