"""The executor on real gloo (thread-ranks): every rank's result equals the simulator's (plans
without communication, and the choice of CPU path: tests/core/test_execute.py).

Many conversions run inside ONE world per grid to keep this fast.
"""
import itertools

import pytest
import torch

import globaltensor as gt
from globaltensor.plan import oracle
from globaltensor.runtime import execute
from globaltensor.layout import Layout
from globaltensor.plan import plan
from globaltensor.plan import AllGatherV
from globaltensor.testing import run_ranks

from helpers import full_of, random_cases

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
VALUES = [S(0), S(1), B, P]


def convert_all(rank, cases, world):
    """Run every case on this rank; check the input is untouched and the output fresh."""
    out = []
    for src, dst in cases:
        piece = oracle.scatter(full_of(src.shape), src, world)[rank]
        before = piece.clone()
        result = execute.run(plan(src, dst), piece, rank)
        assert torch.equal(piece, before), "the executor modified its input"
        if src != dst and piece.numel():
            assert result.untyped_storage().data_ptr() != piece.untyped_storage().data_ptr()
        assert result.is_contiguous()
        out.append(result)
    return out


def check_against_simulator(cases, world, timeout=60):
    results = run_ranks(convert_all, world, cases, world, timeout=timeout)
    for k, (src, dst) in enumerate(cases):
        expected = oracle.run(plan(src, dst), oracle.scatter(full_of(src.shape), src, world))
        for rank in range(world):
            got = results[rank][k]
            assert got.shape == expected[rank].shape and torch.equal(got, expected[rank]), (
                f"rank {rank}: {plan(src, dst).describe()}")
        assert torch.equal(oracle.gather([results[r][k] for r in range(world)], dst),
                           full_of(src.shape))


@pytest.fixture(params=["p2p", "gloo"])
def cpu_path(request, monkeypatch):
    """Both ways the executor runs gathers and reductions on CPU: point to point (the default)
    and gloo's own collectives (GT_CPU_COLLECTIVES=gloo, the code path NCCL takes)."""
    monkeypatch.setenv("GT_CPU_COLLECTIVES", request.param)  # read by each rank thread
    return request.param


def all_pairs(src_p, dst_p, shapes):
    return [(Layout(src_p, a, shape), Layout(dst_p, b, shape))
            for shape in shapes
            for a in itertools.product(VALUES, repeat=src_p.ndim)
            for b in itertools.product(VALUES, repeat=dst_p.ndim)]


@pytest.mark.parametrize("grid, world", [([0, 1], 2), ([0, 1, 2, 3], 4), ([[0, 1], [2, 3]], 4)])
def test_every_pair_on_a_grid_matches_the_simulator(grid, world, cpu_path):
    placement = gt.placement("cpu", grid)
    check_against_simulator(all_pairs(placement, placement, [(4, 4), (5, 7)]), world)


def test_ranks_outside_the_placement_take_part_in_group_creation(cpu_path):
    placement = gt.placement("cpu", [0, 2, 3])
    check_against_simulator(all_pairs(placement, placement, [(5, 7)]), 4)


@pytest.mark.parametrize("src, dst", [
    ([0, 1], [2, 3]), ([0, 1, 2], [1, 3]), ([0], [0, 1, 2, 3]), ([0, 1, 2, 3], [0]),
    ([[0, 1], [2, 3]], [0, 1, 2, 3]), ([0, 1, 2, 3], [[0, 1], [2, 3]]),
])
def test_placement_changes_match_the_simulator(src, dst):
    check_against_simulator(all_pairs(gt.placement("cpu", src), gt.placement("cpu", dst),
                                      [(4, 6), (5, 7)]), 4)


