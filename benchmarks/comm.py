"""gt.comm against raw torch.distributed, call by call, in the same run.

    python benchmarks/comm.py [--nproc 4] [--sizes 4K,64K,1M,16M] [--reps 20]

Real processes (gt.spawn) on gloo. For each collective and message size, gt.comm's call and the
torch.distributed call it stands for alternate (so machine load hits both alike); each timed
call starts after a barrier and counts the slowest rank. Prints median times and the ratio
gt/torch (target <= 1.05 at 1 MiB and above). "value" rows are value-style calls, which also
return a new tensor (all_gather exchanges shapes first, to allow differently sized tensors).

On a loaded machine the medians of two identical calls differ by tens of percent, so the run
ends with the one number load cannot blur: the time gt.comm adds per call, measured in this
process on a world of 1 (a real gloo group; the collective itself is nearly free there),
thousands of calls each, best of several rounds.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import globaltensor as gt
from _common import parse_size, timed  # benchmarks/ is on sys.path when run as a script


def _raw_gather_any_shape(t, n: int):
    """What a hand-written gather of tensors of unknown shapes does: shapes, then the data."""
    shapes = torch.empty(n * 2, dtype=torch.int64)
    dist.all_gather_single(shapes, torch.tensor([t.dim(), t.numel()]))
    return dist.all_gather_single(torch.empty(n * t.numel()), t)


def cases(n: int, numel: int):
    """name -> (gt call, torch call); each call takes no argument and returns nothing useful."""
    t = torch.ones(numel)
    out_list = [torch.empty(numel) for _ in range(n)]
    big, piece = torch.empty(n * numel), torch.empty(numel)
    return {
        "all_reduce": (lambda: gt.comm.all_reduce(t), lambda: dist.all_reduce(t)),
        "all_reduce value mean": (lambda: gt.comm.all_reduce(t, reduce_op="mean"),
                                  lambda: dist.all_reduce(t.clone(), op=dist.ReduceOp.AVG)),
        "broadcast": (lambda: gt.comm.broadcast(t, src=0), lambda: dist.broadcast(t, src=0)),
        "all_gather": (lambda: gt.comm.all_gather(out_list, t),
                       lambda: dist.all_gather(out_list, t)),
        "all_gather value": (lambda: gt.comm.all_gather(t),
                             lambda: dist.all_gather_single(torch.empty(n * numel), t)),
        # like for like: value style takes tensors of any shapes, so raw exchanges shapes first too
        "all_gather value vs raw+shapes": (lambda: gt.comm.all_gather(t),
                                           lambda: _raw_gather_any_shape(t, n)),
        "all_gather_into_tensor": (lambda: gt.comm.all_gather_into_tensor(big, t),
                                   lambda: dist.all_gather_single(big, t)),
        "reduce_scatter_tensor": (lambda: gt.comm.reduce_scatter_tensor(piece, big),
                                  lambda: dist.reduce_scatter_single(piece, big)),
    }


def worker(local_rank: int, sizes: list[int], reps: int, threads: int):
    torch.set_num_threads(threads)
    gt.init()
    n = dist.get_world_size()
    rows = []
    for nbytes in sizes:
        for name, (ours, theirs) in cases(n, nbytes // 4).items():
            times = {"gt": [], "torch": []}
            for rep in range(reps + 2):
                pair = (("gt", ours), ("torch", theirs)) if rep % 2 else (("torch", theirs), ("gt", ours))
                for who, call in pair:
                    took = timed(call)
                    if rep >= 2:
                        times[who].append(took)
            rows.append((name, nbytes, statistics.median(times["gt"]),
                         statistics.median(times["torch"]), min(times["gt"]), min(times["torch"])))
    return rows


def overhead_us(calls: int = 3000, rounds: int = 5) -> dict[str, tuple[float, float]]:
    """Microseconds per call of gt.comm and of torch.distributed, on a world of 1 in-process."""
    gt.init()  # nothing set in the environment: a world of 1
    result = {}
    for name, (ours, theirs) in cases(1, 1024).items():
        best = {}
        for who, call in (("gt", ours), ("torch", theirs)):
            per_round = []
            for _ in range(rounds):
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                per_round.append((time.perf_counter() - start) / calls * 1e6)
            best[who] = min(per_round)
        result[name] = (best["gt"], best["torch"])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--sizes", default="4K,64K,1M,16M")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    rows = gt.spawn(worker, args=(sizes, a.reps, a.threads), nproc_per_node=a.nproc,
                    timeout=1800)[0]
    print(f"gt.comm vs torch.distributed, {a.nproc} ranks, gloo, float32, median of {a.reps} "
          f"(slowest rank per call)")
    print(f"{'collective':24s} {'size':>6s} {'gt ms':>9s} {'torch ms':>9s} {'ratio':>6s} "
          f"{'min ratio':>9s}")
    for name, nbytes, ours, theirs, ours_min, theirs_min in rows:
        size = f"{nbytes // 1024 ** 2}M" if nbytes >= 1024 ** 2 else f"{nbytes // 1024}K"
        print(f"{name:24s} {size:>6s} {ours * 1e3:9.3f} {theirs * 1e3:9.3f} {ours / theirs:6.3f} "
              f"{ours_min / theirs_min:9.3f}")
    print("\nper-call cost on a world of 1 (4 KiB, best of 5 x 3000 calls):")
    print(f"{'collective':24s} {'gt us':>8s} {'torch us':>9s} {'added us':>9s}")
    for name, (ours, theirs) in overhead_us().items():
        print(f"{name:24s} {ours:8.1f} {theirs:9.1f} {ours - theirs:9.1f}")


if __name__ == "__main__":
    main()
