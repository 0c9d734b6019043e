"""One training step of the tensor-parallel x data-parallel MLP: global tensors against a
hand-written version on local tensors with explicit collectives, in the same run.

    python benchmarks/train_mlp.py [--steps 20] [--batch 64] [--dim 256] [--hidden 1024]

Four processes (gt.spawn) form a 2x2 grid: axis 0 data parallel, axis 1 tensor parallel
(W1 split(1) by columns, W2 split(0) by rows), as in examples/quickstart.py. A step is forward,
MSE loss, backward and AdamW. The hand-written version holds the same pieces as plain tensors and
calls torch.distributed itself: an all_reduce of the partial outputs across the tensor-parallel
group (identity in backward), then an all_reduce of the weight gradients across the
data-parallel group. Steps alternate (global, local, global, ...) after a barrier; a step's time
is the slowest rank's. Prints the median step time of each and their ratio (target <= 1.2).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import globaltensor as gt

S, B = gt.sbp.split, gt.sbp.broadcast


class _SumOverGroup(torch.autograd.Function):
    """Forward: all_reduce(sum) over ``group``; backward: identity (the loss is replicated)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def full_values(cfg):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(cfg.batch, cfg.dim, generator=gen), torch.randn(cfg.batch, cfg.dim, generator=gen),
            torch.randn(cfg.dim, cfg.hidden, generator=gen) / cfg.dim ** 0.5,
            torch.randn(cfg.hidden, cfg.dim, generator=gen) / cfg.hidden ** 0.5)


def global_step(cfg, grid):
    x, y, w1, w2 = full_values(cfg)
    params = [torch.nn.Parameter(w1), torch.nn.Parameter(w2)]
    model = torch.nn.ParameterList(params).to_global(grid, lambda n, t: (B, S(1)) if n == "0" else (B, S(0)))
    gx, gy = (gt.tensor(t, placement=grid, sbp=(S(0), B)) for t in (x, y))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        loss = F.mse_loss(torch.relu(gx @ model[0]) @ model[1], gy)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return step


def local_step(cfg, rank):
    x, y, w1, w2 = full_values(cfg)
    dp, tp = divmod(rank, 2)                                   # grid [[0, 1], [2, 3]]
    # every rank creates every group, in the same order
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_group, dp_group = tp_groups[dp], dp_groups[tp]
    rows, cols = cfg.batch // 2, cfg.hidden // 2
    lx, ly = x[dp * rows:(dp + 1) * rows], y[dp * rows:(dp + 1) * rows]
    p1 = torch.nn.Parameter(w1[:, tp * cols:(tp + 1) * cols].clone())
    p2 = torch.nn.Parameter(w2[tp * cols:(tp + 1) * cols].clone())
    opt = torch.optim.AdamW([p1, p2], lr=1e-3)
    scale = rows / cfg.batch                                   # local mean -> share of global mean

    def step():
        out = _SumOverGroup.apply(torch.relu(lx @ p1) @ p2, tp_group)
        loss = F.mse_loss(out, ly) * scale
        opt.zero_grad()
        loss.backward()
        for p in (p1, p2):
            dist.all_reduce(p.grad, group=dp_group)
        opt.step()
    return step


def timed(step, device_sync=lambda: None) -> float:
    dist.barrier()
    start = time.perf_counter()
    step()
    device_sync()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def worker(local_rank, cfg):
    gt.init()
    torch.set_num_threads(1)
    rank = gt.env.get_rank()
    grid = gt.placement("cpu", [[0, 1], [2, 3]])
    ours, theirs = global_step(cfg, grid), local_step(cfg, rank)
    for _ in range(3):
        ours()
        theirs()
    t_ours, t_theirs = [], []
    for _ in range(cfg.steps):
        t_ours.append(timed(ours))
        t_theirs.append(timed(theirs))
    return statistics.median(t_ours), statistics.median(t_theirs), min(t_ours), min(t_theirs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    cfg = parser.parse_args()
    results = gt.spawn(worker, args=(cfg,), nproc_per_node=4)
    med_ours, med_theirs, min_ours, min_theirs = results[0]
    print(f"TP x DP MLP step on a 2x2 gloo grid: batch {cfg.batch}, {cfg.dim} -> {cfg.hidden} -> "
          f"{cfg.dim}, float32, {cfg.steps} steps each (milliseconds)")
    print(f"{'':22} {'median':>8} {'fastest':>8}")
    print(f"{'global tensors':22} {med_ours * 1e3:8.2f} {min_ours * 1e3:8.2f}")
    print(f"{'hand-written local':22} {med_theirs * 1e3:8.2f} {min_theirs * 1e3:8.2f}")
    ratio = med_ours / med_theirs
    print(f"ratio global / hand-written: median {ratio:.2f}, fastest {min_ours / min_theirs:.2f} "
          f"(target <= 1.2: {'met' if ratio <= 1.2 else 'NOT met'})")


if __name__ == "__main__":
    main()
