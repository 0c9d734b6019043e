"""The candidate table of the signature choice: per placement axis the rows of a rule that can
stand there, and every candidate of their product (one row per axis) with its facts and a
bound on its cost, as arrays over them all (docs/planner.md, "Choosing a signature").

Pure: no torch.distributed, no rank.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from ...errors import GlobalTensorError
from ...layout import Layout, trusted
from ...plan import candidate_terms, code, cost, fewest_collectives
from ...sbp import PartialSum, SbpValue, Split
from ..rules import KEEP, Rule


def partial_count(outs, grid) -> int:
    """How many (output, axis) entries of a candidate's results are partial sums: each is a
    reduction still owed, priced at one α in a candidate's cost (choose.py,
    ``_candidate_cost``); between candidates of equal cost, the one leaving fewer wins (with an
    input's resolved form already at hand, e.g. an RMSNorm's input gathered for its variance,
    paying it now costs nothing)."""
    return sum(1 for out in outs for a, v in enumerate(out)
               if isinstance(v, PartialSum) and grid[a] > 1)  # P on one rank is its value



def costing_nothing(options, layouts, grid, free=()) -> list:
    """The rows of ``options`` that could stand in a candidate of cost 0: a candidate costs 0
    only if every input's target is its own layout or one of its free layouts (anything else
    is a move, and moving a non-empty input on an axis of more than one rank costs something:
    every step writes memory, every exchange is a message), so where a candidate that moves
    nothing exists (cost 0), only rows giving each non-empty input, on each such axis, its own
    sbp or that of one of its free layouts can be part of the answer."""
    sizes = [layout.numel() for layout in layouts]
    kept = []
    for axis, (opts, n) in enumerate(zip(options, grid)):
        if n == 1:
            kept.append(opts)
            continue
        allowed = [None if not size else
                   {layout.sbp[axis]} | {f.sbp[axis] for f in (free[i] if free else ())}
                   for i, (layout, size) in enumerate(zip(layouts, sizes))]
        kept.append([o for o in opts if all(ok is None or r in ok for r, ok in zip(o[3], allowed))])
    return kept



def axis_options(rule: Rule, layouts, naxes: int, fixed, free) -> list:
    """Per placement axis, (index, row, sbp per input, resolved sbp per input) for the rows
    that can stand on it: none asks an input to become P unless another input is P there (a
    pending reduction deferred: the input is zero-filled into a P, docs/planner.md "Deferred
    reductions") or a free layout of it is P there; none splits a dim it lacks, or changes a
    fixed input (or, for an in-place op, its result). A row's values are checked and resolved once for all axes (all but KEEP, which
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
        if any(isinstance(o, PartialSum) for o in own):  # a reduction is pending: may wait
            can_be_p = -1  # (any input may join it, as a local zero-fill)
        else:
            can_be_p = sum(1 << i for i, f in enumerate(free or ())
                           if any(isinstance(g.sbp[axis], PartialSum) for g in f))
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


class Table:
    """Every candidate of ``options`` (one option per axis; candidate ``index`` is its place in
    product order, the last axis fastest), with, as arrays over them all: its bound, the
    partial-sum entries of its results (as :func:`partial_count` counts them) and the inputs it
    changes, all worked out from per-axis facts; ``order`` lists the candidates by
    (bound, partial sums, inputs changed, index), leaving out those mixing two kernels.

    The bound, per input, is the planner's (plan._Bound) with one collective per axis that
    needs one (or one exchange, two messages only where pieces overlap three or more:
    :func:`candidate_terms`): α per collective, the memory of one step per changed axis, and β
    for the elements that must move. :meth:`refined` puts in the planner's count of
    collectives (plan.fewest_collectives: nested splits' round trips, an exchange's messages
    rank by rank) for a candidate that comes first. A lone candidate gets no bound (0): it
    is costed whatever its bound."""

    __slots__ = ("options", "layouts", "counts", "bound", "partials", "changed", "order",
                 "collectives", "rest")

    def __init__(self, options, layouts, itemsizes, free, grid):
        self.options, self.layouts = options, layouts
        self.counts = counts = tuple(len(opts) for opts in options)
        size = math.prod(counts)
        if size == 1:
            kernels = {o[1].kernel for opts in options for o in opts if o[1].kernel}
            self.order = [0] if len(kernels) <= 1 else []
            self.bound, self.partials, self.changed = [0.0], [0], [0]
            self.collectives, self.rest = [[0]] * len(layouts), [[0.0]] * len(layouts)
            return
        picks = np.indices(counts).reshape(len(counts), -1)  # per axis, each candidate's option
        # per axis, per option: each input's target code, the inputs it changes, how many
        # results it has, which are partial sums, the kernel it names (0: none)
        kernels = sorted({o[1].kernel for opts in options for o in opts if o[1].kernel})
        most = max(len(o[1].outs) for opts in options for o in opts)
        facts = []
        for a, opts in enumerate(options):
            own = [layout.sbp[a] for layout in layouts]
            rows = [[code(v) for v in o[3]]
                    + [sum(1 << i for i, (r, w) in enumerate(zip(o[3], own)) if r != w),
                       len(o[1].outs),
                       1 + kernels.index(o[1].kernel) if o[1].kernel else 0]
                    + [grid[a] > 1 and (len(o[1].outs) == 1 or k < len(o[1].outs)) and isinstance(
                        o[1].outs[k if len(o[1].outs) > 1 else 0], PartialSum) for k in range(most)]
                    for o in opts]
            facts.append(np.array(rows, dtype=np.int64).T[:, picks[a]])
        facts = np.stack(facts)  # (axis, fact, candidate)
        m = len(layouts)
        self.collectives, self.rest = [], []
        bound = np.zeros(size)
        for i, (layout, n) in enumerate(zip(layouts, itemsizes)):
            collectives, rest = candidate_terms(layout, n, free[i] if free else (), facts[:, i])
            bound += cost.ALPHA * collectives + rest
            self.collectives.append(collectives.tolist())
            self.rest.append(rest.tolist())
        bound *= 1 - 1e-9
        mask = np.bitwise_or.reduce(facts[:, m], axis=0)
        changed = sum((mask >> i) & 1 for i in range(m))
        outs = facts[:, m + 1].max(axis=0)  # a row of one result stands for all of them
        partials = sum(np.where(k < outs, facts[:, m + 3 + k].sum(axis=0), 0) for k in range(most))
        bound += cost.ALPHA * partials * (1 - 1e-9)  # each partial sum: a reduction owed (choose.py)
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
        total = cost.ALPHA * self.partials[index]
        for layout, collectives, rest, sbp in zip(self.layouts, self.collectives, self.rest, resolved):
            if collectives[index]:
                total += cost.ALPHA * fewest_collectives(layout, sbp)
            total += rest[index]
        return total * (1 - 1e-9)


def candidates(rule: Rule, n_in: int, grid):
    for combo in itertools.product(rule.rows, repeat=len(grid)):
        kernels = {r.kernel for r in combo if r.kernel}
        if len(kernels) > 1:
            continue
        yield combo, (kernels.pop() if kernels else None)



def outs_of(combo) -> tuple[tuple[SbpValue, ...], ...]:
    n = max(len(r.outs) for r in combo)
    return tuple(tuple(r.outs[k if len(r.outs) > 1 else 0] for r in combo) for k in range(n))


def resolved_layouts(layouts, resolved) -> tuple[Layout, ...]:
    """:func:`target_layouts` for sbps already resolved and checked per axis (dims in range): the
    same layouts, without checking them again."""
    return tuple(layout if sbp == layout.sbp else trusted(layout.placement, sbp, layout.shape)
                 for layout, sbp in zip(layouts, resolved))


def target_layouts(layouts, ins):
    out = []
    for layout, sbp in zip(layouts, ins):
        try:
            out.append(layout if sbp == layout.sbp else layout.with_sbp(sbp))
        except GlobalTensorError:
            return None
    return tuple(out)



__all__ = ["Table", "candidates", "costing_nothing", "axis_options", "outs_of", "partial_count",
           "resolved_layouts", "target_layouts"]
