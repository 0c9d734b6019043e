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

import numpy as np

from ..errors import GlobalTensorError
from ..layout import Layout, _trusted
from ..plan import _most_overlaps, code as _code, cost_above, fewest_collectives, lower_bound, plan
from ..sbp import Broadcast, PartialSum, SbpValue, Split
from ..steps import ALPHA, BETA, MEMORY
from .signature import KEEP, B, P, Call, Rule, rows_for


@dataclass(frozen=True, slots=True)
class Choice:
    """The signature chosen for a call: target input layouts and the outputs' sbp tuples."""

    ins: tuple[Layout, ...]
    outs: tuple[tuple[SbpValue, ...], ...]
    kernel: str | None
    cost: float


def _move_cost(src: Layout, dst: Layout, itemsize: int) -> float:
    """Estimated time to turn ``src`` into ``dst``; infinite when it would invent a P."""
    if src == dst:
        return 0.0
    for a, v in enumerate(dst.sbp):
        if isinstance(v, PartialSum) and not isinstance(src.sbp[a], PartialSum):
            return math.inf
    return plan(src, dst).cost(itemsize)


# what ``choose(..., stay_or_moves=True)`` returns when the cheapest candidate moves an input
MOVES = object()


# How much dearer than the cheapest candidate a choice may be (modelled seconds, 0.01 α = 100 ns):
# a candidate whose bound is within this of the best found is not costed further, like a
# branch-and-bound solver's optimality gap. Exact ties still go by the keys below.
TOLERANCE = 0.01 * ALPHA


