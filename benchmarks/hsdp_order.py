"""HSDP's reduction order in gt.simulate: what each rank sends to reduce a step's gradients.

    python benchmarks/hsdp_order.py [--world 1024] [--layers 2] [--seq 1024]

The grid and model of benchmarks/simulate.py (HF Llama-3-8B's shapes with fewer layers, dp x
fsdp x tp with tp 8 and fsdp 16, Megatron TP on "tp", fully_shard over "fsdp", the batch split on
("dp", "fsdp")), one forward and backward under gt.comm_trace: the bytes rank 0 sends in the
units' gathers, reduce-scatters and shard all-reduces (FSDP2's order: reduce-scatter over "fsdp",
then all-reduce the 1/16 shard over "dp"), in the other all-reduces, and by collective, and the
modelled step time. Run it at an earlier commit (PYTHONPATH=<checkout>) for the order before.
"""
from __future__ import annotations

import argparse


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    args = ap.parse_args()

    import torch
    import transformers

    import globaltensor as gt
    from simulate import SHAPES, grid_shape, lay_out

    S, B = gt.sbp.split, gt.sbp.broadcast
    _, hidden, ffn, heads, kv, vocab = SHAPES["8b"]
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=kv,
        max_position_embeddings=args.seq, attn_implementation="sdpa", tie_word_embeddings=False)
    dp, fsdp, tp = grid_shape(args.world)
    with gt.simulate(args.world) as sim:
        gt.init()
        grid = gt.placement("cpu", torch.arange(args.world).reshape(dp, fsdp, tp).tolist(),
                            axes=("dp", "fsdp", "tp"))
        model = lay_out(transformers.LlamaForCausalLM(config), grid)
        ids = torch.randint(0, vocab, (dp * fsdp, args.seq)).to_global(grid, (B, B, B))
        ids = ids.to_global(sbp=(S(0), S(0), B))
        with gt.comm_trace() as trace:
            model(input_ids=ids, labels=ids).loss.backward()
    mb = 2 ** 20
    units: dict = {}
    for r in trace.records:
        if "fully_shard" in r.op:
            kind = r.op.split(" (")[0]
            units[kind] = units.get(kind, 0) + (r.bytes_per_rank or 0)
    other = sum(r.bytes_per_rank or 0 for r in trace.records
                if "fully_shard" not in r.op and "all_reduce" in " ".join(r.collectives))
    step = sim.step_time(alpha=1e-5, bandwidth=25e9, flops=4e14, axes={"tp": (2e-6, 4e11)})
    print(f"grid {dp}x{fsdp}x{tp}, {args.layers} layers, seq {args.seq}")
    for kind, n in units.items():
        print(f"  {kind}: {n / mb:,.1f} MiB")
    print(f"  other all_reduces: {other / mb:,.1f} MiB")
    print("  by collective: " + ", ".join(f"{k} {v / mb:,.1f} MiB"
                                          for k, v in sim.comm_bytes(0).items()))
    print(f"  modelled step (forward + backward): {float(step):.3f} s")


if __name__ == "__main__":
    main()
