"""Bad input sweep: every public entry point rejects bad arguments quickly, clearly, and alike
on every rank; awkward but valid input (non-contiguous, zero-size, requires_grad) works. (The
sweep's cases are in helpers; the sweep in a world of one: tests/core/test_bad_input.py.)"""
import pytest
import torch

import globaltensor as gt
from globaltensor.errors import GlobalTensorError
from globaltensor.testing import run_ranks

from helpers import BAD_INPUT_CASES

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


def _uninitialised_only(case) -> bool:
    return case[0].startswith("init ")  # gt.init inside an initialised world is a no-op


def test_every_rank_fails_alike_and_at_once():
    """The same sweep on 3 thread-ranks: every rank raises the same error, nobody waits."""
    cases = [c for c in BAD_INPUT_CASES if not _uninitialised_only(c)]

    def body(rank):
        out = []
        for name, call, kind, words in cases:
            try:
                call()
                out.append((name, "no error"))
            except GlobalTensorError as e:
                out.append((name, type(e).__name__, str(e)))
        return out

    results = run_ranks(body, 3, timeout=30)
    for r in (1, 2):
        for mine, first in zip(results[r], results[0]):
            assert mine == first
    for (name, _, kind, words), got in zip(cases, results[0]):
        assert got[1] == kind.__name__ or issubclass(getattr(gt.errors, got[1], object), kind), got
        assert words.replace("[0, 7]", "") in got[2], got


# --- disagreements between ranks: each rank's piece is fine alone ----------------------------------


def _messages(body, n):
    def wrapped(rank):
        try:
            body(rank)
        except GlobalTensorError as e:
            return type(e).__name__, str(e)
        return None

    return run_ranks(wrapped, n, timeout=30)


def test_pieces_breaking_the_uneven_rule_are_named_on_every_rank():
    p = gt.placement("cpu", [0, 1, 2])
    out = _messages(lambda r: torch.ones([3, 1, 2][r], 4).to_global(placement=p, sbp=S(0)), 3)
    assert len(set(out)) == 1
    kind, msg = out[0]
    assert kind == "ShapeMismatchError"
    assert "rank 0 passed a piece of shape [3, 4], expected [2, 4] for a global shape [6, 4]" in msg
    assert "found: {0: [3, 4], 1: [1, 4], 2: [2, 4]}" in msg


def test_pieces_of_different_dtypes_are_named_on_every_rank():
    p = gt.placement("cpu", [0, 1])
    dtypes = [torch.float32, torch.int64]
    out = _messages(lambda r: torch.ones(2, dtype=dtypes[r]).to_global(placement=p, sbp=S(0)), 2)
    assert len(set(out)) == 1
    assert out[0][0] == "ShapeMismatchError"
    assert "found torch.float32 on rank 0 and torch.int64 on rank 1" in out[0][1]


def test_pieces_of_different_ndim_are_named_on_every_rank():
    p = gt.placement("cpu", [0, 1])
    out = _messages(lambda r: torch.ones([2] * (r + 1)).to_global(placement=p, sbp=B), 2)
    assert len(set(out)) == 1
    assert "rank 1 with [2, 2]" in out[0][1]


def test_rank_dependent_sbp_is_named_on_every_rank():
    """Issue 41: ranks passing different sbps built different global shapes, silently."""
    p = gt.placement("cpu", [0, 1, 2])
    sbps = [S(0), B, S(0)]
    out = _messages(lambda r: torch.ones(2, 4).to_global(placement=p, sbp=sbps[r]), 3)
    assert len(set(out)) == 1
    kind, msg = out[0]
    assert kind == "SbpError"
    assert "expected every rank to pass the same sbp" in msg
    assert "found ranks 0, 2: (S(0),); rank 1: (B,)" in msg and "gt.get_rank()" in msg
    # the same split spelled per rank (S(-1) is S(1) of a 2-D piece) is the same sbp
    dims = [1, -1, 1]
    same = run_ranks(lambda r: tuple(torch.ones(2, 4).to_global(p, S(dims[r])).shape), 3,
                     timeout=30)
    assert same == [(2, 12)] * 3


