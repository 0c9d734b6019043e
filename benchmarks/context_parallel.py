"""A sequence split over ranks (docs/long_context.md): HF Llama, one long sequence, 4 gloo ranks.

    python benchmarks/context_parallel.py [--seq 4096] [--hidden 256] [--layers 4] [--steps 3]

In the same 4 processes, steps in turn: ``gt`` (the model laid out with ``to_global(line)``,
the token ids split on the sequence, ``S(1)`` over "cp": attention keeps its queries split and
gathers k and v), ``head-tail`` (the same with ``S(1, "head_tail")``: rank i holds chunks i and
7-i of 8, the causal work even; ``gt.attention_balance`` gives each layout's busiest rank over
the mean), ``ring`` (the plain split with ``gt.set_attention_method("ring")``: k and v stay
split and go around the ranks; in a phase of its own, since the setting forgets the cached
choices; ``gt``'s row is what the choice takes by itself) and ``whole`` (plain torch, the whole sequence on every rank: what each rank
would compute and hold without the split). Per contender: the step (forward, backward, AdamW)
median over ``--steps``, slowest rank; rank 0's allocator peak above the step's start
(``_common.allocator_profile``); the first loss (same data and weights: they must agree); the
bytes gt sent per rank (``gt.comm_trace``). torch's ``context_parallel`` needs CUDA's SDPA
kernels (flash, efficient, cuDNN) and cannot run on this CPU machine: it is not in the table.
"CPU s per rank": each rank's own compute in a step (process CPU time): what balance evens out.
On this machine 4 ranks share 2 cores, so a rank that finishes early gives its core to the
others and the step time follows the total work, not the busiest rank's; with a core (or a GPU)
per rank the step waits for the busiest.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import globaltensor as gt
from _common import allocation_peak, allocator_profile, timed  # benchmarks/ is on sys.path


def build(a):
    import transformers
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=a.hidden,
                                      intermediate_size=a.hidden * 4, num_hidden_layers=a.layers,
                                      num_attention_heads=8, num_key_value_heads=2,
                                      max_position_embeddings=a.seq, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def worker(local_rank, a):
    torch.set_num_threads(1)
    gt.init()
    line = gt.placement("cpu", [0, 1, 2, 3], axes=("cp",))
    whole = build(a)
    split, balanced, ringed = build(a), build(a), build(a)
    for model in (split, balanced, ringed):
        model.load_state_dict(whole.state_dict())
        model.to_global(line)
    ids = torch.randint(0, 1024, (1, a.seq), generator=torch.Generator().manual_seed(1))
    x = ids.to_global(line, gt.sbp.broadcast).to_global(sbp=gt.sbp.S(1))
    y = ids.to_global(line, gt.sbp.broadcast).to_global(sbp=gt.sbp.S(1, "head_tail"))
    contenders = {"gt": (split, x, torch.optim.AdamW(split.parameters(), lr=1e-4)),
                  "head-tail": (balanced, y, torch.optim.AdamW(balanced.parameters(), lr=1e-4)),
                  "whole": (whole, ids, torch.optim.AdamW(whole.parameters(), lr=1e-4)),
                  "ring": (ringed, x, torch.optim.AdamW(ringed.parameters(), lr=1e-4))}
    first = {}

    def step(name):
        model, data, opt = contenders[name]
        loss = model(data, labels=data).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        first.setdefault(name, loss.item() if name == "whole" else loss.full_tensor().item())

    times = {name: [] for name in contenders}
    cpu = {name: [] for name in contenders}  # this rank's own compute (CPU seconds) per step
    peaks, sent = {}, {}
    # the ring runs in a phase of its own: gt.set_attention_method forgets the cached choices
    for names, method in ((["gt", "head-tail", "whole"], "auto"), (["ring"], "ring")):
        gt.set_attention_method(method)
        for name in names:  # warm-up: the first step's decisions and AdamW's state
            step(name)
        for i in range(a.steps):
            for name in names[i % len(names):] + names[:i % len(names)]:
                start = time.process_time()
                times[name].append(timed(lambda name=name: step(name)))
                cpu[name].append(time.process_time() - start)
        for name in names:
            with allocator_profile() as prof:
                if name != "whole":
                    with gt.comm_trace() as trace:
                        step(name)
                    sent[name] = trace.bytes_per_rank
                else:
                    step(name)
            peaks[name] = allocation_peak(prof)
    gt.set_attention_method("auto")
    queries = (1, 8, a.seq, a.hidden // 8)
    ratios = {name: gt.attention_balance(gt.Layout(line, (sbp,), queries)).ratio
              for name, sbp in (("gt", gt.sbp.S(2)), ("head-tail", gt.sbp.S(2, "head_tail")),
                                ("ring", gt.sbp.S(2)))}
    return ({k: statistics.median(v) for k, v in times.items()}, peaks, first, sent, ratios,
            {k: statistics.median(v) for k, v in cpu.items()})


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    results = gt.spawn(worker, args=(a,), nproc_per_node=4, timeout=1800)
    times, peaks, first, sent, ratios, _ = results[0]
    cpu = {k: [r[5][k] for r in results] for k in times}  # per rank
    spread = {k: max(v) / (sum(v) / len(v)) for k, v in cpu.items()}
    print(f"HF Llama, hidden {a.hidden}, {a.layers} layers, 8 heads over 2 key heads, one "
          f"sequence of {a.seq}, 4 ranks, AdamW")
    print(f"{'contender':>10} {'step s':>8} {'peak MiB (rank 0)':>18} {'first loss':>11} "
          f"{'attention work: busiest/mean':>29} {'CPU s per rank':>26} {'busiest/mean':>13}")
    for k in times:
        ratio = f"{ratios[k]:.2f}" if k in ratios else "-"
        ranks = " ".join(f"{c:.2f}" for c in cpu[k])
        print(f"{k:>10} {times[k]:8.3f} {peaks[k] / 2**20:18.1f} {first[k]:11.5f} {ratio:>29} "
              f"{ranks:>26} {spread[k]:13.2f}")
    for k in sent:
        print(f"{k} / whole: step {times[k] / times['whole']:.2f}x, peak "
              f"{peaks[k] / peaks['whole']:.2f}x; sent {sent[k] / 2**20:.1f} MiB per rank a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
