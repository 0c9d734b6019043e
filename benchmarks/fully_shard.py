"""gt.nn.fully_shard against torch's FSDP2 (torch.distributed.fsdp.fully_shard), same processes.

    python benchmarks/fully_shard.py [--world 4] [--grid line|2x2] [--dtype fp32|bf16]
                                     [--steps 6] [--hidden 512] [--blocks 8] [--compile]

An 8-block pre-norm transformer (hidden 512, 8 heads, vocab 1024, sequence 64, 2 sequences per
rank), one unit per block and the root, AdamW. Contenders, alternating step by step in the same
gloo processes (the order reversed every other step):

- ``fsdp2``: torch's ``fully_shard`` on a 1-D DeviceMesh (``--grid 2x2``: DTensor Megatron TP
  on "tp" by ``parallelize_module``, then ``fully_shard`` on "dp");
- ``gt``: ``gt.nn.fully_shard`` (``--grid 2x2``: ``model.to_global`` with colwise / rowwise
  sbp_fns on "tp", then ``fully_shard`` on "dp");
- ``gt-noprefetch``: the same with empty prefetch lists (what prefetch buys);
- with ``--compile``: ``fsdp2+compile`` and ``gt+compile`` (``torch.compile(model)``; both run
  their hooks between graphs).

``--dtype bf16``: ``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)`` for both (FSDP2's
``MixedPrecisionPolicy``). Printed per contender: the median step (the slowest rank's, after a
barrier), the ratio to fsdp2, the loss of the first step (same data and initial values: they
must agree; after every contender's steps on the same batches, the largest difference of a
parameter from FSDP2's is printed too), and memory per rank on rank 0 over one step: the allocator's peak above the
step's start (benchmarks/_common.py ``allocator_profile``: torch.profiler's memory events, the
allocator counting frees on every thread), and
``gt.memory()``'s peak of live bytes above the start (every contender's model is alive in the
process, so what was alive at the start is left out of both) with the highest of the
``communication`` kind (gathered units, collectives' buffers; FSDP2's count as activations).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys

import torch
import torch.nn.functional as F

import globaltensor as gt
from _common import allocation_peak, allocator_profile, timed  # benchmarks/ is on sys.path when a benchmark runs as a script

S, B = gt.sbp.split, gt.sbp.broadcast
VOCAB, SEQ, BATCH = 1024, 64, 2


class Block(torch.nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(h)
        self.q, self.k, self.v = (torch.nn.Linear(h, h) for _ in range(3))
        self.o = torch.nn.Linear(h, h)
        self.norm2 = torch.nn.LayerNorm(h)
        self.up = torch.nn.Linear(h, 4 * h)
        self.down = torch.nn.Linear(4 * h, h)

    def forward(self, x):
        b, t, _ = x.shape
        hd = x.shape[-1] // self.heads
        y = self.norm1(x)
        q, k, v = (p(y).view(b, t, -1, hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Transformer(torch.nn.Module):
    def __init__(self, h, blocks, heads=8):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, h)
        self.layers = torch.nn.ModuleList(Block(h, heads) for _ in range(blocks))
        self.norm = torch.nn.LayerNorm(h)
        self.head = torch.nn.Linear(h, VOCAB, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def loss_of(model, ids):
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), ids.reshape(-1))


# ------------------------------------------------------------------------------- the contenders

def fsdp2(base, grid, bf16):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = torch.distributed.get_world_size()
    model = copy.deepcopy(base)
    if grid == "2x2":
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], {
                "q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                "o": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()})
        dp = mesh["dp"]
    else:
        dp = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mesh=dp, mp_policy=policy)
    fully_shard(model, mesh=dp, mp_policy=policy)
    return model, dp


def gt_sharded(base, grid, bf16, prefetch=True):
    world = torch.distributed.get_world_size()
    model = copy.deepcopy(base)
    if grid == "2x2":
        placement = gt.placement("cpu", [list(range(world // 2)), list(range(world // 2, world))],
                                 axes=("dp", "tp"))
        col, row = gt.nn.colwise("tp"), gt.nn.rowwise("tp")
        model.to_global(placement, gt.nn.sbp_plan({f"layers.*.{n}": col for n in "qkv"}
                                                  | {"layers.*.up": col, "layers.*.o": row,
                                                     "layers.*.down": row}))
        axis = "dp"
    else:
        placement, axis = gt.placement("cpu", list(range(world))), None
    policy = gt.nn.MixedPrecision(torch.bfloat16, torch.float32) if bf16 else None
    for layer in model.layers:
        gt.nn.fully_shard(layer, placement, axis, mp_policy=policy)
    gt.nn.fully_shard(model, placement, axis, mp_policy=policy)
    if not prefetch:
        for sub in model.modules():
            if isinstance(sub, gt.nn.FSDPModule):
                sub.set_modules_to_forward_prefetch([])
                sub.set_modules_to_backward_prefetch([])
    return model, placement


def global_ids(ids_full, placement, grid):
    sbp = (S(0), B) if grid == "2x2" else S(0)
    return ids_full.to_global(placement, (B,) * placement.ndim).to_global(sbp=sbp)


# ------------------------------------------------------------------------------- measuring

def worker(local_rank, a):
    torch.set_num_threads(1)
    gt.init()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    base = Transformer(a.hidden, a.blocks)
    bf16 = a.dtype == "bf16"
    gen = torch.Generator().manual_seed(1)
    dp_size = world // 2 if a.grid == "2x2" else world
    batches = [torch.randint(0, VOCAB, (BATCH * dp_size, SEQ), generator=gen) for _ in range(4)]
    dp_index = rank // (world // dp_size) if a.grid == "2x2" else rank

    contenders = {}
    m, _ = fsdp2(base, a.grid, bf16)
    contenders["fsdp2"] = (m, lambda ids, m=m: loss_of(m, ids[dp_index * BATCH:(dp_index + 1) * BATCH]))
    for name, prefetch in (("gt", True), ("gt-noprefetch", False)):
        m, placement = gt_sharded(base, a.grid, bf16, prefetch)
        contenders[name] = (m, lambda ids, m=m, p=placement: loss_of(m, global_ids(ids, p, a.grid)))
    if a.compile:
        m, _ = fsdp2(base, a.grid, bf16)
        cm = torch.compile(m, dynamic=False)  # the contenders share Block.forward: static shapes each
        contenders["fsdp2+compile"] = (m, lambda ids, cm=cm: loss_of(cm, ids[dp_index * BATCH:(dp_index + 1) * BATCH]))
        m, placement = gt_sharded(base, a.grid, bf16)
        cm = torch.compile(m, dynamic=False)  # the contenders share Block.forward: static shapes each
        contenders["gt+compile"] = (m, lambda ids, cm=cm, p=placement: loss_of(cm, global_ids(ids, p, a.grid)))
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, (m, _) in contenders.items()}

    def step(name, ids):
        model, loss_fn = contenders[name]
        opts[name].zero_grad()
        loss = loss_fn(ids)
        loss.backward()
        opts[name].step()
        return loss

    def global_loss(k, loss):  # FSDP2's loss is this rank's mean: average it over the dp ranks
        if isinstance(loss, gt.GlobalTensor):
            return loss.item()
        t = loss.detach().reshape(1).double()
        torch.distributed.all_reduce(t)
        return t.item() / world

    first = {k: global_loss(k, step(k, batches[0])) for k in contenders}  # warm-up, same data
    times = {k: [] for k in contenders}
    names = list(contenders)
    for i in range(a.steps):
        for k in (names if i % 2 == 0 else names[::-1]):
            times[k].append(timed(lambda k=k: step(k, batches[1 + i % 3])))
    memory = {}
    for k in contenders:
        with allocator_profile() as prof:
            step(k, batches[1])
        with gt.memory() as mem:
            step(k, batches[1])
        memory[k] = (allocation_peak(prof), mem.peak_bytes() - mem.start_bytes(),
                     mem.peak_bytes("communication"))
    full = {k: {n: _full(p).float() for n, p in m.named_parameters()} for k, (m, _) in contenders.items()}
    apart = {k: max((full[k][n] - full["fsdp2"][n]).abs().max().item() for n in full["fsdp2"])
             for k in contenders}
    return {k: (statistics.median(v), first[k], memory[k], apart[k]) for k, v in times.items()}


def _full(p):
    """A parameter's whole value (FSDP2's are DTensors, gt's global tensors)."""
    return p.full_tensor().detach()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--grid", choices=("line", "2x2"), default="line")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    out = gt.spawn(worker, args=(a,), nproc_per_node=a.world, timeout=3600)[0]
    ref = out["fsdp2"]
    print(f"fully_shard: {a.blocks} blocks, hidden {a.hidden}, {a.grid} grid of {a.world} gloo "
          f"ranks, {a.dtype}, {a.steps} steps each (median of the slowest rank)")
    print(f"{'contender':<16}{'step ms':>9}{'/ fsdp2':>9}{'first loss':>12}"
          f"{'alloc peak MiB':>16}{'gt.memory MiB':>15}{'comm MiB':>10}{'params vs fsdp2':>17}")
    for k, (t, loss, (alloc, live, comm), apart) in out.items():
        print(f"{k:<16}{t * 1e3:9.1f}{t / ref[0]:9.2f}{loss:12.5f}{alloc / 2**20:16.1f}"
              f"{live / 2**20:15.1f}{comm / 2**20:10.1f}{apart:17.2e}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
