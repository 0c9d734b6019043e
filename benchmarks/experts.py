"""Expert parallelism (docs/experts.md): HF's Qwen3-MoE on 4 gloo ranks, the experts split over
"ep" and the tokens split alike.

    python benchmarks/experts.py [--tokens 4096] [--hidden 256] [--steps 3]

Two parts, in the same 4 processes, each contender in turn:

1. **One MoE layer** (HF's ``Qwen3MoeSparseMoeBlock``: router and experts), 8 experts top-2 and
   64 experts top-8, ``--tokens`` tokens over the 4 ranks, forward and backward. Per contender
   the bytes each rank sends (``gt.comm_trace``, the busiest rank), forward alone and forward
   with backward, and the step's median time (slowest rank). Contenders: ``all_to_all`` (token
   dispatch, the default) and ``all_reduce`` (``gt.set_experts_method("all_reduce")``: the
   ``_grouped_mm`` rules, every rank all tokens, partial sums all-reduced: what ran before).
   The bound: the routed tokens' hidden states twice (there and back: tokens per rank x top-k x
   hidden x 4 bytes x 2) plus the counts. With ``--titan`` (torchtitan 0.3's MoE with its
   ``AllToAllTokenDispatcher`` on a 4-rank DeviceMesh, where it runs on CPU), its layer too.
2. **A training step** of the whole model (2 layers, 8 experts top-2, the router's aux loss in
   the loss, AdamW): median step time, both methods, and one process beside them.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import globaltensor as gt
from _common import timed  # benchmarks/ is on sys.path

S, B = gt.sbp.split, gt.sbp.broadcast
METHODS = ("all_to_all", "all_reduce")


def config(a, experts: int, top_k: int):
    import transformers
    return transformers.Qwen3MoeConfig(
        vocab_size=1024, hidden_size=a.hidden, intermediate_size=a.hidden * 2,
        moe_intermediate_size=a.hidden // 2 if experts <= 8 else a.hidden // 8,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        head_dim=a.hidden // 8, num_experts=experts, num_experts_per_tok=top_k,
        output_router_logits=True, max_position_embeddings=a.tokens)


def experts_split(name, t):
    return S(0) if t.dim() == 3 else B


def layer_part(a, line, experts: int, top_k: int):
    """The MoE layer alone: per method its bytes (forward; forward and backward) on the
    busiest rank, this rank's, and the step's median time."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    torch.manual_seed(0)
    cfg = config(a, experts, top_k)
    cfg._experts_implementation = "grouped_mm"  # what the model's init sets: transformers' default
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05)
    block.to_global(line, experts_split)
    x = torch.randn(4, a.tokens // 4, a.hidden, generator=torch.Generator().manual_seed(1))
    x = x.to_global(line, B).to_global(sbp=S(0)).requires_grad_(True)
    out = {}
    for method in METHODS:
        gt.set_experts_method(method)

        def step():
            block(x).pow(2).mean().backward()
        step()  # warm-up: the decisions
        with gt.comm_trace() as forward:
            y = block(x)
        with gt.comm_trace() as both:
            y.pow(2).mean().backward()
        times = [timed(step) for _ in range(a.steps)]
        out[method] = (forward.bytes_per_rank, forward.bytes_per_rank + both.bytes_per_rank,
                       statistics.median(times))
    gt.set_experts_method("all_to_all")
    return out


def model_part(a, line):
    """The whole model's AdamW step, both methods, and one process's (this rank's)."""
    import transformers
    torch.manual_seed(0)
    whole = transformers.Qwen3MoeForCausalLM(config(a, 8, 2))
    models = {}
    for method in METHODS:
        model = transformers.Qwen3MoeForCausalLM(whole.config)
        model.load_state_dict(whole.state_dict())
        models[method] = model.to_global(line, experts_split)
    ids = torch.randint(0, 1024, (8, a.tokens // 8), generator=torch.Generator().manual_seed(2))
    split = ids.to_global(line, B).to_global(sbp=S(0))
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    opts["one process"] = torch.optim.AdamW(whole.parameters(), lr=1e-4)
    losses, times = {}, {}
    for name in (*METHODS, "one process"):
        model = whole if name == "one process" else models[name]
        data = ids if name == "one process" else split
        if name in METHODS:
            gt.set_experts_method(name)

        def step():
            loss = model(data, labels=data).loss
            loss.backward()
            opts[name].step()
            opts[name].zero_grad()
            return loss
        first = step()
        losses[name] = first.full_tensor().item() if name in METHODS else first.item()
        times[name] = statistics.median(timed(step) for _ in range(a.steps))
    gt.set_experts_method("all_to_all")
    return losses, times


def worker(local_rank, a):
    torch.set_num_threads(1)
    gt.init()
    line = gt.placement("cpu", [0, 1, 2, 3], axes=("ep",))
    layers = {(e, k): layer_part(a, line, e, k) for e, k in ((8, 2), (64, 8))}
    titan = {}
    if a.titan:
        sys.path.insert(0, a.titan)  # torchtitan installed there (benchmarks/_titan_ep.py)
        from _titan_ep import titan_moe_step_seconds
        for e, k in ((8, 2), (64, 8)):
            inter = a.hidden // 2 if e <= 8 else a.hidden // 8
            titan[e, k] = titan_moe_step_seconds(a.hidden, inter, e, k, a.tokens // 4, a.steps,
                                                 expert_dtype="fp32")
    losses, times = model_part(a, line)
    return layers, titan, losses, times


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--titan", default="", help="a folder torchtitan 0.3 is installed in "
                   "(benchmarks/_titan_ep.py says how): its EP MoE layer beside ours")
    a = p.parse_args()
    start = time.time()
    results = gt.spawn(worker, args=(a,), nproc_per_node=4, timeout=3600)
    print(f"HF Qwen3-MoE, hidden {a.hidden}, {a.tokens} tokens over 4 ranks (ep=4), float32")
    print(f"{'layer':>14} {'method':>11} {'fwd KiB':>9} {'fwd+bwd KiB':>12} {'bound fwd KiB':>14} "
          f"{'fwd / bound':>12} {'step ms':>8}")
    for (e, k), _ in results[0][0].items():
        bound = (a.tokens // 4) * k * a.hidden * 4 * 2 / 1024
        for method in METHODS:
            fwd = max(r[0][e, k][method][0] for r in results) / 1024
            both = max(r[0][e, k][method][1] for r in results) / 1024
            ms = max(r[0][e, k][method][2] for r in results) * 1e3
            print(f"{f'{e} experts top-{k}':>14} {method:>11} {fwd:9.1f} {both:12.1f} "
                  f"{bound:14.1f} {fwd / bound:12.2f} {ms:8.1f}")
        ratio = (max(r[0][e, k]["all_reduce"][1] for r in results)
                 / max(r[0][e, k]["all_to_all"][1] for r in results))
        print(f"{'':>14} all_reduce / all_to_all bytes (fwd+bwd): {ratio:.2f}x")
        if results[0][1]:
            titan = max(r[1][e, k] for r in results) * 1e3
            print(f"{'':>14} torchtitan AllToAllTokenDispatcher step: {titan:.1f} ms")
    losses, _ = results[0][2], None
    print("whole model (2 layers, 8 experts top-2, AdamW):")
    for name in (*METHODS, "one process"):
        step = max(r[3][name] for r in results)
        print(f"  {name:>12}: step {step * 1e3:8.1f} ms, first loss {losses[name]:.5f}")
    print(f"({time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
