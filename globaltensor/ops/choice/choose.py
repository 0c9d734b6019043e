"""The choice of a signature: candidates over the grid, costed by the moves they need.

On an n-D grid a candidate is one row per placement axis (the product of a rule's rows with
themselves). :func:`choose` costs each candidate by the redistribution its inputs need
(``plan(src, dst).cost``), plus the move each input's gradient will then need in backward, and
returns the cheapest as a :class:`Choice`. It does not plan every candidate: rows are filtered
per axis, candidates are ordered by cheap lower bounds and planned only while a bound can still
beat the best (branch and bound, docs/planner.md); :func:`reference_choose` is the exhaustive
loop it replaced, kept as the tests' oracle.

Pure: no torch.distributed, no rank.
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

from ...errors import GlobalTensorError
from ...layout import Layout
from ...plan import cost, cost_above, lower_bound, plan
from ...sbp import Broadcast, PartialSum, SbpValue, Split
from .balanced import with_balanced
from .backward import backward_cost, backward_move, with_sbp
from .candidates import (Table, axis_options, candidates, costing_nothing, outs_of, partial_count,
                         resolved_layouts, target_layouts)
from ..rules import KEEP, Call, Rule
from ..registry import rows_for


@dataclass(frozen=True, slots=True)
class Choice:
    """The signature chosen for a call: target input layouts and the outputs' sbp tuples."""

    ins: tuple[Layout, ...]
    outs: tuple[tuple[SbpValue, ...], ...]
    kernel: str | None
    cost: float


def _move_cost(src: Layout, dst: Layout, itemsize: int, pending=frozenset()) -> float:
    """Estimated time to turn ``src`` into ``dst``; infinite when it would invent a P on an
    axis not in ``pending`` (where no input of the call is P). Where one is, B or S into P is
    a local zero-fill that defers the reduction already pending (docs/planner.md)."""
    if src == dst:
        return 0.0
    for a, v in enumerate(dst.sbp):
        if isinstance(v, PartialSum) and not isinstance(src.sbp[a], PartialSum) and a not in pending:
            return math.inf
    return plan(src, dst).cost(itemsize)


# what ``choose(..., stay_or_moves=True)`` returns when the cheapest candidate moves an input
MOVES = object()


# How much dearer than the cheapest candidate a choice may be, in α (0.01 α: 100 ns at the default
# figures): a candidate whose bound is within this of the best found is not costed further, like
# a branch-and-bound solver's optimality gap. Exact ties still go by the keys below.
TOLERANCE = 0.01


def choose(call: Call, layouts: tuple[Layout, ...], itemsizes: tuple[int, ...],
           fixed: tuple[int, ...] = (), grads: tuple[bool, ...] = (),
           free: tuple = (), stay_or_moves: bool = False,
           tolerance: float | None = None) -> Choice | None:
    """The cheapest signature for ``call`` on inputs laid out as ``layouts``, to within
    ``tolerance`` seconds (None: :data:`TOLERANCE` α of the figures in use; 0: the exact
    cheapest, as :func:`reference_choose`).

    ``fixed``: inputs that must keep their layout (the ``self`` of an in-place op, whose result
    must then have that layout too). ``grads``: per input, whether it will receive a gradient
    (it requires grad and grad mode is on): moving such an input also costs the move its
    gradient will need in backward (:func:`backward_cost`). ``free``: per input, layouts it is
    already available in at no cost (pieces moved earlier and remembered). Returns None
    when the op has no rule or no candidate fits (dispatch then falls back to broadcast inputs).
    Ties go to the candidate that changes fewest inputs, then to the earlier row.

    ``stay_or_moves``: the caller only needs the answer if it moves no input (dispatch decides
    a call that moves inputs again, with its gradients and free layouts): when no candidate
    keeps every input (so the cheapest moves one), :data:`MOVES` is returned without costing
    any candidate.
    """
    rule = rows_for(call)
    if rule is None or not layouts:
        return None
    if tolerance is None:
        tolerance = TOLERANCE * cost.ALPHA
    return _choose(rule, call, tuple(layouts), tuple(itemsizes), tuple(fixed), tuple(grads),
                   tuple(free), stay_or_moves, tolerance)