def choose(call: Call, layouts: tuple[Layout, ...], itemsizes: tuple[int, ...],
           fixed: tuple[int, ...] = (), grads: tuple[bool, ...] = (),
           free: tuple = (), stay_or_moves: bool = False,
           tolerance: float = TOLERANCE) -> Choice | None:
    """The cheapest signature for ``call`` on inputs laid out as ``layouts``, to within
    ``tolerance`` (:data:`TOLERANCE`; 0: the exact cheapest, as :func:`reference_choose`).

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
    return _choose(rule, call, tuple(layouts), tuple(itemsizes), tuple(fixed), tuple(grads),
                   tuple(free), stay_or_moves, tolerance)


def _choose(rule: Rule, call: Call, layouts, itemsizes, fixed, grads=(), free=(),
            stay_or_moves=False, tolerance=0.0) -> Choice | None:
    """Branch and bound over the candidates (one row per placement axis, DESIGN.md's product).

    Rows that cannot stand on an axis are dropped per axis (an input asked to become P, a split
    of a dim the input lacks, a fixed input or result changed); each remaining candidate gets a
    bound on its cost worked out per axis, for all at once (:class:`_Table`), and candidates are
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
    mesh = layouts[0].placement.shape
    options = _options(rule, layouts, len(mesh), fixed, free)
    stay = _stay(rule, call, layouts, options)
    if stay is not None and not _partials(stay.outs, mesh):
        return stay  # (one leaving partial sums may tie with one that resolves them: search)
    if stay is None and stay_or_moves and not any(free):
        return MOVES if _first(rule, call, layouts, options) is not None else None
    if stay is not None:
        options = _costing_nothing(options, layouts, mesh, free)
    if not all(options):
        return None  # some axis has no row that can stand there
    table = _Table(options, layouts, itemsizes, free, mesh)
    order, heap, taken = table.order, [], 0
    best, best_key = None, None
    while True:  # the candidates in table order, merged with those queued again (the heap)
        if taken < len(order):
            index = int(order[taken])
            first = (table.bound[index], table.partials[index], table.changed[index], index)
            if heap and heap[0][:4] < first:
                entry = heapq.heappop(heap)
            else:
                taken += 1
                entry = first + (-1, None, None)  # -1: the table's bound
        elif heap:
            entry = heapq.heappop(heap)
        else:
            break
        bound, partials, changed, index, terms, combo, resolved = entry
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
        if combo is None:
            combo, resolved = table.candidate(index)
        if terms == -1:  # first the per-axis bound with the planner's count of collectives
            refined = table.refined(index, resolved)
            if refined > bound:
                heapq.heappush(heap, (refined, partials, changed, index, 0, combo, resolved))
                continue
            terms = 0  # 0: no term yet
        rows = tuple(r for _, r, _, _ in combo)
        outs = outs_of(rows)
        targets = _resolved_targets(layouts, resolved)
        if terms == 0:  # first time first: is it a candidate at all, and a finer bound
            if rule.check is not None and not rule.check(
                    call, mesh, tuple(zip(*(values for _, _, values, _ in combo))), outs):
                continue
            terms = _terms(layouts, targets, itemsizes, outs, grads, free)
        else:  # then the plans, the largest bound first: one may be enough to rule it out
            terms = _exact_one(terms, layouts, targets, itemsizes, outs, limit)
        if terms is None:
            continue  # a move that would invent a partial sum
        if any(not exact for _, exact, _, _ in terms):
            total = sum(value for value, _, _, _ in terms) * (1 - 1e-9)
            heapq.heappush(heap, (max(bound, total), partials, changed, index, terms, combo,
                                  resolved))
            continue
        cost = _candidate_cost(layouts, targets, itemsizes, outs, grads, free)
        key = (cost, partials, changed, index)
        if best_key is None or key < best_key:
            kernels = {r.kernel for r in rows if r.kernel}
            best, best_key = Choice(targets, outs, kernels.pop() if kernels else None, cost), key
    return best


def _partials(outs, mesh) -> int:
    """How many (output, axis) entries of a candidate's results are partial sums: between
    candidates of equal cost, the one leaving fewer partial sums wins (a partial sum is a
    reduction still owed; with an input's resolved form already at hand, e.g. an RMSNorm's
    input gathered for its variance, paying it now costs nothing)."""
    return sum(1 for out in outs for a, v in enumerate(out)
               if isinstance(v, PartialSum) and mesh[a] > 1)  # P on one rank is its value


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
    mesh = layouts[0].placement.shape
    for combo in itertools.product(*options):
        rows = tuple(r for _, r, _, _ in combo)
        kernels = {r.kernel for r in rows if r.kernel}
        if len(kernels) > 1:
            continue
        ins = tuple(zip(*(values for _, _, values, _ in combo)))
        outs = outs_of(rows)
        if rule.check is not None and not rule.check(call, mesh, ins, outs):
            continue
        targets = _targets(layouts, ins)
        if targets is not None:
            return Choice(targets, outs, kernels.pop() if kernels else None, 0.0)
    return None


def _costing_nothing(options, layouts, mesh, free=()) -> list:
    """The rows of ``options`` that could stand in a candidate of cost 0: a candidate costs 0
    only if every input's target is its own layout or one of its free layouts (anything else
    is a move, and moving a non-empty input on an axis of more than one rank costs something:
    every step writes memory, every exchange is a message), so where a candidate that moves
    nothing exists (cost 0), only rows giving each non-empty input, on each such axis, its own
    sbp or that of one of its free layouts can be part of the answer."""
    sizes = [layout.numel() for layout in layouts]
    kept = []
    for axis, (opts, n) in enumerate(zip(options, mesh)):
        if n == 1:
            kept.append(opts)
            continue
        allowed = [None if not size else
                   {layout.sbp[axis]} | {f.sbp[axis] for f in (free[i] if free else ())}
                   for i, (layout, size) in enumerate(zip(layouts, sizes))]
        kept.append([o for o in opts if all(ok is None or r in ok for r, ok in zip(o[3], allowed))])
    return kept


def _terms(layouts, targets, itemsizes, outs, grads, free) -> tuple:
    """The parts of a candidate's cost, each as (bound, exact?, input, backward?): the moves
    its inputs need (the planner's bound, or 0 for a free layout) and, for inputs that will
    get a gradient, the move that gradient needs in backward."""
    terms = []
    for i, (src, dst, n) in enumerate(zip(layouts, targets, itemsizes)):
        if src == dst:
            continue
        if not (free and dst in free[i]):
            terms.append((lower_bound(src, dst, n), False, i, False))
        if grads and grads[i]:
            grad, wanted = _backward_move(src, dst, outs)
            bound = lower_bound(grad, _with(grad, wanted), n) if wanted != grad.sbp else 0.0
            terms.append((bound, wanted == grad.sbp, i, True))
    return tuple(sorted(terms, key=lambda t: -t[0]))


def _exact_one(terms, layouts, targets, itemsizes, outs, best=None):
    """``terms`` with the first (largest) inexact one costed (None: it is infinite): exactly,
    or, when it alone would lift the candidate's cost above ``best`` (the best cost found so
    far), maybe only to a bound that does (the planner's search stops there)."""
    k = next(k for k, (_, exact, _, _) in enumerate(terms) if not exact)
    _, _, i, backward = terms[k]
    src, dst, n = layouts[i], targets[i], itemsizes[i]
    limit = math.inf
    if best is not None:
        limit = (best - sum(value for j, (value, _, _, _) in enumerate(terms) if j != k)) * (1 + 1e-9)
    if backward:
        grad, wanted = _backward_move(src, dst, outs)
        cost, exact = (0.0, True) if wanted == grad.sbp else cost_above(
            grad, _with(grad, wanted), limit, n)
    elif any(isinstance(v, PartialSum) and not isinstance(src.sbp[a], PartialSum)
             for a, v in enumerate(dst.sbp)):
        return None  # it would invent a partial sum
    else:
        cost, exact = cost_above(src, dst, limit, n)
    return terms[:k] + ((cost, exact, i, backward),) + terms[k + 1:]


def _options(rule: Rule, layouts, naxes: int, fixed, free) -> list:
    """Per placement axis, (index, row, sbp per input, resolved sbp per input) for the rows
    that can stand on it: none asks an input to become P (unless a free layout of it is P
    there), splits a dim it lacks, or changes a fixed input (or, for an in-place op, its
    result). A row's values are checked and resolved once for all axes (all but KEEP, which
    stands for each axis' own value)."""
    ndims = [layout.ndim for layout in layouts]
    prepared = []  # (index, row, values, resolved, inputs asked to be P, KEEP inputs)
    for index, row in enumerate(rule.rows):
        values, resolved, partial, keeps = [], [], 0, []
        for i, (v, ndim) in enumerate(zip(row.ins, ndims)):
            if v is KEEP:
                keeps.append(i)
                r = None
            elif isinstance(v, Split):
                if not -ndim <= v.dim < ndim:
                    break  # a split of a dim the input lacks
                r = Split(v.dim % ndim) if v.dim < 0 else v
            else:
                r = v
                if isinstance(v, PartialSum):
                    partial |= 1 << i
            values.append(v)
            resolved.append(r)
        else:
            prepared.append((index, row, tuple(values), tuple(resolved), partial, keeps))
    per_axis = []
    for axis in range(naxes):
        own = tuple(layout.sbp[axis] for layout in layouts)
        can_be_p = sum(1 << i for i, o in enumerate(own) if isinstance(o, PartialSum) or bool(free)
                       and any(isinstance(f.sbp[axis], PartialSum) for f in free[i]))
        result = layouts[fixed[0]].sbp[axis] if fixed else None
        options = []
        for index, row, values, resolved, partial, keeps in prepared:
            if partial & ~can_be_p or fixed and row.outs[0] != result:
                continue
            if keeps:  # KEEP stands for the axis' own value
                values, resolved = list(values), list(resolved)
                for i in keeps:
                    values[i] = resolved[i] = own[i]
                values, resolved = tuple(values), tuple(resolved)
            if fixed and any(resolved[i] != own[i] for i in fixed):
                continue
            options.append((index, row, values, resolved))
        per_axis.append(options)
    return per_axis


class _Table:
    """Every candidate of ``options`` (one option per axis; candidate ``index`` is its place in
    product order, the last axis fastest), with, as arrays over them all: its bound, the
    partial-sum entries of its results (as :func:`_partials` counts them) and the inputs it
    changes, all worked out from per-axis facts; ``order`` lists the candidates by
    (bound, partial sums, inputs changed, index), leaving out those mixing two kernels.

    The bound, per input, is the planner's (plan._Bound) with one collective per axis that
    needs one (or one exchange, two messages only where pieces overlap three or more:
    :func:`_quick_terms`): α per collective, the memory of one step per changed axis, and β
    for the elements that must move. :meth:`refined` puts in the planner's count of
    collectives (plan.fewest_collectives: nested splits' round trips, an exchange's messages
    rank by rank) for a candidate that comes first. A lone candidate gets no bound (0): it
    is costed whatever its bound."""

    __slots__ = ("options", "layouts", "counts", "bound", "partials", "changed", "order",
                 "collectives", "rest")

    def __init__(self, options, layouts, itemsizes, free, mesh):
        self.options, self.layouts = options, layouts
        self.counts = counts = tuple(len(opts) for opts in options)
        size = math.prod(counts)
        if size == 1:
            kernels = {o[1].kernel for opts in options for o in opts if o[1].kernel}
            self.order = [0] if len(kernels) <= 1 else []
            self.bound, self.partials, self.changed = [0.0], [0], [0]
            self.collectives, self.rest = [[0]] * len(layouts), [[0.0]] * len(layouts)
            return
        grid = np.indices(counts).reshape(len(counts), -1)  # per axis, each candidate's option
        # per axis, per option: each input's target code, the inputs it changes, how many
        # results it has, which are partial sums, the kernel it names (0: none)
        kernels = sorted({o[1].kernel for opts in options for o in opts if o[1].kernel})
        most = max(len(o[1].outs) for opts in options for o in opts)
        facts = []
        for a, opts in enumerate(options):
            own = [layout.sbp[a] for layout in layouts]
            rows = [[_code(v) for v in o[3]]
                    + [sum(1 << i for i, (r, w) in enumerate(zip(o[3], own)) if r != w),
                       len(o[1].outs),
                       1 + kernels.index(o[1].kernel) if o[1].kernel else 0]
                    + [mesh[a] > 1 and (len(o[1].outs) == 1 or k < len(o[1].outs)) and isinstance(
                        o[1].outs[k if len(o[1].outs) > 1 else 0], PartialSum) for k in range(most)]
                    for o in opts]
            facts.append(np.array(rows, dtype=np.int64).T[:, grid[a]])
        facts = np.stack(facts)  # (axis, fact, candidate)
        m = len(layouts)
        self.collectives, self.rest = [], []
        bound = np.zeros(size)
        for i, (layout, n) in enumerate(zip(layouts, itemsizes)):
            collectives, rest = _quick_terms(layout, n, free[i] if free else (), facts[:, i])
            bound += ALPHA * collectives + rest
            self.collectives.append(collectives.tolist())
            self.rest.append(rest.tolist())
        bound *= 1 - 1e-9
        mask = np.bitwise_or.reduce(facts[:, m], axis=0)
        changed = sum((mask >> i) & 1 for i in range(m))
        outs = facts[:, m + 1].max(axis=0)  # a row of one result stands for all of them
        partials = sum(np.where(k < outs, facts[:, m + 3 + k].sum(axis=0), 0) for k in range(most))
        index = np.arange(size)
        if kernels:  # at most one kernel per candidate
            named = facts[:, m + 2]
            lowest = np.where(named > 0, named, len(kernels) + 1).min(axis=0)
            index = index[(lowest > len(kernels)) | (lowest == named.max(axis=0))]
        self.order = index[np.lexsort((index, changed[index], partials[index], bound[index]))]
        self.bound, self.partials, self.changed = bound.tolist(), partials.tolist(), changed.tolist()

    def candidate(self, index: int) -> tuple:
        """(the option of each axis, each input's resolved target sbp) of candidate ``index``."""
        combo = []
        for opts, count in zip(reversed(self.options), reversed(self.counts)):
            index, k = divmod(index, count)
            combo.append(opts[k])
        combo.reverse()
        return tuple(combo), tuple(zip(*(values for _, _, _, values in combo)))

    def refined(self, index: int, resolved) -> float:
        """The candidate's bound with the planner's count of collectives for each move."""
        total = 0.0
        for layout, collectives, rest, sbp in zip(self.layouts, self.collectives, self.rest, resolved):
            if collectives[index]:
                total += ALPHA * fewest_collectives(layout, sbp)
            total += rest[index]
        return total * (1 - 1e-9)


def move_bounds(layout: Layout, itemsize: int, sbp, free=()) -> tuple[float, float]:
    """The two bounds :class:`_Table` puts on moving ``layout`` to ``sbp`` (resolved): the
    first stage's and the refined one (with the planner's count of collectives)."""
    collectives, rest = _quick_terms(layout, itemsize, free,
                                     np.array([[_code(v)] for v in sbp], dtype=np.int64))
    collectives, rest = int(collectives[0]), float(rest[0])
    refined = ALPHA * fewest_collectives(layout, tuple(sbp)) if collectives else 0.0
    return (ALPHA * collectives + rest) * (1 - 1e-9), (refined + rest) * (1 - 1e-9)


def _quick_terms(layout: Layout, itemsize: int, free, codes) -> tuple:
    """(collectives, the memory and β terms) of the bound on moving ``layout`` to the target
    sbp of each candidate, ``codes`` holding the targets' codes (:func:`_code`), one row per
    axis: α per collective every plan needs on the axes that need one (the planner's count,
    plan.fewest_collectives, can be more), or one exchange after reducing every partial
    axis, two where some target piece overlaps three or more input pieces
    (plan._Space.one_message, without its rank-by-rank count; from a partial layout, into a
    non-partial target, the pieces the reductions leave with B there, the coarsest they can:
    plan._Space.after_reducing); the memory of one step per
    changed axis; β for the reductions a partial axis needs, or what the target's pieces
    lack (summed over ranks, a layout's pieces hold numel N / s elements, s the product of
    its split axes' sizes), or, to a non-partial target, both: R - 1 transfers to sum R
    summands and D - 1 to deliver to the D ranks that hold an element (docs/planner.md,
    "(c)"). Both 0 for a target that is the layout's own sbp or one of ``free``'s."""
    mesh = layout.placement.shape
    own = [_code(v) for v in layout.sbp]
    partial = [a for a, v in enumerate(own) if v == -2 and mesh[a] > 1]
    numel, ranks = layout.numel(), layout.placement.size
    smallest = numel / ranks
    big = [a for a, n in enumerate(mesh) if n > 1]
    w = codes[big]
    v = np.array([own[a] for a in big], dtype=np.int64)[:, None]
    n = np.array([mesh[a] for a in big], dtype=np.int64)[:, None]
    split, summed, from_p = w >= 0, w == -2, v == -2
    splits = np.where(split, n, 1).prod(axis=0)
    sums = np.where(summed, n, 1).prod(axis=0)
    changes = w != v
    steps = changes.sum(axis=0)  # from P, every change but to P is a reduction
    comm = (changes & (from_p | ((v >= 0) & ~summed))).sum(axis=0)  # from B: slices, zero-fills
    if partial:
        exchange = len(partial) + 1
        several = (comm > exchange) & (sums == 1)  # into a non-partial target, where it counts
        if several.any():  # the exchange after the reductions (plan._Space.after_reducing)
            exchange = np.where(several & (_overlap_products(layout, codes) > 2), exchange + 1,
                                exchange)
        reduce = math.prod(mesh[a] for a in partial)
        keep = np.where(from_p & summed, n, 1).prod(axis=0)
        kept = ~(from_p & ~summed).any(axis=0)  # every partial axis stays partial
        wanted = numel / (splits * sums)  # per rank, on average, the target's groups need
        elements = np.where(sums == 1, smallest * (reduce + ranks / splits - 2),
                            np.maximum(smallest * (reduce - keep), np.where(kept, 0.0, wanted)))
    else:
        exchange = np.ones_like(comm)
        several = comm > 1
        if several.any():  # some rank receives two messages (plan._Space.one_message)
            exchange = np.where(several & (_overlap_products(layout, codes) > 2), 2, 1)
        held = numel / math.prod(m for m, c in zip(mesh, own) if c >= 0)
        elements = np.maximum(numel / (splits * sums) - held, 0.0)
    collectives = np.minimum(comm, exchange)
    rest = itemsize * (MEMORY * smallest * np.minimum(steps, exchange) + BETA * elements)
    same = np.zeros(codes.shape[1], dtype=bool)
    for sbp in (layout.sbp,) + tuple(f.sbp for f in free):
        same |= (codes == np.array([_code(x) for x in sbp], dtype=np.int64)[:, None]).all(axis=0)
    return np.where(same, 0, collectives), np.where(same, 0.0, rest)


def _overlap_products(layout: Layout, codes) -> np.ndarray:
    """Per candidate, the most pieces of ``layout`` one piece of its target overlaps: the
    product over dims of plan._most_overlaps, each dim's from the axes splitting it (a
    bitmask of them, in axis order), worked out for the (dim, mask) pairs that occur."""
    mesh = layout.placement.shape
    mine = [()] * layout.ndim
    for v, n in zip(layout.sbp, mesh):
        if isinstance(v, Split) and n > 1:
            mine[v.dim] += (n,)
    axes = [a for a, n in enumerate(mesh) if n > 1]
    width = 1 << len(axes)
    weights = np.array([1 << k for k in range(len(axes))], dtype=np.int64)[:, None]
    dims = np.arange(layout.ndim, dtype=np.int64)[:, None, None]
    masks = ((codes[axes][None] == dims) * weights).sum(axis=1)  # (dim, candidate)
    keys = masks + np.arange(layout.ndim, dtype=np.int64)[:, None] * width
    table = np.ones(layout.ndim * width, dtype=np.int64)
    for key in np.flatnonzero(np.bincount(keys.ravel(), minlength=table.size)).tolist():
        d, m = divmod(key, width)
        if mine[d] or m:
            table[key] = _most_overlaps(layout.shape[d], mine[d],
                                        tuple(mesh[a] for k, a in enumerate(axes) if m >> k & 1))
    return table[keys].prod(axis=0)


def reference_choose(call: Call, layouts, itemsizes, fixed=(), grads=(), free=()) -> Choice | None:
    """The exhaustive choice this module replaced (issue 14), kept as the test oracle: every
    candidate of the product of rows over axes, each planned."""
    rule = rows_for(call)
    if rule is None or not layouts:
        return None
    layouts = tuple(layouts)
    mesh = layouts[0].placement.shape
    best, best_key = None, None
    for order, (combo, kernel) in enumerate(_candidates(rule, len(layouts), mesh)):
        if any(len(r.ins) != len(layouts) for r in combo):
            raise GlobalTensorError(
                f"internal: a rule for {call.op} gave rows for {len(combo[0].ins)} inputs, the "
                f"call has {len(layouts)} global tensor inputs; please report this")
        ins = tuple(tuple(layouts[i].sbp[a] if r.ins[i] is KEEP else r.ins[i]
                          for a, r in enumerate(combo)) for i in range(len(layouts)))
        outs = outs_of(combo)
        if rule.check is not None and not rule.check(call, mesh, ins, outs):
            continue
        targets = _targets(layouts, ins)
        if targets is None or any(targets[i] != layouts[i] for i in fixed):
            continue
        if fixed and outs[0] != layouts[fixed[0]].sbp:
            continue  # an in-place result must land in self's own layout
        cost = _candidate_cost(layouts, targets, itemsizes, outs, grads, free)
        if math.isinf(cost):
            continue
        key = (cost, _partials(outs, mesh), sum(1 for s, t in zip(layouts, targets) if s != t),
               order)
        if best_key is None or key < best_key:
            best, best_key = Choice(targets, outs, kernel, cost), key
    return best


def _candidates(rule: Rule, n_in: int, mesh):
    for combo in itertools.product(rule.rows, repeat=len(mesh)):
        kernels = {r.kernel for r in combo if r.kernel}
        if len(kernels) > 1:
            continue
        yield combo, (kernels.pop() if kernels else None)


def _candidate_cost(layouts, targets, itemsizes, outs, grads, free) -> float:
    cost = 0.0
    for i, (src, dst, n) in enumerate(zip(layouts, targets, itemsizes)):
        if src == dst:
            continue
        if not (free and dst in free[i]):
            cost += _move_cost(src, dst, n)
        if grads and grads[i]:
            cost += backward_cost(src, dst, outs, n)
    return cost


def grad_layout(dst: Layout, outs) -> Layout:
    """The layout the gradient of an input used as ``dst`` (by an op whose outputs have the
    sbp tuples ``outs``) is expected to arrive in: per axis, S(d) stays S(d) (an elementwise
    or batched backward keeps the split), P gives B (the gradient of a sum is the same on every
    term), and B stays B when every output is B on that axis (a replicated computation has a
    replicated gradient), otherwise becomes P (each rank's outputs contribute a part)."""
    values = []
    for a, v in enumerate(dst.sbp):
        if isinstance(v, PartialSum):
            values.append(B)
        elif isinstance(v, Broadcast):
            replicated = all(o[a] is None or isinstance(o[a], Broadcast) for o in outs)
            values.append(B if replicated else P)
        else:
            values.append(v)
    return _trusted(dst.placement, tuple(values), dst.shape)  # dst's own values, resolved


def backward_cost(src: Layout, dst: Layout, outs, itemsize: int) -> float:
    """What moving an input ``src -> dst`` in forward implies for backward: its gradient
    arrives in :func:`grad_layout` and its producer takes it in the dual of ``src`` (S stays S,
    P wants B; a B source accepts any layout, as partial sums or not). The cost of that plan
    (0 when the gradient already fits): P -> S(d) costs a gather in backward, P -> B nothing."""
    grad, wanted = _backward_move(src, dst, outs)
    if wanted == grad.sbp:
        return 0.0
    return plan(grad, grad.with_sbp(wanted)).cost(itemsize)


def _with(layout: Layout, sbp) -> Layout:
    """``layout.with_sbp(sbp)`` for resolved values of its own kind (no checks)."""
    return _trusted(layout.placement, tuple(sbp), layout.shape)


def _backward_move(src: Layout, dst: Layout, outs):
    """The gradient's layout and the sbp its producer takes it in (see :func:`backward_cost`)."""
    grad = grad_layout(dst, outs)
    wanted = tuple(g if isinstance(s, Broadcast) else (B if isinstance(s, PartialSum) else s)
                   for s, g in zip(src.sbp, grad.sbp))
    return grad, wanted


def outs_of(combo) -> tuple[tuple[SbpValue, ...], ...]:
    n = max(len(r.outs) for r in combo)
    return tuple(tuple(r.outs[k if len(r.outs) > 1 else 0] for r in combo) for k in range(n))


def _resolved_targets(layouts, resolved) -> tuple[Layout, ...]:
    """:func:`_targets` for sbps already resolved and checked per axis (dims in range): the
    same layouts, without checking them again."""
    return tuple(layout if sbp == layout.sbp else _trusted(layout.placement, sbp, layout.shape)
                 for layout, sbp in zip(layouts, resolved))


def _targets(layouts, ins):
    out = []
    for layout, sbp in zip(layouts, ins):
        try:
            out.append(layout if sbp == layout.sbp else layout.with_sbp(sbp))
        except GlobalTensorError:
            return None
    return tuple(out)


__all__ = ["MOVES", "Choice", "backward_cost", "choose", "grad_layout", "outs_of", "reference_choose"]
