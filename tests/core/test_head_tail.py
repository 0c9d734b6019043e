"""The head-tail split (``S(d, head_tail)``), in one process: which positions each rank holds,
and every plan into, out of and between such layouts preserving the value in the oracle
(docs/long_context.md, "Head-tail")."""
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import globaltensor as gt
from globaltensor.errors import SbpError
from globaltensor.layout import Layout, head_tail_order, head_tail_ranges, split_sizes
from globaltensor.plan import Reorder, oracle, plan

from helpers import placements, sbp_values, shapes, small_ints

S, B, P = gt.sbp.S, gt.sbp.broadcast, gt.sbp.partial_sum
HT = "head_tail"
PURE = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.mark.parametrize("n,k", [(16, 4), (13, 4), (3, 4), (0, 2), (7, 1), (250, 4), (9, 3)])
def test_each_rank_holds_its_head_and_tail_chunks(n, k):
    order = head_tail_order(n, k)
    assert sorted(order) == list(range(n))  # every position once
    sizes = split_sizes(n, k)
    for i in range(k):
        (a, b), (c, d) = head_tail_ranges(n, k, i)
        assert (b - a) + (d - c) == sizes[i]  # the uneven rule's piece size
        assert b - a == (sizes[i] + 1) // 2  # the head: the first half, rounded up
        assert a == sum((s + 1) // 2 for s in sizes[:i])  # heads in rank order from the start
        assert d == n - sum(s // 2 for s in sizes[:i])  # tails in reverse order from the end
    if n % (2 * k) == 0:  # even chunks: chunk i and chunk 2k-1-i
        c = n // (2 * k)
        assert [head_tail_ranges(n, k, i) for i in range(k)] == [
            ((i * c, (i + 1) * c), ((2 * k - 1 - i) * c, (2 * k - i) * c)) for i in range(k)]


def test_causal_work_is_balanced():
    """Rows at position p see p + 1 keys: a plain split of 4,096 over 4 gives rank 3 seven times
    rank 0's work (7/16 of it); head-tail gives each rank the same (gt.attention_balance)."""
    line = gt.placement("cpu", [0, 1, 2, 3])
    plain = gt.attention_balance(Layout(line, (S(2),), (1, 8, 4096, 64)))
    flops = [plain.flops[r] for r in range(4)]
    assert flops[3] / flops[0] == pytest.approx(7.0, rel=0.01)
    assert flops[3] / sum(flops) == pytest.approx(7 / 16, rel=0.01)
    assert plain.ratio == pytest.approx(1.75, rel=0.01)
    assert sum(flops) == pytest.approx(4.0 * 8 * 64 * 4096 * 4097 / 2)  # the whole causal work
    balanced = gt.attention_balance(Layout(line, (S(2, HT),), (1, 8, 4096, 64)))
    assert balanced.ratio == pytest.approx(1.0, abs=1e-3) and "1.00x the mean" in str(balanced)
    full = gt.attention_balance(Layout(line, (S(2),), (1, 8, 4096, 64)), causal=False)
    assert full.ratio == 1.0  # without a mask every row sees every key
    with pytest.raises(gt.GlobalTensorError, match="expects the queries"):
        gt.attention_balance(torch.ones(3))


def test_str_codes_and_plain():
    ht = S(1, HT)
    assert str(ht) == "S(1, head_tail)" and ht != S(1) and ht.plain == S(1)
    assert gt.sbp.from_codes(gt.sbp.to_codes((ht, S(0), B, P))) == (ht, S(0), B, P)
    layout = Layout(gt.placement("cpu", [0, 1]), (S(-1, HT),), (2, 6))
    assert layout.sbp == (ht,) and layout.order == ((1, 2),)
    assert layout.plain().sbp == (S(1),) and layout.local_shape((0,)) == (2, 3)
    assert layout.ranges((0,)) == (((0, 2),), ((0, 2), (5, 6)))


def test_bad_balances_are_clear_errors():
    with pytest.raises(SbpError, match="expects one of \\['head_tail'\\]"):
        S(0, "zigzag")
    grid = gt.placement("cpu", [[0, 1], [2, 3]])
    with pytest.raises(SbpError, match="no other placement axis splitting dim 0"):
        Layout(grid, (S(0), S(0, HT)), (8, 2))
    with pytest.raises(gt.GlobalTensorError, match="Layout.ranges"):
        Layout(grid, (S(0, HT), B), (8, 2)).box((0, 0))


@st.composite
def balanced_layouts(draw, world: int, shape=None, placement=None):
    """Layouts whose splits are head-tail about half the time (where the rule allows one)."""
    placement = placement if placement is not None else draw(placements(world))
    shape = shape if shape is not None else draw(shapes)
    sbp = [draw(sbp_values(len(shape))).resolve(max(len(shape), 1)) if shape else B
           for _ in range(placement.ndim)]
    sbp = [S(v.dim, HT) if isinstance(v, type(S(0))) and draw(st.booleans()) else v for v in sbp]
    try:
        return Layout(placement, tuple(sbp), shape)
    except SbpError:
        assume(False)


@st.composite
def balanced_conversions(draw, world: int):
    src = draw(balanced_layouts(world))
    same = draw(st.booleans())
    dst = draw(balanced_layouts(world, shape=src.shape, placement=src.placement if same else None))
    return src, dst


@PURE
@given(balanced_layouts(world=8))
def test_a_head_tail_layout_covers_the_tensor_once_per_replica(layout):
    replicas: dict = {}
    for coord in layout.placement.coords():
        key = tuple(c for a, c in enumerate(coord) if not isinstance(layout.sbp[a], type(S(0))))
        replicas.setdefault(key, []).append(layout.ranges(coord))
        assert layout.local_shape(coord) == tuple(
            sum(b - a for a, b in dim) for dim in layout.ranges(coord))
    if not layout.shape:
        return
    for pieces in replicas.values():
        count = torch.zeros(layout.shape, dtype=torch.int64)
        for ranges in pieces:
            index = [torch.cat([torch.arange(a, b) for a, b in dim]) for dim in ranges]
            count[torch.meshgrid(*index, indexing="ij")] += 1
        assert bool((count == 1).all())


@PURE
@given(balanced_conversions(world=6), st.sampled_from([torch.float64, torch.int64]))
def test_every_plan_with_head_tail_preserves_the_value(case, dtype):
    src, dst = case
    full = small_ints(src.shape, dtype)
    pieces = oracle.scatter(full, src, world_size=6)
    for rank, coord in zip(src.placement.flat_ranks, src.placement.coords()):
        if not src.is_partial:  # a piece holds its ranges' values, in their order
            index = [torch.cat([torch.arange(a, b) for a, b in dim]) for dim in src.ranges(coord)]
            if full.ndim:
                assert torch.equal(pieces[rank], full[torch.meshgrid(*index, indexing="ij")])
    found = plan(src, dst)
    out = oracle.run(found, pieces)
    for rank in range(6):
        assert tuple(out[rank].shape) == dst.local_shape_of_rank(rank)
    assert torch.equal(oracle.gather(out, dst), full)
    if src.order == dst.order:  # one order: the plain layouts' plan, no reorder
        assert not any(isinstance(s, Reorder) for s in found.steps)


def test_plans_pick_the_cheapest_way_round():
    line = gt.placement("cpu", [0, 1, 2, 3])
    big = (1, 4096, 1024)  # a long sequence's hidden states: two all_to_alls through S(2)
    ht, plain = Layout(line, (S(1, HT),), big), Layout(line, (S(1),), big)
    assert [s.kind for s in plan(ht, plain).steps] == ["all_to_all", "reorder", "all_to_all"]
    small = (1, 64, 32)  # a few KiB: one gather (one α) is cheaper
    ht, plain = Layout(line, (S(1, HT),), small), Layout(line, (S(1),), small)
    assert [s.kind for s in plan(ht, plain).steps] == ["all_gather", "reorder", "local slice"]
    assert [s.kind for s in plan(Layout(line, (B,), (1, 64, 32)), ht).steps] == [
        "reorder", "local slice"]


def test_an_exchange_between_placements_keeps_a_head_tail_order():
    """A pipeline's stages hand activations over by point-to-point exchanges: head-tail splits
    over as many ranks on both sides move their pieces as they are; two orders are refused."""
    from globaltensor.plan import exchange
    first, second = gt.placement("cpu", [0, 1]), gt.placement("cpu", [2, 3])
    src, dst = Layout(first, (S(1, HT),), (2, 9)), Layout(second, (S(1, HT),), (2, 9))
    full = small_ints((2, 9))
    out = oracle.run(plan(src, dst), oracle.scatter(full, src, world_size=4))
    assert torch.equal(oracle.gather(out, dst), full)
    step = exchange(src, dst)
    assert step.before == src.plain() and step.after == dst.plain()
    with pytest.raises(gt.GlobalTensorError, match="head-tail splits of one order"):
        exchange(src, Layout(second, (S(1),), (2, 9)))
