"""A model larger than one process would like (issue 53): memory per rank of the whole flow, and
loading time, beside the old flow and FSDP2's meta flow, in the same kind of gloo processes.

    python benchmarks/big_model.py [--world 4] [--layers 20] [--hidden 1024] [--inter 2816]
                                   [--vocab 32000] [--reps 3] [--flows gt,gt-copy,old,fsdp2]
                                   [--folder DIR]

An HF Llama (defaults: 20 layers, hidden 1024, SwiGLU 2816, 8 of 16 heads for k/v, vocab 32000:
302M parameters, 1.21 GB in float32) is saved once by HF's own ``save_pretrained`` (500 MB shards with the index), then
each flow runs in ``--world`` fresh processes (``gt.spawn``), every rank the same:

- ``gt``: build under ``torch.device("meta")``, ``gt.nn.fully_shard`` on the embedding, each
  decoder layer and the head (torchtitan's units), then the root, ``gt.nn.load_pretrained(model, folder)`` (each rank reads the slices of its pieces; the
  rotary buffer, which the folder does not hold, is ``to_empty``'d and computed), one training
  step (forward, backward, AdamW), ``model.save_pretrained(dir)`` (one tensor at a time through
  rank 0); its pieces map the files copy-on-write (the allocator does not see them: their bytes,
  found in /proc/self/maps, are added to every peak from the load on);
- ``gt-copy``: the same with ``load_pretrained(..., mmap=False)`` (each piece read into fresh
  memory);
- ``old``: the way before: ``LlamaForCausalLM.from_pretrained(folder)`` on every rank (the whole
  model), then the same ``fully_shard``, step and save;
- ``fsdp2``: torch's meta flow: build on meta, ``torch.distributed.fsdp.fully_shard`` on the
  same units and the root, ``to_empty``, ``dcp.load`` with ``HuggingFaceStorageReader`` (DTensor shards read
  by slices), the rotary buffer computed, the step, and ``dcp.save`` with
  ``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)`` (rank 0 writes
  one HF folder).

Memory: the allocator's live total (``torch.profiler(profile_memory=True)`` with the allocator
counting frees on every thread; benchmarks/_common.py ``allocator_profile``) from before the build, in three blocks: loading (build, layout, load),
training up to the optimizer's first step (forward, backward), and from it (the step, the save);
each block's peak is added to what the blocks before it left alive. Printed per flow: the largest over ranks of each
peak, against one full copy of the model and against the target (a rank's pieces plus twice the
largest tensor, once loaded). Load time: the slowest rank's, median of ``--reps`` runs of the
flow, beside ``from_pretrained`` of the same folder in one process followed by one read of every
weight (``from_pretrained`` maps the files; alone it reads nothing), median of ``--reps``; and
the first step's seconds (forward, backward, AdamW's step; the slowest rank): a mapped piece's
pages are copied there, when the step first writes them.
The loss is the batch's mean (FSDP2's per-rank losses averaged); the same data in every flow.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's start/stop lines, per rank

import torch

import globaltensor as gt
from _common import allocation_end, allocation_peak, allocator_profile  # benchmarks/ is on sys.path when a benchmark runs as a script

SEQ, BATCH = 32, 1  # a sequence per rank


def _config(args):
    import transformers
    return transformers.LlamaConfig(
        vocab_size=args["vocab"], hidden_size=args["hidden"], intermediate_size=args["inter"],
        num_hidden_layers=args["layers"], num_attention_heads=16, num_key_value_heads=8,
        max_position_embeddings=SEQ, tie_word_embeddings=False)


def _rotary(model, config, device="cpu"):
    """The rotary buffer the folder does not hold: materialized and computed, as HF's init does."""
    import transformers
    fresh = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    rotary = model.model.rotary_emb
    rotary.to_empty(device=device)
    rotary.inv_freq.copy_(fresh.inv_freq)
    rotary.original_inv_freq = fresh.original_inv_freq


