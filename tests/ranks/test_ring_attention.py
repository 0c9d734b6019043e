"""Ring attention (issue 55, item 1; docs/long_context.md, "Ring attention"): q, k and v split
on the sequence, the key/value chunks shifted around the ranks while each rank computes with
the chunk it holds; equal to one process, plain and head-tail, with only the ring's messages."""
import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.testing import run_ranks

B = gt.sbp.broadcast
TIMEOUT = 120
LINE = gt.placement("cpu", [0, 1, 2, 3], axes=("cp",))
BALANCES = ["plain", "head_tail"]


def _seq(dim: int, balance: str):
    return gt.sbp.S(dim, None if balance == "plain" else balance)


@pytest.mark.parametrize("balance", BALANCES)
def test_ring_attention_equals_one_process_and_sends_only_its_shifts(balance):
    """``gt.set_attention_method("ring")``: q, k and v stay split on the sequence and the
    key/value chunks go around the ranks (3 shifts of k and v forward; backward 3 more and 4
    of their gradients, which end where they started): causal, full and masked attention, an
    uneven 1,021 positions, equal to one process; only point-to-point messages. The boolean
    mask hides whole rows and a whole rank's keys: blocks with no visible key must add
    nothing (torch's kernel gives them an lse of 0, which a merge would weigh)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 1021, 8, generator=g) for _ in range(3))
    mask = torch.rand(1, 1, 1021, 1021, generator=g) > 0.7
    mask[..., 5, :] = mask[..., 700, :] = False
    mask[..., 300:560] = False
    cases = [(True, None), (False, None), (False, mask)]
    refs = []
    for causal, m in cases:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal, attn_mask=m)
        out.square().sum().backward()
        refs.append((out.detach(), [t.grad for t in leaves]))

    def body(rank):
        found = []
        for causal, m in cases:
            ins = [t.to_global(LINE, B).to_global(sbp=_seq(2, balance)).requires_grad_()
                   for t in (q, k, v)]
            gm = None if m is None else m.to_global(LINE, B).to_global(sbp=_seq(2, balance))
            with gt.comm_trace() as trace:
                out = F.scaled_dot_product_attention(*ins, is_causal=causal, attn_mask=gm)
                out.square().sum().backward()
            kinds = [c for r in trace.records for c in r.collectives]
            found.append((out.full_tensor(), [t.grad.full_tensor() for t in ins], out.sbp, kinds))
        return found
    before = gt.set_attention_method("ring")
    try:
        results = run_ranks(body, 4, timeout=TIMEOUT)
    finally:
        gt.set_attention_method(before)
    for found in results:
        for (out, grads, sbp, kinds), (want, wants) in zip(found, refs):
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
            for got, w in zip(grads, wants):
                torch.testing.assert_close(got, w, atol=1e-4, rtol=1e-4)
            assert sbp == (_seq(2, balance),)
            assert kinds == ["send/recv"] * (6 + 6 + 8), kinds
    with pytest.raises(gt.GlobalTensorError, match="expects one of"):
        gt.set_attention_method("zigzag")
