"""Cold planning: plan() and the signature choice on 3-D to 5-D grids, in one process (issue 14).

    python benchmarks/planning.py [--pairs 200] [--calls 40] [--repeats 3] [--reference]
                                  [--transformer [--transformer-grids 2x2,2x2x2] [--no-dtensor] [--dtensor-nd]]
                                  [--grids 3,4,5] [--choice-grids 3,4] [--wide-grids 4x4,2x3x4,...]

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
  tensors, each op's inputs laid out as the choices before it made them; then the same
  choices again with every plan already known (caches kept: the part that is not search);
  then the same samples cold with each op's answer known beforehand, only the chosen moves
  planned (``winners_only``: the replay and those plans, the least a choice that plans what
  it picks can take).
- ``--wide-grids``: plan() and the choice for ``mm`` on other grids (more or wider axes, uneven
  sizes), beyond the targets.
- ``--transformer``: the first training step of the transformer block of
  tests/ranks/test_transformer.py against its later steps, on 2x2 (data x tensor parallel) and
  2x2x2 (data x data x tensor) grids, in processes (gt.spawn, real gloo; 8 processes on this
  2-core box take a few minutes), gt and DTensor with the same placements in the same run:
  the first step of a fresh process, and the first step after the contender's caches of
  decisions and plans are emptied (``--no-dtensor``: gt only). DTensor's first step on a 3-D
  grid plans for minutes per process (8 minutes of CPU on 2x2x2 here), so there it is timed
  only with ``--dtensor-nd``, in one process on torch's fake process group.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import math
import pathlib
import random
import statistics
import sys
import time

import numpy as np
import torch

# this checkout's package, whatever the editable install points at (and in spawned ranks)
_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
if sys.path[:1] != [_ROOT]:
    sys.path.insert(0, _ROOT)
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
    return grid_of((2,) * ndim)


def grid_of(shape) -> gt.Placement:
    return gt.placement("cpu", np.arange(math.prod(shape)).reshape(shape).tolist())


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


def warm(fn, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` runs of ``fn()``, caches kept."""
    best = float("inf")
    for _ in range(repeats):
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


def pairs(ndim: int, count: int, placement=None):
    rng = random.Random(1000 + ndim)
    placement = placement or grid(ndim)
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


def replay(placement, inputs, calls, layouts, chooser=None):
    """Choose a signature for every recorded op, its inputs laid out as the choices before made
    them (a result takes the chosen output sbp; an op without a rule gives B). ``chooser``
    stands in for ``ops.choose`` (see :func:`winners_only`)."""
    chooser = chooser or choose
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
        choice = chooser(call, ins, (4,) * len(ins)) if ins else None
        results = out if isinstance(out, (list, tuple)) else (out,)
        for k, res in enumerate(r for r in results if isinstance(r, torch.Tensor)):
            sbp = choice.outs[min(k, len(choice.outs) - 1)] if choice else (B,) * placement.ndim
            if any(v is None for v in sbp):
                sbp = (B,) * placement.ndim
            known[id(res)] = Layout(placement, sbp, tuple(res.shape))


def winners_only(placement, inputs, calls, layouts):
    """A stand-in for ``ops.choose`` that knows each op's answer beforehand (recorded from a
    real run of the same sample) and only plans the moves of the chosen candidate: the time of
    the replay, the chosen moves' plans and nothing else, the least any choice can cost that
    plans what it picks (it weighs no candidate and builds no table)."""
    answers = {}

    def record(call, ins, itemsizes):
        answers[call, ins] = choice = choose(call, ins, itemsizes)
        return choice
    clear_all()
    replay(placement, inputs, calls, layouts, record)

    def chosen(call, ins, itemsizes):
        choice = answers[call, ins]
        if choice is not None:
            for src, dst in zip(ins, choice.ins):
                if src != dst:
                    plan(src, dst)
        return choice
    return chosen


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
        rng, times = random.Random(3000 + ndim), []
        for _ in range(count):  # the same samples again, every plan already known
            ls = layouts_for(rng, placement, [tuple(t.shape) for t in inputs])
            clear_all()
            replay(placement, inputs, calls, ls)
            times.append(warm(lambda: replay(placement, inputs, calls, ls), repeats))
        print(f"  plans known     {'x'.join(['2'] * ndim):<10} {summary(times)}  "
              f"(the same choices with their plans cached: the part that is not search)",
              flush=True)
        rng, times = random.Random(3000 + ndim), []
        for _ in range(count):  # the same samples, only the chosen moves planned, cold
            ls = layouts_for(rng, placement, [tuple(t.shape) for t in inputs])
            chosen = winners_only(placement, inputs, calls, ls)
            times.append(cold(lambda: replay(placement, inputs, calls, ls, chosen), repeats))
        print(f"  chosen only     {'x'.join(['2'] * ndim):<10} {summary(times)}  "
              f"(answers known, only the chosen moves planned, cold: no candidate weighed)",
              flush=True)


