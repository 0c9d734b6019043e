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
        learnt = gt.from_local(torch.ones(1, 4), p, S(0))  # the members' pieces, exchanged
        return given.shape, given.to_local().shape, learnt.shape, learnt.to_local().shape

    results = run_ranks(outside, 3, timeout=TIMEOUT)
    assert results[2] == (torch.Size([2, 4]), torch.Size([0, 0]), torch.Size([2, 4]),
                          torch.Size([0, 0]))
    assert results[0][2] == torch.Size([2, 4]) and results[0][3] == torch.Size([1, 4])


def test_uneven_pieces_without_a_shape_agree_on_every_rank_or_fail_on_every_rank():
    """Issue 52.8: each rank took its piece times the ranks for the global shape, so ranks with
    3 and 2 rows built global tensors of 6 and 4 rows, silently. Without shape= the pieces'
    shapes are exchanged: 5 rows on every rank; pieces the uneven rule does not allow (1 and 4
    rows) are an error on every rank. With shape= nothing is sent."""
    def body(rank, rows):
        p = gt.placement("cpu", [0, 1])
        piece = FULL[:rows[0]] if rank == 0 else FULL[rows[0]:rows[0] + rows[1]]
        try:
            x = gt.from_local(piece, p, S(0))
        except gt.GlobalTensorError as error:
            return str(error)
        with gt.comm_trace() as t:
            gt.from_local(piece, p, S(0), shape=x.shape)
        return x.shape, x.full_tensor(), len(t)

    for shape, full, moves in run_ranks(body, 2, (3, 2), timeout=TIMEOUT):
        assert shape == torch.Size([5, 4]) and torch.equal(full, FULL) and moves == 0
    for message in run_ranks(body, 2, (1, 4), timeout=TIMEOUT):
        assert isinstance(message, str) and "rank 0 passed a piece of shape [1, 4]" in message
