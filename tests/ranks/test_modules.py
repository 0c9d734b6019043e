"""module.to_global / gt.nn.to_global: parameters and buffers become global; each parameter's
grad has the parameter's own layout; data and tensor parallel training match one process."""
import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.errors import GlobalTensorError
from globaltensor.layout import Layout
from globaltensor.testing import RankFailed, run_ranks

from helpers import ROOT, gen, make_global

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
G2 = gt.placement("cpu", [0, 1])
G22 = gt.placement("cpu", [[0, 1], [2, 3]])


class MLP(torch.nn.Module):
    """y = relu(x @ w1) @ w2 with explicit (in, hidden) and (hidden, out) weights."""

    def __init__(self, w1, w2):
        super().__init__()
        self.w1 = torch.nn.Parameter(w1.clone())
        self.w2 = torch.nn.Parameter(w2.clone())
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        return torch.relu(x @ self.w1) @ self.w2


W1, W2 = gen(6, 8, seed=1), gen(8, 3, seed=2)
X, Y = gen(8, 6, seed=3), gen(8, 3, seed=4)


def megatron(name, t):
    """Tensor parallel on axis 1 (w1 by columns, w2 by rows), data parallel on axis 0."""
    return {"w1": (B, S(1)), "w2": (B, S(0))}.get(name, (B, B))


def reference_steps(steps=3, lr=0.05):
    model = MLP(W1, W2)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(model(X), Y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.w1.detach(), model.w2.detach()


def test_parameters_and_buffers_become_global_with_first_rank_values():
    def body(rank):
        model = MLP(W1 + rank, W2)          # ranks disagree: the first rank's values win
        model.to_global(G22, megatron)
        return (model.w1.sbp, model.w2.sbp, model.steps.sbp, isinstance(model.w1, torch.nn.Parameter),
                model.w1.requires_grad, model.w1.full_tensor(), [n for n, _ in model.named_parameters()])

    for s1, s2, sb, is_param, rg, w1, names in run_ranks(body, 4, timeout=30):
        assert s1 == (B, S(1)) and s2 == (B, S(0)) and sb == (B, B)
        assert is_param and rg and names == ["w1", "w2"]
        torch.testing.assert_close(w1, W1)


def test_a_single_sbp_applies_to_every_tensor_and_gt_nn_to_global_is_the_same():
    def body(rank):
        a = MLP(W1, W2).to_global(G2, B)
        b = gt.nn.to_global(torch.nn.Linear(4, 2), G2, lambda name, t: S(0) if name == "weight" else None)
        return a.w1.sbp, a.w2.sbp, b.weight.sbp, b.bias.sbp

    assert run_ranks(body, 2, timeout=30)[0] == ((B,), (B,), (S(0),), (B,))


def test_grads_have_the_parameters_layout():
    def body(rank):
        model = MLP(W1, W2).to_global(G22, megatron)
        x = make_global(X, Layout(G22, (S(0), B), X.shape), rank)
        y = make_global(Y, Layout(G22, (S(0), B), Y.shape), rank)
        F.mse_loss(model(x), y).backward()
        return (model.w1.grad.sbp, model.w2.grad.sbp, model.w1.grad.full_tensor(),
                model.w2.grad.full_tensor())

    ref = MLP(W1, W2)
    F.mse_loss(ref(X), Y).backward()
    for s1, s2, g1, g2 in run_ranks(body, 4, timeout=30):
        assert s1 == (B, S(1)) and s2 == (B, S(0))   # summed over the data-parallel axis
        torch.testing.assert_close(g1, ref.w1.grad)
        torch.testing.assert_close(g2, ref.w2.grad)


@pytest.mark.parametrize("grid,sbp_fn,x_sbp", [
    (G2, None, (S(0),)),                                   # pure data parallel
    (G2, lambda n, t: {"w1": S(1), "w2": S(0)}.get(n), (B,)),  # pure tensor parallel
    (G22, megatron, (S(0), B)),                            # both
], ids=["dp", "tp", "dp+tp"])
def test_training_matches_one_process(grid, sbp_fn, x_sbp):
    ref_losses, ref_w1, ref_w2 = reference_steps()

    def body(rank):
        model = MLP(W1, W2).to_global(grid, sbp_fn)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        x = make_global(X, Layout(grid, x_sbp, X.shape), rank)
        y = make_global(Y, Layout(grid, x_sbp, Y.shape), rank)
        losses = []
        for _ in range(3):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, model.w1.detach().full_tensor(), model.w2.detach().full_tensor()

    for losses, w1, w2 in run_ranks(body, grid.size, timeout=60):
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-10
        torch.testing.assert_close(w1, ref_w1)
        torch.testing.assert_close(w2, ref_w2)


def test_nn_layers_forward_backward():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.GELU(),
                              torch.nn.Linear(8, 3)).double()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    ref = net(X).sum()
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in net.named_parameters()}

    def body(rank):
        local = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.GELU(),
                                    torch.nn.Linear(8, 3)).double()
        local.load_state_dict(state)
        local.to_global(G22, lambda name, t: (B, S(0)) if name == "0.weight" else None)
        x = make_global(X, Layout(G22, (S(0), B), X.shape), rank)
        out = local(x).sum()
        out.backward()
        return out.item(), {n: (p.grad.sbp, p.grad.full_tensor()) for n, p in local.named_parameters()}

    for value, grads in run_ranks(body, 4, timeout=60):
        assert abs(value - ref.item()) < 1e-9
        for n, (sbp, g) in grads.items():
            torch.testing.assert_close(g, ref_grads[n], msg=n)
        assert grads["0.weight"][0] == (B, S(0)) and grads["3.bias"][0] == (B, B)


