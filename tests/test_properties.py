"""Property-based tests over random shapes, grids, placements and sbps.

1. A layout covers the tensor exactly once per replica, with the uneven, nested split rule.
2. Every plan preserves the logical value in the simulator, and never holds the whole tensor
   on a rank on its way unless an end does.
3. Plans executed on real gloo (thread-ranks) give every rank exactly the simulator's piece.

Bounded (max_examples, small sizes) so the file runs in seconds on two shared cores.
"""
import math

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import globaltensor as gt
from globaltensor import simulate
from globaltensor.layout import Layout
from globaltensor.plan import holds_full, plan
from globaltensor.sbp import Split
from globaltensor.tensor import redistribute_local
from globaltensor.testing import run_ranks

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
PURE = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
GLOO = settings(max_examples=6, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# --- strategies ------------------------------------------------------------------------------------

shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)


@st.composite
def grids(draw, max_size: int):
    """A grid shape of 1 to 3 axes with at most ``max_size`` cells."""
    grid, size = [], 1
    for _ in range(draw(st.integers(1, 3))):
        n = draw(st.integers(1, max(1, min(4, max_size // size))))
        grid.append(n)
        size *= n
    return tuple(grid)


@st.composite
def placements(draw, world: int):
    """Any grid of distinct ranks of a world, in any order."""
    grid = draw(grids(world))
    ranks = draw(st.permutations(range(world)))[:math.prod(grid)]
    return gt.placement("cpu", np.array(ranks, dtype=np.int64).reshape(grid))


def sbp_values(tensor_ndim: int):
    choices = [st.just(B), st.just(P)]
    if tensor_ndim:
        choices.append(st.integers(-tensor_ndim, tensor_ndim - 1).map(S))
    return st.one_of(*choices)


@st.composite
def layouts(draw, world: int, shape=None, placement=None):
    placement = placement if placement is not None else draw(placements(world))
    shape = shape if shape is not None else draw(shapes)
    sbp = tuple(draw(sbp_values(len(shape))) for _ in range(placement.ndim))
    return Layout(placement, sbp, shape)


@st.composite
def conversions(draw, world: int):
    """(src, dst): one shape; half the time one placement, otherwise any two of the world."""
    src = draw(layouts(world))
    same = draw(st.booleans())
    dst = draw(layouts(world, shape=src.shape, placement=src.placement if same else None))
    return src, dst


def _value(shape, dtype=torch.float64, seed=0) -> torch.Tensor:
    """Small integers: sums are exact in every dtype and order."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-9, 10, shape, generator=gen).to(dtype)


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
    full = _value(src.shape, dtype)
    pieces = simulate.scatter(full, src, world_size=6)
    out = simulate.run(plan(src, dst), pieces)
    for rank in range(6):
        assert tuple(out[rank].shape) == dst.local_shape_of_rank(rank)
    assert torch.equal(simulate.gather(out, dst), full)


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


# --- 3. real gloo agrees with the simulator ------------------------------------------------------------

WORLD = 4


@GLOO
@given(st.lists(st.tuples(conversions(world=WORLD),
                          st.sampled_from([torch.float64, torch.float32, torch.int64])),
                min_size=6, max_size=10))
def test_executed_plans_agree_with_the_simulator(cases):
    inputs, expected = [], []
    for seed, ((src, dst), dtype) in enumerate(cases):
        pieces = simulate.scatter(_value(src.shape, dtype, seed), src, world_size=WORLD)
        inputs.append(pieces)
        expected.append(simulate.run(plan(src, dst), pieces))

    def body(rank):
        out = []
        for ((src, dst), _), pieces in zip(cases, inputs):
            local = pieces[rank].clone()
            got = redistribute_local(local, src, dst)
            out.append((got, torch.equal(local, pieces[rank])))
        return out

    results = run_ranks(body, WORLD, timeout=60)
    for i, ((src, dst), _) in enumerate(cases):
        for rank in range(WORLD):
            got, input_intact = results[rank][i]
            want = expected[i][rank]
            assert input_intact, f"rank {rank} changed its input piece: {src!r} -> {dst!r}"
            assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (src, dst)
            assert torch.equal(got, want), f"rank {rank}: {src!r} -> {dst!r}\n{plan(src, dst)}"
