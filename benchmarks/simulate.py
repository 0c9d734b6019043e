"""gt.simulate at scale: one training step of a Llama-3-shaped model on up to 4,096 simulated ranks.

    python benchmarks/simulate.py [--worlds 64,256,1024,4096] [--shape 8b|70b] [--layers N]
                                  [--seq 8192] [--meta]

Each world runs in a fresh process (so its peak RSS is its own): HF ``LlamaForCausalLM`` (random
init, no data: inside the simulation every tensor is meta) on a dp x fsdp x tp grid (tp 8,
fsdp up to 16, dp the rest), Megatron TP on "tp" (q/k/v/gate/up/lm_head column-wise, o/down
row-wise), ``gt.nn.fully_shard`` over "fsdp" per decoder layer and the root, the batch (one
sequence per data-parallel rank) split on ("dp", "fsdp"), one AdamW step. Printed per world:
the seconds the simulated step took (model build + step), the process's peak RSS, the rank
classes, rank 0's predicted peak by kind and bytes sent, and the model's alpha-beta step time.
``--meta``: the model is built under ``torch.device("meta")``, laid out, ``to_empty``'d and
initialised by HF's ``init_weights`` (docs/big_models.md): printed beside rank 0's parameter
peak is the whole model's bytes, which no rank then holds at any moment (without ``--meta`` the
model is built whole first, as a plain program does, and rank 0 holds it until it is laid out).
Targets (issue): 8B on 1,024 ranks <= 60 s and <= 2 GB RSS; 70B on 4,096 ranks <= 3 min; the
cost grows with the number of rank classes, not the world size.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

SHAPES = {  # layers, hidden, ffn, heads, kv heads, vocab
    "8b": (32, 4096, 14336, 32, 8, 128256),
    "70b": (80, 8192, 28672, 64, 8, 128256),
}


def grid_shape(world: int) -> tuple[int, int, int]:
    tp = min(8, world)
    fsdp = min(16, world // tp)
    return world // (tp * fsdp), fsdp, tp


def lay_out(model, grid):
    """Megatron TP on "tp" (q/k/v/gate/up/lm_head column-wise, o/down row-wise), then
    fully_shard over "fsdp" per decoder layer and the root."""
    import globaltensor as gt

    col, row = gt.nn.colwise("tp"), gt.nn.rowwise("tp")
    model.to_global(grid, gt.nn.sbp_plan({
        "*.q_proj": col, "*.k_proj": col, "*.v_proj": col, "*.gate_proj": col,
        "*.up_proj": col, "lm_head": col, "*.o_proj": row, "*.down_proj": row}))
    for layer in model.model.layers:
        gt.nn.fully_shard(layer, grid, "fsdp")
    gt.nn.fully_shard(model, grid, "fsdp")
    return model


def one(world: int, shape: str, layers: int | None, seq: int, meta: bool = False) -> dict:
    import torch
    import transformers

    import globaltensor as gt

    S, B = gt.sbp.split, gt.sbp.broadcast
    n_layers, hidden, ffn, heads, kv, vocab = SHAPES[shape]
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
        num_hidden_layers=layers or n_layers, num_attention_heads=heads, num_key_value_heads=kv,
        max_position_embeddings=seq, attn_implementation="sdpa", tie_word_embeddings=False)
    dp, fsdp, tp = grid_shape(world)
    llama = transformers.LlamaForCausalLM  # transformers imports its modeling module lazily: ~3 s
    start = time.perf_counter()  # the simulation's time, not the import's
    with gt.simulate(world) as sim:
        gt.init()
        grid = gt.placement("cpu", torch.arange(world).reshape(dp, fsdp, tp).tolist(),
                            axes=("dp", "fsdp", "tp"))
        if meta:
            with torch.device("meta"):
                model = lay_out(llama(config), grid)
            model.to_empty(device="cpu")
            gt.manual_seed(0)
            model.init_weights()
        else:
            model = lay_out(llama(config), grid)
        whole = sum(p.numel() * p.element_size() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, vocab, (dp * fsdp, seq)).to_global(grid, (B, B, B))
        ids = ids.to_global(sbp=(S(0), S(0), B))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
    took = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    kinds = {k: sim.peak_bytes(0, k) for k in ("parameters", "gradients", "optimizer",
                                                 "activations", "communication")}
    return {"world": world, "grid": [dp, fsdp, tp], "seconds": took, "rss": rss,
            "classes": sim.report().splitlines()[0], "peak": sim.peak_bytes(0), "kinds": kinds,
            "sent": sim.comm_bytes(0), "whole": whole, "step_time": sim.step_time(
                alpha=1e-5, bandwidth=25e9, flops=4e14, axes={"tp": (2e-6, 4e11)}).total}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="64,256,1024,4096")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a quick look)")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--meta", action="store_true", help="build on meta, to_empty, init_weights")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one is not None:
        print(json.dumps(one(a.one, a.shape, a.layers, a.seq, a.meta)))
        return
    print(f"gt.simulate: Llama-{a.shape} shape, {a.layers or SHAPES[a.shape][0]} layers, "
          f"sequence {a.seq}, one AdamW step" + (", built on meta" if a.meta else ""))
    print(f"{'ranks':>6} {'grid':>12} {'seconds':>8} {'RSS GiB':>8} {'peak GiB r0':>12} "
          f"{'sent GiB r0':>12} {'step s':>8}  classes")
    for world in [int(w) for w in a.worlds.split(",")]:
        cmd = [sys.executable, __file__, "--one", str(world), "--shape", a.shape,
               "--seq", str(a.seq)] + (["--layers", str(a.layers)] if a.layers else []) + \
            (["--meta"] if a.meta else [])
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            print(f"{world:>6} failed:\n{out.stderr[-3000:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{world:>6} {'x'.join(map(str, r['grid'])):>12} {r['seconds']:8.1f} "
              f"{r['rss'] / 2**30:8.2f} {r['peak'] / 2**30:12.2f} "
              f"{sum(r['sent'].values()) / 2**30:12.2f} {r['step_time']:8.3f}  {r['classes']}")
        print("        rank 0 peak by kind (GiB): " + ", ".join(
            f"{k} {v / 2**30:.2f}" for k, v in r["kinds"].items()) +
            f"; the whole model {r['whole'] / 2**30:.1f} GiB")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
