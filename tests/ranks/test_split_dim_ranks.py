"""A split dim past int64 on several ranks (issue 52.9): the piece-shape exchange of
``to_global(check_meta=True)`` carries it saturated, so every rank raises an SbpError naming
the dim, not a raw ValueError from packing it (the mechanism in a world of one:
tests/core/test_bad_input.py)."""
import torch

import globaltensor as gt
from globaltensor.errors import GlobalTensorError
from globaltensor.testing import run_ranks

S, B = gt.sbp.split, gt.sbp.broadcast
HUGE = 2**100


def _messages(body, n):
    def wrapped(rank):
        try:
            body(rank)
        except Exception as e:  # a raw error is a failure of this test, not of the rank
            return type(e).__name__, str(e)
        return None

    return run_ranks(wrapped, n, timeout=30)


def test_a_huge_split_dim_is_named_on_every_rank():
    p = gt.placement("cpu", [0, 1])
    out = _messages(lambda r: torch.ones(2, 3).to_global(placement=p, sbp=S(HUGE)), 2)
    assert len(set(out)) == 1
    kind, msg = out[0]
    assert issubclass(getattr(gt.errors, kind), GlobalTensorError) and kind == "SbpError", out
    assert f"split({HUGE}) needs a tensor dim in [-2, 2)" in msg
    grid = gt.placement("cpu", [[0], [1]])
    out = _messages(lambda r: torch.ones(2, 3).to_global(placement=grid, sbp=(S(-HUGE), B)), 2)
    assert out[0][0] == "SbpError" and f"split({-HUGE}) needs a tensor dim" in out[0][1]


def test_a_huge_split_dim_on_one_rank_is_a_disagreement_on_every_rank():
    p = gt.placement("cpu", [0, 1])
    dims = [HUGE, 0]
    out = _messages(lambda r: torch.ones(2, 3).to_global(placement=p, sbp=S(dims[r])), 2)
    assert len(set(out)) == 1
    kind, msg = out[0]
    assert kind == "SbpError" and "expected every rank to pass the same sbp" in msg
    assert "rank 0: (S(64 or more),); rank 1: (S(0),)" in msg