def test_operators_reject_mixed_placements_and_local_operands():
    def body(rank):
        p, q = gt.placement("cpu", [0, 1]), gt.placement("cpu", [1, 0])
        x = gt.ones(4, 2, placement=p, sbp=S(0))
        errors = []
        for call in (lambda: x + gt.ones(4, 2, placement=q, sbp=S(0)),
                     lambda: x + torch.ones(4, 2)):
            with pytest.raises(GlobalTensorError) as info:
                call()
            errors.append(str(info.value))
        scalar = (x + torch.tensor(2.0)).full_tensor()  # a 0-dim local is a scalar: fine
        return errors, scalar.tolist()

    out = run_ranks(body, 2, timeout=30)
    assert out[0] == out[1]
    (mixed, local), scalar = out[0]
    assert "expected global tensors of one placement, found 2" in mixed
    assert "a local tensor of shape [4, 2]" in local
    assert scalar == [[3.0, 3.0]] * 4


# --- awkward but valid input -------------------------------------------------------------------------


def test_non_contiguous_local_pieces_are_taken_by_value():
    def body(rank):
        p = gt.placement("cpu", [0, 1])
        base = torch.arange(12.0).reshape(3, 4) + 100 * rank
        piece = base.t()[:, ::2]  # (4, 2) non-contiguous view
        assert not piece.is_contiguous()
        x = piece.to_global(placement=p, sbp=S(1))
        y = piece.to_global(placement=p, sbp=B)
        return x.full_tensor(), y.full_tensor()

    (x0, y0), (x1, y1) = run_ranks(body, 2, timeout=30)
    expect_piece = lambda r: (torch.arange(12.0).reshape(3, 4) + 100 * r).t()[:, ::2]
    torch.testing.assert_close(x0, torch.cat([expect_piece(0), expect_piece(1)], dim=1))
    torch.testing.assert_close(y0, expect_piece(0))  # rank 0's data wins for B
    torch.testing.assert_close(x1, x0)
    torch.testing.assert_close(y1, y0)


def test_zero_size_tensors_round_trip():
    def body(rank):
        p = gt.placement("cpu", [0, 1, 2])
        empty_rows = torch.ones(0, 5).to_global(placement=p, sbp=S(0))
        fewer_rows = gt.arange(2, placement=p, sbp=S(0))  # N < k: rank 2 holds an empty piece
        moved = fewer_rows.to_global(sbp=B)
        back = gt.zeros(0, 3, placement=p, sbp=S(1)).to_global(sbp=S(0))
        return (list(empty_rows.shape), list(fewer_rows.to_local().shape), moved.to_local().tolist(),
                list(back.shape), list(back.to_local().shape))

    out = run_ranks(body, 3, timeout=30)
    assert out[0] == ([0, 5], [1], [0, 1], [0, 3], [0, 3])
    assert out[2] == ([0, 5], [0], [0, 1], [0, 3], [0, 3])


def test_requires_grad_is_preserved_and_gradients_flow():
    def body(rank):
        p = gt.placement("cpu", [0, 1])
        leaf = torch.full((2, 3), float(rank + 1), requires_grad=True)
        x = leaf.to_global(placement=p, sbp=S(0))
        y = x.to_global(sbp=B)
        w = gt.ones(4, 3, placement=p, sbp=S(0), requires_grad=True)
        flags = (x.requires_grad, y.requires_grad, y.to_local().requires_grad, w.requires_grad,
                 w.is_leaf)
        (y.to_local() * 2).sum().backward()
        return flags, leaf.grad.tolist()

    out = run_ranks(body, 2, timeout=30)
    for flags, grad in out:
        assert flags == (True, True, True, True, True)
        # y is B: each rank's local 2*sum contributes 2 to every element; S(0) grad sums them
        assert grad == [[4.0] * 3] * 2


