"""Dispatch remembers a tensor's moved pieces; a write to the tensor must forget them, on every
rank alike (ranks outside the placement included), or values go stale / ranks disagree."""
import torch

import globaltensor as gt
from globaltensor.testing import run_ranks

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
PAIR = gt.placement("cpu", [0, 1])


def test_in_place_op_after_a_move_is_seen_everywhere():
    def body(rank):
        a = gt.ones(4, placement=PAIR, sbp=P)          # value 1; `a + w` all-reduces it
        w = gt.ones(4, placement=PAIR, sbp=B)
        first = (a + w).tolist()
        a.mul_(2)                                      # runs below autograd on the pieces
        second = (a + w).tolist()
        a.add_(gt.ones(4, placement=PAIR, sbp=B))      # a write that goes through a move too
        third = (a + w).tolist()
        return first, second, third

    # rank 2 is outside the placement: it must take the same path (no hang)
    for first, second, third in run_ranks(body, 3, timeout=30):
        assert first == [2.0] * 4 and second == [3.0] * 4 and third == [4.0] * 4


def test_write_through_to_local_after_a_move():
    def body(rank):
        a = gt.arange(4, placement=PAIR, sbp=P, dtype=torch.float32)
        w = gt.zeros(4, placement=PAIR, sbp=B)
        before = (a + w).tolist()
        a.to_local().mul_(10)                          # every rank scales its piece
        return before, (a + w).tolist()

    for before, after in run_ranks(body, 2, timeout=30):
        assert before == [0.0, 1.0, 2.0, 3.0] and after == [0.0, 10.0, 20.0, 30.0]