def _units(model):
    """torchtitan's units: the embedding, each decoder layer, the head (the root keeps the
    norm): the two largest tensors are gathered one at a time, not together in the root."""
    return [model.model.embed_tokens, *model.model.layers, model.lm_head]


def _ids(config, rank):
    g = torch.Generator().manual_seed(rank)
    return torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=g)


def _flow(local_rank, name, args, folder, out):
    """One flow on this rank: (peak once loaded, peak before the step, peak of the whole run,
    load s, pieces bytes, largest tensor bytes, loss)."""
    import torch.distributed as dist
    import transformers

    gt.init()
    torch.set_num_threads(1)
    rank, world = gt.env.get_rank(), gt.env.get_world_size()
    config = _config(args)
    with allocator_profile() as before:
        if name == "old":
            dist.barrier()
            start = time.perf_counter()
            model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
            load_s = time.perf_counter() - start
        else:
            with torch.device("meta"):
                model = transformers.LlamaForCausalLM(config)
        if name == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            import torch.distributed.checkpoint as dcp

            mesh = init_device_mesh("cpu", (world,))
            for unit in _units(model):
                fully_shard(unit, mesh=mesh)
            fully_shard(model, mesh=mesh)
            model.to_empty(device="cpu")
            state = {k: v for k, v in model.state_dict().items() if "inv_freq" not in k}
            dist.barrier()
            start = time.perf_counter()
            dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(folder))
            load_s = time.perf_counter() - start
            _rotary(model, config)
            ids = _ids(config, rank)
        else:
            p = gt.placement("cpu", list(range(world)))
            for unit in _units(model):
                gt.nn.fully_shard(unit, p)
            gt.nn.fully_shard(model, p)
            if name in ("gt", "gt-copy"):
                dist.barrier()
                start = time.perf_counter()
                gt.nn.load_pretrained(model, folder, mmap=name == "gt")
                load_s = time.perf_counter() - start
                _rotary(model, config)
            ids = gt.tensor(torch.cat([_ids(config, r) for r in range(world)]), placement=p,
                            sbp=gt.sbp.split(0))
    mapped = _mapped_bytes(model, folder)  # pieces that map the files: not the allocator's
    loaded, left = allocation_peak(before) + mapped, allocation_end(before) + mapped
    dist.barrier()
    start = time.perf_counter()
    with allocator_profile() as training:
        loss = model(ids, labels=ids).loss
        loss.backward()
    peak_before = max(loaded, left + allocation_peak(training))
    left += allocation_end(training)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with allocator_profile() as after:
        opt.step()
        step_s = time.perf_counter() - start
        opt.zero_grad()
        target = os.path.join(out, name)
        if name == "fsdp2":
            import torch.distributed.checkpoint as dcp
            dcp.save(model.state_dict(), storage_writer=dcp.HuggingFaceStorageWriter(
                target, save_distributed=True, enable_consolidation=True))
        else:
            model.save_pretrained(target)
    pieces = sum(_local(t).numel() * t.element_size() for t in model.parameters())
    largest = max(t.numel() * t.element_size() for t in model.parameters())
    took = torch.tensor([load_s, step_s], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    if isinstance(loss, gt.GlobalTensor):
        value = loss.full_tensor().detach()
    else:  # FSDP2's loss is this rank's sequence's: the mean over the ranks is the batch's
        value = loss.detach().clone()
        dist.all_reduce(value)
        value /= world
    return (loaded, peak_before, max(peak_before, left + allocation_peak(after)), took[0].item(),
            pieces, largest, float(value.detach().mean()), took[1].item())


def _mapped_bytes(model, folder) -> int:
    """Bytes of this rank's pieces that lie in a mapping of the folder's files (/proc/self/maps):
    ``load_pretrained``'s copy-on-write views, which the allocator does not see; they are held
    from the load on (copied page by page into anonymous memory when first written)."""
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            span, *_, path = line.split(maxsplit=5)
            if path.strip().startswith(os.path.abspath(folder)):
                spans.append(tuple(int(x, 16) for x in span.split("-")))
    return sum(_local(t).numel() * t.element_size() for t in model.parameters()
               if any(low <= _local(t).data_ptr() < high for low, high in spans))


def _local(t):
    if isinstance(t, gt.GlobalTensor):
        return t.to_local()
    return t.to_local() if hasattr(t, "to_local") else t


def _save_folder(args, folder) -> int:
    """HF's own save_pretrained of a random model in one process (once per shape)."""
    import transformers
    stamp = os.path.join(folder, "bench.json")
    if os.path.exists(stamp) and json.load(open(stamp)) == args:
        return json.load(open(os.path.join(folder, "params.json")))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config(args))
    model.save_pretrained(folder, max_shard_size="500MB")
    params = sum(p.numel() for p in model.parameters())
    json.dump(params, open(os.path.join(folder, "params.json"), "w"))
    json.dump(args, open(stamp, "w"))
    return params


