"""gt.nn.Pipeline against torch.distributed.pipelining, same processes, stages and data.

    python benchmarks/pipeline.py [--world 4] [--steps 6] [--hidden 1024] [--blocks 8]
                                  [--microbatches 8] [--rows 128] [--contenders a,b,...]

An MLP of ``--blocks`` residual blocks ``x + Linear(4h, h)(GELU(Linear(h, 4h)(x)))`` (hidden
``--hidden``), a batch of ``--rows`` rows split into ``--microbatches`` micro-batches, loss =
mse against a target (the mean of the micro-batches' losses), AdamW (lr 1e-4). The blocks are
built once from a seed; every contender starts from copies of them. Contenders, alternating
step by step in the same gloo processes (the order reversed every other step); a step is the
forward and backward of every micro-batch and the optimizer's step:

- ``torch-1f1b`` / ``torch-gpipe``: ``Schedule1F1B`` / ``ScheduleGPipe`` on ``--world`` stages
  of equal blocks, one per rank (``PipelineStage(stage, rank, world, cpu)``), its default
  ``scale_grads=True`` (gradients divided by the micro-batch count: the micro-batches' mean);
  the first rank passes the batch, the last the target;
- ``torch-interleaved``: ``ScheduleInterleaved1F1B`` on ``2 * world`` stages, stage i on rank
  ``i % world``;
- ``gt-1f1b`` / ``gt-gpipe`` / ``gt-interleaved``: ``gt.nn.Pipeline`` of the same stages, each
  laid out with ``stage.to_global(gt.placement("cpu", [i % world]))`` on every rank, the batch
  a global tensor broadcast on the first stage's placement and the target on the last's, one
  AdamW over every stage's parameters;

Printed per contender: the median step (the slowest rank's, after a barrier) and its ratio to
``torch-1f1b``; the step against the ideal and the floor: ``ideal = microbatches x t_fb``, where
``t_fb`` is the median time of one stage's forward + backward of one micro-batch run alone on
rank 0 (the other ranks waiting in a barrier), one rank's compute with no bubble and no waiting;
``floor = world x (microbatches x t_fb + t_opt) / min(cores, world)``, with ``t_opt`` one AdamW
step of that stage alone, is the whole step's work (every rank's forwards, backwards and
optimizer step) spread over the machine's cores: with fewer cores than ranks the cores, not the
bubble, bound the step (a rank waiting in a bubble frees its core for another); the first step's
loss (the same data and initial values: they must agree; torch's is the mean of its
per-micro-batch losses) and its difference from torch-1f1b's; on rank 0 (the first stage) the
allocator's peak above the step's start (benchmarks/_common.py ``allocator_profile``), over one whole step (the optimizer's peak, the same for every schedule), over
its forwards and backwards alone (``zero_grad`` done, the optimizer not yet: the gradients,
allocated at the first backward, plus what the schedule keeps), and the latter less this rank's
gradients' bytes (the activations and temporaries; gt's include its copy of the batch,
``gt.tensor`` made inside the step); and the largest difference of a parameter from the torch
contender of the same stage layout after every contender's steps on the same batches.
``--contenders`` runs a subset.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import globaltensor as gt
from _common import allocation_peak, allocator_profile, timed  # benchmarks/ is on sys.path when a benchmark runs as a script

B = gt.sbp.broadcast


class Block(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.up = torch.nn.Linear(h, 4 * h)
        self.down = torch.nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def stages_of(blocks, n):
    """``n`` stages of equal consecutive blocks (copies) and, per stage, its blocks' indices."""
    per = len(blocks) // n
    index = [list(range(i * per, (i + 1) * per)) for i in range(n)]
    return [torch.nn.Sequential(*copy.deepcopy([blocks[b] for b in ix])) for ix in index], index


# ------------------------------------------------------------------------------- the contenders

