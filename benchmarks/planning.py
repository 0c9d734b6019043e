"""Cold planning: plan() and the signature choice on 3-D to 5-D grids, in one process (issue 14).

    python benchmarks/planning.py [--pairs 200] [--calls 40] [--repeats 3] [--reference]
                                  [--transformer] [--grids 3,4,5]

Pure core only, no communication (the transformer step excepted, see below). "Cold" means every
cache of the package is emptied first (``_cache.clear_all()``: plans, boxes, bounds, exchanges),
then garbage is collected, outside the timed region. Each sample is timed ``--repeats`` times,
cold each time, and its fastest run kept: this box is shared, and a run that waited for the CPU
says nothing about the planner. Reported per grid: median, 90th percentile and maximum.

- plan(): a seeded sample of ``--pairs`` (source, target) layouts per grid, every sbp drawn from
  {S(0), S(1), B, P} per placement axis, the shape drawn from SHAPES. ``--reference`` also times
  the exhaustive search the planner replaced (``plan.reference_plan``) on the first grid and
  checks both costs agree.
- signature choice: ``ops.choose`` for ``mm`` and ``add`` on ``--calls`` seeded pairs of input
  layouts (each input requiring grad or not at random), and for the einsum of issue 14
  ("pqrs,tuqvr->pstuv"): the choices of every aten op of its decomposition, replayed on meta
  tensors, each op's inputs laid out as the choices before it made them.
- ``--transformer``: the first training step of the transformer block of
  tests/ranks/test_transformer.py on a 2x2 grid (4 thread-ranks, real gloo), caches cold,
  against its later steps.
"""
from __future__ import annotations

import argparse
import gc
import pathlib
import random
import statistics
import sys
import time

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import globaltensor as gt
from globaltensor._cache import clear_all
from globaltensor.layout import Layout
from globaltensor.ops import NUMBER, Call, Ref, choose
from globaltensor.plan import plan, reference_plan

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
VALUES = [S(0), S(1), B, P]
SHAPES = [(1024, 1024), (4096, 512), (64, 48), (13, 17), (5, 7)]


def grid(ndim: int) -> gt.Placement:
    return gt.placement("cpu", np.arange(2 ** ndim).reshape([2] * ndim).tolist())


