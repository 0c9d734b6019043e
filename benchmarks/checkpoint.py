"""Checkpoint save and load: global tensors against DTensor, both through torch.distributed.checkpoint,
on the same state in the same run.

    python benchmarks/checkpoint.py [--nproc 4] [--reps 5] [--rows 2051] [--cols 1031]

Four real processes (gt.spawn) on gloo form a 2x2 grid. Each holds a 3-layer model (uneven
shapes; one weight (S(0), S(1)), one (B, S(1)), one bias (B, B)) and AdamW's state after one step
(exp_avg and exp_avg_sq laid out as their weights): once as global tensors, once as DTensors
with the same placements. Measured, alternating gt and DTensor call by call:

- save: ``gt.checkpoint.save(dir, model=, optimizer=)`` against ``dcp.save(get_state_dict(...))``,
  and the bare ``dcp.save`` of both state dicts (the hooks alone);
- load into the same layout, and load resharded into (S(1), S(0)) / (Shard(1), Shard(0)):
  ``gt.checkpoint.load`` against get_state_dict + ``dcp.load`` + set_state_dict, into a new model
  and optimizer each time.

Time: the slowest rank's, after a barrier; median over reps. Peak memory: each process's peak
resident set during the call above what it held before (VmHWM reset through /proc/self/clear_refs;
glibc's mmap threshold is fixed so freed buffers leave the process), the largest over ranks.
Targets: ratio gt/DTensor <= 1.0 for both. The size of the largest whole tensor is printed for
scale: a rank that gathered one would show at least that much.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import tempfile
import time
import warnings

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by each process's glibc at start

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,  # noqa: E402
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # noqa: E402

import globaltensor as gt  # noqa: E402

S, B = gt.sbp.split, gt.sbp.broadcast


class Model(torch.nn.Module):
    def __init__(self, rows: int, cols: int):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(rows, cols, generator=g))
        self.w2 = torch.nn.Parameter(torch.randn(cols, rows + 3, generator=g))
        self.b = torch.nn.Parameter(torch.randn(rows + 3, generator=g))

    def forward(self, x):
        return torch.relu(x @ self.w1) @ self.w2 + self.b


GT_SBP = {"w1": (S(0), S(1)), "w2": (B, S(1)), "b": (B, B)}
GT_RESHARD = {"w1": (S(1), S(0)), "w2": (S(1), B), "b": (B, B)}
DT_SBP = {"w1": (Shard(0), Shard(1)), "w2": (Replicate(), Shard(1)), "b": (Replicate(), Replicate())}
DT_RESHARD = {"w1": (Shard(1), Shard(0)), "w2": (Shard(1), Replicate()), "b": (Replicate(), Replicate())}


def gt_model(rows, cols, sbps):
    return Model(rows, cols).to_global(gt.placement("cpu", [[0, 1], [2, 3]]), lambda n, t: sbps[n])


def dt_model(rows, cols, placements, mesh):
    model = Model(rows, cols)
    for name, p in list(model.named_parameters()):
        setattr(model, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, placements[name])))
    return model


def stepped(model, rows, cols):
    """The model and an AdamW after one step (so exp_avg / exp_avg_sq exist)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = sum((p * p).sum() for p in model.parameters())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


def measured(call) -> tuple[float, int]:
    """(seconds on the slowest rank, peak bytes above the start on the largest rank)."""
    gt.comm.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set starts again from what is resident now
    before = _status("VmRSS")
    start = time.perf_counter()
    call()
    took = time.perf_counter() - start
    peak = _status("VmHWM") - before
    return gt.comm.all_reduce(took, reduce_op="max"), int(gt.comm.all_reduce(peak, reduce_op="max"))