def torch_pipe(blocks, schedule, mb, rank, world):
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)

    n = 2 * world if schedule == "interleaved" else world
    stages, index = stages_of(blocks, n)
    mine = list(range(rank, n, world))
    pstages = [PipelineStage(stages[i], i, n, device=torch.device("cpu")) for i in mine]
    if schedule == "interleaved":
        sched = ScheduleInterleaved1F1B(pstages, n_microbatches=mb, loss_fn=F.mse_loss)
    else:
        cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
        sched = cls(pstages[0], n_microbatches=mb, loss_fn=F.mse_loss)
    params = [p for i in mine for p in stages[i].parameters()]
    first, last = 0 in mine, (n - 1) in mine

    def run(x, y):
        losses = []
        args = (x,) if first else ()
        kwargs = {"target": y, "losses": losses} if last else {}
        sched.step(*args, **kwargs)
        # the mean of the micro-batches' losses, from the last stage's rank to every rank
        value = torch.tensor([sum(v.item() for v in losses) / mb if last else 0.0],
                             dtype=torch.float64)
        dist.broadcast(value, src=(n - 1) % world)
        return value.item()

    def held():  # block index -> its parameters' values, for the blocks this rank holds
        return {b: [p.detach() for p in stages[i][j].parameters()] for i in mine
                for j, b in enumerate(index[i])}
    return run, params, held, n


def gt_pipe(blocks, schedule, mb, rank, world):
    n = 2 * world if schedule == "interleaved" else world
    stages, index = stages_of(blocks, n)
    places = [gt.placement("cpu", [r]) for r in range(world)]
    for i, stage in enumerate(stages):
        stage.to_global(places[i % world])
    pipe = gt.nn.Pipeline(stages, microbatches=mb,
                          schedule="interleaved-1f1b" if schedule == "interleaved" else schedule)
    params = [p for s in stages for p in s.parameters()]

    def run(x, y):
        gx = gt.tensor(x, placement=places[0], sbp=B)
        gy = gt.tensor(y, placement=places[(n - 1) % world], sbp=B)
        return pipe.step(gx, target=gy, loss_fn=F.mse_loss)

    def held():
        return {b: [p.to_local().detach() for p in stages[i][j].parameters()]
                for i in range(rank, n, world) for j, b in enumerate(index[i])}
    return run, params, held, n


# ------------------------------------------------------------------------------- measuring

def stage_compute(blocks, world, rows, reps=7):
    """Median seconds of one stage's forward + backward of one micro-batch on this rank, and of
    one AdamW step of the stage."""
    stage = stages_of(blocks, world)[0][0]
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-4)
    x = torch.randn(rows, blocks[0].up.in_features)
    fb, step = [], []
    for _ in range(reps + 1):
        start = time.perf_counter()
        out = stage(x)
        out.backward(torch.ones_like(out))
        fb.append(time.perf_counter() - start)
        start = time.perf_counter()
        opt.step()
        step.append(time.perf_counter() - start)
    return statistics.median(fb[1:]), statistics.median(step[1:])