def cold(fn, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` runs of ``fn()``, every cache emptied before each."""
    best = float("inf")
    for _ in range(repeats):
        clear_all()
        gc.collect()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def summary(times) -> str:
    times = sorted(times)
    p90 = times[int(0.9 * (len(times) - 1))]
    return (f"median {statistics.median(times) * 1e3:7.2f} ms  p90 {p90 * 1e3:7.2f} ms  "
            f"max {times[-1] * 1e3:7.2f} ms  (n={len(times)})")


# --------------------------------------------------------------------------- plan()


def pairs(ndim: int, count: int):
    rng = random.Random(1000 + ndim)
    placement = grid(ndim)
    for _ in range(count):
        a, b = (tuple(rng.choice(VALUES) for _ in range(ndim)) for _ in range(2))
        shape = rng.choice(SHAPES)
        yield Layout(placement, a, shape), Layout(placement, b, shape)


def bench_plans(ndims, count, repeats, reference):
    for ndim in ndims:
        sample = list(pairs(ndim, count))
        times = [cold(lambda: plan(src, dst), repeats) for src, dst in sample]
        print(f"plan()            {'x'.join(['2'] * ndim):<10} {summary(times)}", flush=True)
        if reference and ndim == ndims[0]:
            old = []
            for src, dst in sample:
                old.append(cold(lambda: reference_plan(src, dst), 1))
                new, ref = plan(src, dst).cost(), reference_plan(src, dst).cost()
                assert abs(new - ref) <= 1e-9 * ref, (src, dst, new, ref)
            print(f"reference_plan()  {'x'.join(['2'] * ndim):<10} {summary(old)}  (same costs)",
                  flush=True)


# --------------------------------------------------------------------------- choose()


def layouts_for(rng, placement, shapes):
    def one(shape):
        values = [S(d) for d in range(len(shape))] + [B, P]
        return Layout(placement, tuple(rng.choice(values) for _ in range(placement.ndim)), shape)
    return tuple(one(s) for s in shapes)


class Recorder(TorchDispatchMode):
    """The aten ops a function runs on meta tensors, with their arguments and results."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, args, kwargs or {}, out))
        return out


def einsum_calls():
    p, q, r, s, t, u, v = 8, 4, 6, 10, 2, 4, 6
    x = torch.empty(p, q, r, s, device="meta")
    y = torch.empty(t, u, q, v, r, device="meta")
    with Recorder() as rec:
        torch.einsum("pqrs,tuqvr->pstuv", x, y)
    return (x, y), rec.calls


def replay(placement, inputs, calls, layouts):
    """Choose a signature for every recorded op, its inputs laid out as the choices before made
    them (a result takes the chosen output sbp; an op without a rule gives B)."""
    known = {id(t): l for t, l in zip(inputs, layouts)}
    for func, args, kwargs, out in calls:
        tensors, counter = [], iter(range(1000))

        def mark(a):
            if isinstance(a, torch.Tensor):
                tensors.append(a)
                return Ref(next(counter))
            if isinstance(a, (list, tuple)):
                return tuple(mark(x) for x in a)
            return NUMBER if isinstance(a, float) else a
        margs = tuple(mark(a) for a in args)
        mkwargs = tuple(sorted((k, mark(v)) for k, v in kwargs.items()))
        ins = tuple(known.get(id(t)) or Layout(placement, (B,) * placement.ndim, tuple(t.shape))
                    for t in tensors)
        name = f"{func._schema.name.split('::')[1]}.{func._overloadname}"
        tags = frozenset(str(t).split(".")[-1] for t in func.tags)
        call = Call(name, tuple(l.shape for l in ins), margs, mkwargs, tags)
        choice = choose(call, ins, (4,) * len(ins)) if ins else None
        results = out if isinstance(out, (list, tuple)) else (out,)
        for k, res in enumerate(r for r in results if isinstance(r, torch.Tensor)):
            sbp = choice.outs[min(k, len(choice.outs) - 1)] if choice else (B,) * placement.ndim
            if any(v is None for v in sbp):
                sbp = (B,) * placement.ndim
            known[id(res)] = Layout(placement, sbp, tuple(res.shape))


def bench_choices(ndims, count, repeats):
    mm = Call("mm.default", ((1024, 512), (512, 2048)), (Ref(0), Ref(1)))
    add = Call("add.Tensor", ((1024, 512), (1024, 512)), (Ref(0), Ref(1)), (),
               frozenset({"pointwise"}))
    inputs, calls = einsum_calls()
    for ndim in ndims:
        placement = grid(ndim)
        for name, call in (("mm", mm), ("add", add)):
            rng, times = random.Random(2000 + ndim), []
            for _ in range(count):
                ls = layouts_for(rng, placement, call.shapes)
                grads = tuple(rng.random() < 0.5 for _ in ls)
                times.append(cold(lambda: choose(call, ls, (4,) * len(ls), grads=grads), repeats))
            print(f"choose {name:<10} {'x'.join(['2'] * ndim):<10} {summary(times)}", flush=True)
        rng, times = random.Random(3000 + ndim), []
        for _ in range(count):
            ls = layouts_for(rng, placement, [tuple(t.shape) for t in inputs])
            times.append(cold(lambda: replay(placement, inputs, calls, ls), repeats))
        print(f"choose einsum     {'x'.join(['2'] * ndim):<10} {summary(times)}  "
              f"({len(calls)} aten ops)", flush=True)


# --------------------------------------------------------------------------- transformer


def bench_transformer(steps: int):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests" / "ranks"))
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
    from test_transformer import Block, data, layout_of  # the block the tests train
    from globaltensor.testing import run_ranks

    placement = gt.placement("cpu", [[0, 1], [2, 3]])

    def body(rank):
        torch.set_num_threads(1)
        model = Block(torch.Generator().manual_seed(1)).to_global(placement, layout_of)
        tokens, targets = (gt.tensor(t, placement=placement, sbp=(S(0), B)) for t in data())
        if rank == 0:
            clear_all()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            model(tokens, targets).backward()
            times.append(time.perf_counter() - start)
        return times

    clear_all()
    per_rank = run_ranks(body, placement.size, timeout=600)
    slowest = [max(ts[i] for ts in per_rank) for i in range(steps)]
    steady = statistics.median(slowest[1:])
    print(f"transformer 2x2: first step {slowest[0] * 1e3:.0f} ms, later steps median "
          f"{steady * 1e3:.0f} ms: {slowest[0] / steady:.1f}x", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--grids", default="3,4,5", help="placement ndims for plan() (2 ranks each)")
    ap.add_argument("--choice-grids", default="3,4")
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--transformer", action="store_true")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    bench_plans([int(g) for g in args.grids.split(",") if g], args.pairs, args.repeats, args.reference)
    bench_choices([int(g) for g in args.choice_grids.split(",") if g], args.calls, args.repeats)
    if args.transformer:
        bench_transformer(args.steps)


if __name__ == "__main__":
    main()
