"""torchtitan 0.3.0's expert-parallel MoE layer (its AllToAllTokenDispatcher) timed on CPU and
gloo, beside ours in benchmarks/experts.py (``--titan DIR``). torchtitan is not a dependency:

    pip install --no-deps --target DIR torchtitan==0.3.0 spmd_types==0.2.3 tyro typeguard docstring_parser

(``--no-deps``: it must not touch torch). ``titan_moe_step_seconds(...)`` runs on every rank of
an initialised gloo group whose world size is the EP degree (every rank an EP rank). Two
import-time shims (below) and torchtitan's "partial_dtensor" backend make it run on CPU; its
experts' forward keeps float32 with ``expert_dtype="fp32"`` (torchtitan casts to bf16 for
``_grouped_mm``).
"""
import functools
import os
import warnings
import statistics
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.nn as nn

# --------------------------------------------------------------------------
# Import-time shims (the only two things that block CPU use):
# 1. torchtitan.models.common.token_dispatcher imports the MinimalAsyncEP
#    dispatcher whose kernels module does `import triton` unconditionally.
#    We never use that dispatcher; stub only torchtitan's kernels module
#    (NOT triton itself, so torch's own triton detection is unaffected).
# 2. torchtitan.tools.utils.device_type falls back to "cuda" when no
#    accelerator exists; ParallelDims.build_mesh uses it for init_device_mesh.
# --------------------------------------------------------------------------
_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
if _KERNELS not in sys.modules:
    try:
        import triton  # noqa: F401
    except ImportError:
        _m = types.ModuleType(_KERNELS)

        def _needs_triton(*a, **k):
            raise RuntimeError("torchtitan MinimalAsyncEP kernels need triton")

        for _n in (
            "copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel",
            "expand_topk_grad_kernel", "fill_combine_metadata_kernel",
            "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
            "reduce_topk_slots_kernel", "topk_scores_grad_kernel",
        ):
            setattr(_m, _n, _needs_triton)
        sys.modules[_KERNELS] = _m

import torchtitan.tools.utils as _tt_utils  # noqa: E402

if not torch.cuda.is_available():
    _tt_utils.device_type = "cpu"
    _tt_utils.device_module = torch.cpu

import spmd_types as spmd  # noqa: E402
import torchtitan.distributed.utils as tt_dist_utils  # noqa: E402
from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402
from torchtitan.models.common.config_utils import (  # noqa: E402
    make_moe_config,
    make_routed_experts_config,
    make_router_config,
)
from torchtitan.models.common.moe_sharding import set_moe_sharding_config  # noqa: E402
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher  # noqa: E402

# TokenChoiceTopKRouter wraps the gate in autocast(float32), which CPU autocast
# rejects with a warning and skips (harmless: inputs are already fp32).
warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype")

