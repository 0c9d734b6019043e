"""torch.compile on global models against torch DDP and DTensor, each eager and compiled, same run.

    python benchmarks/compile.py [--runs 3] [--steps 8] [--world 4] [--backend inductor]
                                 [--hidden 64,128,256] [--only dp,tp,tp2x2]

- dp: HF GPT-2 (2 layers, 4 heads, sequence 32, batch 8 per rank, random init) data parallel
  on ``--world`` ranks (parameters B, batch S(0)): gt eager, gt + torch.compile, torch DDP eager,
  torch DDP + torch.compile, one config per ``--hidden``. gt's loss is the global batch's mean
  with its count given as ``gt.data.loader(items=...)`` gives it (``num_items_in_batch``), so
  its forward has no collective; DDP's is each rank's own mean.
- tp: HF Llama (hidden 128, 2 layers) Megatron tensor parallel on ``--world`` ranks: gt eager,
  gt + torch.compile, DTensor ``parallelize_module`` (ColwiseParallel / RowwiseParallel) eager
  and + torch.compile.
- tp2x2: the same Llama on a 2x2 grid (4 ranks), data x tensor parallel: gt (batch S(0) on "dp",
  Megatron on "tp") against DTensor's tensor parallel on the mesh's "tp" axis with the gradients
  averaged over "dp" after backward (one flat all-reduce, as DDP's one bucket).

A step is zero_grad + forward and loss + backward + optimizer step (AdamW). "+ compile" compiles
the forward and loss (gt with ``fullgraph=True``; DDP's forward breaks the graph by design, its
logger and bucket boundaries, DDPOptimizer); the backward runs the compiled backward graph; DDP's
gradient all-reduce and gt's gradient buckets run in their hooks, eagerly) and the optimizer
step (``torch.compile(opt.step)``), with ``--backend``. The contenders alternate step by step in
the same processes (the order reversed every other step); a step's time is the slowest rank's
after a barrier; the median over ``--steps`` steady steps, the ratios median (spread) over
``--runs`` runs of fresh processes. Printed beside them: the first step of each contender (the
compiling one for "+ compile") and the number of times globaltensor's ``__torch_dispatch__`` is
entered during one steady compiled step (target 0) and during the compiled forward alone.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

import globaltensor as gt
from globaltensor.testing import dispatches_in
from _common import bucketed_all_reduce, dtensor_tp, timed  # benchmarks/ is on sys.path when a benchmark runs as a script

S, B = gt.sbp.split, gt.sbp.broadcast
BATCH, SEQ, VOCAB = 8, 32, 256


def gpt2(hidden):
    import transformers

    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=hidden, n_layer=2, n_head=4,
                                     n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # else HF logs a warning inside forward: a graph break
    return model


def llama(hidden):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.loss_type = "ForCausalLM"
    return model


def lm_loss(model, ids, num_items=None):
    return model(ids, labels=ids, num_items_in_batch=num_items).loss


def make_step(model, ids, backend=None, fullgraph=False, after_backward=None, num_items=None):
    """zero_grad + forward/loss + backward (+ ``after_backward``) + AdamW step; compiled with
    ``backend`` if given. ``num_items``: the global batch's count of labels, as
    ``gt.data.loader(items=...)`` gives it (the mean then needs no collective in the forward)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    compiled = lm_loss if backend is None else torch.compile(lm_loss, backend=backend,
                                                              fullgraph=fullgraph)

    def loss_of(model, ids):
        return compiled(model, ids, num_items)
    opt_step = opt.step if backend is None else torch.compile(opt.step, backend=backend)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_of(model, ids).backward()
        if after_backward is not None:
            after_backward()
        opt_step()

    step.loss_of, step.model, step.ids = loss_of, model, ids
    return step


def race(steps: dict, n: int) -> tuple[dict, dict]:
    """First-step time and median steady step time of each contender, alternating them."""
    first = {}
    for name, step in steps.items():  # the compiling step, one contender at a time
        first[name] = timed(step)
    times = {k: [] for k in steps}
    names = list(steps)
    for i in range(n + 2):
        for name in (names if i % 2 == 0 else names[::-1]):
            took = timed(steps[name])
            if i >= 2:  # warm-up (the optimizers' recompile at step 2, when state fills)
                times[name].append(took)
    return first, {k: statistics.median(v) for k, v in times.items()}


def megatron(name, t):
    column = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    row = ("o_proj", "down_proj")
    if t.dim() == 2 and any(c in name for c in column):
        return S(0)
    if t.dim() == 2 and any(c in name for c in row):
        return S(1)
    return B


