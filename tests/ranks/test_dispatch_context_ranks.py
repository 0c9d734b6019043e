"""Signatures chosen with their backward in mind: moving an input that will get a gradient also
costs the move its gradient needs (ops.backward_cost), moves already made are free, and a
data-parallel gradient's all-reduce runs asynchronously until the end of backward. Checked on
the sbp an op gives and by counting the collectives of a step (on the choice itself:
tests/core/test_dispatch_context.py)."""
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from globaltensor import env
from globaltensor.runtime import execute
from globaltensor.layout import Layout
from globaltensor.ops import B, S
from globaltensor.testing import run_ranks

from helpers import G2, G22, gen, make_global, train_mse


# ----------------------------------------------------------------------------- on ranks


def test_relu_of_a_partial_sum_is_broadcast_when_it_gets_a_gradient():
    x, w = gen(4, 6, seed=1), gen(6, 4, seed=2)

    def body(rank):
        gx = make_global(x, Layout(G2, (S(1),), x.shape), rank)
        gw = make_global(w, Layout(G2, (S(0),), w.shape), rank).requires_grad_()
        with torch.no_grad():
            no_grad = torch.relu(gx @ gw)
        y = torch.relu(gx @ gw)
        y.sum().backward()
        return no_grad.sbp, y.sbp, y.detach().full_tensor(), gw.grad.full_tensor()

    wr = w.clone().requires_grad_()
    ref = torch.relu(x @ wr)
    ref.sum().backward()
    for no_grad, with_grad, value, grad in run_ranks(body, 2, timeout=30):
        assert no_grad == (S(0),) and with_grad == (B,)
        torch.testing.assert_close(value, ref.detach())
        torch.testing.assert_close(grad, wr.grad)


_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast", "send",
                "recv", "batch_isend_irecv")
# (isend/irecv are not wrapped: torch's P2POp accepts only the functions themselves)


@pytest.fixture
def collectives(monkeypatch):
    """Counts the collectives each rank runs: {rank: [name, ...]} for the ranks in ``on``. A
    redistribution step counts once, by its kind (on CPU the executor runs an all_reduce step
    as point-to-point messages); torch.distributed calls made outside the executor count by
    their own name."""
    calls: dict = {"on": set()}
    inside = threading.local()

    def wrap(name, fn):
        def counted(*args, **kwargs):
            rank = env.get_rank()
            if rank in calls["on"] and not getattr(inside, "step", False):
                calls.setdefault(rank, []).append(name)
            return fn(*args, **kwargs)
        return counted

    def run_step(step, local, rank, *tag):  # (the plan's message tag, runtime/layoutcheck.py)
        if rank in calls["on"] and step.kind in _STEP_KINDS:
            calls.setdefault(rank, []).append(step.kind)
        inside.step = True
        try:
            return real_step(step, local, rank, *tag)
        finally:
            inside.step = False

    for name in _COLLECTIVES:
        monkeypatch.setattr(dist, name, wrap(name, getattr(dist, name)))
    real_step = execute._run_step
    monkeypatch.setattr(execute, "_run_step", run_step)
    return calls


_STEP_KINDS = ("all_gather", "all_gatherv", "reduce_scatter", "all_reduce", "all_to_all",
               "send/recv")


class MLP(torch.nn.Module):
    def __init__(self, w1, w2):
        super().__init__()
        self.w1, self.w2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())

    def forward(self, x):
        return torch.relu(x @ self.w1) @ self.w2


