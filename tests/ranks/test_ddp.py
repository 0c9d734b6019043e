"""gt.nn.parallel.DistributedDataParallel against torch's DDP, on gloo thread-worlds."""
import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from globaltensor.errors import GlobalTensorError
from globaltensor.nn.parallel import DistributedDataParallel as DDP
from globaltensor.nn.parallel import plan_buckets
from globaltensor.testing import RankFailed, run_ranks

T = 60


def seeded(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Deterministic weights from a private generator (ranks are threads: the global RNG races)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return module


def mlp(seed: int) -> torch.nn.Module:
    return seeded(torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(),
                                      torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                      torch.nn.Linear(32, 3)), seed)


def batch(rank: int, step: int):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("cap_mb,as_view", [(25, False), (0.0004, False), (0.0004, True)])
def test_ten_sgd_steps_match_torch_ddp(cap_mb, as_view):
    def body(rank):
        base = mlp(seed=rank)  # different on every rank: the wrap must broadcast rank 0's
        ours = DDP(copy.deepcopy(base), bucket_cap_mb=cap_mb, gradient_as_bucket_view=as_view)
        theirs = TorchDDP(copy.deepcopy(base), bucket_cap_mb=cap_mb)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
        for step in range(10):
            x, y = batch(rank, step)
            for model, opt in zip((ours, theirs), opts):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        return max_diff(ours, theirs), len(ours.buckets), [p.detach().clone() for p in ours.parameters()]

    out = run_ranks(body, 3, timeout=T)
    assert all(diff <= 1e-6 for diff, _, _ in out)
    assert out[0][1] == (1 if cap_mb == 25 else 3)
    for p0, p2 in zip(out[0][2], out[2][2]):
        assert torch.equal(p0, p2)  # every rank holds the same model
    assert not torch.equal(out[0][2][0], mlp(seed=0)[0].weight)  # and it trained


def test_no_sync_accumulates_as_torch_does():
    def body(rank):
        base = mlp(seed=0)
        ours, theirs = DDP(copy.deepcopy(base)), TorchDDP(copy.deepcopy(base))
        grads = []
        for model in (ours, theirs):
            with model.no_sync():
                for step in range(2):
                    x, y = batch(rank, step)
                    torch.nn.functional.mse_loss(model(x), y).backward()
            local = [p.grad.clone() for p in model.parameters()]
            x, y = batch(rank, 2)
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append((local, [p.grad.clone() for p in model.parameters()]))
        return grads

    out = run_ranks(body, 2, timeout=T)
    for (ours_local, ours), (theirs_local, theirs) in out:
        for a, b in zip(ours_local + ours, theirs_local + theirs):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    # inside no_sync the ranks differ; after the synced step they agree
    assert not torch.equal(out[0][0][0][0], out[1][0][0][0])
    assert torch.equal(out[0][0][1][0], out[1][0][1][0])


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(4, 4)
        self.left = torch.nn.Linear(4, 2)
        self.right = torch.nn.Linear(4, 2)
        self.unused = torch.nn.Linear(4, 2)
        seeded(self, 0)

    def forward(self, x, use_right):
        h = self.trunk(x)
        return self.left(h) + (self.right(h) if use_right else 0)


def test_unused_parameters_fail_naming_them():
    def body(rank):
        model = DDP(TwoHeads())
        model(torch.ones(3, 4), True).sum().backward()

    with pytest.raises(RankFailed, match=r"found none for \['unused.weight', 'unused.bias'\].*"
                                         r"find_unused_parameters=True"):
        run_ranks(body, 2, timeout=T)


def test_find_unused_parameters_matches_torch():
    def body(rank):
        use_right = rank == 0  # `right` is used on rank 0 only; `unused` nowhere
        result = []
        for model in (DDP(TwoHeads(), find_unused_parameters=True),
                      TorchDDP(TwoHeads(), find_unused_parameters=True)):
            for step in range(2):
                model.zero_grad()
                x, _ = batch(rank, step)
                model(x[:, :4], use_right).pow(2).sum().backward()
            result.append({n: None if p.grad is None else p.grad.clone()
                           for n, p in model.named_parameters()})
        return result

    for ours, theirs in run_ranks(body, 2, timeout=T):
        assert ours["module.unused.weight"] is None and theirs["module.unused.weight"] is None
        for name, grad in theirs.items():
            if grad is not None:
                torch.testing.assert_close(ours[name], grad, rtol=0, atol=1e-7)


