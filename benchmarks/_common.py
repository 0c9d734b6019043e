"""Shared by the benchmarks (benchmarks/ is on sys.path when a benchmark runs as a script)."""
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


def allocation_peak(prof) -> int:
    """The highest running sum of the allocator's events (allocations +, frees -) over the
    profiled block: the peak above what was alive when it began."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.typed[0] == _EventType.Allocation:
            events.append((e.start_time_ns, e.typed[1].alloc_size))
        stack.extend(e.children)
    running = peak = 0
    for _, size in sorted(events):
        running += size
        peak = max(peak, running)
    return peak
