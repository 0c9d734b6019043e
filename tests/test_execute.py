"""The executor on real gloo (thread-ranks): every rank's result equals the simulator's.

Many conversions run inside ONE world per grid to keep this fast.
"""
import itertools

import pytest
import torch

import globaltensor as gt
from globaltensor import simulate
from globaltensor.comm import execute
from globaltensor.layout import Layout
from globaltensor.plan import plan
from globaltensor.testing import run_ranks

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
VALUES = [S(0), S(1), B, P]


def full_of(shape):
    return torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def convert_all(rank, cases, world):
    """Run every case on this rank; check the input is untouched and the output fresh."""
    out = []
    for src, dst in cases:
        piece = simulate.scatter(full_of(src.shape), src, world)[rank]
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
        expected = simulate.run(plan(src, dst), simulate.scatter(full_of(src.shape), src, world))
        for rank in range(world):
            got = results[rank][k]
            assert got.shape == expected[rank].shape and torch.equal(got, expected[rank]), (
                f"rank {rank}: {plan(src, dst).describe()}")
        assert torch.equal(simulate.gather([results[r][k] for r in range(world)], dst),
                           full_of(src.shape))


def all_pairs(src_p, dst_p, shapes):
    return [(Layout(src_p, a, shape), Layout(dst_p, b, shape))
            for shape in shapes
            for a in itertools.product(VALUES, repeat=src_p.ndim)
            for b in itertools.product(VALUES, repeat=dst_p.ndim)]


@pytest.mark.parametrize("grid, world", [([0, 1], 2), ([0, 1, 2, 3], 4), ([[0, 1], [2, 3]], 4)])
def test_every_pair_on_a_grid_matches_the_simulator(grid, world):
    placement = gt.placement("cpu", grid)
    check_against_simulator(all_pairs(placement, placement, [(4, 4), (5, 7)]), world)


def test_ranks_outside_the_placement_take_part_in_group_creation():
    placement = gt.placement("cpu", [0, 2, 3])
    check_against_simulator(all_pairs(placement, placement, [(5, 7)]), 4)


@pytest.mark.parametrize("src, dst", [
    ([0, 1], [2, 3]), ([0, 1, 2], [1, 3]), ([0], [0, 1, 2, 3]), ([0, 1, 2, 3], [0]),
    ([[0, 1], [2, 3]], [0, 1, 2, 3]), ([0, 1, 2, 3], [[0, 1], [2, 3]]),
])
def test_placement_changes_match_the_simulator(src, dst):
    check_against_simulator(all_pairs(gt.placement("cpu", src), gt.placement("cpu", dst),
                                      [(4, 6), (5, 7)]), 4)


def test_other_dtypes_and_higher_rank_tensors():
    placement = gt.placement("cpu", [[0, 1], [2, 3]])
    cases = [(Layout(placement, (S(2), S(0)), (3, 5, 6)), Layout(placement, (S(1), B), (3, 5, 6))),
             (Layout(placement, (P, S(1)), (3, 5, 6)), Layout(placement, (S(2), S(2)), (3, 5, 6)))]

    def body(rank):
        out = []
        for src, dst in cases:
            full = torch.arange(90, dtype=torch.int64).reshape(3, 5, 6)
            piece = simulate.scatter(full, src, 4)[rank]
            out.append(execute.run(plan(src, dst), piece, rank))
        return out

    results = run_ranks(body, 4, timeout=60)
    for k, (src, dst) in enumerate(cases):
        got = simulate.gather([results[r][k] for r in range(4)], dst)
        assert got.dtype == torch.int64
        assert torch.equal(got, torch.arange(90).reshape(3, 5, 6))


def test_same_layout_returns_the_input_itself():
    layout = Layout(gt.placement("cpu", [0]), (S(0),), (2, 2))
    x = torch.ones(2, 2)
    assert execute.run(plan(layout, layout), x, 0) is x