def _from_pretrained_s(folder) -> tuple[float, float, float]:
    """Seconds of ``from_pretrained`` in one process; of it plus reading every weight once (it
    maps the files: their bytes are read when first used); and of it plus copying every weight
    into the process's own memory (what loading by pieces does with its pieces)."""
    import transformers
    out = []
    for then in (None, "read", "copy"):
        start = time.perf_counter()
        model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
        with torch.no_grad():
            kept = [p.sum() if then == "read" else p.clone() for p in model.parameters()] \
                if then else []
        out.append(time.perf_counter() - start)
        del model, kept
    return tuple(out)


def _gb(n) -> str:
    return f"{n / 1e9:.3f} GB"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--flows", default="gt,gt-copy,old,fsdp2")
    parser.add_argument("--folder", default=os.path.join(tempfile.gettempdir(), "gt_big_model"))
    a = parser.parse_args()
    args = {k: getattr(a, k) for k in ("layers", "hidden", "inter", "vocab")}
    os.makedirs(a.folder, exist_ok=True)
    params = _save_folder(args, a.folder)
    full = params * 4
    print(f"HF Llama, {params / 1e6:.0f}M parameters ({_gb(full)} fp32), {a.world} gloo ranks, "
          f"medians of {a.reps}")
    timings = [_from_pretrained_s(a.folder) for _ in range(a.reps)]
    mapped, one, copied = (statistics.median(t[i] for t in timings) for i in range(3))
    rows = []
    for name in a.flows.split(","):
        runs = []
        for _ in range(a.reps):
            with tempfile.TemporaryDirectory() as out:
                runs.append(gt.spawn(_flow, args=(name, args, a.folder, out),
                                     nproc_per_node=a.world, timeout=1800))
        loaded, before, whole = (statistics.median(max(r[i] for r in run) for run in runs)
                                 for i in range(3))
        load = statistics.median(run[0][3] for run in runs)
        step = statistics.median(run[0][7] for run in runs)
        pieces, largest = max(r[4] for r in runs[0]), max(r[5] for r in runs[0])
        rows.append((name, loaded, before, whole, load, pieces, largest, runs[0][0][6], step))
    print(f"\n| flow | peak, loaded | target (pieces + 2 x largest) | peak before the step | "
          f"peak, whole run | / one full copy | load s | / from_pretrained + one read "
          f"in one process | first step s | loss |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, loaded, before, whole, load, pieces, largest, loss, step in rows:
        target = pieces + 2 * largest
        print(f"| {name} | {_gb(loaded)} | {_gb(target)} ({'met' if loaded <= target else 'missed'})"
              f" | {_gb(before)} | {_gb(whole)} | {whole / full:.2f} | {load:.2f} | "
              f"{load / one:.2f} | {step:.2f} | {loss:.4f} |")
    print(f"\nfrom_pretrained in one process: {mapped:.2f} s (the files mapped), {one:.2f} s "
          f"with every weight read once, {copied:.2f} s with every weight copied into the "
          f"process's memory; one full copy {_gb(full)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
