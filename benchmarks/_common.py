"""Shared by the benchmarks (benchmarks/ is on sys.path when a benchmark runs as a script)."""
import contextlib
import ctypes
import os
import time

import torch
import torch.distributed as dist


def parse_size(text: str) -> int:
    """'4K' -> 4096, '32M' -> 33554432, '1MiB' -> 1048576, '100' -> 100."""
    units = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}
    text = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def timed(call) -> float:
    """Seconds ``call()`` took on the slowest rank, started together after a barrier."""
    dist.barrier()
    start = time.perf_counter()
    call()
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def dtensor_tp(model, mesh):
    """DTensor's Megatron layout of an HF Llama (``parallelize_module``): q/k/v, gate and up
    column-parallel, o and down row-parallel; the baseline the tensor-parallel rows compare to."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    plan = {}
    for i in range(len(model.model.layers)):
        for proj in ("q_proj", "k_proj", "v_proj"):
            plan[f"model.layers.{i}.self_attn.{proj}"] = ColwiseParallel()
        plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"model.layers.{i}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.up_proj"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def bucketed_all_reduce(params, group):
    """The hand-written data-parallel gradient reduction beside DTensor's tensor parallelism (its
    gradients are replicated across ``group``): one flat all-reduce of the local pieces, as
    DDP's one bucket, then the average."""
    size = dist.get_world_size(group)

    def reduce():
        pieces = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                  for p in params if p.grad is not None]
        flat = torch.cat([x.reshape(-1) for x in pieces])
        dist.all_reduce(flat, group=group)
        flat /= size
        for x, part in zip(pieces, flat.split([x.numel() for x in pieces])):
            x.copy_(part.view_as(x))
    return reduce


@contextlib.contextmanager
def allocator_profile():
    """``torch.profiler.profile(profile_memory=True)`` over the block, with the CPU allocator
    keeping its own total of live bytes across every thread. The profiler records an
    allocation or a free only on the threads it profiles, and gloo's worker threads free what
    a collective's work object held last (its inputs, a metadata exchange's buffers): those
    frees are never recorded, so a sum of the events grows by them (3-14% on the simulation's
    cases, differing between identical ranks). The allocator's total
    (``FLAGS_caffe2_report_cpu_memory_usage``, a c10 flag: the reporter then counts frees on
    every thread) is carried by every event as ``total_allocated``."""
    from torch.profiler import ProfilerActivity, profile

    flag = _report_cpu_memory_flag()
    before, flag.value = flag.value, True
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield prof
    finally:
        flag.value = before


def _report_cpu_memory_flag():
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    return ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage")


def _allocator_totals(prof) -> list[int]:
    """The allocator's live total after each allocation event of the block, in time order,
    measured from what was alive when it began."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.typed[0] == _EventType.Allocation:
            events.append((e.start_time_ns, e.typed[1].alloc_size, e.typed[1].total_allocated))
        stack.extend(e.children)
    if not events:
        return [0]
    events.sort()
    start = events[0][2] - events[0][1]
    return [total - start for _, _, total in events]


def allocation_peak(prof) -> int:
    """The allocator's highest live total over a block profiled by ``allocator_profile()``,
    above what was alive when it began."""
    return max(0, max(_allocator_totals(prof)))


def allocation_end(prof) -> int:
    """What a block profiled by ``allocator_profile()`` left alive: the allocator's total at
    its last event, above what was alive when it began."""
    return _allocator_totals(prof)[-1]
