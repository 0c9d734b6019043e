"""DDP step time: gt.nn.parallel.DistributedDataParallel and a global model against torch's DDP.

    python benchmarks/ddp.py [--nproc 4] [--steps 20] [--batch 16] [--width 2048]

Four real processes (gt.spawn) on gloo, each training its own copy of a ~10M-parameter MLP three
ways: gt's DDP wrapper ("gt"), the model made global (``to_global(placement, B)``, the batch
``S(0)``: the gradient hooks and buckets of grads.py, "global") and torch's DDP ("torch"); steps
rotate among them so load on the machine hits all alike.
A step is forward + backward + SGD; every step starts after a barrier, and its time is the
slowest rank's. Prints the median step time of each and their ratio (target <= 1.05), and the
ratio of the fastest steps (less sensitive to other load on the machine).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import globaltensor as gt
from globaltensor.nn.parallel import DistributedDataParallel as GtDDP


def mlp(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(1024, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 256))


def timed_step(model, opt, x, y) -> float:
    gt.comm.barrier()
    start = time.perf_counter()
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    took = time.perf_counter() - start
    return gt.comm.all_reduce(took, reduce_op="max")  # the slowest rank sets the pace


def worker(local_rank: int, steps: int, batch: int, width: int, threads: int):
    torch.set_num_threads(threads)
    gt.init()
    base = mlp(width)
    params = sum(p.numel() for p in base.parameters())
    everyone = gt.placement("cpu", list(range(gt.env.get_world_size())))
    models = {"gt": GtDDP(copy.deepcopy(base)), "torch": TorchDDP(copy.deepcopy(base)),
              "global": copy.deepcopy(base).to_global(everyone, gt.sbp.broadcast)}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    gen = torch.Generator().manual_seed(local_rank)
    times = {k: [] for k in models}
    names = list(models)
    for step in range(steps + 3):
        x, y = torch.randn(batch, 1024, generator=gen), torch.randn(batch, 256, generator=gen)
        batches = {"global": tuple(gt.from_local(t, everyone, gt.sbp.split(0)) for t in (x, y))}
        for name in names[step % 3:] + names[:step % 3]:
            took = timed_step(models[name], opts[name], *batches.get(name, (x, y)))
            if step >= 3:  # warm-up steps are not counted
                times[name].append(took)
    same = all(torch.allclose(a, b, atol=1e-5) and torch.allclose(g.full_tensor(), b, atol=1e-5)
               for a, b, g in zip(models["gt"].parameters(), models["torch"].parameters(),
                                  models["global"].parameters()))
    return params, times, same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    a = ap.parse_args()
    params, times, same = gt.spawn(worker, args=(a.steps, a.batch, a.width, a.threads),
                                   nproc_per_node=a.nproc, timeout=1800)[0]
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"DDP step, {params / 1e6:.1f}M-parameter MLP, batch {a.batch}/rank, {a.nproc} ranks "
          f"(gloo, {a.threads} thread/rank), {a.steps} steps each, median of slowest rank:")
    for k, v in times.items():
        print(f"  {k:6s} {med[k] * 1e3:8.1f} ms   (min {min(v) * 1e3:.1f}, max {max(v) * 1e3:.1f})")
    for k in ("gt", "global"):
        print(f"  ratio {k}/torch = {med[k] / med['torch']:.3f} median, "
              f"{min(times[k]) / min(times['torch']):.3f} fastest   (target <= 1.05)")
    print(f"  same parameters after training: {same}")


if __name__ == "__main__":
    main()
