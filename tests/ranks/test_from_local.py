"""gt.from_local on real ranks: a piece made global with no communication (the global shape from
the pieces when even, or given), its checks, its gradient, and ranks outside the placement.
(Inside torch.compile: tests/processes/test_compile.py, user redistributions.)"""
import pytest
import torch

import globaltensor as gt
from globaltensor.testing import RankFailed, run_ranks

S, B, P = gt.sbp.S, gt.sbp.B, gt.sbp.P
TIMEOUT = 60
FULL = torch.arange(20.0).reshape(5, 4)


def test_even_pieces_give_the_shape_and_uneven_pieces_take_it_given():
    def body(rank):
        p = gt.placement("cpu", [[0, 1], [2, 3]], axes=("dp", "tp"))
        even = gt.from_local(torch.full((2, 3), float(rank)), p, {"dp": S(0), "tp": S(1)})
        rows = FULL[:3] if rank % 2 == 0 else FULL[3:]         # 5 rows over "tp"
        piece = rows.clone().requires_grad_(True)
        uneven = gt.from_local(piece, p, {"tp": S(0)}, shape=(5, 4), grad_sbp={"tp": S(0)})
        (uneven * uneven).sum().backward()
        with gt.comm_trace() as t:
            gt.from_local(torch.ones(3), p, (B, B))
        return (even.shape, even.sbp, even.full_tensor(), uneven.full_tensor(),
                piece.grad, len(t))

    for rank, (shape, sbp, even, uneven, grad, moves) in enumerate(run_ranks(body, 4, timeout=TIMEOUT)):
        assert shape == torch.Size([4, 6]) and sbp == (S(0), S(1))
        assert even.tolist() == [[0.0] * 3 + [1.0] * 3] * 2 + [[2.0] * 3 + [3.0] * 3] * 2
        assert torch.equal(uneven, FULL)
        mine = FULL[:3] if rank % 2 == 0 else FULL[3:]
        # d/dpiece of sum(x^2), a plain tensor's gradient; grad_sbp B on "dp": every replica
        # holds it whole (the default, P, would leave zeros on the second "dp" row)
        assert torch.equal(grad, 2 * mine)
        assert moves == 0  # no communication


def test_a_piece_of_the_wrong_shape_and_a_rank_outside_without_a_shape_are_refused():
    def wrong(rank):
        p = gt.placement("cpu", [0, 1])
        gt.from_local(torch.ones(3 if rank == 0 else 1, 4), p, S(0), shape=(5, 4))

    with pytest.raises(RankFailed, match=r"rank 1 passed a piece of shape \[1, 4\], expected \[2, 4\]"):
        run_ranks(wrong, 2, timeout=TIMEOUT)

    def outside(rank):
        p = gt.placement("cpu", [0, 1])
        given = gt.from_local(torch.ones(1, 4), p, S(0), shape=(2, 4))
        try:
            gt.from_local(torch.ones(1, 4), p, S(0))
        except gt.GlobalTensorError as error:
            return given.shape, given.to_local().shape, str(error)
        return given.shape, given.to_local().shape, None

    results = run_ranks(outside, 3, timeout=TIMEOUT)
    assert results[0][2] is None and results[1][2] is None
    shape, piece, message = results[2]
    assert shape == torch.Size([2, 4]) and piece == torch.Size([0, 0])
    assert "outside placement" in message and "pass shape=(...)" in message
