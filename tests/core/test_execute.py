"""The executor in one process, on plans that need no communication: every rank's result equals
the simulator's; and GT_CPU_COLLECTIVES choosing the CPU path (the executor on real gloo:
tests/ranks/test_execute_ranks.py)."""
import contextvars

import pytest
import torch

import globaltensor as gt
from globaltensor.plan import oracle
from globaltensor.errors import GlobalTensorError
from globaltensor.layout import Layout
from globaltensor.runtime import execute
from globaltensor.plan import plan
from globaltensor.plan import LocalSlice

from helpers import full_of

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


def test_same_layout_returns_the_input_itself():
    layout = Layout(gt.placement("cpu", [0]), (S(0),), (2, 2))
    x = torch.ones(2, 2)
    assert execute.run(plan(layout, layout), x, 0) is x


def test_local_slice_plans_return_fresh_contiguous_pieces_on_every_rank():
    # no communication, so every rank runs here in turn, twice (the per-plan, per-rank cache)
    grid = gt.placement("cpu", [[3, 1], [0, 2]])
    part = gt.placement("cpu", [2, 0])  # ranks 1 and 3 are outside
    cases = [(Layout(grid, (B, B), (5, 7)), Layout(grid, (S(0), S(1)), (5, 7))),
             (Layout(grid, (B, B), (5, 7)), Layout(grid, (S(1), S(1)), (5, 7))),
             (Layout(grid, (B, S(0)), (5, 7)), Layout(grid, (S(1), S(0)), (5, 7))),
             (Layout(part, (B,), (3, 4)), Layout(part, (S(1),), (3, 4)))]
    for src, dst in cases:
        p = plan(src, dst)
        assert p.steps and all(isinstance(s, LocalSlice) for s in p.steps), p
        pieces = oracle.scatter(full_of(src.shape), src, 4)
        expected = oracle.run(p, pieces)
        for _ in range(2):
            for rank in (0, 3, 1, 2):
                got = execute.run(p, pieces[rank], rank)
                assert got.shape == expected[rank].shape and torch.equal(got, expected[rank])
                assert got.is_contiguous()
                if got.numel():
                    assert got.untyped_storage().data_ptr() != pieces[rank].untyped_storage().data_ptr()


@pytest.mark.parametrize("value, p2p", [(None, True), ("p2p", True), ("gloo", False), (" GLOO ", False),
                                        ("nccl", "expected GT_CPU_COLLECTIVES to be "
                                                 "'p2p' or 'gloo', found 'nccl'")])
def test_gt_cpu_collectives_chooses_the_cpu_path(value, p2p, monkeypatch):
    # read once per context (a thread-rank has its own): a fresh context reads the environment
    monkeypatch.delenv("GT_CPU_COLLECTIVES", raising=False)
    if value is not None:
        monkeypatch.setenv("GT_CPU_COLLECTIVES", value)
    read = contextvars.Context().run
    if isinstance(p2p, bool):
        assert read(execute.cpu_point_to_point) is p2p
    else:
        with pytest.raises(GlobalTensorError, match=p2p):
            read(execute.cpu_point_to_point)
