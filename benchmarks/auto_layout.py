"""gt.auto_layout: the search's speed at scale, and its choice against real runs of every candidate.

    python benchmarks/auto_layout.py --scale [--worlds 64,512,1024]
    python benchmarks/auto_layout.py --quality [--budget 0.62] [--steps 3]

``--scale``: HF ``LlamaForCausalLM`` with Llama-3-8B's shapes (32 layers, hidden 4096, ffn 14336,
32 / 8 heads, vocab 128256; fp32 AdamW as built), one 8,192-token sequence per rank as the
global batch, 80 GB per rank (80e9 bytes), links of a GPU cluster (25 GB/s and 10 us between
nodes, 400 GB/s and 2 us inside a node of 8 ranks), 400 TFLOP/s. Each world in a fresh process:
the search's seconds (the model's meta build included), the layouts simulated, the choice and
its verified peak, and the first rows of the table.

``--quality``: a 4-rank gloo job on this machine. The model is an ``nn.Sequential`` GPT (token
embedding, 8 pre-norm blocks of causal attention and a GELU MLP, hidden 512, 8 heads, vocabulary
8,192; 33.6M parameters), the batch 8 sequences of 128 tokens, AdamW. First the machine's
figures are measured in 4 real ranks (gt.costs() for the links, a matmul's flop rate and a global
operator's overhead per rank while all 4 ranks run); ``gt.auto_layout`` then searches with them
and a budget of ``--budget`` times the peak of plain data parallelism (so some layouts do not
fit). Then **every** candidate layout runs for real: 4 gloo processes, the layout applied as
``row.apply`` does, built and stepped twice inside the allocator's profile (torch.profiler
memory events with the allocator's own total: the peak of everything the rank holds, the max over
ranks), then ``--steps`` AdamW steps timed outside the profiler (their median, the slowest rank). Printed: the
whole table, predicted against measured time and peak, and whether the auto choice fits and is
within 10% of the fastest measured layout that fits.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

# the tests' models (tests/helpers.py): the quality benchmark trains their nn.Sequential GPT
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

SHAPE_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                attn_implementation="sdpa", tie_word_embeddings=False)
# what torchtitan's Llama-3-8B config (torchtitan/models/llama3/train_configs/llama3_8b.toml)
# runs: FSDP over every rank (data_parallel_shard_degree -1), tp 1, pp 1, selective activation
# checkpointing, local batch 1 of 8,192 tokens, bf16 compute with fp32 reductions
TITAN_8B = "fsdp over all ranks, tp 1, pp 1, selective checkpointing"


def gpt(vocab=8192, h=512, heads=8, layers=8) -> torch.nn.Sequential:
    """The quality benchmark's model: the tests' nn.Sequential GPT (tests/helpers.py), larger."""
    from helpers import gpt as sequential_gpt

    return sequential_gpt(vocab=vocab, h=h, heads=heads, layers=layers)


# ------------------------------------------------------------------------------------ --scale
def scale_one(world: int) -> dict:
    import transformers

    import globaltensor as gt

    llama, config = transformers.LlamaForCausalLM, transformers.LlamaConfig(**SHAPE_8B)
    links = gt.auto.Links(alpha=1e-5, bandwidth=25e9, node=(2e-6, 4e11), ranks_per_node=8)
    start = time.perf_counter()
    table = gt.auto_layout(lambda: llama(config), world, memory_per_rank=80e9,
                           batch=(world, 8192), costs=links, flops=4e14, progress=False)
    took = time.perf_counter() - start
    best = table[0]
    simulated = sum(1 for r in table if r.step is not None)
    return {"world": world, "seconds": took, "layouts": len(table), "simulated": simulated,
            "choice": str(best.layout), "peak": best.peak, "status": best.status,
            "step": best.step.total, "kinds": best.kinds, "table": str(table).splitlines()[:8]}


def scale(worlds):
    print("gt.auto_layout: Llama-3-8B shape, one 8,192-token sequence per rank, 80e9 bytes per "
          "rank, 25 GB/s between nodes of 8 ranks (400 GB/s inside), 400 TFLOP/s")
    for world in worlds:
        out = subprocess.run([sys.executable, __file__, "--scale-one", str(world)],
                             capture_output=True, text=True)
        if out.returncode:
            print(f"{world}: failed\n{out.stderr[-3000:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"\n{world} ranks: {r['seconds']:.1f} s, {r['layouts']} layouts, {r['simulated']} "
              f"simulated; choice: {r['choice']} (peak {r['peak'] / 1e9:.1f} GB, {r['status']}, "
              f"step {r['step']:.2f} s); torchtitan's 8B config: {TITAN_8B}")
        print("\n".join(r["table"]))
        sys.stdout.flush()


# ---------------------------------------------------------------------------------- --quality
VOCAB, SEQS, TOKENS = 8192, 8, 128


def _calibrate(rank):
    """This machine's figures, in 4 real ranks at once (each measurement starts together on
    every rank, so each sees its share of the cores): the links, a matmul's flop rate, the
    a global operator's overhead."""
    import globaltensor as gt

    gt.init()
    costs = gt.measure_costs()

    def timed(fn, n):
        fn()
        gt.comm.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n

    a, b = torch.randn(256, 512), torch.randn(512, 2048)
    rate = 2 * 256 * 512 * 2048 / timed(lambda: a @ b, 20)
    g = gt.randn(4, 8, placement=gt.placement("cpu", list(range(4))), sbp=gt.sbp.broadcast)
    overhead = timed(lambda: g * 1.0, 400)
    return {"alpha": costs.alpha, "beta": costs.beta, "rate": rate, "overhead": overhead}


