"""gt.simulate against the allocator: a real gloo job's per-rank peak (torch.profiler's allocation
events) next to the simulation's prediction for the same code, in one run.

    python benchmarks/simulate_check.py [--grid 2x2|2x3|line4] [--hidden 256] [--rows 64]
                                        [--pipeline]

The job: a small pre-norm MLP transformer (embedding-free: Linear in, 2 blocks of LayerNorm ->
Linear(h, 4h) -> ReLU -> Linear(4h, h) with a residual, Linear out), Megatron tensor parallel on
"tp", the batch split on "dp", one AdamW step; built and stepped inside the measured block, in a
fresh process per rank (so nothing else is alive). ``--pipeline``: the same model as two stages
of ``gt.nn.Pipeline`` on [0, 1] and [2, 3] (data parallel inside each), 4 micro-batches, 1F1B.

Per rank: the allocator's peak (the highest running sum of allocation events, the block starting
from nothing), ``gt.memory()``'s peak in the same process, and ``gt.simulate``'s peak for that
rank (played as rank 0, and for --pipeline also as rank 2: a simulation is exact for its own
stage); the collectives and bytes ``gt.comm_trace`` recorded next to the simulation's. The target
(issue 44): counts and bytes equal, the peak within 10% of the allocator's.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import globaltensor as gt
from _common import allocation_peak, allocator_profile  # benchmarks/ is on sys.path when a benchmark runs as a script

S, B = gt.sbp.split, gt.sbp.broadcast
GRIDS = {"2x2": [[0, 1], [2, 3]], "2x3": [[0, 1, 2], [3, 4, 5]], "line4": [[0, 1, 2, 3]]}


class Block(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)
        self.up = torch.nn.Linear(h, 4 * h)
        self.down = torch.nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def job(a) -> None:
    """One training step; the same code real and simulated (values do not matter)."""
    gt.init()
    torch.manual_seed(0)
    if a.pipeline:
        places = [gt.placement("cpu", [0, 1]), gt.placement("cpu", [2, 3])]
        stages = [torch.nn.Sequential(torch.nn.Linear(16, a.hidden), Block(a.hidden)),
                  torch.nn.Sequential(Block(a.hidden), torch.nn.Linear(a.hidden, 8))]
        for stage, p in zip(stages, places):
            stage.to_global(p)
        pipe = gt.nn.Pipeline(stages, microbatches=4, schedule="1f1b")
        opt = torch.optim.AdamW(list(pipe.parameters()))
        x = gt.randn(a.rows, 16, placement=places[0], sbp=S(0))
        y = gt.randint(0, 8, (a.rows,), placement=places[1], sbp=S(0))
        pipe.step(x, target=y, loss_fn=F.cross_entropy)
        opt.step()
        return
    grid = gt.placement("cpu", GRIDS[a.grid], axes=("dp", "tp"))
    model = torch.nn.Sequential(torch.nn.Linear(16, a.hidden), Block(a.hidden), Block(a.hidden),
                                torch.nn.Linear(a.hidden, 8))
    model.to_global(grid, gt.nn.sbp_plan({"*.up": gt.nn.colwise("tp"), "*.down": gt.nn.rowwise("tp")}))
    opt = torch.optim.AdamW(model.parameters())
    x = gt.randn(a.rows, 16, placement=grid, sbp=(S(0), B))
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()


def worker(local_rank, a):
    torch.set_num_threads(1)
    with allocator_profile() as prof:
        with gt.comm_trace() as trace, gt.memory() as mem:
            job(a)
    return allocation_peak(prof), mem.peak_bytes(), trace.counts(), trace.bytes_per_rank


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--grid", default="2x2", choices=sorted(GRIDS))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--pipeline", action="store_true")
    a = p.parse_args()
    world = 4 if a.pipeline else sum(len(r) for r in GRIDS[a.grid])
    real = gt.spawn(worker, args=(a,), nproc_per_node=world, timeout=600)
    sims = {}
    for played in ((0, 2) if a.pipeline else (0,)):
        with gt.simulate(world, rank=played) as sim:
            job(a)
        sims[played] = sim
    what = "pipeline 2 stages x 2 dp, 1F1B" if a.pipeline else f"{a.grid} dp x tp"
    print(f"gt.simulate vs a real run: {what}, hidden {a.hidden}, rows {a.rows}, AdamW step")
    print("rank  allocator peak  gt.memory peak  simulated peak  sim/allocator  counts equal  bytes equal")
    worst = 0.0
    for rank, (allocator, measured, counts, sent) in enumerate(real):
        played = 2 if a.pipeline and rank >= 2 else 0
        sim = sims[played]
        predicted = sim.peak_bytes(rank)
        ratio = predicted / allocator
        worst = max(worst, abs(ratio - 1))
        print(f"{rank:>4}  {allocator:>14,}  {measured:>14,}  {predicted:>14,}  {ratio:>13.3f}  "
              f"{str(sim.collectives(rank) == counts):>12}  "
              f"{str(sum(sim.comm_bytes(rank).values()) == sent):>11}")
    print(f"largest gap to the allocator: {worst:.1%} (target <= 10%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
