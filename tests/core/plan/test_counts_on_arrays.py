"""The planner's per-coordinate counts worked out on arrays (ranges.held_sum, ranges.overlaps,
Space.rank_table, Messages.missing / receives_two) and to_global's one-piece-shape shortcut
equal their coordinate-by-coordinate references, exhaustively over small grids and uneven
nested splits."""
import itertools

import pytest
import torch

import globaltensor as gt
from globaltensor.convert import _checked_global_shape, _one_piece_shape
from globaltensor.errors import ShapeMismatchError
from globaltensor.layout import Layout, boxes, grid_coords
from globaltensor.plan.ranges import (_held_sum_ints, held_sum, most_overlaps, nested_ranges,
                                      overlaps, radix)
from globaltensor.plan.space import space_of
from globaltensor.runtime.meta import Meta

S, B = gt.sbp.split, gt.sbp.broadcast
SIZES = [(2,), (3,), (2, 2), (2, 3), (3, 2, 2)]


def test_overlap_counts_are_the_pair_scan():
    for length in range(0, 13):
        for mine, theirs in itertools.product([(), (2,), (3,), (2, 2), (3, 2), (5,)], repeat=2):
            ranges = {r for r in nested_ranges(length, mine) if r[0] < r[1]}
            want = tuple(sum(1 for lo, hi in ranges if lo < b and a < hi)
                         for a, b in nested_ranges(length, theirs))
            assert overlaps(length, mine, theirs)[2] == want
            assert most_overlaps(length, mine, theirs) == max(want)


def test_held_sum_on_arrays_is_the_loop():
    for sizes in SIZES:
        axes = range(len(sizes))
        splits = [()] + [s for k in (1, 2) for s in itertools.permutations(axes, k)]
        for length, mine, theirs in itertools.product((1, 5, 7), splits, splits):
            dims = ((length, mine, theirs),)
            assert held_sum(sizes, dims) == _held_sum_ints(sizes, dims)
        dims = ((5, (0,), (len(sizes) - 1,)), (7, (len(sizes) - 1,), (0,)))
        assert held_sum(sizes, dims) == _held_sum_ints(sizes, dims)


def test_rank_table_is_per_coordinate():
    for grid in [[0, 1, 2], [[0, 1], [2, 3]], [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9, 10, 11]]]]:
        place = gt.placement("cpu", grid)
        for shape in [(5, 7), (13,), (1, 4)]:
            space = space_of(place, shape)
            splits = [()] + [s for k in (1, 2) for s in itertools.permutations(range(place.ndim), k)]
            for d, mine, theirs in itertools.product(range(len(shape)), splits, splits):
                sizes = place.shape
                mr, tr, counts = overlaps(shape[d], tuple(sizes[a] for a in mine),
                                          tuple(sizes[a] for a in theirs))
                want = []
                for coord in grid_coords(place):
                    j = radix(coord, theirs, sizes)
                    (lo, hi), (lo2, hi2) = tr[j], mr[radix(coord, mine, sizes)]
                    want.append((hi - lo, max(0, min(hi, hi2) - max(lo, lo2)), counts[j]))
                assert space.rank_table(d, mine, theirs).T.tolist() == [list(w) for w in want]


def test_one_piece_shape_is_every_coordinate_alike():
    for grid in [[0, 1, 2], [[0, 1], [2, 3]], [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]]:
        place = gt.placement("cpu", grid)
        for shape in [(4, 6), (5, 7), (8,), (0, 3), (12, 2)]:
            values = [B] + [S(d) for d in range(len(shape))]
            for sbp in itertools.product(values, repeat=place.ndim):
                layout = Layout(place, sbp, shape)
                shapes = {tuple(hi - lo for lo, hi in box) for box in boxes(layout).values()}
                assert _one_piece_shape(layout) == (len(shapes) == 1), layout


def test_checked_global_shape_with_shared_and_distinct_records():
    # a simulation's members share one record (checked once when the rule cuts one piece
    # shape); distinct records (a real run) are checked coordinate by coordinate
    grid = gt.placement("cpu", [0, 1, 2, 3])

    def meta(n):
        return Meta((n,), torch.float32, (S(0),))

    shared = meta(3)
    assert _checked_global_shape([shared] * 4, grid, (S(0),)) == (12,)
    assert _checked_global_shape([meta(3), meta(3), meta(3), meta(2)], grid, (S(0),)) == (11,)
    with pytest.raises(ShapeMismatchError):
        _checked_global_shape([meta(2), meta(3), meta(3), meta(3)], grid, (S(0),))
    with gt.simulate(4):
        x = torch.zeros(2, 3).to_global(grid, S(0))  # each rank passes (2, 3)
        assert tuple(x.shape) == (8, 3)
