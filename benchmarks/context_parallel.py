"""A sequence split over ranks (docs/long_sequences.md): HF Llama, one long sequence, 4 gloo ranks.

    python benchmarks/context_parallel.py [--seq 4096] [--hidden 256] [--layers 4] [--steps 3]

In the same 4 processes, steps alternating: ``gt`` (the model laid out with ``to_global(line)``,
the token ids split on the sequence, ``S(1)`` over "cp": attention keeps its queries split and
gathers k and v) and ``whole`` (plain torch, the whole sequence on every rank: what each rank
would compute and hold without the split). Per contender: the step (forward, backward, AdamW)
median over ``--steps``, slowest rank; rank 0's allocator peak above the step's start
(``_common.allocator_profile``); the first loss (same data and weights: they must agree); the
bytes gt sent per rank (``gt.comm_trace``). torch's ``context_parallel`` needs CUDA's SDPA
kernels (flash, efficient, cuDNN) and cannot run on this CPU machine: it is not in the table.
"""
from __future__ import annotations

import argparse
import statistics
import sys

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
    split = build(a)
    split.load_state_dict(whole.state_dict())
    split.to_global(line)
    ids = torch.randint(0, 1024, (1, a.seq), generator=torch.Generator().manual_seed(1))
    x = ids.to_global(line, gt.sbp.broadcast).to_global(sbp=gt.sbp.split(1))
    contenders = {"gt": (split, x, torch.optim.AdamW(split.parameters(), lr=1e-4)),
                  "whole": (whole, ids, torch.optim.AdamW(whole.parameters(), lr=1e-4))}
    first = {}

    def step(name):
        model, data, opt = contenders[name]
        loss = model(data, labels=data).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        first.setdefault(name, loss.full_tensor().item() if name == "gt" else loss.item())

    for name in contenders:  # warm-up: the first step's decisions and AdamW's state
        step(name)
    times = {name: [] for name in contenders}
    for i in range(a.steps):
        for name in (contenders if i % 2 == 0 else list(contenders)[::-1]):
            times[name].append(timed(lambda name=name: step(name)))
    peaks, sent = {}, 0
    for name in contenders:
        with allocator_profile() as prof:
            if name == "gt":
                with gt.comm_trace() as trace:
                    step(name)
                sent = trace.bytes_per_rank
            else:
                step(name)
        peaks[name] = allocation_peak(prof)
    return ({k: statistics.median(v) for k, v in times.items()}, peaks, first, sent)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    times, peaks, first, sent = gt.spawn(worker, args=(a,), nproc_per_node=4, timeout=1800)[0]
    print(f"HF Llama, hidden {a.hidden}, {a.layers} layers, 8 heads over 2 key heads, one "
          f"sequence of {a.seq}, 4 ranks, AdamW")
    print(f"{'contender':>10} {'step s':>8} {'peak MiB (rank 0)':>18} {'first loss':>11}")
    for k in times:
        print(f"{k:>10} {times[k]:8.3f} {peaks[k] / 2**20:18.1f} {first[k]:11.5f}")
    print(f"gt / whole: step {times['gt'] / times['whole']:.2f}x, peak "
          f"{peaks['gt'] / peaks['whole']:.2f}x; gt sent {sent / 2**20:.1f} MiB per rank a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
