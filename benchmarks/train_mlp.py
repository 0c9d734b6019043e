"""One training step of the tensor-parallel x data-parallel MLP: global tensors against a
hand-written version on local tensors with explicit collectives, in the same run.

    python benchmarks/train_mlp.py [--steps 40] [--batch 64] [--dim 256] [--hidden 1024]

Four processes (gt.spawn) form a 2x2 grid: axis 0 data parallel, axis 1 tensor parallel
(W1 split(1) by columns, W2 split(0) by rows), as in examples/quickstart.py. A step is forward,
MSE loss, backward and AdamW. The hand-written version holds the same pieces as plain tensors and
calls torch.distributed itself: an all_reduce of the partial outputs across the tensor-parallel
group (identity in backward), then an all_reduce of the weight gradients across the
data-parallel group. Steps alternate (global, local, global, ...) after a barrier; a step's time
is the slowest rank's. Prints the median step time of each, their ratio (target <= 1.2) and two
readings that a busy machine disturbs less: the median over steps of the ratio of each global
step to the hand-written step right after it (the two run under about the same load), and the
ratio of the CPU time the four processes spend per step (median of the sum over ranks). The
ranks run with glibc's malloc told to keep freed memory, as in benchmarks/redistribute.py (both
versions allocate fresh gradients and buffers every step; --no-malloc-tuning for defaults).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import globaltensor as gt

S, B = gt.sbp.split, gt.sbp.broadcast
MALLOC_TUNING = "glibc.malloc.trim_threshold=4294967296:glibc.malloc.mmap_threshold=33554432"


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


def timed(step, device_sync=lambda: None) -> tuple[float, float]:
    """(the slowest rank's wall time, the CPU time of all ranks together) of one step."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    step()
    device_sync()
    wall = torch.tensor([time.perf_counter() - start])
    cpu = torch.tensor([time.process_time() - cpu])
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)
    return wall.item(), cpu.item()


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
    return t_ours, t_theirs


def summary(t_ours, t_theirs) -> dict:
    wall_ours, wall_theirs = [w for w, _ in t_ours], [w for w, _ in t_theirs]
    return {
        "median": (statistics.median(wall_ours), statistics.median(wall_theirs)),
        "fastest": (min(wall_ours), min(wall_theirs)),
        "paired": statistics.median(a / b for a, b in zip(wall_ours, wall_theirs)),
        "cpu": (statistics.median(c for _, c in t_ours), statistics.median(c for _, c in t_theirs)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--no-malloc-tuning", action="store_true", help="glibc's default malloc")
    cfg = parser.parse_args()
    if not cfg.no_malloc_tuning:  # read by each rank's process at start (gt.spawn starts them)
        tunables = [t for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t]
        os.environ["GLIBC_TUNABLES"] = ":".join(tunables + [MALLOC_TUNING])
    load = os.getloadavg()[0]
    t_ours, t_theirs = gt.spawn(worker, args=(cfg,), nproc_per_node=4)[0]
    r = summary(t_ours, t_theirs)
    print(f"TP x DP MLP step on a 2x2 gloo grid: batch {cfg.batch}, {cfg.dim} -> {cfg.hidden} -> "
          f"{cfg.dim}, float32, {cfg.steps} steps each (milliseconds); 1-min load average "
          f"{load:.1f} at start, {os.getloadavg()[0]:.1f} at end"
          f"{'' if cfg.no_malloc_tuning else '; malloc keeps freed memory'}")
    print(f"{'':22} {'median':>8} {'fastest':>8} {'CPU, 4 ranks':>13}")
    for name, k in (("global tensors", 0), ("hand-written local", 1)):
        print(f"{name:22} {r['median'][k] * 1e3:8.2f} {r['fastest'][k] * 1e3:8.2f} "
              f"{r['cpu'][k] * 1e3:13.2f}")
    ratio = r["median"][0] / r["median"][1]
    print(f"ratio global / hand-written: median {ratio:.2f}, fastest "
          f"{r['fastest'][0] / r['fastest'][1]:.2f}, paired median {r['paired']:.2f}, CPU "
          f"{r['cpu'][0] / r['cpu'][1]:.2f} (target <= 1.2 on the median: "
          f"{'met' if ratio <= 1.2 else 'NOT met'})")


if __name__ == "__main__":
    main()