def _steps(model, x, y, counted, rank, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses, per_step = [], []
    for i in range(steps):
        if i > 0:  # the first step builds the groups
            counted["on"].add(rank)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        counted["on"].discard(rank)
        per_step.append(counted.pop(rank, []))
        losses.append(loss.detach().full_tensor().item())  # not counted: reading the loss
    return losses, per_step[1:]


def _reference(model, x, y, steps=3):
    return train_mse(model, torch.optim.AdamW(model.parameters(), lr=0.05), x, y, steps)


def test_tp_dp_mlp_step_runs_two_all_reduces_like_megatron_with_ddp(collectives):
    """The partial output is all-reduced once (not reduce-scattered then gathered in backward)
    and the weights' gradients once, in one bucket, over the data-parallel axis: 2 collectives
    per step, the hand-written count (Megatron's forward all-reduce, DDP's one bucket)."""
    w1, w2, x, y = gen(6, 8, seed=1), gen(8, 6, seed=2), gen(8, 6, seed=3), gen(8, 6, seed=4)
    ref = _reference(MLP(w1, w2), x, y)

    def body(rank):
        model = MLP(w1, w2).to_global(G22, lambda n, t: (B, S(1)) if n == "w1" else (B, S(0)))
        gx = make_global(x, Layout(G22, (S(0), B), x.shape), rank)
        gy = make_global(y, Layout(G22, (S(0), B), y.shape), rank)
        losses, per_step = _steps(model, gx, gy, collectives, rank)
        return losses, per_step, model.w1.grad.sbp, model.w2.grad.sbp

    for losses, per_step, s1, s2 in run_ranks(body, 4, timeout=60):
        assert max(abs(a - b) for a, b in zip(losses, ref)) < 1e-10
        assert s1 == (B, S(1)) and s2 == (B, S(0))
        assert per_step == [["all_reduce"] * 2] * 2


def test_linear_with_bias_all_reduces_the_partial_output_once(collectives):
    """nn.Linear with a bias runs addmm, decomposed below autograd into mm + add: the mm result
    made inside counts as getting a gradient, so the row-parallel output is all-reduced."""
    gen_ = torch.Generator().manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 6)).double()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen_, dtype=torch.float64))
    state = {k: v.clone() for k, v in net.state_dict().items()}
    x, y = gen(8, 6, seed=3), gen(8, 6, seed=4)
    ref = _reference(net, x, y)
    tp = {"0.weight": (B, S(0)), "0.bias": (B, S(0)), "2.weight": (B, S(1))}

    def body(rank):
        local = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 6)).double()
        local.load_state_dict(state)
        local.to_global(G22, lambda n, t: tp.get(n, (B, B)))
        gx = make_global(x, Layout(G22, (S(0), B), x.shape), rank)
        gy = make_global(y, Layout(G22, (S(0), B), y.shape), rank)
        losses, per_step = _steps(local, gx, gy, collectives, rank)
        return losses, per_step

    for losses, per_step in run_ranks(body, 4, timeout=60):
        assert max(abs(a - b) for a, b in zip(losses, ref)) < 1e-10
        # one in forward, then one bucket of the 4 gradients over the data-parallel axis
        assert per_step == [["all_reduce"] * 2] * 2


def test_async_gradient_all_reduce_with_a_rank_outside_the_placement():
    """Data parallel on ranks 0 and 1 of a world of 3: rank 2 runs the same program with empty
    pieces; the gradients are the summed ones on the members and empty on rank 2."""
    w, x = gen(6, 3, seed=1), gen(4, 6, seed=2)
    wr = w.clone().requires_grad_()
    (x @ wr).square().sum().backward()

    def body(rank):
        model = MLP(w, gen(3, 3, seed=5))
        del model.w2
        model.to_global(G2, None)
        gx = make_global(x, Layout(G2, (S(0),), x.shape), rank)
        (gx @ model.w1).square().sum().backward()
        grad = model.w1.grad
        return grad.sbp, grad.to_local().shape, grad.full_tensor()

    results = run_ranks(body, 3, timeout=60)
    for rank, (sbp, local_shape, full) in enumerate(results):
        assert sbp == (B,)
        assert local_shape == ((6, 3) if rank < 2 else (0, 0))
        torch.testing.assert_close(full, wr.grad)


def test_a_partial_sum_whose_sum_is_at_hand_is_resolved_not_carried():
    """An RMSNorm on a partial-sum residual stream (a vocabulary-split embedding's output, a
    row-parallel projection's): its variance needs the sum, so x is all-reduced once; the
    normalised x * rsqrt(var) then uses that sum too (free, and it leaves no partial sum)
    instead of staying partial, so the column-parallel projection after it moves nothing
    (before: its weight was gathered, in forward and again in backward)."""
    import globaltensor as gt

    x_full, w_full = gen(8, 6, seed=5), gen(6, 4, seed=6)
    P = gt.sbp.partial_sum

    def body(rank):
        x0 = make_global(x_full, Layout(G2, (P,), x_full.shape), rank).requires_grad_()
        w = make_global(w_full, Layout(G2, (S(1),), w_full.shape), rank).requires_grad_()
        with gt.comm_trace() as trace:
            x = x0 * 1  # an activation, as in a model (a leaf keeps no moved pieces)
            var = x.pow(2).mean(-1, keepdim=True)
            y = x * torch.rsqrt(var + 1e-6)
            out = y @ w
        out.sum().backward()
        return trace.counts(), y.sbp, out.sbp, out.detach().full_tensor(), w.grad.full_tensor()

    xr, wr = x_full.clone().requires_grad_(), w_full.clone().requires_grad_()
    ref = (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6)) @ wr
    ref.sum().backward()
    for counts, y_sbp, out_sbp, value, grad in run_ranks(body, 2, timeout=30):
        assert counts == {"all_reduce": 1}, counts
        assert y_sbp == (B,) and out_sbp == (S(1),)
        torch.testing.assert_close(value, ref.detach())
        torch.testing.assert_close(grad, wr.grad)
