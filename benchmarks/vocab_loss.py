"""Cross-entropy over vocabulary-split logits: the rule (no gather) against gathering the logits
first, on an HF Llama with Megatron tensor parallelism, same processes.

    python benchmarks/vocab_loss.py [--world 4] [--vocab 32000] [--seq 64] [--batch 4] [--steps 6]

A 2-layer LlamaForCausalLM (hidden 64; random init) laid out Megatron-style on a 1-D "tp"
placement (q/k/v/gate/up/lm_head and the embedding column-wise, o/down row-wise), so its logits
are split on the vocabulary. Two spellings of the same loss, alternating step by step:

- ``split``: ``F.cross_entropy(logits.view(-1, V), labels)``: the softmax and nll rules keep the
  vocabulary split (each rank's row max and sum of exponentials are all-gathered, two numbers
  per row; the target's logit is picked by the rank that holds it);
- ``gathered``: ``F.cross_entropy(logits.to_global(sbp=B).view(-1, V), labels)``: what a layout
  without the rule must do (all-gather the logits, and reduce-scatter their gradient).

Printed: the bytes each rank sends per step (``gt.comm_trace``), the median step (forward and
backward, the slowest rank), and the losses (equal).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import globaltensor as gt


def worker(local_rank, a):
    import transformers

    torch.set_num_threads(1)
    gt.init()
    config = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=2 * a.seq)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    place = gt.placement("cpu", list(range(a.world)), axes=("tp",))
    col, row = gt.nn.colwise(), gt.nn.rowwise()
    model.to_global(place, gt.nn.sbp_plan({
        "lm_head": col, "model.embed_tokens": col, "*.q_proj": col, "*.k_proj": col,
        "*.v_proj": col, "*.gate_proj": col, "*.up_proj": col, "*.o_proj": row, "*.down_proj": row}))
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(1))
    tokens = gt.tensor(ids, placement=place, sbp=gt.sbp.broadcast)
    labels = tokens[:, 1:].reshape(-1)

    def step(how):
        logits = model(tokens).logits[:, :-1]
        if how == "gathered":
            logits = logits.to_global(sbp=gt.sbp.broadcast)
        loss = F.cross_entropy(logits.reshape(-1, a.vocab), labels)
        loss.backward()
        for p in model.parameters():
            p.grad = None
        return loss

    out = {}
    for how in ("split", "gathered"):
        step(how)  # warm
        with gt.comm_trace() as trace:
            loss = step(how)
        out[how] = {"bytes": trace.bytes_per_rank, "loss": loss.full_tensor().item(), "times": []}
    for i in range(a.steps):
        for how in (("split", "gathered") if i % 2 == 0 else ("gathered", "split")):
            torch.distributed.barrier()
            t = time.perf_counter()
            step(how)
            torch.distributed.barrier()
            out[how]["times"].append(time.perf_counter() - t)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    res = gt.spawn(worker, args=(a,), nproc_per_node=a.world, timeout=900)[0]
    print(f"vocab-split cross-entropy: Llama 2 layers, hidden 64, vocab {a.vocab}, "
          f"{a.batch} x {a.seq} tokens, tp {a.world}")
    base = statistics.median(res["gathered"]["times"])
    for how in ("split", "gathered"):
        r = res[how]
        med = statistics.median(r["times"])
        print(f"{how:9} bytes/rank/step {r['bytes']:>12,}  step {med * 1e3:8.1f} ms  "
              f"/ gathered {med / base:5.2f}  loss {r['loss']:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