def test_other_dtypes_and_higher_rank_tensors(cpu_path):
    placement = gt.placement("cpu", [[0, 1], [2, 3]])
    cases = [(Layout(placement, (S(2), S(0)), (3, 5, 6)), Layout(placement, (S(1), B), (3, 5, 6))),
             (Layout(placement, (P, S(1)), (3, 5, 6)), Layout(placement, (S(2), S(2)), (3, 5, 6)))]

    def body(rank):
        out = []
        for src, dst in cases:
            full = torch.arange(90, dtype=torch.int64).reshape(3, 5, 6)
            piece = oracle.scatter(full, src, 4)[rank]
            out.append(execute.run(plan(src, dst), piece, rank))
        return out

    results = run_ranks(body, 4, timeout=60)
    for k, (src, dst) in enumerate(cases):
        got = oracle.gather([results[r][k] for r in range(4)], dst)
        assert got.dtype == torch.int64
        assert torch.equal(got, torch.arange(90).reshape(3, 5, 6))


def test_rank_order_on_the_axis_is_not_the_group_order(cpu_path):
    # torch numbers a group's members by global rank; the placement's order must win
    grid = gt.placement("cpu", [[3, 1], [0, 2]])
    line = gt.placement("cpu", [2, 0, 3, 1])
    check_against_simulator(all_pairs(grid, grid, [(5, 7)]) + all_pairs(line, line, [(5, 7)])
                            + all_pairs(line, grid, [(4, 6)]), 4)


def test_random_layouts_match_the_simulator(cpu_path):
    check_against_simulator(random_cases(seed=7, count=120, world=6), 6, timeout=120)


def test_exact_uneven_gathers_match_the_simulator():
    line = gt.placement("cpu", [2, 0, 3, 1])
    grid = gt.placement("cpu", [[3, 1], [0, 2]])
    three = gt.placement("cpu", [0, 2, 3])  # rank 1 is outside
    cases = [(Layout(line, (S(0),), (5, 3)), Layout(line, (B,), (5, 3))),
             (Layout(line, (S(1),), (3, 6)), Layout(line, (B,), (3, 6))),
             (Layout(line, (S(0),), (2, 3)), Layout(line, (B,), (2, 3))),  # two empty pieces
             (Layout(grid, (S(0), S(1)), (3, 5)), Layout(grid, (B, B), (3, 5))),
             (Layout(three, (S(0),), (4, 2)), Layout(three, (B,), (4, 2)))]
    for src, dst in cases:
        assert any(isinstance(s, AllGatherV) for s in plan(src, dst).steps), plan(src, dst)
    check_against_simulator(cases, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.bool])
def test_partial_sums_on_cpu_are_pairwise_in_axis_order_and_agree_bitwise(dtype, monkeypatch):
    """P -> B and P -> S run as point-to-point messages on CPU (no group is created) and sum the
    members' pieces in axis order: every rank of P -> B holds the same bits, equal to
    ((p0 + p1) + p2) + p3 in axis order, and P -> S(0) gives exactly their rows of it."""
    monkeypatch.setenv("GT_CPU_COLLECTIVES", "p2p")  # whatever the environment said
    line = gt.placement("cpu", [2, 0, 3, 1])  # axis order is not rank order
    shape = (7, 5)  # 7 rows over 4 ranks: uneven slices; 35 elements: uneven all_reduce runs
    src = Layout(line, (P,), shape)

    def piece(k):
        g = torch.Generator().manual_seed(100 + k)
        if dtype == torch.bool:
            return torch.rand(shape, generator=g) < 0.3
        if dtype.is_floating_point:
            return (torch.randn(shape, generator=g, dtype=torch.float64) * 1e3).to(dtype)
        return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)

    def body(rank):
        from globaltensor.runtime import groups
        mine = piece(line.coord_of(rank)[0])
        created = len(groups._world_cache())
        to_b = execute.run(plan(src, Layout(line, (B,), shape)), mine, rank)
        to_s = execute.run(plan(src, Layout(line, (S(0),), shape)), mine, rank)
        return to_b, to_s, len(groups._world_cache()) - created

    expected = piece(0).clone()
    for k in range(1, 4):
        expected += piece(k)
    results = run_ranks(body, 4, timeout=60)
    rows = Layout(line, (S(0),), shape)
    for rank, (to_b, to_s, new_groups) in enumerate(results):
        assert new_groups == 0
        assert to_b.dtype == dtype and torch.equal(to_b, expected)
        assert torch.equal(to_s, expected[rows.slices(line.coord_of(rank))])


