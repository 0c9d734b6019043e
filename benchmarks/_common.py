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
