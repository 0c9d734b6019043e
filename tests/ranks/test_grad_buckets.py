"""Gradients of broadcast parameters are all-reduced in buckets (DDP's bucket_cap_mb semantics):
one all-reduce per full bucket, launched during backward, the last at its end (issue 13).
Gradients are bit-for-bit those of one all-reduce per parameter on 2 ranks, and equal to one
process's on a 2x2 grid."""
import copy
import threading

import pytest
import torch
import torch.distributed as dist

import globaltensor as gt
from globaltensor.testing import run_ranks

S, B = gt.sbp.split, gt.sbp.broadcast


class Net(torch.nn.Module):
    def __init__(self, dtype=torch.float64):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(8, 8).to(dtype) for _ in range(4))
        self.extra = torch.nn.Parameter(torch.randn(8, generator=g, dtype=torch.float32))
        with torch.no_grad():
            for p in self.layers.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum() + (x.float() * self.extra).sum()


X = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


class Counted:
    """Counts dist.all_reduce calls of rank 0's thread."""

    def __init__(self):
        self.calls = []

    def __enter__(self):
        self.original = dist.all_reduce

        def counting(tensor, *args, **kwargs):
            if threading.current_thread().name == "gt-rank-0":
                self.calls.append(tensor.numel())
            return self.original(tensor, *args, **kwargs)
        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.original


def grads_with_cap(cap, placement, sbp_fn, x_sbp, world):
    def body(rank):
        gt.nn.set_bucket_cap_mb(cap)
        try:
            net = copy.deepcopy(BASE).to_global(placement, sbp_fn)
            x = gt.tensor(X, placement=placement, sbp=x_sbp)
            net(x).backward()
            return {n: (p.grad.sbp, p.grad.to_local().clone(), p.grad.full_tensor())
                    for n, p in net.named_parameters()}
        finally:
            gt.nn.set_bucket_cap_mb(25)
    with Counted() as counted:
        results = run_ranks(body, world, timeout=60)
    return results, counted.calls


BASE = Net()


def reference_grads():
    net = copy.deepcopy(BASE)
    net(X).backward()
    return {n: p.grad for n, p in net.named_parameters()}


def test_one_all_reduce_per_bucket_and_the_same_bits_as_one_per_parameter():
    p = gt.placement("cpu", [0, 1])
    apart, apart_calls = grads_with_cap(0, p, B, S(0), 2)
    bucketed, bucketed_calls = grads_with_cap(25, p, B, S(0), 2)
    nparams = len(list(BASE.parameters()))
    assert len(apart_calls) == nparams
    assert len(bucketed_calls) == 2  # one bucket per dtype (float64 weights, a float32 one)
    assert sum(bucketed_calls) == sum(apart_calls)
    ref = reference_grads()
    for a, b in zip(apart, bucketed):
        for n in a:
            assert a[n][0] == b[n][0] == (B,)
            assert torch.equal(a[n][1], b[n][1]), n  # bit for bit
            torch.testing.assert_close(b[n][2], ref[n])


def test_small_buckets_are_launched_as_they_fill():
    p = gt.placement("cpu", [0, 1])
    results, calls = grads_with_cap(0.0005, p, B, S(0), 2)  # ~500 bytes: a few params each
    assert 2 < len(calls) < len(list(BASE.parameters()))
    ref = reference_grads()
    for r in results:
        for n, (sbp, _, full) in r.items():
            torch.testing.assert_close(full, ref[n])


def test_buckets_on_the_data_axis_of_a_2x2_grid():
    grid = gt.placement("cpu", [[0, 1], [2, 3]])

    def sbp_fn(name, t):  # tensor parallel on axis 1 for the first layer, data parallel on 0
        return (B, S(0)) if name == "layers.0.weight" else (B, B)

    results, calls = grads_with_cap(25, grid, sbp_fn, (S(0), B), 4)
    ref = reference_grads()
    for r in results:
        for n, (sbp, _, full) in r.items():
            assert sbp == ((B, S(0)) if n == "layers.0.weight" else (B, B)), n
            torch.testing.assert_close(full, ref[n])


def test_partial_sums_over_both_axes_of_a_grid_go_in_buckets():
    """A gradient that is P on both axes of a 2x2 grid (B, B parameter) is summed by one
    all-reduce over the four ranks in a bucket; a (B, S(1)) parameter's is reduce-scattered on
    the tensor axis in the hook, then all-reduced over the data axis in a bucket."""
    grid = gt.placement("cpu", [[0, 1], [2, 3]])
    g = torch.Generator().manual_seed(3)
    X, W, V = (torch.randn(4, 6, generator=g, dtype=torch.float64) for _ in range(3))
    P = gt.sbp.partial_sum

    def body(rank):
        x = gt.tensor(X, placement=grid, sbp=(B, B)).to_global(sbp=(P, P))
        w = gt.tensor(W, placement=grid, sbp=(B, B)).requires_grad_()
        v = gt.tensor(V, placement=grid, sbp=(B, S(1))).requires_grad_()
        with gt.comm_trace() as trace:
            ((w * x).sum() + (v * x).sum()).backward()
        return (w.grad.sbp, w.grad.full_tensor(), v.grad.sbp, v.grad.full_tensor(),
                [(r.op, r.collectives) for r in trace])

    with Counted() as counted:
        results = run_ranks(body, 4, timeout=60)
    for w_sbp, w_grad, v_sbp, v_grad, records in results:
        assert (w_sbp, v_sbp) == ((B, B), (B, S(1)))
        assert torch.equal(w_grad, X) and torch.equal(v_grad, X)  # one term per rank: exact
        syncs = [c for op, c in records if op == "gradient sync"]
        buckets = [c for op, c in records if op.startswith("gradient bucket")]
        assert syncs == [("reduce_scatter",)], records  # v's, on the tensor axis, in its hook
        assert buckets == [("all_reduce",)] * 2, records
    assert len(counted.calls) == 2  # rank 0: the two buckets, one all-reduce each


def test_bucket_cap_must_be_a_size():
    with pytest.raises(gt.GlobalTensorError, match="megabytes"):
        gt.nn.set_bucket_cap_mb(-1)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("sbp", [None, S(0), S(1)], ids=["broadcast", "rows", "columns"])
def test_weight_gradients_keep_the_parameters_strides(sbp, world):
    """torch's layout contract (a gradient's strides follow its parameter's): a Linear weight's
    gradient piece comes out of backward transposed; left so, AdamW's element-wise updates run
    several times slower (benchmarks/pipeline.py found it). The optimizer's step sees it
    contiguous, with the same values."""
    def body(rank):
        p = gt.placement("cpu", list(range(world)))
        lin = torch.nn.Linear(16, 32)
        lin.to_global(p, (lambda name, t: sbp if name == "weight" else None) if sbp else None)
        x = gt.tensor(torch.randn(8, 16, generator=torch.Generator().manual_seed(0)), placement=p,
                      sbp=S(0))
        for _ in range(2):  # the first gradient, then one accumulated into it
            lin(x).sum().backward()
        before = lin.weight.grad.full_tensor()
        seen = []
        opt = torch.optim.SGD(lin.parameters(), lr=0.0)
        opt.register_step_pre_hook(lambda o, a, k: seen.append(lin.weight.grad._local.stride()))
        opt.step()
        return seen, lin.weight._local.stride(), torch.equal(before, lin.weight.grad.full_tensor())
    for seen, param, same in run_ranks(body, world, timeout=60):
        assert seen == [param] and same, (seen, param)