def bench_wide(shapes, count, repeats):
    """plan() and the choice for ``mm`` on grids with more or wider axes than the targets'
    (uneven sizes among them): not targets, a look at how planning grows beyond them."""
    mm = Call("mm.default", ((1024, 512), (512, 2048)), (Ref(0), Ref(1)))
    for shape in shapes:
        placement, name = grid_of(shape), "x".join(map(str, shape))
        sample = list(pairs(len(shape), count, placement))
        times = [cold(lambda: plan(src, dst), repeats) for src, dst in sample]
        print(f"plan()            {name:<10} {summary(times)}", flush=True)
        rng, times = random.Random(2000 + len(shape)), []
        for _ in range(max(count // 5, 1)):
            ls = layouts_for(rng, placement, mm.shapes)
            times.append(cold(lambda: choose(mm, ls, (4,) * len(ls)), repeats))
        print(f"choose mm         {name:<10} {summary(times)}", flush=True)


# --------------------------------------------------------------------------- transformer


def _block_module():
    """tests/ranks/test_transformer.py, the block the tests train (Block, data, TP)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    for where in (root / "tests" / "ranks", root / "tests"):
        if str(where) not in sys.path:
            sys.path.insert(0, str(where))
    import test_transformer
    return test_transformer


def _gt_block(mod, grid_shape):
    """The block on a grid whose last axis is tensor parallel and the others data parallel."""
    ndim = len(grid_shape)
    placement = gt.placement("cpu", np.arange(math.prod(grid_shape)).reshape(grid_shape).tolist())
    model = mod.Block(torch.Generator().manual_seed(1)).to_global(
        placement, lambda name, t: (B,) * (ndim - 1) + (mod.TP.get(name, B),))
    data_sbp = (S(0),) * (ndim - 1) + (B,)
    tokens, targets = (gt.tensor(t, placement=placement, sbp=data_sbp) for t in mod.data())
    return lambda: model(tokens, targets).backward()


def _dtensor_block(mod, grid_shape):
    """The same block with torch's DTensor: every parameter, buffer and input distributed with
    the same placements (Shard(d) for S(d), Replicate for B) on a DeviceMesh of the grid."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", tuple(grid_shape))
    ndim = len(grid_shape)
    model = mod.Block(torch.Generator().manual_seed(1))

    def placements(name):
        value = mod.TP.get(name)
        return [Replicate()] * (ndim - 1) + [Shard(value.dim) if value is not None else Replicate()]
    for owner in (model, model.ln1, model.ln2):
        for name, p in list(owner.named_parameters(recurse=False)):
            shared = placements(name) if owner is model else [Replicate()] * ndim
            setattr(owner, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, shared)))
    model.causal = distribute_tensor(model.causal, mesh, [Replicate()] * ndim)
    data = [Shard(0)] * (ndim - 1) + [Replicate()]
    tokens, targets = (distribute_tensor(t, mesh, data) for t in mod.data())
    return lambda: model(tokens, targets).backward()


def _clear_dtensor_caches():
    """DTensor's caches of sharding decisions and redistribution plans (what clear_all is to gt)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    for fn in vars(_redistribute).values():
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()


def transformer_worker(local_rank, grid_shape, steps, dtensor):
    """One rank: torch._dynamo imported and a plain step of the block (warming torch for both
    contenders alike), then per
    contender: a model's first step in this fresh process ("fresh"), its later steps, and the
    first step of a second model after the contender's caches of decisions and plans are
    emptied ("cold caches": the planning cost alone, the rest of the process warm). Times are
    the slowest rank's."""
    import warnings

    from _common import timed

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    gt.init()
    # torch imports torch._dynamo (~2 s here) the first time a decomposition runs on meta
    # tensors, which both contenders do: whoever ran first would pay it
    importlib.import_module("torch._dynamo")
    mod = _block_module()
    plain = mod.Block(torch.Generator().manual_seed(1))
    plain(*mod.data()).backward()
    contenders = {"gt": (_gt_block, clear_all)}
    if dtensor:
        contenders["DTensor"] = (_dtensor_block, _clear_dtensor_caches)
    out = {}
    for who, (build, clear) in contenders.items():
        clear()
        step = build(mod, grid_shape)
        times = [timed(step) for _ in range(steps)]
        clear()
        step = build(mod, grid_shape)
        out[who] = (times[0], statistics.median(times[1:]), timed(step))
    return out