def test_converting_a_global_module_again_lays_it_out_anew_and_to_local_full_gives_full_values():
    ref = torch.relu(X @ W1) @ W2

    def body(rank):
        m = MLP(W1, W2).to_global(G22, megatron)
        m.to_global(G22, lambda name, t: (S(0), B) if name == "w1" else (B, B))  # values kept
        x = gt.tensor(X, placement=G22, sbp=(S(0), B))
        out = m(x).full_tensor()
        sbps = (m.w1.sbp, m.w2.sbp, isinstance(m.w1, torch.nn.Parameter))
        m.to_local(full=True)
        plain = (type(m.w1), type(m.steps), m(X))  # plain modules again, forward out of global mode
        return out, sbps, plain

    for out, sbps, (w_type, buf_type, plain_out) in run_ranks(body, 4, timeout=60):
        torch.testing.assert_close(out, ref)
        assert sbps == ((S(0), B), (B, B), True)
        assert w_type is torch.nn.Parameter and buf_type is torch.Tensor
        torch.testing.assert_close(plain_out, ref)


def test_a_bad_sbp_is_a_clear_error():
    def bad(rank):
        MLP(W1, W2).to_global(G22, S(0))

    with pytest.raises(RankFailed, match="found one split, S\\(0\\), which does not say which axis"):
        run_ranks(bad, 4, timeout=30)


@pytest.mark.parametrize("world", [4, 3])
def test_quickstart_tp_dp_matches_one_process(world):
    import importlib.util

    path = ROOT / "examples" / "quickstart.py"
    spec = importlib.util.spec_from_file_location("quickstart", path)
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)

    def body(rank):
        losses, single, model = quickstart.run()
        return losses, single, model.w1.sbp, model.w1.to_local().shape

    for losses, single, sbp, local in run_ranks(body, world, timeout=120):
        assert len(losses) == 20 and losses[-1] < losses[0]
        assert max(abs(a - b) for a, b in zip(losses, single)) < 1e-5
        assert sbp == (B, S(1)) and local == torch.Size([16, 64 // (2 if world == 4 else 1)])
