"""Redistribution: raw torch.distributed vs DTensor.redistribute vs x.to_global(sbp=...), side by side.

    python benchmarks/redistribute.py [--sizes 4K,32M] [--reps 10] [--runs 1] [--threads 1]

Four real processes (gt.spawn) on gloo, float32. Each case starts from the same local pieces;
per repetition the three contenders run in rotating order, each call after a barrier, timed on
its slowest rank (cases whose calls take under 5 ms run 5x the repetitions). Prints the median
of the repetitions and the ratios ours/raw and ours/DTensor (of the medians, and of the fastest
calls, which machine load blurs less). "raw" is hand-written torch.distributed code for the same
data movement as ours (the fewest collectives and copies we know of), producing a contiguous
local result. On gloo gt runs gathers, reduce_scatters and all_reduces as batches of
isend/irecv, so raw does too; the rows named after a collective ("S0->B all_gather", "P->B
all_reduce", ...) time the common idiom instead (that one torch.distributed collective), and
"uneven S0->B pad" the idiom for uneven pieces (pad, all_gather, trim).

The ranks run with glibc's malloc told to keep freed memory (trim and mmap thresholds raised,
see MALLOC_TUNING): every contender allocates its result fresh, and with glibc's default
heuristics an 8 MiB allocation now and then lands on memory just returned to the OS and pays
~2048 page faults (1-2 ms), on whichever contender happens to run then. --no-malloc-tuning
keeps the defaults.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics

import torch
import torch.distributed as dist

import globaltensor as gt
from _common import parse_size, timed  # benchmarks/ is on sys.path when run as a script

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
WORLD = 4
# keep freed memory in the heap (no trimming; allocations below 32 MiB, glibc's largest allowed
# threshold, never mmapped): results are comparable run to run, not luck of the allocator
MALLOC_TUNING = "glibc.malloc.trim_threshold=4294967296:glibc.malloc.mmap_threshold=33554432"


def shape_for(nbytes: int, uneven: bool) -> tuple[int, int]:
    """A 2-D float32 shape of about ``nbytes``, both dims divisible by 4 (rows - 1 if uneven)."""
    numel = nbytes // 4
    cols = 32 if numel <= 4096 else 4096
    rows = numel // cols
    return (rows - 1, cols) if uneven else (rows, cols)


# --------------------------------------------------------------------------- raw torch.distributed


def raw_gather_rows(local, rows_each, group=None, n=WORLD):
    """S(0) -> B: all_gather, padding uneven pieces to the largest and trimming after."""
    big = max(rows_each)
    if min(rows_each) == big:
        out = local.new_empty((n * big,) + tuple(local.shape[1:]))
        dist.all_gather_single(out, local, group=group)
        return out
    send = local.new_zeros((big,) + tuple(local.shape[1:]))
    send[: local.shape[0]] = local
    buf = local.new_empty((n * big,) + tuple(local.shape[1:]))
    dist.all_gather_single(buf, send, group=group)
    return torch.cat([buf[k * big: k * big + r] for k, r in enumerate(rows_each)])


def raw_gather_rows_p2p(local, rows_each, rank, n=WORLD):
    """S(0) -> B for uneven pieces without padding: each rank sends its rows to every other
    rank and receives theirs straight into their rows of the result (one batch of isend/irecv)."""
    starts = [sum(rows_each[:k]) for k in range(n)]
    out = local.new_empty((sum(rows_each),) + tuple(local.shape[1:]))
    out[starts[rank]: starts[rank] + rows_each[rank]] = local
    ops = []
    for k in range(n):
        if k != rank:
            ops.append(dist.P2POp(dist.isend, local, k))
            ops.append(dist.P2POp(dist.irecv, out[starts[k]: starts[k] + rows_each[k]], k))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out


def raw_gather_p2p(local, dim, members, rank):
    """S(dim) -> B among ``members`` (global ranks in axis order), even pieces, as gt runs it on
    gloo: one batch of isend/irecv, each piece received straight into its rows along dim 0,
    into a buffer and then placed along another dim."""
    me, size = members.index(rank), local.shape[dim]
    shape = list(local.shape)
    shape[dim] = size * len(members)
    out = local.new_empty(shape)
    out.narrow(dim, me * size, size).copy_(local)
    ops, landing = [], []
    for k, peer in enumerate(members):
        if peer != rank:
            place = out.narrow(dim, k * size, size)
            buf = place if dim == 0 else torch.empty_like(local)
            ops += [dist.P2POp(dist.isend, local, peer), dist.P2POp(dist.irecv, buf, peer)]
            landing.append((place, buf))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for place, buf in landing:
        if buf is not place:
            place.copy_(buf)
    return out


def raw_reduce_scatter_p2p(local, rank, n=WORLD):
    """P -> S(0) as gt runs it on gloo: each rank isends every other rank its rows, receives its
    own rows from each, and sums them in rank order (even rows)."""
    rows = local.shape[0] // n
    parts, ops = {rank: local[rank * rows: (rank + 1) * rows]}, []
    for k in range(n):
        if k != rank:
            parts[k] = local.new_empty((rows,) + tuple(local.shape[1:]))
            ops += [dist.P2POp(dist.isend, local[k * rows: (k + 1) * rows], k),
                    dist.P2POp(dist.irecv, parts[k], k)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    out = parts[0].clone()
    for k in range(1, n):
        out += parts[k]
    return out


def raw_all_reduce_p2p(local, rank, n=WORLD):
    """P -> B as gt runs it on gloo: the reduce_scatter above on the flattened piece, with the
    gather's receives posted up front (tag 1), then this rank's summed run sent to every other
    rank (even runs)."""
    flat = local.view(-1)
    run = flat.numel() // n
    out = flat.new_empty(flat.shape)
    parts, scatter, gather = {rank: flat[rank * run: (rank + 1) * run]}, [], []
    for k in range(n):
        if k != rank:
            parts[k] = flat.new_empty(run)
            scatter += [dist.P2POp(dist.isend, flat[k * run: (k + 1) * run], k),
                        dist.P2POp(dist.irecv, parts[k], k)]
            gather.append(dist.P2POp(dist.irecv, out[k * run: (k + 1) * run], k, tag=1))
    scattering, gathering = dist.batch_isend_irecv(scatter), dist.batch_isend_irecv(gather)
    for work in scattering:
        work.wait()
    mine = torch.add(parts[0], parts[1], out=out[rank * run: (rank + 1) * run])
    for k in range(2, n):
        mine += parts[k]
    sends = [dist.P2POp(dist.isend, mine, k, tag=1) for k in range(n) if k != rank]
    for work in gathering + dist.batch_isend_irecv(sends):
        work.wait()
    return out.view(local.shape)


def raw_s0_to_s1(local):
    rows, cols = local.shape
    send = local.view(rows, WORLD, cols // WORLD).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return recv.view(rows * WORLD, cols // WORLD)


def raw_all_reduce(local):
    out = local.clone()
    dist.all_reduce(out)
    return out


def raw_reduce_scatter(local):
    out = local.new_empty((local.shape[0] // WORLD,) + tuple(local.shape[1:]))
    dist.reduce_scatter_single(out, local)
    return out


def raw_slice(local, rank):
    rows = local.shape[0] // WORLD
    return local[rank * rows: (rank + 1) * rows].clone()


def raw_grid_gather_p2p(local, rank):
    """(S(0), S(1)) -> (B, B) on [[0, 1], [2, 3]] as gt runs it on gloo: dim 1 among the row's
    ranks, then dim 0 among the column's, each as one batch of isend/irecv."""
    row, col = [2 * (rank // 2), 2 * (rank // 2) + 1], [rank % 2, rank % 2 + 2]
    return raw_gather_p2p(raw_gather_p2p(local, 1, row, rank), 0, col, rank)


def raw_grid_gather(local, row_group, col_group):
    """(S(0), S(1)) -> (B, B) on [[0, 1], [2, 3]] with all_gather (the idiom): gather dim 1
    along axis 1, then dim 0 along axis 0."""
    rows, cols = local.shape
    half = local.new_empty((2 * rows, cols))
    dist.all_gather_single(half, local.contiguous(), group=row_group)
    wide = half.view(2, rows, cols).movedim(0, 1).reshape(rows, 2 * cols)
    out = wide.new_empty((2 * wide.shape[0], wide.shape[1]))
    dist.all_gather_single(out, wide, group=col_group)
    return out


# --------------------------------------------------------------------------- the cases


def build_cases(rank, nbytes, groups):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    line = gt.placement("cpu", list(range(WORLD)))
    grid = gt.placement("cpu", [[0, 1], [2, 3]])
    mesh1 = init_device_mesh("cpu", (WORLD,))
    mesh2 = init_device_mesh("cpu", (2, 2))
    to_dt = {"S(0)": Shard(0), "S(1)": Shard(1), "B": Replicate(), "P": Partial()}
    cases = []

    def add(name, placement, mesh, src, dst, raw, uneven=False):
        shape = shape_for(nbytes, uneven)
        full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
        layout = gt.Layout(placement, src, shape)
        coord = placement.coord_of(rank)
        local = full[layout.slices(coord)].contiguous()
        # uneven pieces need the shape exchange (check_meta); made once, outside the timing
        ours = local.to_global(placement=placement, sbp=src, check_meta=uneven, sync_data=False)
        dt = DTensor.from_local(local, mesh, [to_dt[str(v)] for v in src], run_check=False,
                                shape=torch.Size(shape), stride=full.stride())
        dt_dst = [to_dt[str(v)] for v in dst]

        def theirs():
            t = dt.redistribute(mesh, dt_dst).to_local()
            return t.wait() if hasattr(t, "wait") else t

        cases.append((name, {"raw": lambda: raw(local),
                             "dtensor": theirs,
                             "ours": lambda: ours.to_global(sbp=dst).to_local()}))

    rows = shape_for(nbytes, True)[0]
    uneven_rows = [rows // WORLD + (1 if k < rows % WORLD else 0) for k in range(WORLD)]
    add("S0->B", line, mesh1, (S(0),), (B,), lambda x: raw_gather_p2p(x, 0, list(range(WORLD)), rank))
    add("S0->B all_gather", line, mesh1, (S(0),), (B,),
        lambda x: raw_gather_rows(x, [x.shape[0]] * WORLD))
    add("P->B", line, mesh1, (P,), (B,), lambda x: raw_all_reduce_p2p(x, rank))
    add("P->B all_reduce", line, mesh1, (P,), (B,), raw_all_reduce)
    add("P->S0", line, mesh1, (P,), (S(0),), lambda x: raw_reduce_scatter_p2p(x, rank))
    add("P->S0 reduce_scatter", line, mesh1, (P,), (S(0),), raw_reduce_scatter)
    add("S0->S1", line, mesh1, (S(0),), (S(1),), raw_s0_to_s1)
    add("B->S0", line, mesh1, (B,), (S(0),), lambda x: raw_slice(x, rank))
    add("uneven S0->B", line, mesh1, (S(0),), (B,),
        lambda x: raw_gather_rows_p2p(x, uneven_rows, rank), uneven=True)
    add("uneven S0->B pad", line, mesh1, (S(0),), (B,),
        lambda x: raw_gather_rows(x, uneven_rows), uneven=True)
    add("(S0,S1)->(B,B)", grid, mesh2, (S(0), S(1)), (B, B), lambda x: raw_grid_gather_p2p(x, rank))
    add("(S0,S1)->(B,B) all_gather", grid, mesh2, (S(0), S(1)), (B, B),
        lambda x: raw_grid_gather(x, *groups[rank]))
    return cases


def make_groups():
    """Row and column groups of the 2x2 grid, created on every rank in one order."""
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cols = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return {0: (rows[0], cols[0]), 1: (rows[0], cols[1]), 2: (rows[1], cols[0]),
            3: (rows[1], cols[1])}


def check_same(rank, name, calls):
    got = {who: call() for who, call in calls.items()}
    for who, value in got.items():
        if not torch.equal(value, got["raw"]):
            raise AssertionError(f"rank {rank}: {name}: {who} differs from raw")


def worker(local_rank, sizes, reps, threads, only=None):
    torch.set_num_threads(threads)
    gt.init(backend="gloo")
    rank = dist.get_rank()
    groups = make_groups()
    rows = []
    for nbytes in sizes:
        for name, calls in build_cases(rank, nbytes, groups):
            if only and name not in only:
                continue
            check_same(rank, name, calls)
            times = {who: [] for who in calls}
            orders = itertools.cycle(itertools.permutations(calls))
            warm = [timed(calls[who]) for who in next(orders)]  # caches (plans, groups)
            # calls of a few ms are the noisiest relative to their size: repeat them more
            for rep in range(reps * (5 if max(warm) < 5e-3 else 1)):
                for who in next(orders):
                    times[who].append(timed(calls[who]))
            rows.append((name, nbytes, {w: statistics.median(t) for w, t in times.items()},
                         {w: min(t) for w, t in times.items()}))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4K,32M")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=1, help="whole runs, summarised together")
    ap.add_argument("--cases", default="", help="case names separated by ';' (default: all)")
    ap.add_argument("--no-malloc-tuning", action="store_true", help="glibc's default malloc")
    a = ap.parse_args()
    if not a.no_malloc_tuning:  # read by each rank's process at start (gt.spawn starts them)
        tunables = [t for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t]
        os.environ["GLIBC_TUNABLES"] = ":".join(tunables + [MALLOC_TUNING])
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    only = [c for c in a.cases.split(";") if c]
    loads, runs = [os.getloadavg()[0]], []
    for _ in range(a.runs):
        runs.append(gt.spawn(worker, args=(sizes, a.reps, a.threads, only), nproc_per_node=WORLD,
                             timeout=3600)[0])
        loads.append(os.getloadavg()[0])
    print(f"redistribution, {WORLD} ranks, gloo, float32, median of {a.reps} (slowest rank per call)"
          f"{'' if a.no_malloc_tuning else ', malloc keeps freed memory'}; 1-min load average "
          + ", ".join(f"{x:.1f}" for x in loads) + " (start, after each run)")
    if a.runs == 1:
        _print_run(runs[0])
    else:
        _print_runs(runs)


def _size(nbytes: int) -> str:
    return f"{nbytes // 1024 ** 2}M" if nbytes >= 1024 ** 2 else f"{nbytes // 1024}K"


def _print_run(rows) -> None:
    print(f"{'case':26s} {'size':>5s} {'raw ms':>9s} {'DTensor ms':>11s} {'ours ms':>9s} "
          f"{'ours/raw':>9s} {'ours/DT':>8s}   (ratios of the fastest calls)")
    for name, nbytes, t, m in rows:
        print(f"{name:26s} {_size(nbytes):>5s} {t['raw'] * 1e3:9.3f} {t['dtensor'] * 1e3:11.3f} "
              f"{t['ours'] * 1e3:9.3f} {t['ours'] / t['raw']:9.2f} {t['ours'] / t['dtensor']:8.2f}"
              f"   ({m['ours'] / m['raw']:.2f}, {m['ours'] / m['dtensor']:.2f})")


def _print_runs(runs) -> None:
    """Per case: the median over runs of each run's median time, and the median [min-max] over
    runs of each run's ratio."""
    print(f"{len(runs)} runs: times are the median of the runs' medians; ratios the median "
          f"[lowest-highest] of the runs' ratios")
    print(f"{'case':26s} {'size':>5s} {'raw ms':>9s} {'DTensor ms':>11s} {'ours ms':>9s} "
          f"{'ours/raw':>17s} {'ours/DTensor':>17s}")
    for k, (name, nbytes, _, _) in enumerate(runs[0]):
        t = {who: statistics.median(run[k][2][who] for run in runs) for who in ("raw", "dtensor", "ours")}
        vs_raw = [run[k][2]["ours"] / run[k][2]["raw"] for run in runs]
        vs_dt = [run[k][2]["ours"] / run[k][2]["dtensor"] for run in runs]
        print(f"{name:26s} {_size(nbytes):>5s} {t['raw'] * 1e3:9.3f} {t['dtensor'] * 1e3:11.3f} "
              f"{t['ours'] * 1e3:9.3f} "
              f"{statistics.median(vs_raw):5.2f} [{min(vs_raw):.2f}-{max(vs_raw):.2f}] "
              f"{statistics.median(vs_dt):5.2f} [{min(vs_dt):.2f}-{max(vs_dt):.2f}]")

if __name__ == "__main__":
    main()
