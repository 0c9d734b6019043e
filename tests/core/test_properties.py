"""Property-based tests over random shapes, grids, placements and sbps (the strategies are in
helpers).

1. A layout covers the tensor exactly once per replica, with the uneven, nested split rule.
2. Every plan preserves the logical value in the simulator, and never holds the whole tensor
   on a rank on its way unless an end does.
3. Plans executed on real gloo (thread-ranks) give every rank exactly the simulator's piece:
   tests/ranks/test_properties_ranks.py.

Bounded (max_examples, small sizes) so the file runs in seconds on two shared cores.
"""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import globaltensor as gt
from globaltensor.plan import oracle
from globaltensor.layout import Layout
from globaltensor.plan import plan
from globaltensor.plan import holds_full
from globaltensor.sbp import Split

from helpers import conversions, layouts, small_ints

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
PURE = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])

# --- 1. layouts ---------------------------------------------------------------------------------------


def _expected_box(layout: Layout, coord) -> tuple:
    """The box by the rule, recomputed independently: axes split in order, axis 0 outermost;
    k pieces of n: n // k each, the first n % k one more."""
    box = [[0, n] for n in layout.shape]
    for axis, value in enumerate(layout.sbp):
        if isinstance(value, Split):
            lo, hi = box[value.dim]
            k, i = layout.placement.shape[axis], coord[axis]
            q, r = divmod(hi - lo, k)
            start = lo + i * q + min(i, r)
            box[value.dim] = [start, start + q + (1 if i < r else 0)]
    return tuple(tuple(b) for b in box)


@PURE
@given(layouts(world=8))
def test_layout_covers_the_tensor_exactly_once_per_replica(layout):
    replicas: dict = {}
    for coord in layout.placement.coords():
        assert layout.box(coord) == _expected_box(layout, coord)
        assert layout.local_shape(coord) == tuple(b - a for a, b in _expected_box(layout, coord))
        # a replica: one coordinate on every broadcast / partial axis; its split axes tile
        key = tuple(c for a, c in enumerate(coord) if not isinstance(layout.sbp[a], Split))
        replicas.setdefault(key, []).append(layout.box(coord))
    for boxes in replicas.values():
        count = torch.zeros(layout.shape, dtype=torch.int64)
        for box in boxes:
            count[tuple(slice(a, b) for a, b in box)] += 1
        assert bool((count == 1).all())
    outside = max(layout.placement.flat_ranks) + 1
    assert layout.local_shape_of_rank(outside) == (0,) * layout.ndim


@PURE
@given(layouts(world=8))
def test_split_minus_one_is_the_last_dim(layout):
    values = tuple(S(v.dim - layout.ndim) if isinstance(v, Split) else v for v in layout.sbp)
    assert Layout(layout.placement, values, layout.shape) == layout


# --- 2. plans in the simulator ----------------------------------------------------------------------


@PURE
@given(conversions(world=6), st.sampled_from([torch.float64, torch.int64]))
def test_every_plan_preserves_the_value_in_the_simulator(case, dtype):
    src, dst = case
    full = small_ints(src.shape, dtype)
    pieces = oracle.scatter(full, src, world_size=6)
    out = oracle.run(plan(src, dst), pieces)
    for rank in range(6):
        assert tuple(out[rank].shape) == dst.local_shape_of_rank(rank)
    assert torch.equal(oracle.gather(out, dst), full)


@PURE
@given(conversions(world=6))
def test_plans_never_hold_the_whole_tensor_unless_an_end_does(case):
    src, dst = case
    if holds_full(src) or holds_full(dst):
        return
    for step in plan(src, dst).steps:
        assert not holds_full(step.after), (str(plan(src, dst)), step)


@PURE
@given(conversions(world=6))
def test_plans_are_values_of_their_layouts(case):
    src, dst = case
    again = (Layout(src.placement, src.sbp, src.shape), Layout(dst.placement, dst.sbp, dst.shape))
    assert plan(*again) is plan(src, dst)
    if src == dst:
        assert plan(src, dst).steps == ()