def _choose(rule: Rule, call: Call, layouts, itemsizes, fixed, grads=(), free=(),
            stay_or_moves=False, tolerance=0.0) -> Choice | None:
    """Branch and bound over the candidates (one row per placement axis, DESIGN.md's product).

    Rows that cannot stand on an axis are dropped per axis (an input asked to become P, a split
    of a dim the input lacks, a fixed input or result changed); each remaining candidate gets a
    bound on its cost worked out per axis, for all at once (:class:`Table`), and candidates are
    costed in the order of their bounds: first a finer bound (``plan.lower_bound``), then the
    plans themselves, until the next bound cannot beat the best found (by more than
    ``tolerance``, save for a candidate that would win an exact tie). With ``tolerance`` 0 the
    result is the candidate the exhaustive loop (:func:`reference_choose`) picks: the least
    (cost, partial-sum results, inputs changed, rows in product order); otherwise one whose
    cost is at most ``tolerance`` above that one's."""
    for r in rule.rows:
        if len(r.ins) != len(layouts):
            raise GlobalTensorError(
                f"internal: a rule for {call.op} gave rows for {len(r.ins)} inputs, the "
                f"call has {len(layouts)} global tensor inputs; please report this")
    grid = layouts[0].placement.shape
    options = axis_options(rule, layouts, len(grid), fixed, free)
    options, rule = with_balanced(rule, layouts, options, grid, fixed, free)
    # a candidate that moves nothing costs 0 and wins, unless the rule weighs its work: then
    # keeping inputs as they are may mean computing the whole op on every rank
    stay = None if rule.work or rule.sends else _stay(rule, call, layouts, options)
    if stay is not None and (not partial_count(stay.outs, grid)
                             or not any(math.prod(l.shape) for l in layouts)):
        # (one leaving partial sums may tie with one that resolves them: search; but where the
        # inputs hold no element every move is free, and resolving would only change the
        # layout an empty tensor reports: (P, S(1)) * 2 stays (P, S(1)))
        return stay
    if stay is None and stay_or_moves and not any(free):
        return MOVES if _first(rule, call, layouts, options) is not None else None
    if stay is not None:
        options = costing_nothing(options, layouts, grid, free)
    if not all(options):
        return None  # some axis has no row that can stand there
    table = Table(options, layouts, itemsizes, free, grid)
    return _branch_and_bound(rule, call, layouts, itemsizes, grads, free, tolerance, table)


def _branch_and_bound(rule, call, layouts, itemsizes, grads, free, tolerance, table):
    """The candidates of ``table`` in the order of their bounds, each costed further only while
    it can still beat the best found (see :func:`_choose`). An entry is (bound, partial sums,
    inputs changed, index, terms, combo, resolved): terms -1 for the table's bound, 0 for the
    refined one, else the parts of its cost (:func:`_terms`), costed one by one."""
    heap, taken = [], 0
    best, best_key = None, None
    while True:
        entry, taken = _next_entry(table, heap, taken)
        if entry is None:
            break
        bound, partials, changed, index = entry[:4]
        limit = None
        if best_key is not None:
            if (bound, partials, changed, index) >= best_key:
                break
            if (partials, changed, index) < best_key[1:]:
                limit = best_key[0]  # it would win an exact tie: costed up to the best itself
            else:  # it must beat the best by more than the tolerance
                limit = best_key[0] - tolerance
                if bound >= limit:
                    continue
        found = _cost_further(rule, call, layouts, itemsizes, grads, free, table, entry, limit,
                              heap)
        if found is None:
            continue  # not a candidate, or queued again with a higher bound
        cost, targets, outs, rows = found
        key = (cost, partials, changed, index)
        if best_key is None or key < best_key:
            kernels = {r.kernel for r in rows if r.kernel}
            best, best_key = Choice(targets, outs, kernels.pop() if kernels else None, cost), key
    return best


def _next_entry(table, heap, taken):
    """The next candidate: the table's next in order, or one queued again (the heap) if it
    comes first; and the count of the table's taken."""
    order = table.order
    if taken < len(order):
        index = int(order[taken])
        first = (table.bound[index], table.partials[index], table.changed[index], index)
        if heap and heap[0][:4] < first:
            return heapq.heappop(heap), taken
        return first + (-1, None, None), taken + 1  # -1: the table's bound
    if heap:
        return heapq.heappop(heap), taken
    return None, taken