def worker(local_rank: int, reps: int, rows: int, cols: int, root: str):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")  # DTensor's saves over
    gt.init()
    mesh = init_device_mesh("cpu", (2, 2))
    g_model, g_opt = stepped(gt_model(rows, cols, GT_SBP), rows, cols)
    d_model, d_opt = stepped(dt_model(rows, cols, DT_SBP, mesh), rows, cols)
    counter = iter(range(10 ** 6))

    def fresh(key):
        """A new directory per save, as a training run's ckpt/step_N (removed after, untimed)."""
        return os.path.join(root, f"{key}-{next(counter)}")

    def gt_save(path):
        gt.checkpoint.save(path, model=g_model, optimizer=g_opt)

    def dt_save(path):
        msd, osd = get_state_dict(d_model, d_opt)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=path)

    def gt_bare_save(path):
        msd, osd = get_state_dict(g_model, g_opt)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=path)

    last = {"gt": os.path.join(root, "gt"), "DTensor": os.path.join(root, "dt")}
    gt_save(last["gt"])
    dt_save(last["DTensor"])

    def gt_load(sbps, optimizer=True):
        def call(model, opt):
            gt.checkpoint.load(last["gt"], model=model, optimizer=opt)
        return (lambda: stepless(gt_model(rows, cols, sbps), optimizer)), call, g_model

    def dt_load(placements, optimizer=True):
        def call(model, opt):
            if opt is None:
                msd = get_model_state_dict(model)
                dcp.load({"model": msd}, checkpoint_id=last["DTensor"])
                set_model_state_dict(model, msd)
                return
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optimizer": osd}
            dcp.load(state, checkpoint_id=last["DTensor"])
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        return (lambda: stepless(dt_model(rows, cols, placements, mesh), optimizer)), call, d_model

    cases = {
        "save, new directory": {"gt": (gt_save, fresh), "DTensor": (dt_save, fresh)},
        "save over the last": {"gt": (gt_save, lambda k: last["gt"]),
                               "DTensor": (dt_save, lambda k: last["DTensor"])},
        "bare dcp.save, new": {"gt": (gt_bare_save, fresh), "DTensor": (dt_save, fresh)},
        "load, same layout": {"gt": gt_load(GT_SBP), "DTensor": dt_load(DT_SBP)},
        "load, resharded": {"gt": gt_load(GT_RESHARD), "DTensor": dt_load(DT_RESHARD)},
        "load model, resharded": {"gt": gt_load(GT_RESHARD, False),
                                  "DTensor": dt_load(DT_RESHARD, False)},
    }
    results = {case: {k: [] for k in calls} for case, calls in cases.items()}
    for rep in range(reps + 1):
        for case, calls in cases.items():
            names = list(calls) if rep % 2 == 0 else list(calls)[::-1]
            for name in names:
                call = calls[name]
                if len(call) == 3:  # a load: into a new model and optimizer, made untimed
                    make, load, saved = call
                    model, opt = make()
                    took = measured(lambda: load(model, opt))
                    check(model, saved)
                    del model, opt
                else:
                    save, where = call
                    path = where(name)
                    took = measured(lambda: save(path))
                    if path not in last.values():
                        gt.comm.barrier()
                        if gt.env.get_rank() == 0:
                            shutil.rmtree(path)
                if rep:  # the first round warms up
                    results[case][name].append(took)
    sizes = {k: sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
             for k, d in last.items()}
    logical = sum(p.numel() * 4 for p in g_model.parameters()) * 3
    largest = max(p.numel() * 4 for p in g_model.parameters())
    return results, sizes, logical, largest


def stepless(model, optimizer=True):
    """``model`` and a new AdamW whose state get_state_dict has made (zero moments), so the
    timed load measures the checkpoint, not the optimizer's first step."""
    if not optimizer:
        return model, None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    get_state_dict(model, opt)
    return model, opt


def check(model, reference):
    """The loaded weights are the saved ones."""
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        if not torch.equal(p.full_tensor(), ref.full_tensor()):
            raise SystemExit(f"loaded {name} differs from the saved value")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=2051)
    ap.add_argument("--cols", type=int, default=1031)
    a = ap.parse_args()
    if a.nproc != 4:
        raise SystemExit("the layouts are for a 2x2 grid: --nproc 4")
    root = tempfile.mkdtemp(prefix="gt-ckpt-bench-")
    try:
        results, sizes, logical, largest = gt.spawn(
            worker, args=(a.reps, a.rows, a.cols, root), nproc_per_node=a.nproc, timeout=1800)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mib = 1024 ** 2
    print(f"model + AdamW state: {logical / mib:.1f} MiB logical, largest tensor "
          f"{largest / mib:.1f} MiB; {a.nproc} ranks (gloo, 1 thread), {a.reps} reps, alternating")
    print(f"files written: gt {sizes['gt'] / mib:.1f} MiB, DTensor {sizes['DTensor'] / mib:.1f} MiB")
    print(f"{'case':22s} {'gt ms':>8s} {'DT ms':>8s} {'median':>7s} {'fastest':>7s}"
          f"   {'gt peak':>8s} {'DT peak':>8s} {'ratio':>6s}")
    for case, by in results.items():
        t = {k: statistics.median(x for x, _ in v) for k, v in by.items()}
        fast = {k: min(x for x, _ in v) for k, v in by.items()}
        m = {k: max(statistics.median(y for _, y in v), 0) for k, v in by.items()}
        ratio = f"{m['gt'] / m['DTensor']:6.2f}" if m["DTensor"] > mib / 4 else "     -"
        print(f"{case:22s} {t['gt'] * 1e3:8.1f} {t['DTensor'] * 1e3:8.1f} "
              f"{t['gt'] / t['DTensor']:7.2f} {fast['gt'] / fast['DTensor']:7.2f}"
              f"   {m['gt'] / mib:6.1f}Mi {m['DTensor'] / mib:6.1f}Mi {ratio}")
    print("ratios are gt / DTensor (target <= 1.0); time: median and fastest of the reps, slowest "
          "rank; peak: the largest rank's resident memory above its start (median), '-' when "
          "DTensor's is under 0.25 MiB")


if __name__ == "__main__":
    main()