_INIT = functools.partial(nn.init.normal_, std=0.02)
# qwen3's dense-TP fallback layout (unused when EP is on, but required by the API)
_GROUPED_EXPERTS_PARAM_LAYOUT = {"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)}


_PDIMS = {}


def _fp32_grouped_experts_forward(self, x_RD, num_tokens_per_expert_E):
    """GroupedExperts.forward without the hard-coded .bfloat16() casts."""
    w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w
                  for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
    offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    h = torch.nn.functional.silu(torch._grouped_mm(x_RD, w1.transpose(-2, -1), offs=offs))
    h = h * torch._grouped_mm(x_RD, w3.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)


def build_titan_ep_moe(dim, hidden, experts, top_k, spmd_backend="partial_dtensor",
                       expert_dtype="bf16"):
    """Build one torchtitan MoE layer with EP over every rank of the default group.

    expert_dtype="bf16": torchtitan as shipped (GroupedExperts casts x and the
    fp32 weights to bf16 for torch._grouped_mm). "fp32": same code path but the
    three grouped mms run in fp32 (instance-level forward override).
    """
    world = dist.get_world_size()
    assert experts % world == 0
    tt_dist_utils.set_spmd_backend(spmd_backend)
    key = (world, spmd_backend)
    if key not in _PDIMS:  # build meshes (new process groups) only once
        # EP over all ranks: dp_shard = world, ep = world  -> efsdp = 1
        pd = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=world,
                          world_size=world, spmd_backend=spmd_backend)
        pd.build_mesh()
        _PDIMS[key] = pd
    pdims = _PDIMS[key]
    cfg = make_moe_config(
        num_experts=experts,
        router=make_router_config(dim=dim, num_experts=experts,
                                  gate_param_init={"weight": _INIT}, top_k=top_k,
                                  score_func="softmax", route_norm=True),
        routed_experts=make_routed_experts_config(
            dim=dim, hidden_dim=hidden, num_experts=experts, top_k=top_k,
            param_init={"w1_EFD": _INIT, "w2_EDF": _INIT, "w3_EFD": _INIT},
            comm_backend="standard"),
        load_balance_coeff=1e-3,
    )
    set_moe_sharding_config(cfg, enable_ep=True, enable_sp=False,
                            expert_param_layout=_GROUPED_EXPERTS_PARAM_LAYOUT)
    moe = cfg.build()
    moe.init_states(buffer_device=torch.device("cpu"))
    moe.parallelize(pdims)  # shards experts on dim 0 over "ep", wires ep_mesh
    assert isinstance(moe.routed_experts.token_dispatcher, AllToAllTokenDispatcher)
    assert moe.routed_experts.token_dispatcher.ep_mesh is not None
    if expert_dtype == "fp32":
        ie = moe.routed_experts.inner_experts
        ie.forward = types.MethodType(_fp32_grouped_experts_forward, ie)
    else:
        assert expert_dtype == "bf16"
    ctx = tt_dist_utils.get_spmd_context(parallel_dims=pdims)
    return moe, pdims, ctx


def titan_moe_step_seconds(dim, hidden, experts, top_k, tokens_per_rank, steps,
                           warmup=2, spmd_backend="partial_dtensor", expert_dtype="bf16"):
    """Median seconds (max over ranks) of forward+backward of one torchtitan MoE
    layer with expert parallelism over all ranks of the default (gloo) group.
    Every rank feeds its own (1, tokens_per_rank, dim) fp32 batch.

    spmd_backend: "partial_dtensor" works on gloo. torchtitan's default
    "spmd_types" fails on gloo: spmd_types' uneven all_to_all calls the list
    form dist.all_to_all, which ProcessGroupGloo only supports for equal sizes.
    """
    moe, _pdims, ctx = build_titan_ep_moe(dim, hidden, experts, top_k, spmd_backend,
                                          expert_dtype)
    moe.train()
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(1, tokens_per_rank, dim, generator=g, requires_grad=True)
    gy = torch.randn(1, tokens_per_rank, dim, generator=g)
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        with ctx():
            y = moe(x)
            y = y.to_local() if hasattr(y, "to_local") else y
            with spmd.no_typecheck():
                y.backward(gy)
        dist.barrier()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
        x.grad = None
        moe.zero_grad(set_to_none=True)
    med = statistics.median(times)
    # report the slowest rank's median (all ranks return the same value)
    t = torch.tensor([med], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _worker(rank, world, port, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for (dim, hidden, experts, top_k) in args["configs"]:
            for edt in args["expert_dtypes"]:
                s = titan_moe_step_seconds(dim, hidden, experts, top_k,
                                           args["tokens"], args["steps"],
                                           expert_dtype=edt)
                if rank == 0:
                    print(f"torchtitan EP MoE dim={dim} hidden={hidden} E={experts} "
                          f"top{top_k} tokens/rank={args['tokens']} world={world} "
                          f"experts-mm={edt}: median fwd+bwd {s * 1e3:.2f} ms",
                          flush=True)
    finally:
        dist.destroy_process_group()


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    import torch.multiprocessing as mp
    world = 4
    args = {"configs": [(256, 512, 8, 2), (256, 512, 64, 8)], "tokens": 256,
            "steps": 10, "expert_dtypes": ["bf16", "fp32"]}
    mp.spawn(_worker, args=(world, _free_port(), args), nprocs=world, join=True)