def test_gradients_are_reduced_during_backward():
    def body(rank):
        model = DDP(mlp(0), bucket_cap_mb=0.0004)
        reducer, log = model._reducer, []
        on_grad = reducer.on_grad
        reducer.on_grad = lambda i: (log.append(len(reducer.works)), on_grad(i))
        x, y = batch(rank, 0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        return log, len(model.buckets)

    log, buckets = run_ranks(body, 2, timeout=T)[0]
    # buckets 0 and 1 were on the wire before the last gradient arrived
    assert buckets == 3 and len(log) == 6 and log[0] == 0 and log[-1] == 2


def test_wrap_broadcasts_buffers_and_forwards_attributes():
    def body(rank):
        net = seeded(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)), rank)
        net.lr = 0.01 * (rank + 1)
        model = DDP(net)
        model(batch(rank, 0)[0][:, :3])  # each rank updates its running stats...
        model(batch(rank, 1)[0][:, :3])  # ...after the forward took rank 0's again
        return (net[0].weight.detach().clone(), net[1].running_mean.clone(), model.lr,
                list(model.state_dict())[:2])

    out = run_ranks(body, 2, timeout=T)
    assert torch.equal(out[0][0], out[1][0])
    assert torch.equal(out[0][0], seeded(torch.nn.Linear(3, 3), 0).weight)  # rank 0's initial
    assert out[0][2] == 0.01 and out[1][2] == 0.02
    assert out[0][3] == ["module.0.weight", "module.0.bias"]
    assert not torch.equal(out[0][1], out[1][1])  # buffers updated locally after the broadcast


def test_mismatched_parameters_are_named():
    def body(rank):
        DDP(torch.nn.Linear(3, 4 if rank == 0 else 5))

    with pytest.raises(RankFailed, match=r"rank 1 differs from rank 0: 'weight' \(4, 3\).*"
                                         r"vs 'weight' \(5, 3\)"):
        run_ranks(body, 2, timeout=T)


def test_plan_buckets_walks_back_to_front_by_dtype_and_cap():
    params = [torch.empty(256), torch.empty(256), torch.empty(8, dtype=torch.float64),
              torch.empty(100), torch.empty(1)]
    buckets = plan_buckets(params, cap_bytes=1500, first_cap_bytes=500)
    # 4 + 400 + 1024 bytes pass the first cap; a float64 parameter never shares a float32 bucket
    assert [b.params for b in buckets] == [(4, 3, 1), (2,), (0,)]
    assert buckets[0].offsets == (0, 1, 101) and buckets[0].numel == 357
    assert [b.params for b in plan_buckets(params, cap_bytes=10**9)] == [(4, 3, 1, 0), (2,)]


def test_raising_in_hooks_leaves_no_pending_state():
    def body(rank):
        model = DDP(TwoHeads())
        with pytest.raises(GlobalTensorError, match="found none for"):
            model(torch.ones(3, 4), True).sum().backward()
        with model.no_sync():  # the wrapper still works afterwards
            model(torch.ones(3, 4), True).sum().backward()
        return model._reducer.works

    assert run_ranks(body, 2, timeout=T) == [[], []]


def test_without_broadcast_buffers_the_wrap_keeps_each_ranks_buffers_as_torch_does():
    def body(rank):
        net = seeded(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)), rank)
        net[1].running_mean.fill_(float(rank + 1))
        theirs = TorchDDP(copy.deepcopy(net), broadcast_buffers=False)
        ours = DDP(net, broadcast_buffers=False)
        return (ours.module[1].running_mean.clone(), theirs.module[1].running_mean.clone(),
                ours.module[0].weight.detach().clone())

    out = run_ranks(body, 2, timeout=T)
    for rank, (ours, theirs, _) in enumerate(out):
        assert torch.equal(ours, theirs) and torch.equal(ours, torch.full((3,), rank + 1.0))
    assert torch.equal(out[0][2], out[1][2])  # parameters are still rank 0's