def _cost_further(rule, call, layouts, itemsizes, grads, free, table, entry, limit, heap):
    """One more stage of an entry's cost: (cost, targets, outs, rows) once every part is
    exact, or None (not a candidate, or queued again on ``heap`` with the bound found)."""
    bound, partials, changed, index, terms, combo, resolved = entry
    if combo is None:
        combo, resolved = table.candidate(index)
    if terms == -1:  # first the per-axis bound with the planner's count of collectives
        refined = table.refined(index, resolved)
        if refined > bound:
            heapq.heappush(heap, (refined, partials, changed, index, 0, combo, resolved))
            return None
        terms = 0  # 0: no term yet
    rows = tuple(r for _, r, _, _ in combo)
    outs = outs_of(rows)
    targets = resolved_layouts(layouts, resolved)
    if terms == 0:  # first time first: is it a candidate at all, and a finer bound
        grid = layouts[0].placement.shape
        if rule.check is not None and not rule.check(
                call, grid, tuple(zip(*(values for _, _, values, _ in combo))), outs):
            return None
        terms = _terms(layouts, targets, itemsizes, outs, grads, free,
                       _own(rule, targets, itemsizes, outs, grads))
    else:  # then the plans, the largest bound first: one may be enough to rule it out
        terms = _exact_one(terms, layouts, targets, itemsizes, outs, limit)
    if any(not exact for _, exact, _, _ in terms):
        total = sum(value for value, _, _, _ in terms) * (1 - 1e-9)
        heapq.heappush(heap, (max(bound, total), partials, changed, index, terms, combo, resolved))
        return None
    return (_candidate_cost(layouts, targets, itemsizes, outs, grads, free,
                            _own(rule, targets, itemsizes, outs, grads)), targets,
            outs, rows)




def _stay(rule: Rule, call: Call, layouts, options) -> Choice | None:
    """The first candidate (in product order) that moves no input, if there is one: it costs
    0 and changes nothing, so no other candidate comes before it (the common case, decided
    without costing anything)."""
    own = [tuple(layout.sbp[axis] for layout in layouts) for axis in range(len(options))]
    return _first(rule, call, layouts, [[o for o in opts if o[3] == own[axis]]
                                        for axis, opts in enumerate(options)])


def _first(rule: Rule, call: Call, layouts, options) -> Choice | None:
    """The first candidate (in product order) of ``options`` that the rule accepts, with cost 0
    (for :func:`_stay`), or None."""
    grid = layouts[0].placement.shape
    for combo in itertools.product(*options):
        rows = tuple(r for _, r, _, _ in combo)
        kernels = {r.kernel for r in rows if r.kernel}
        if len(kernels) > 1:
            continue
        ins = tuple(zip(*(values for _, _, values, _ in combo)))
        outs = outs_of(rows)
        if rule.check is not None and not rule.check(call, grid, ins, outs):
            continue
        targets = target_layouts(layouts, ins)
        if targets is not None:
            return Choice(targets, outs, kernels.pop() if kernels else None, 0.0)
    return None



def _terms(layouts, targets, itemsizes, outs, grads, free, own=0.0) -> tuple:
    """The parts of a candidate's cost, each as (bound, exact?, input, backward?): the moves
    its inputs need (the planner's bound, or 0 for a free layout) and, for inputs that will
    get a gradient, the move that gradient needs in backward; and, exact from the start, one α
    per partial sum the results leave and the op's ``own`` seconds (:func:`_own`; input -1)."""
    grid = layouts[0].placement.shape
    owed = cost.ALPHA * partial_count(outs, grid) + own
    terms = [(owed, True, -1, False)] if owed else []
    for i, (src, dst, n) in enumerate(zip(layouts, targets, itemsizes)):
        if src == dst:
            continue
        if not (free and dst in free[i]):
            terms.append((lower_bound(src, dst, n), False, i, False))
        if grads and grads[i]:
            grad, wanted = backward_move(src, dst, outs)
            bound = lower_bound(grad, with_sbp(grad, wanted), n) if wanted != grad.sbp else 0.0
            terms.append((bound, wanted == grad.sbp, i, True))
    return tuple(sorted(terms, key=lambda t: -t[0]))


def _exact_one(terms, layouts, targets, itemsizes, outs, best=None):
    """``terms`` with the first (largest) inexact one costed: exactly,
    or, when it alone would lift the candidate's cost above ``best`` (the best cost found so
    far), maybe only to a bound that does (the planner's search stops there)."""
    k = next(k for k, (_, exact, _, _) in enumerate(terms) if not exact)
    _, _, i, backward = terms[k]
    src, dst, n = layouts[i], targets[i], itemsizes[i]
    limit = math.inf
    if best is not None:
        limit = (best - sum(value for j, (value, _, _, _) in enumerate(terms) if j != k)) * (1 + 1e-9)
        if limit <= terms[k][0]:  # no room left above its bound (an exact tie): a stopped
            limit = math.inf      # search would answer that bound again, so cost it exactly
    if backward:
        grad, wanted = backward_move(src, dst, outs)
        cost, exact = (0.0, True) if wanted == grad.sbp else cost_above(
            grad, with_sbp(grad, wanted), limit, n)
    else:
        cost, exact = cost_above(src, dst, limit, n)
    return terms[:k] + ((cost, exact, i, backward),) + terms[k + 1:]



