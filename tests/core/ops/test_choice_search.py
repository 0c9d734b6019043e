"""The signature choice's branch and bound (issue 14) against the exhaustive loop it replaced
(ops.choose.reference_choose): with no tolerance the same Choice (targets, outputs, kernel,
cost), with the default one a candidate at most TOLERANCE dearer, on a seeded sample of calls,
input layouts, item sizes, gradients, free layouts and in-place ops, on grids [2], [2, 2],
[1, 2], [2, 3] and [2, 2, 2]. Pure: one process, no ranks."""
import random

import numpy as np
import pytest

import globaltensor as gt
from globaltensor.layout import Layout
from globaltensor.ops import Call, Ref, choose
from globaltensor.ops.choice.choose import reference_choose

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
POINTWISE = frozenset({"pointwise"})
CALLS = [
    (Call("mm.default", ((8, 6), (6, 10)), (Ref(0), Ref(1))), False),
    (Call("mm.default", ((1024, 512), (512, 2048)), (Ref(0), Ref(1))), False),
    (Call("add.Tensor", ((8, 6), (8, 6)), (Ref(0), Ref(1)), (), POINTWISE), False),
    (Call("add.Tensor", ((8, 6), (6,)), (Ref(0), Ref(1)), (), POINTWISE), False),
    (Call("mul.Tensor", ((5, 7), (5, 7)), (Ref(0), Ref(1)), (), POINTWISE), False),
    (Call("bmm.default", ((4, 6, 8), (4, 8, 2)), (Ref(0), Ref(1))), False),
    (Call("sum.dim_IntList", ((8, 6),), (Ref(0), (1,), True)), False),
    (Call("view.default", ((4, 6),), (Ref(0), (24,))), False),
    (Call("view.default", ((4, 6),), (Ref(0), (2, 2, 6))), False),
    (Call("add_.Tensor", ((8, 6), (8, 6)), (Ref(0), Ref(1)), (), POINTWISE | {"inplace"}), True),
    # rows with local kernels, several results
    (Call("embedding.default", ((50, 8), (4, 6)), (Ref(0), Ref(1))), False),
    (Call("nll_loss_forward.default", ((8, 5), (8,)), (Ref(0), Ref(1), None, 1, -100)), False),
    (Call("_embedding_bag.default", ((50, 8), (12,), (4,)), (Ref(0), Ref(1), Ref(2), False, 0)),
     False),
    (Call("max.dim", ((8, 6),), (Ref(0), 1, False)), False),
    # a rule that states its work (Rule.work): the stay shortcut is off, the work share counts
    (Call("_scaled_dot_product_flash_attention_for_cpu.default",
          ((2, 4, 512, 8), (2, 4, 512, 8), (2, 4, 512, 8)),
          (Ref(0), Ref(1), Ref(2), 0.0, True)), False),
    (Call("_scaled_dot_product_flash_attention_for_cpu_backward.default",
          ((2, 4, 64, 8),) * 5 + ((2, 4, 64),),
          (Ref(0), Ref(1), Ref(2), Ref(3), Ref(4), Ref(5), 0.0, True)), False),
]
GRIDS = {"[2]": [0, 1], "[2,2]": [[0, 1], [2, 3]], "[1,2]": [[0, 1]], "[2,3]": [[0, 1, 2], [3, 4, 5]],
         "[2,2,2]": np.arange(8).reshape(2, 2, 2).tolist()}


def _random_layout(rng, placement, shape):
    values = [S(d) for d in range(len(shape))] + [B, P]
    return Layout(placement, tuple(rng.choice(values) for _ in range(placement.ndim)), shape)


