"""Redistribution plans: how to turn one layout of a logical tensor into another.

``plan(src, dst)`` returns a :class:`Plan`, a tuple of frozen step values, each of which knows
the layout before and after it, so an executor runs a plan with no search of its own::

    >>> p = placement("cpu", ranks=[0, 1])
    >>> print(plan(Layout(p, (split(0),), (4, 5)), Layout(p, (broadcast,), (4, 5))).describe(4))
    (S(0),) -> (B,)  on placement('cpu', ranks=[0, 1])  shape [4, 5]
      1. all_gather      axis 0  dim 0          sends 40 B per rank
    total: 40 B per rank, 1 collective

Pure: no torch.distributed, no rank. Plans depend only on (src, dst) and the cost figures in use
(``cost.current()``: the defaults, or those ``gt.set_costs`` / the start-up probe set, which
clear every cache) and are cached. This
module only re-exports; one file per part (docs/architecture.md, docs/planner.md):
steps · reorder · cost · codes · ranges · space · messages · moves · traffic · exchange · bound · search ·
reference ·
oracle (a plan run over every rank's full set of pieces in one process: the tests' and
``gt.verify``'s oracle, imported on its own: ``from globaltensor.plan import oracle``).
"""
from .bound import candidate_terms, fewest_collectives, lower_bound, move_bounds
from .codes import code
from . import cost
from .cost import DEFAULT, SEARCH_ITEMSIZE, Costs
from .exchange import exchange
from .ranges import most_overlaps
from .reference import reference_plan
from .reorder import Reorder, reorder_piece
from .search import cost_above, plan
from .steps import (AllGather, AllGatherV, AllReduce, AllToAll, Exchange, LocalSlice, Move, Plan,
                    ReduceScatter, Step, ZeroFill, holds_full)

__all__ = ["DEFAULT", "SEARCH_ITEMSIZE", "AllGather", "AllGatherV", "Costs",
           "AllReduce", "AllToAll", "Exchange", "LocalSlice", "Move", "Plan", "ReduceScatter",
           "Reorder", "Step", "reorder_piece", "ZeroFill", "candidate_terms", "code", "cost", "cost_above", "exchange",
           "fewest_collectives", "holds_full", "lower_bound", "most_overlaps", "move_bounds",
           "plan", "reference_plan"]