def worker(local_rank, what, hidden, steps, backend, threads):
    torch.set_num_threads(threads)
    warnings.simplefilter("ignore")
    gt.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    everyone = gt.placement("cpu", list(range(world)))
    if what == "dp":
        base = gpt2(hidden)
        data = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 + r))
                for r in range(world)]
        gids = gt.tensor(torch.cat(data), placement=everyone, sbp=S(0))
        g, gc = (copy.deepcopy(base).to_global(everyone, B) for _ in range(2))
        t, tc = (torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base)) for _ in range(2))
        items = world * BATCH * (SEQ - 1)  # gt.data.loader(items=...)'s count: the shifted labels
        steps_ = {"gt eager": make_step(g, gids, num_items=items),
                  "gt + compile": make_step(gc, gids, backend, fullgraph=True, num_items=items),
                  "DDP eager": make_step(t, data[rank]),
                  "DDP + compile": make_step(tc, data[rank], backend)}
    elif what == "tp2x2":
        steps_ = _tp2x2_steps(hidden, backend, rank)
    else:
        from torch.distributed.device_mesh import init_device_mesh

        base = llama(hidden)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
        gids = gt.tensor(ids, placement=everyone, sbp=B)
        g, gc = (copy.deepcopy(base).to_global(everyone, megatron) for _ in range(2))
        mesh = init_device_mesh("cpu", (world,))
        d, dc = (dtensor_tp(copy.deepcopy(base), mesh) for _ in range(2))
        steps_ = {"gt eager": make_step(g, gids), "gt + compile": make_step(gc, gids, backend, fullgraph=True),
                  "DTensor eager": make_step(d, ids),
                  "DTensor + compile": make_step(dc, ids, backend)}
    first, median = race(steps_, steps)
    compiled = steps_["gt + compile"]
    return {"first": first, "median": median,
            "dispatches_step": dispatches_in(compiled),
            "dispatches_forward": dispatches_in(lambda: compiled.loss_of(compiled.model, compiled.ids))}


def _tp2x2_steps(hidden, backend, rank):
    """HF Llama on a 2x2 grid, data x tensor parallel: gt (batch S(0) on "dp", Megatron sbps on
    "tp") against DTensor ``parallelize_module`` on the mesh's "tp" axis plus a flat gradient
    all-reduce over "dp" after backward, each eager and compiled."""
    from torch.distributed.device_mesh import init_device_mesh

    base = llama(hidden)
    grid = gt.placement("cpu", [[0, 1], [2, 3]], axes=("dp", "tp"))
    ids = torch.randint(0, VOCAB, (2 * BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    gids = gt.tensor(ids, placement=grid, sbp=(S(0), B))
    g, gc = (copy.deepcopy(base).to_global(grid, lambda n, t: (B, megatron(n, t))) for _ in range(2))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mine = ids[BATCH * (rank // 2): BATCH * (rank // 2 + 1)]  # this rank's dp row
    d, dc = (dtensor_tp(copy.deepcopy(base), mesh["tp"]) for _ in range(2))
    group = mesh["dp"].get_group()
    return {"gt eager": make_step(g, gids), "gt + compile": make_step(gc, gids, backend, fullgraph=True),
            "DTensor eager": make_step(d, mine, after_backward=bucketed_all_reduce(list(d.parameters()), group)),
            "DTensor + compile": make_step(dc, mine, backend,
                                           after_backward=bucketed_all_reduce(list(dc.parameters()), group))}


def spread(values, digits=2):
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--hidden", default="64,128,256", help="GPT-2 widths (dp)")
    ap.add_argument("--tp-hidden", type=int, default=128, help="Llama width (tp)")
    ap.add_argument("--only", default="dp,tp,tp2x2")
    a = ap.parse_args()
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        sys.exit("benchmarks/compile.py needs transformers (pip install -e '.[test]')")
    jobs = [("dp", int(h)) for h in a.hidden.split(",")] if "dp" in a.only.split(",") else []
    if "tp" in a.only.split(","):
        jobs.append(("tp", a.tp_hidden))
    if "tp2x2" in a.only.split(",") and a.world == 4:
        jobs.append(("tp2x2", a.tp_hidden))
    for what, hidden in jobs:
        runs = []
        for _ in range(a.runs):
            started = time.perf_counter()
            runs.append(gt.spawn(worker, args=(what, hidden, a.steps, a.backend, a.threads),
                                 nproc_per_node=a.world, timeout=3600)[0])
            wall = time.perf_counter() - started
        names = list(runs[0]["median"])
        ref_c, ref_e = names[3], names[2]
        model = {"dp": "GPT-2 data parallel", "tp": "Llama tensor parallel",
                 "tp2x2": "Llama data x tensor parallel (2x2)"}[what]
        print(f"{model}, hidden {hidden}, {a.world} ranks, backend {a.backend} "
              f"(last run {wall:.0f} s wall):")
        for n in names:
            print(f"  {n:18s} {statistics.median([r['median'][n] for r in runs]) * 1e3:8.1f} ms/step"
                  f"   first step {statistics.median([r['first'][n] for r in runs]):7.1f} s")
        print(f"  gt + compile / {ref_c}: "
              f"{spread([r['median']['gt + compile'] / r['median'][ref_c] for r in runs])}"
              f"   (target <= {'1.05' if what == 'dp' else '1.0'})")
        print(f"  first step (compiling), gt + compile / {ref_c}: "
              f"{spread([r['first']['gt + compile'] / r['first'][ref_c] for r in runs])}")
        print(f"  gt + compile / {ref_e}: "
              f"{spread([r['median']['gt + compile'] / r['median'][ref_e] for r in runs])}"
              + ("   (target <= 1.1)" if what == "dp" else ""))
        print(f"  gt eager / {ref_e}: "
              f"{spread([r['median']['gt eager'] / r['median'][ref_e] for r in runs])}")
        print(f"  __torch_dispatch__ entries in a steady compiled step: "
              f"{[r['dispatches_step'] for r in runs]} (forward alone "
              f"{[r['dispatches_forward'] for r in runs]}; target 0)")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