def worker(local_rank, a):
    torch.set_num_threads(1)
    gt.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.blocks % (2 * world):
        raise SystemExit(f"--blocks must be a multiple of {2 * world} (interleaved stages)")
    torch.manual_seed(0)
    blocks = [Block(a.hidden) for _ in range(a.blocks)]
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(a.rows, a.hidden, generator=gen),
                torch.randn(a.rows, a.hidden, generator=gen)) for _ in range(4)]

    contenders = {}
    for name in a.contenders.split(","):
        lib, schedule = name.split("-")
        make = torch_pipe if lib == "torch" else gt_pipe
        contenders[name] = make(blocks, schedule, a.microbatches, rank, world)
    opts = {k: torch.optim.AdamW(c[1], lr=1e-4) for k, c in contenders.items()}

    def step(name, batch, around_pipeline=contextlib.nullcontext):
        opts[name].zero_grad()
        with around_pipeline():
            loss = contenders[name][0](*batch)
        opts[name].step()
        return loss

    # one stage's compute alone: rank 0 works, the others wait in the barrier
    t_fb = t_opt = None
    dist.barrier()
    if rank == 0:
        t_fb, t_opt = stage_compute(blocks, world, a.rows // a.microbatches)
    dist.barrier()

    first = {k: step(k, batches[0]) for k in contenders}  # warm-up, same data
    times = {k: [] for k in contenders}
    names = list(contenders)
    for i in range(a.steps):
        for k in (names if i % 2 == 0 else names[::-1]):
            times[k].append(timed(lambda k=k: step(k, batches[1 + i % 3])))
    memory = {}
    for k in contenders:  # the whole step, then the pipeline's part alone (no optimizer)
        dist.barrier()
        with allocator_profile() as whole:
            step(k, batches[1])
        dist.barrier()
        pipeline_part = []

        @contextlib.contextmanager
        def around():
            with allocator_profile() as prof:
                yield
            pipeline_part.append(prof)

        step(k, batches[1], around)
        grads = sum(g.numel() * g.element_size() for ps in contenders[k][2]().values() for g in ps)
        memory[k] = (allocation_peak(whole), allocation_peak(pipeline_part[0]), grads)
    apart = {}
    for k, (_, _, held, n) in contenders.items():
        ref = next((r for r in (f"torch-{k.split('-')[1].split('+')[0]}", "torch-1f1b")
                    if r in contenders and contenders[r][3] == n), None)
        mine, theirs = held(), contenders[ref][2]() if ref else {}
        diff = torch.tensor([float("nan") if ref is None else max(
            (u - v).abs().max().item() for b in mine for u, v in zip(mine[b], theirs[b]))],
            dtype=torch.float64)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        apart[k] = diff.item()
    if rank != 0:
        return None
    return {"t_fb": t_fb, "t_opt": t_opt, "cores": os.cpu_count(),
            "rows": {k: (statistics.median(v), first[k], memory[k], apart[k])
                     for k, v in times.items()}}


CONTENDERS = "torch-1f1b,torch-gpipe,torch-interleaved,gt-1f1b,gt-gpipe,gt-interleaved"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--contenders", default=CONTENDERS,
                    help=f"comma-separated, from {CONTENDERS} (torch-1f1b is the reference)")
    a = ap.parse_args()
    out = gt.spawn(worker, args=(a,), nproc_per_node=a.world, timeout=3600)[0]
    rows, t_fb = out["rows"], out["t_fb"]
    ideal = a.microbatches * t_fb
    floor = a.world * (ideal + out["t_opt"]) / min(out["cores"], a.world)
    ref = rows.get("torch-1f1b", next(iter(rows.values())))[0]
    print(f"pipeline: {a.blocks} blocks, hidden {a.hidden}, {a.rows} rows in {a.microbatches} "
          f"micro-batches, {a.world} gloo ranks on {out['cores']} cores, {a.steps} steps each "
          f"(median of the slowest rank)")
    print(f"one stage's forward+backward of one micro-batch alone: t_fb {t_fb * 1e3:.1f} ms; "
          f"ideal step {ideal * 1e3:.1f} ms (microbatches x t_fb), core floor "
          f"{floor * 1e3:.1f} ms (world x (ideal + t_opt) / min(cores, world)), t_opt "
          f"{out['t_opt'] * 1e3:.1f} ms (a stage's AdamW step alone)")
    print(f"{'contender':<19}{'step ms':>9}{'/ torch-1f1b':>14}{'/ ideal':>9}{'/ floor':>9}"
          f"{'first loss':>12}{'- torch-1f1b':>13}{'step peak MiB':>15}{'fwd+bwd MiB':>13}"
          f"{'- grads':>9}{'params apart':>14}")
    ref_loss = rows.get("torch-1f1b", next(iter(rows.values())))[1]
    for k, (t, loss, (alloc, alloc_fb, grads), apart) in rows.items():
        print(f"{k:<19}{t * 1e3:9.1f}{t / ref:14.2f}{t / ideal:9.2f}{t / floor:9.2f}"
              f"{loss:12.7f}{loss - ref_loss:13.1e}{alloc / 2**20:15.1f}{alloc_fb / 2**20:13.1f}"
              f"{(alloc_fb - grads) / 2**20:9.1f}{apart:14.2e}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
