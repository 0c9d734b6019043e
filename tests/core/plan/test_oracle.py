"""The simulator: every plan preserves the logical value, exhaustively over small spaces."""
import itertools

import pytest
import torch

import globaltensor as gt
from globaltensor.plan import oracle
from globaltensor.errors import ShapeMismatchError
from globaltensor.layout import Layout
from globaltensor.plan import plan
from globaltensor.plan import AllGatherV

from helpers import random_cases

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
VALUES = [S(0), S(1), B, P]
SHAPES = [(4, 4), (5, 7), (13, 17), (3, 5)]


def value(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-50, 50, shape, generator=g).to(torch.float32)


def check_all_pairs(src_p, dst_p, shape, world):
    full = value(shape)
    for a in itertools.product(VALUES, repeat=src_p.ndim):
        src = Layout(src_p, a, shape)
        pieces = oracle.scatter(full, src, world)
        for b in itertools.product(VALUES, repeat=dst_p.ndim):
            dst = Layout(dst_p, b, shape)
            out = oracle.run(plan(src, dst), pieces)
            assert len(out) == world
            assert torch.equal(oracle.gather(out, dst), full), plan(src, dst).describe()
            for r in range(world):
                assert tuple(out[r].shape) == dst.local_shape_of_rank(r)


@pytest.mark.parametrize("grid", [[0, 1], [0, 1, 2], [0, 1, 2, 3], [[0, 1], [2, 3]]])
@pytest.mark.parametrize("shape", SHAPES)
def test_every_pair_preserves_the_value(grid, shape):
    placement = gt.placement("cpu", grid)
    check_all_pairs(placement, placement, shape, 4)


@pytest.mark.parametrize("src, dst", [
    ([0, 1], [2, 3]), ([0, 1, 2], [1, 3]), ([0], [0, 1, 2, 3]), ([0, 1, 2, 3], [0]),
    ([[0, 1], [2, 3]], [0, 1, 2, 3]), ([0, 1, 2, 3], [[0, 1], [2, 3]]),
    ([[0, 1], [2, 3]], [[3, 2], [1, 0]]), ([[0, 1, 2], [3, 4, 5]], [[0, 1], [2, 3], [4, 5]]),
])
@pytest.mark.parametrize("shape", [(4, 4), (5, 7)])
def test_every_pair_across_placements_preserves_the_value(src, dst, shape):
    check_all_pairs(gt.placement("cpu", src), gt.placement("cpu", dst), shape, 6)


def test_three_axis_grid_sample():
    cube = gt.placement("cpu", [[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    full = value((6, 5, 3))
    cases = [((S(0), S(0), S(1)), (S(2), B, S(0))), ((P, S(0), P), (S(0), S(0), S(0))),
             ((S(1), S(1), S(1)), (P, B, S(2))), ((B, P, S(0)), (S(0), S(2), P))]
    for a, b in cases:
        src, dst = Layout(cube, a, full.shape), Layout(cube, b, full.shape)
        out = oracle.run(plan(src, dst), oracle.scatter(full, src))
        assert torch.equal(oracle.gather(out, dst), full)


def test_scatter_splits_partial_values_that_sum_back():
    full = value((4, 6))
    layout = Layout(gt.placement("cpu", [[0, 1], [2, 3]]), (P, S(1)), (4, 6))
    pieces = oracle.scatter(full, layout)
    assert torch.equal(pieces[0] + pieces[2], full[:, :3])
    assert torch.equal(pieces[1] + pieces[3], full[:, 3:])
    assert not torch.equal(pieces[0], full[:, :3])  # really split, not value + zeros
    assert torch.equal(oracle.gather(pieces, layout), full)


def test_dicts_and_ranks_outside_the_placement():
    layout = Layout(gt.placement("cpu", [1, 2]), (S(0),), (4, 2))
    pieces = oracle.scatter(torch.arange(8.0).reshape(4, 2), layout, world_size=4)
    assert [tuple(p.shape) for p in pieces] == [(0, 0), (2, 2), (2, 2), (0, 0)]
    out = oracle.run(plan(layout, layout.with_sbp(B)), dict(enumerate(pieces)))
    assert isinstance(out, dict) and tuple(out[0].shape) == (0, 0)
    assert torch.equal(out[2], torch.arange(8.0).reshape(4, 2))


def test_gather_catches_replicas_that_differ_and_wrong_shapes():
    layout = Layout(gt.placement("cpu", [0, 1]), (B,), (2,))
    with pytest.raises(ShapeMismatchError, match="same piece as rank 0"):
        oracle.gather([torch.zeros(2), torch.ones(2)], layout)
    with pytest.raises(ShapeMismatchError, match=r"rank 1's piece .* shape \[2\], found \[3\]"):
        oracle.gather([torch.zeros(2), torch.ones(3)], layout)
    with pytest.raises(ShapeMismatchError, match="local tensor for rank 1"):
        oracle.run(plan(layout, layout.with_sbp(S(0))), [torch.zeros(2)])


def test_random_layouts_preserve_the_value():
    for src, dst in random_cases(seed=11, count=300, world=8):
        full = value(src.shape)
        out = oracle.run(plan(src, dst), oracle.scatter(full, src, 8))
        assert torch.equal(oracle.gather(out, dst), full), plan(src, dst).describe()


@pytest.mark.parametrize("dim", [0, 1])
def test_exact_gathers_of_uneven_pieces_preserve_the_value(dim):
    placement = gt.placement("cpu", [2, 0, 1])
    full = value((5, 7))
    src = Layout(placement, (S(dim),), full.shape)
    p = plan(src, src.with_sbp((B,)))
    assert [type(s) for s in p.steps] == [AllGatherV]
    out = oracle.run(p, oracle.scatter(full, src, 3))
    assert all(torch.equal(piece, full) for piece in out)