def reference_choose(call: Call, layouts, itemsizes, fixed=(), grads=(), free=()) -> Choice | None:
    """The exhaustive choice this module replaced (issue 14), kept as the test oracle: every
    candidate of the product of rows over axes, each planned."""
    rule = rows_for(call)
    if rule is None or not layouts:
        return None
    layouts = tuple(layouts)
    grid = layouts[0].placement.shape
    best, best_key = None, None
    for order, (combo, kernel) in enumerate(candidates(rule, len(layouts), grid)):
        if any(len(r.ins) != len(layouts) for r in combo):
            raise GlobalTensorError(
                f"internal: a rule for {call.op} gave rows for {len(combo[0].ins)} inputs, the "
                f"call has {len(layouts)} global tensor inputs; please report this")
        ins = tuple(tuple(layouts[i].sbp[a] if r.ins[i] is KEEP else r.ins[i]
                          for a, r in enumerate(combo)) for i in range(len(layouts)))
        outs = outs_of(combo)
        if rule.check is not None and not rule.check(call, grid, ins, outs):
            continue
        targets = target_layouts(layouts, ins)
        if targets is None or any(targets[i] != layouts[i] for i in fixed):
            continue
        if fixed and outs[0] != layouts[fixed[0]].sbp:
            continue  # an in-place result must land in self's own layout
        cost = _candidate_cost(layouts, targets, itemsizes, outs, grads, free,
                               _own(rule, targets, itemsizes, outs, grads))
        if math.isinf(cost):
            continue
        key = (cost, partial_count(outs, grid), sum(1 for s, t in zip(layouts, targets) if s != t),
               order)
        if best_key is None or key < best_key:
            best, best_key = Choice(targets, outs, kernel, cost), key
    return best



def _own(rule: Rule, targets, itemsizes, outs, grads) -> float:
    """The candidate's own seconds beside its moves: this rank's share of the op's work
    (``Rule.work``) and what its kernel sends (``Rule.sends``: ring attention's shifts), the
    part sent while the kernel computes counting only where it outlasts the compute."""
    grid = targets[0].placement.shape if targets else ()
    seconds = _work_share(rule.work, outs, grid, targets[0] if targets else None)
    if rule.sends is not None and targets:
        (m, b), (m2, b2) = rule.sends(targets, itemsizes, grads)
        hidden = cost.ALPHA * m + cost.BETA * b
        seconds = max(seconds, hidden) + cost.ALPHA * m2 + cost.BETA * b2
    return seconds


def _work_share(work: float, outs, grid, first=None) -> float:
    """Seconds of the op's ``work`` (flops) one rank computes: the whole over the ranks along
    the axes its first output is split or partial on, or, where its first input's target
    ``first`` is split, that input's largest piece's share of it (a dim of 1 split over 4
    ranks leaves one rank all the work)."""
    if not work:
        return 0.0
    share = math.prod(n for n, v in zip(grid, outs[0]) if not isinstance(v, Broadcast))
    if first is not None and first.numel() and any(isinstance(v, Split) for v in first.sbp):
        share = min(share, first.numel() / first.max_local_numel())
    return work * cost.FLOP / share


def _candidate_cost(layouts, targets, itemsizes, outs, grads, free, own=0.0) -> float:
    """The moves the candidate's inputs need (and their gradients' in backward), plus one α per
    partial sum it leaves in its results: a reduction owed is at least one collective whenever
    it is paid, so keeping a sum partial is not free. It is what makes the choice follow the
    cost figures where a kept partial sum competes with a reduction now (a row-parallel
    weight's gradient: gather the weight and keep the activation's gradient partial, or
    all-reduce that gradient as Megatron does; the first where α is small)."""
    grid = layouts[0].placement.shape if layouts else ()
    total = cost.ALPHA * partial_count(outs, grid) + own if layouts else 0.0
    pending = frozenset(a for layout in layouts for a, v in enumerate(layout.sbp)
                        if isinstance(v, PartialSum))
    for i, (src, dst, n) in enumerate(zip(layouts, targets, itemsizes)):
        if src == dst:
            continue
        if not (free and dst in free[i]):
            total += _move_cost(src, dst, n, pending)
        if grads and grads[i]:
            total += backward_cost(src, dst, outs, n)
    return total


__all__ = ["MOVES", "TOLERANCE", "Choice", "choose", "reference_choose"]
