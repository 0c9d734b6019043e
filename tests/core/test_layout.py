import itertools

import pytest

import globaltensor as gt
from globaltensor.errors import SbpError
from globaltensor.layout import Layout, split_sizes

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


@pytest.mark.parametrize("n, k, sizes", [
    (16, 4, (4, 4, 4, 4)),
    (17, 4, (5, 4, 4, 4)),
    (13, 4, (4, 3, 3, 3)),
    (3, 4, (1, 1, 1, 0)),
    (0, 4, (0, 0, 0, 0)),
    (5, 2, (3, 2)),
    (7, 3, (3, 2, 2)),
    (1, 1, (1,)),
])
def test_uneven_rule(n, k, sizes):
    assert split_sizes(n, k) == sizes
    layout = Layout(gt.placement("cpu", range(k)), (S(0),), (n, 2))
    assert [layout.local_shape((i,)) for i in range(k)] == [(s, 2) for s in sizes]
    boxes = [layout.box((i,))[0] for i in range(k)]
    assert boxes[0][0] == 0 and boxes[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(boxes, boxes[1:]))


@pytest.mark.parametrize("n, boxes", [
    (6, [(0, 2), (2, 3), (3, 5), (5, 6)]),
    (17, [(0, 5), (5, 9), (9, 13), (13, 17)]),
    (3, [(0, 1), (1, 2), (2, 3), (3, 3)]),
])
def test_nested_split_axis0_outermost(n, boxes):
    layout = Layout(gt.placement("cpu", [[0, 1], [2, 3]]), (S(0), S(0)), (n,))
    assert [layout.box(c)[0] for c in [(0, 0), (0, 1), (1, 0), (1, 1)]] == boxes


def test_two_dims_on_2d_grid():
    layout = Layout(gt.placement("cpu", [[0, 1], [2, 3]]), (S(0), S(1)), (5, 7))
    assert layout.box((0, 0)) == ((0, 3), (0, 4))
    assert layout.box((1, 1)) == ((3, 5), (4, 7))
    assert layout.local_shape_of_rank(2) == (2, 4)
    assert layout.local_shape_of_rank(9) == (0, 0)


def test_broadcast_and_partial_hold_everything():
    p = gt.placement("cpu", [[0, 1], [2, 3]])
    for sbp in [(B, B), (P, B), (B, P), (P, P)]:
        layout = Layout(p, sbp, (3, 4))
        assert all(layout.local_shape(c) == (3, 4) for c in p.coords())
    assert Layout(p, (P, B), (3,)).partial_axes == (0,)
    assert Layout(p, (S(1), B), (3, 4)).split_axes_of(1) == (0,)


def test_pieces_cover_tensor_exactly_once_per_replica():
    p = gt.placement("cpu", [[0, 1, 2], [3, 4, 5]])
    for sbp in itertools.product([S(0), S(1), B], repeat=2):
        for shape in [(5, 7), (1, 2), (0, 3), (6, 6)]:
            layout = Layout(p, sbp, shape)
            count = {}
            for c in p.coords():
                (a0, b0), (a1, b1) = layout.box(c)
                for i in range(a0, b0):
                    for j in range(a1, b1):
                        count[(i, j)] = count.get((i, j), 0) + 1
            replicas = 1
            for axis, v in enumerate(sbp):
                if v == B:
                    replicas *= p.shape[axis]
            assert len(count) == shape[0] * shape[1]
            assert set(count.values()) <= {replicas}


def test_negative_split_normalised_and_bad_dims():
    p = gt.placement("cpu", [0, 1])
    assert Layout(p, (S(-1),), (3, 4)).sbp == (S(1),)
    with pytest.raises(SbpError, match="tensor shape \\[3, 4\\]"):
        Layout(p, (S(2),), (3, 4))
    with pytest.raises(SbpError, match="expected 1 sbp"):
        Layout(p, (S(0), B), (3, 4))


def test_layout_is_a_hashable_value():
    p = gt.placement("cpu", [0, 1])
    a, b = Layout(p, (S(0),), (4, 4)), Layout(gt.placement("cpu", [0, 1]), [S(0)], [4, 4])
    assert a == b and hash(a) == hash(b)
    assert a != Layout(p, (S(1),), (4, 4))
