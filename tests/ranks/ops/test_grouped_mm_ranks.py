"""Ops whose meta kernel is stricter than the kernel that runs (issue 36, item 3), on thread-ranks:
``torch._grouped_mm``'s meta kernel demands bf16 while its CPU kernel runs float32, so dispatch
learns its output from a run on stand-ins and uses its rule; a call that really fails is still
refused on every rank. ``_safe_softmax`` splits every dim but its own, with no gather."""
import pytest
import torch

import globaltensor as gt
from globaltensor.errors import GlobalTensorError
from globaltensor.testing import run_ranks

from helpers import G2, G22, check, gen

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
OFFS = torch.tensor([3, 3, 7, 12], dtype=torch.int32)  # 4 experts over 12 tokens, one empty
A = gen(12, 16, dtype=torch.float32)                 # tokens sorted by expert
W = gen(4, 16, 16, seed=1, dtype=torch.float32)      # stacked experts (G, K, N)


def test_the_meta_kernel_refuses_float32_and_the_cpu_kernel_runs_it():
    # the premise: if torch's meta kernel learns float32, this test says the mechanism is moot
    with pytest.raises(RuntimeError, match="BF16"):
        torch._grouped_mm(A.to("meta"), W.to("meta"), offs=OFFS.to("meta"))
    assert torch._grouped_mm(A, W, offs=OFFS).shape == (12, 16)


def test_grouped_mm_on_float32_global_inputs_learns_its_output_from_a_real_run():
    expected = torch._grouped_mm(A, W, offs=OFFS)

    def body(rank):
        a = gt.tensor(A, placement=G2, sbp=B)
        w = gt.tensor(W, placement=G2, sbp=S(0))  # expert parallel
        offs = gt.tensor(OFFS, placement=G2, sbp=B)
        with gt.comm_trace() as trace:
            out = torch._grouped_mm(a, w, offs=offs)
        return out.sbp, out.dtype, trace.counts(), out.full_tensor()

    for sbp, dtype, counts, full in run_ranks(body, 2, timeout=60):
        assert sbp == (P,) and dtype == torch.float32 and counts == {}  # the rule's row
        torch.testing.assert_close(full, expected)


def test_a_call_the_real_kernel_refuses_too_is_refused_on_every_rank():
    def body(rank):
        a = gt.tensor(A.double(), placement=G2, sbp=B)  # the CPU kernel: float32, bf16, fp16
        w = gt.tensor(W.double(), placement=G2, sbp=S(0))
        offs = gt.tensor(OFFS, placement=G2, sbp=B)
        try:
            torch._grouped_mm(a, w, offs=offs)
        except GlobalTensorError as e:
            return str(e)
        return None

    for message in run_ranks(body, 2, timeout=60):
        assert message is not None and "_grouped_mm" in message
        assert "Double" in message and "fails alike" in message


def test_a_shape_mismatch_is_still_refused_with_torchs_message():
    def body(rank):
        a = gt.tensor(gen(12, 8, dtype=torch.float32), placement=G2, sbp=S(0))
        try:
            w, offs = gt.tensor(W, placement=G2, sbp=B), gt.tensor(OFFS, placement=G2, sbp=B)
            torch._grouped_mm(a, w, offs=offs)
        except GlobalTensorError as e:
            return str(e)
        return None

    for message in run_ranks(body, 2, timeout=60):
        assert message is not None and "fails alike" in message


def grouped(a, w, offs):
    return torch._grouped_mm(a, w, offs=offs)


@pytest.mark.slow  # a long case: run with pytest -m slow (suite time)
def test_grouped_mm_every_layout_forward_and_backward_matches_torch():
    # offs ends at the token count (no uninitialised tail rows); its own layouts are S(0) or B
    check(grouped, [A, W, torch.tensor([3, 3, 7, 12], dtype=torch.int32)], grids=[G2, G22],
          atol=1e-4, timeout=300)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_safe_softmax_splits_every_dim_but_its_own_without_a_gather(dim):
    x = gen(4, 6, 8)
    x[0, 1] = float("-inf")  # a row of -inf: 0 where softmax gives nan
    expected = torch._safe_softmax(x, dim)
    split = (dim + 1) % 3

    def body(rank):
        g = gt.tensor(x, placement=G2, sbp=S(split))
        with gt.comm_trace() as trace:
            out = torch._safe_softmax(g, dim)
        return out.sbp, trace.counts(), out.full_tensor()

    for sbp, counts, full in run_ranks(body, 2, timeout=60):
        assert sbp == (S(split),) and counts == {}
        torch.testing.assert_close(full, expected)


def test_safe_softmax_backward_matches_torch():
    x = gen(4, 6)
    check(lambda t: torch._safe_softmax(t, 1), [x], grids=[G2, G22])


def test_stand_ins_over_the_bound_are_not_run_and_the_call_is_refused(monkeypatch):
    from globaltensor.dispatch import outputs

    monkeypatch.setattr(outputs, "STAND_IN_BYTES", 1024)  # A and W alone are 3 KiB and 4 KiB
    a, w = gen(20, 16, dtype=torch.float32), gen(4, 16, 8, seed=1, dtype=torch.float32)
    offs = torch.tensor([5, 10, 15, 20], dtype=torch.int32)

    def body(rank):
        ga, gw, go = (gt.tensor(t, placement=G2, sbp=B) for t in (a, w, offs))
        try:
            torch._grouped_mm(ga, gw, offs=go)
        except GlobalTensorError as e:
            return str(e)
        return None

    for message in run_ranks(body, 2, timeout=60):
        assert message is not None and "BF16" in message and "STAND_IN_BYTES" in message