def _sample(grid):
    """Seeded calls on ``grid``: (call, layouts, itemsizes, fixed, grads, free)."""
    rng = random.Random(grid)
    placement = gt.placement("cpu", GRIDS[grid])
    for call, inplace in CALLS:
        heavy = "attention" in call.op  # (3 or 6 inputs: many candidates, each planned)
        if heavy and grid not in ("[2]", "[2,2]"):
            continue
        for _ in range((12 if placement.ndim < 3 else 6) // (4 if heavy else 1)):
            layouts = tuple(_random_layout(rng, placement, s) for s in call.shapes)
            itemsizes = tuple(rng.choice([2, 4, 8]) for _ in layouts)
            grads = tuple(rng.random() < 0.5 for _ in layouts) if rng.random() < 0.6 else ()
            free = ()
            if rng.random() < 0.3:
                free = tuple(frozenset({_random_layout(rng, placement, l.shape)})
                             if rng.random() < 0.5 else frozenset() for l in layouts)
            yield call, layouts, itemsizes, (0,) if inplace else (), grads, free


# the 3-D grid's exhaustive loops take seconds each: -m slow (the tolerance test below walks it)
SLOW_3D = pytest.param("[2,2,2]", marks=pytest.mark.slow)


@pytest.mark.parametrize("grid", [g for g in GRIDS if g != "[2,2,2]"] + [SLOW_3D])
def test_choice_is_the_one_the_exhaustive_loop_picks(grid):
    # with no tolerance, the branch and bound must land on the exhaustive loop's very choice
    checked = 0
    for call, layouts, itemsizes, fixed, grads, free in _sample(grid):
        new = choose(call, layouts, itemsizes, fixed=fixed, grads=grads, free=free, tolerance=0.0)
        ref = reference_choose(call, layouts, itemsizes, fixed=fixed, grads=grads, free=free)
        assert new == ref, (call.op, layouts, grads, free)
        checked += new is not None
    assert checked > 40


def test_choice_within_the_tolerance_costs_at_most_that_much_more():
    # by default a candidate is not costed further once its bound is within TOLERANCE of the
    # best: the choice is a real candidate, its cost is its own, and no candidate is cheaper
    # by more than TOLERANCE; the exact cheapest is still the answer wherever the rest is
    # clearly dearer
    from globaltensor.ops.choice.choose import TOLERANCE, _candidate_cost, _own
    from globaltensor.ops.registry import rows_for
    from globaltensor.plan import cost
    checked, same, dearer = 0, 0, 0
    for grid in GRIDS:
        for call, layouts, itemsizes, fixed, grads, free in _sample(grid):
            new = choose(call, layouts, itemsizes, fixed=fixed, grads=grads, free=free)
            ref = reference_choose(call, layouts, itemsizes, fixed=fixed, grads=grads, free=free)
            assert (new is None) == (ref is None), (call.op, layouts)
            if new is None:
                continue
            checked += 1
            own = _candidate_cost(layouts, new.ins, itemsizes, new.outs, grads, free,
                                  _own(rows_for(call), new.ins, itemsizes, new.outs, grads))
            assert new.cost == pytest.approx(own, rel=1e-12, abs=1e-15), (call.op, layouts)
            assert ref.cost * (1 - 1e-9) <= new.cost <= ref.cost + TOLERANCE * cost.ALPHA, (call.op, layouts)
            same += new == ref
            dearer += new.cost > ref.cost
    assert checked > 250 and same > 0.9 * checked and dearer > 0


@pytest.mark.parametrize("grid", ["[2,2]", "[2,3]", SLOW_3D])
def test_the_candidate_table_holds_each_candidates_facts_and_a_bound_below_its_cost(grid):
    # candidates.Table works out every candidate's facts as arrays over the whole product; each
    # must equal what the candidate itself says (its results' partial sums, the inputs it
    # changes, one kernel at most), and its bound must stay below the candidate's cost
    from globaltensor.ops.choice.candidates import (Table as _Table, axis_options as _options,
                                                    outs_of, partial_count as _partials,
                                                    target_layouts as _targets)
    from globaltensor.ops.choice.choose import _candidate_cost
    from globaltensor.ops.registry import rows_for
    rng = random.Random("table" + grid)
    placement = gt.placement("cpu", GRIDS[grid])
    mesh = placement.shape
    checked = 0
    for call, _ in CALLS:
        rule = rows_for(call)
        for _ in range(3):
            layouts = tuple(_random_layout(rng, placement, s) for s in call.shapes)
            itemsizes = tuple(rng.choice([2, 4, 8]) for _ in layouts)
            grads = tuple(rng.random() < 0.5 for _ in layouts)
            options = _options(rule, layouts, len(mesh), (), ())
            if not all(options):
                continue
            table = _Table(options, layouts, itemsizes, (), mesh)
            listed = set(int(i) for i in table.order)
            size = int(np.prod([len(o) for o in options]))
            for index in range(size):
                combo, resolved = table.candidate(index)
                rows = tuple(r for _, r, _, _ in combo)
                kernels = {r.kernel for r in rows if r.kernel}
                assert (index in listed) == (len(kernels) <= 1), (call.op, index)
                if index not in listed or size == 1:
                    continue
                outs = outs_of(rows)
                assert table.partials[index] == _partials(outs, mesh)
                assert table.changed[index] == sum(
                    1 for layout, sbp in zip(layouts, resolved) if layout.sbp != sbp)
                targets = _targets(layouts, resolved)
                cost = _candidate_cost(layouts, targets, itemsizes, outs, grads, ())
                refined = table.refined(index, resolved)  # (summed in another order: rounding)
                assert table.bound[index] <= refined * (1 + 1e-12) and refined <= cost, (call.op, index)
                checked += 1
            keys = [(table.bound[i], table.partials[i], table.changed[i], i) for i in table.order]
            assert keys == sorted(keys)
    assert checked > 100