def dtensor_one_process(grid_shape, steps):
    """DTensor's steps of the block in one process standing for rank 0 of the grid, on torch's
    fake process group (collectives do nothing; the sharding decisions and redistribution
    plans are DTensor's own): its planning cost without the processes of a whole grid."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    importlib.import_module("torch._dynamo")
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(grid_shape))
    mod = _block_module()
    mod.Block(torch.Generator().manual_seed(1))(*mod.data()).backward()
    step = _dtensor_block(mod, grid_shape)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def bench_transformer(grids, steps: int, dtensor: bool, dtensor_nd: bool):
    """First training step of the block against its later steps, on each grid (processes, real
    gloo; 2x2 is data x tensor parallel, 2x2x2 data x data x tensor). DTensor runs in the same
    processes on 2-D grids; on 3-D grids its first step plans for minutes (its graph-based
    redistribution planner, when it costs strategies), so there it runs only with
    ``dtensor_nd``, in one process on a fake process group (see :func:`dtensor_one_process`)."""
    import multiprocessing

    for grid_shape in grids:
        real = dtensor and len(grid_shape) < 3
        out = gt.spawn(transformer_worker, args=(grid_shape, steps, real),
                       nproc_per_node=math.prod(grid_shape), timeout=3600)[0]
        name = "x".join(map(str, grid_shape))
        for who, (fresh, steady, cold_caches) in out.items():
            print(f"transformer {name:<6} {who:<8} later steps median {steady * 1e3:6.1f} ms; first "
                  f"step: fresh process {fresh * 1e3:7.1f} ms ({fresh / steady:4.1f}x), cold caches "
                  f"{cold_caches * 1e3:7.1f} ms ({cold_caches / steady:4.1f}x)", flush=True)
        if "DTensor" in out:
            print(f"transformer {name:<6} first step gt / DTensor: fresh process "
                  f"{out['gt'][0] / out['DTensor'][0]:.2f}, cold caches "
                  f"{out['gt'][2] / out['DTensor'][2]:.2f}", flush=True)
        elif dtensor and dtensor_nd:
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                times = pool.apply(dtensor_one_process, (grid_shape, max(steps, 3)))
            steady = statistics.median(times[1:])
            print(f"transformer {name:<6} DTensor  one process, fake process group: first step "
                  f"{times[0] * 1e3:.0f} ms, later steps median {steady * 1e3:.1f} ms; gt's fresh "
                  f"first step / DTensor's: {out['gt'][0] / times[0]:.4f}", flush=True)
        elif dtensor:
            print(f"transformer {name:<6} DTensor  skipped (its first step on a 3-D grid plans for "
                  f"minutes: --dtensor-nd times it in one process)", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--grids", default="3,4,5", help="placement ndims for plan() (2 ranks each)")
    ap.add_argument("--choice-grids", default="3,4")
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--wide-grids", default="",
                    help="also plan() and choose mm on these grids, e.g. 4x4,2x3x4,4x4x4,2x2x4x4 "
                         "(not targets; --pairs pairs and --pairs/5 mm calls per grid)")
    ap.add_argument("--transformer", action="store_true",
                    help="also time the transformer block's first training step (processes)")
    ap.add_argument("--transformer-grids", default="2x2,2x2x2")
    ap.add_argument("--no-dtensor", action="store_true", help="skip DTensor's steps")
    ap.add_argument("--dtensor-nd", action="store_true",
                    help="time DTensor on 3-D grids too (one process, fake process group; "
                         "~8 minutes on 2x2x2 here)")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    bench_plans([int(g) for g in args.grids.split(",") if g], args.pairs, args.repeats, args.reference)
    bench_choices([int(g) for g in args.choice_grids.split(",") if g], args.calls, args.repeats)
    bench_wide([tuple(int(n) for n in g.split("x")) for g in args.wide_grids.split(",") if g],
               args.pairs, args.repeats)
    if args.transformer:
        grids = [tuple(int(n) for n in g.split("x")) for g in args.transformer_grids.split(",") if g]
        bench_transformer(grids, args.steps, not args.no_dtensor, args.dtensor_nd)


if __name__ == "__main__":
    main()
