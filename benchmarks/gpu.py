"""The GPU check, for a session lent one GPU: the cuda-marked tests on one rank, then single-GPU
figures for an HF GPT-2 training step, plain torch against a global model on
``placement("cuda", [0])``, each eager and compiled with ``mode="reduce-overhead"`` (CUDA
graphs). One rank: NCCL cannot put two ranks on one GPU, so multi-rank NCCL needs more GPUs.

    python benchmarks/gpu.py [--steps 30] [--hidden 256] [--skip-tests]

Prints the first (compiling) step and the median steady step of each contender, and gt's
ratio to plain torch in the same mode. Without a GPU it says so and exits 0.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import globaltensor as gt

BATCH, SEQ, VOCAB = 8, 128, 1024


def gpt2(hidden: int):
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=hidden, n_layer=4, n_head=8, n_positions=SEQ,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa"))
    model.loss_type = "ForCausalLM"
    return model


def step_of(model, ids, mode):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def loss_of(m, x):
        return m(x, labels=x).loss

    if mode is not None:
        loss_of = torch.compile(loss_of, mode=mode)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_of(model, ids).backward()
        opt.step()
    return step


def timed(step) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--skip-tests", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no GPU here (torch.cuda.is_available() is False): nothing to check")
        return
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    if not a.skip_tests:
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda",
                                "tests/ranks/test_cuda.py"])
        print(f"cuda-marked tests: {'passed' if tests.returncode == 0 else 'FAILED'}")
    dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)
    torch.cuda.set_device(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7)).cuda()
    gpu = gt.placement("cuda", [0])
    base = gpt2(a.hidden)
    steps = {}
    for mode in (None, "reduce-overhead"):
        name = "eager" if mode is None else mode
        plain = __import__("copy").deepcopy(base).cuda()
        steps[f"torch {name}"] = step_of(plain, ids, mode)
        g = __import__("copy").deepcopy(base).to_global(gpu, gt.sbp.broadcast)
        steps[f"gt {name}"] = step_of(g, gt.tensor(ids.cpu(), placement=gpu, sbp=gt.sbp.split(0)), mode)
    first = {k: timed(s) for k, s in steps.items()}
    times = {k: [] for k in steps}
    for i in range(a.steps + 3):
        for k, s in steps.items():
            took = timed(s)
            if i >= 3:
                times[k].append(took)
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"GPT-2 hidden {a.hidden}, 4 layers, batch {BATCH} x {SEQ}, one GPU, AdamW(foreach):")
    for k in steps:
        print(f"  {k:24s} {median[k] * 1e3:8.2f} ms/step   first step {first[k]:7.2f} s")
    for name in ("eager", "reduce-overhead"):
        print(f"  gt / torch, {name}: {median['gt ' + name] / median['torch ' + name]:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