def _run_layout(rank, fields, plan, steps):
    """One candidate for real, in fresh processes: the model built, laid out as ``row.apply``
    does and stepped twice inside the allocator's profile (its peak: everything the rank
    holds, the optimizer's state included); then ``steps`` steps timed outside it."""
    sys.path.insert(0, os.path.dirname(__file__))
    import globaltensor as gt
    from _common import allocation_peak, allocator_profile

    gt.init()
    layout = gt.auto.Layout(**fields, plan=tuple(tuple(p) for p in plan))
    batch = gt.auto.Batch((SEQS, TOKENS))
    with allocator_profile() as prof:
        torch.manual_seed(0)
        model = gpt()
        target = gt.auto.build.apply(model, layout, "cpu")
        opt = torch.optim.AdamW(target.parameters(), lr=1e-4)
        grid = gt.auto.build.make_placement(layout, "cpu", 0)
        ids = gt.randint(0, VOCAB, (SEQS, TOKENS), placement=grid,
                         sbp=gt.auto.build.batch_sbp(grid))
        for _ in range(2):
            gt.auto.build.train_step(target, layout, batch, ids, opt)
    times = []
    for _ in range(steps):
        gt.comm.barrier()
        t0 = time.perf_counter()
        gt.auto.build.train_step(target, layout, batch, ids, opt)
        gt.comm.barrier()
        times.append(time.perf_counter() - t0)
    return {"time": statistics.median(times), "peak": allocation_peak(prof)}


def quality(budget_ratio: float, steps: int, rows: list | None = None):
    import globaltensor as gt

    fig = gt.spawn(_calibrate, nproc_per_node=4, timeout=600)
    rate = statistics.median(f["rate"] for f in fig)
    over = statistics.median(f["overhead"] for f in fig)
    links = gt.auto.Links(alpha=fig[0]["alpha"], bandwidth=1 / fig[0]["beta"], overhead=over,
                          ranks_per_processor=4 / len(os.sched_getaffinity(0)))
    print(f"machine: alpha {links.alpha * 1e6:.0f} us, {links.bandwidth / 1e9:.2f} GB/s, "
          f"{rate / 1e9:.1f} GFLOP/s per rank, "
          f"{over * 1e6:.0f} us per global operator (4 ranks at once)")
    probe = gt.auto_layout(gpt, 4, memory_per_rank=2**40, batch=(SEQS, TOKENS), costs=links,
                           flops=rate, progress=False, candidates={"pp": [1], "fsdp": [1],
                                                                   "tp": [1], "checkpoint": [False]})
    budget = int(budget_ratio * probe[0].peak)
    start = time.perf_counter()
    table = gt.auto_layout(gpt, 4, memory_per_rank=budget, batch=(SEQS, TOKENS), costs=links,
                           flops=rate, progress=False)
    print(f"search: {time.perf_counter() - start:.1f} s; budget {budget / 2**20:.0f} MiB "
          f"({budget_ratio} x plain data parallelism's predicted peak)\n{table}\n")
    measured = []
    for i, row in enumerate(table.rows):
        if rows is not None and i not in rows:
            continue
        fields = {k: getattr(row.layout, k) for k in ("pp", "dp", "fsdp", "tp",
                  "reshard_after_forward", "checkpoint", "microbatches")}
        out = gt.spawn(_run_layout, args=(fields, row.layout.plan, steps), nproc_per_node=4,
                       timeout=1800)
        t, peak = max(o["time"] for o in out), max(o["peak"] for o in out)
        measured.append((row, t, peak))
        pred = f"{row.step.total:.3f} s {row.peak / 2**20:7.1f} MiB" if row.step else "(not simulated)"
        print(f"{i:>3} {str(row.layout):<52} predicted {pred}   measured {t:.3f} s "
              f"{peak / 2**20:7.1f} MiB  {'fits' if peak <= budget else 'over'}")
        sys.stdout.flush()
    fitting = [(r, t) for r, t, p in measured if p <= budget]
    if not fitting or measured[0][0] is not table[0]:
        return
    best = min(fitting, key=lambda x: x[1])
    chosen = measured[0]
    print(f"\nauto choice: {chosen[0].layout}: measured {chosen[1]:.3f} s, peak "
          f"{chosen[2] / 2**20:.1f} MiB ({'fits' if chosen[2] <= budget else 'DOES NOT FIT'}); "
          f"fastest measured that fits: {best[0].layout} {best[1]:.3f} s; ratio "
          f"{chosen[1] / best[1]:.3f} (target <= 1.10)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", action="store_true")
    ap.add_argument("--worlds", default="64,512,1024")
    ap.add_argument("--quality", action="store_true")
    ap.add_argument("--budget", type=float, default=0.62)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", default=None, help="run only these rows of the table (0,3,5)")
    ap.add_argument("--scale-one", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.scale_one is not None:
        print(json.dumps(scale_one(a.scale_one)))
    elif a.scale:
        scale([int(w) for w in a.worlds.split(",")])
    elif a.quality:
        quality(a.budget, a.steps, None if a.rows is None else [int(r) for r in a.rows.split(',')])
    else:
        ap.print_help()


if __name__ == "__main__":
    main()
