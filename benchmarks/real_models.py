"""Real models: a training step on global tensors against torch DDP and DTensor, same run.

    python benchmarks/real_models.py [--runs 3] [--steps 8] [--only overhead,dp,tp,grid,cnn]
    python benchmarks/real_models.py --only overhead --models gpt2   # the per-op figure, GPT-2 only

Models are transformers' own Llama and GPT-2 (tiny configs, random init) and a ResNet-style CNN
with BatchNorm (tests/ranks/test_real_models.py defines the same shapes). Each comparison
alternates the contenders step by step in one run so machine load hits both alike; a step is
zero_grad + forward + backward + optimizer step, its time the slowest rank's after a barrier.
Each comparison is repeated ``--runs`` times; the median ratio and the spread are printed.

- overhead: one process, placement [0], everything broadcast (no communication): added time
  per aten op = (global step - plain step) / aten ops per step (counted on the plain step);
  beside it the same for the floor of any Python wrapper subclass (``Bare``: unwrap, run, wrap,
  nothing else) and for DTensor (Replicate on a mesh of one, dispatch in C++).
- dp:   GPT-2 1-D data parallel on 4 ranks (parameters B, batch S(0)) vs torch DDP.
- tp:   Llama tensor parallel on a placement of 4 (Megatron layout) vs DTensor's
        parallelize_module with ColwiseParallel / RowwiseParallel.
- grid: Llama on a 2x2 grid (data x tensor parallel) vs DTensor TP on the tensor axis plus a
        hand-written bucketed all-reduce of the gradients over the data axis.
- cnn:  the CNN data parallel (sync-BN semantics) vs torch DDP with a synchronized BatchNorm
        of the same semantics (torch's SyncBatchNorm needs a GPU: benchmarks/_sync_bn.py is a
        CPU one, an all-reduce of the statistics forward and one backward per layer), and, for
        reference, DDP with plain BatchNorm (per-rank statistics, less work).

Collectives per step are counted from torch.profiler's gloo events (rank 0), for each contender.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import warnings

import torch
import torch.distributed as dist

import globaltensor as gt
from _common import bucketed_all_reduce, dtensor_tp, timed  # benchmarks/ is on sys.path when a benchmark runs as a script
from _sync_bn import sync_batch_norm

S, B = gt.sbp.split, gt.sbp.broadcast
BATCH, SEQ, VOCAB = 8, 32, 256


def llama(attn="sdpa"):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        attn_implementation=attn)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def gpt2(attn="sdpa"):
    import transformers

    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=128, n_layer=2, n_head=4,
                                     n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, attn_implementation=attn)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


class CNN(torch.nn.Module):
    def __init__(self, c=16, classes=10):
        super().__init__()
        def block():
            return torch.nn.Sequential(torch.nn.Conv2d(c, c, 3, padding=1, bias=False),
                                       torch.nn.BatchNorm2d(c), torch.nn.ReLU())
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, c, 3, padding=1, bias=False),
                                        torch.nn.BatchNorm2d(c), torch.nn.ReLU(),
                                        torch.nn.MaxPool2d(2))
        self.body = torch.nn.Sequential(block(), block(), block())
        self.head = torch.nn.Linear(c, classes)

    def forward(self, x):
        x = torch.nn.functional.adaptive_avg_pool2d(self.body(self.stem(x)), 1)
        return self.head(torch.flatten(x, 1))


def cnn():
    torch.manual_seed(0)
    return CNN()


def lm_loss(model, batch):
    return model(batch, labels=batch).loss


def cnn_loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def data_for(kind, gen):
    if kind == "cnn":
        return torch.randn(BATCH, 3, 16, 16, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def collectives_of(step) -> dict:
    """The gloo collectives one ``step()`` runs on this rank, by kind, as torch.profiler records
    them ("gloo:all_reduce", "gloo:send", ...): the same count for gt, torch DDP (whose reducer
    calls the process group from C++) and DTensor (functional collectives)."""
    from collections import Counter

    with gt.comm_trace() as trace:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step()
    messages = dict(Counter(e.name[len("gloo:"):] for e in prof.events()
                            if e.name.startswith("gloo:")))
    # gt's plans run gathers and reductions on CPU as pairwise messages (GT_CPU_COLLECTIVES):
    # the collectives its plans asked for, from gt.comm_trace, plus the gradient buckets
    planned = trace.counts()
    return {"messages": messages, "planned": planned}


def step_fn(model, opt, loss_fn, batch, after_backward=None):
    def step():
        opt.zero_grad()
        loss_fn(model, batch).backward()
        if after_backward is not None:
            after_backward()
        opt.step()
    return step


def race(steps: dict, n: int, stat=statistics.median) -> dict:
    """Median (or ``stat``) step time of each contender, alternating them step by step."""
    times = {k: [] for k in steps}
    names = list(steps)
    for i in range(n + 2):
        for name in (names if i % 2 == 0 else names[::-1]):
            took = timed(steps[name])
            if i >= 2:  # warm-up
                times[name].append(took)
    return {k: stat(v) for k, v in times.items()}


# ----------------------------------------------------------------------------- contenders


def megatron(name, t, axis_count):
    column = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
    row = ("o_proj", "down_proj")
    lead = (B,) * (axis_count - 1)
    if t.dim() == 2 and any(c in name for c in column):
        return lead + (S(0),)
    if t.dim() == 2 and any(c in name for c in row):
        return lead + (S(1),)
    return lead + (B,)


FOREACH = None  # the optimizers' foreach: torch's default (None), or --foreach


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4, foreach=FOREACH)


def sgd(params):
    return torch.optim.SGD(params, lr=0.01, foreach=FOREACH)


def worker(local_rank, what, steps, threads, foreach=None):
    global FOREACH
    FOREACH = foreach
    torch.set_num_threads(threads)
    warnings.simplefilter("ignore")
    gt.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(100 + rank)
    out = {}
    if what == "dp":
        base = gpt2()
        everyone = gt.placement("cpu", list(range(world)))
        mine = data_for("lm", gen)
        full = torch.cat([torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 + r)) for r in range(world)])
        g = copy.deepcopy(base).to_global(everyone, B)
        t = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
        steps_ = {
            "gt": step_fn(g, adamw(g.parameters()), lm_loss,
                          gt.tensor(full, placement=everyone, sbp=S(0))),
            "torch DDP": step_fn(t, adamw(t.parameters()), lm_loss, mine),
        }
    elif what in ("tp", "grid"):
        from torch.distributed.device_mesh import init_device_mesh

        base = llama()
        ids = torch.randint(0, VOCAB, (BATCH * (2 if what == "grid" else 1), SEQ),
                            generator=torch.Generator().manual_seed(7))
        if what == "tp":
            placement = gt.placement("cpu", list(range(world)))
            g = copy.deepcopy(base).to_global(placement, lambda n, t: megatron(n, t, 1))
            gids = gt.tensor(ids, placement=placement, sbp=B)
            mesh = init_device_mesh("cpu", (world,))
            d = dtensor_tp(copy.deepcopy(base), mesh)
            d_step = step_fn(d, adamw(d.parameters()), lm_loss, ids)
        else:
            placement = gt.placement("cpu", [[0, 1], [2, 3]])
            g = copy.deepcopy(base).to_global(placement, lambda n, t: megatron(n, t, 2))
            gids = gt.tensor(ids, placement=placement, sbp=(S(0), B))
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            d = dtensor_tp(copy.deepcopy(base), mesh["tp"])
            half = ids.chunk(2)[mesh.get_coordinate()[0]]
            d_step = step_fn(d, adamw(d.parameters()), lm_loss, half,
                             bucketed_all_reduce(list(d.parameters()), mesh.get_group("dp")))
        steps_ = {"gt": step_fn(g, adamw(g.parameters()), lm_loss, gids),
                  "DTensor": d_step}
    else:  # cnn
        base = cnn()
        everyone = gt.placement("cpu", list(range(world)))
        x, y = data_for("cnn", gen)
        xs = [data_for("cnn", torch.Generator().manual_seed(100 + r)) for r in range(world)]
        fx, fy = torch.cat([a for a, _ in xs]), torch.cat([b for _, b in xs])
        g = copy.deepcopy(base).to_global(everyone, B)
        synced = torch.nn.parallel.DistributedDataParallel(sync_batch_norm(copy.deepcopy(base)))
        t = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
        steps_ = {
            "gt": step_fn(g, sgd(g.parameters()), cnn_loss,
                          (gt.tensor(fx, placement=everyone, sbp=S(0)),
                           gt.tensor(fy, placement=everyone, sbp=S(0)))),
            "DDP sync-BN": step_fn(synced, sgd(synced.parameters()),
                                   cnn_loss, (x, y)),
            "DDP local BN": step_fn(t, sgd(t.parameters()), cnn_loss, (x, y)),
        }
    out["median"] = race(steps_, steps)
    out["collectives"] = {k: collectives_of(s) for k, s in steps_.items()}
    return out


# ----------------------------------------------------------------------------- overhead


class Bare(torch.Tensor):
    """The floor of any Python wrapper subclass: a tensor that holds a plain tensor and whose
    ``__torch_dispatch__`` only unwraps the arguments, runs the op and wraps the results (no
    layouts, no cache, no rules). Its added time per op on a real step is what every Python
    tensor subclass pays before doing anything of its own."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local):
        out = torch.Tensor._make_wrapper_subclass(cls, local.shape, strides=local.stride(),
                                                  dtype=local.dtype, device=local.device)
        out._local = local
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        largs = [a._local if type(a) is Bare else
                 [v._local if type(v) is Bare else v for v in a] if type(a) is list else a
                 for a in args]
        result = func._op(*largs, **(kwargs or {}))
        returns = func._schema.returns
        if returns and returns[0].alias_info is not None and returns[0].alias_info.is_write:
            return args[0]  # in-place: the same wrapper
        if type(result) is torch.Tensor:
            return Bare(result)
        if type(result) in (tuple, list):
            return type(result)(Bare(r) if type(r) is torch.Tensor else r for r in result)
        return result


def bare_module(model):
    for m in model.modules():
        for k, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[k] = torch.nn.Parameter(Bare(p.detach().clone()))
        for k, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[k] = Bare(b.clone())
    return model


def overhead(steps: int, models=("llama", "gpt2", "cnn"), stat="median") -> dict:
    """Per-op dispatch overhead in a world of one (one process, placement [0], everything B),
    with two references on the same step: the Python wrapper-subclass floor (``Bare``) and
    DTensor (Replicate on a mesh of one; its dispatch runs in C++)."""
    return gt.spawn(overhead_worker, args=(steps, tuple(models), stat), nproc_per_node=1,
                    timeout=1800)[0]


def overhead_worker(local_rank, steps, models=("llama", "gpt2", "cnn"), stat="median"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_module, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    p = gt.placement("cpu", [0])
    mesh = init_device_mesh("cpu", (1,))
    res = {}
    # eager attention: DTensor has no rule for CPU flash attention (sdpa's kernel here)
    for name, make, loss_fn in (("llama", lambda: llama("eager"), lm_loss),
                                ("gpt2", lambda: gpt2("eager"), lm_loss), ("cnn", cnn, cnn_loss)):
        if name not in models:
            continue
        base = make()
        batch = data_for("cnn" if name == "cnn" else "lm", torch.Generator().manual_seed(1))
        plain = copy.deepcopy(base)
        g = copy.deepcopy(base).to_global(p, B)
        bare = bare_module(copy.deepcopy(base))
        dt = distribute_module(copy.deepcopy(base), mesh)
        gbatch = tuple(gt.tensor(v, placement=p, sbp=B) for v in batch) if name == "cnn" \
            else gt.tensor(batch, placement=p, sbp=B)
        bbatch = tuple(Bare(v) for v in batch) if name == "cnn" else Bare(batch)
        dbatch = tuple(distribute_tensor(v, mesh, [Replicate()]) for v in batch) \
            if name == "cnn" else distribute_tensor(batch, mesh, [Replicate()])
        opt_cls = torch.optim.SGD if name == "cnn" else torch.optim.AdamW
        sp = step_fn(plain, opt_cls(plain.parameters(), lr=1e-4), loss_fn, batch)
        sg = step_fn(g, opt_cls(g.parameters(), lr=1e-4), loss_fn, gbatch)
        sb = step_fn(bare, opt_cls(bare.parameters(), lr=1e-4), loss_fn, bbatch)
        sd_inner = step_fn(dt, opt_cls(dt.parameters(), lr=1e-4), loss_fn, dbatch)

        def sd():  # HF's own tensors (positions, masks) are plain: taken as replicated
            with implicit_replication():
                sd_inner()
        counting = Count()
        with counting:
            sp()
        times = race({"plain": sp, "global": sg, "bare": sb, "dtensor": sd}, steps,
                     min if stat == "min" else statistics.median)
        res[name] = (counting.n, times)
    return res


def spread(values):
    return f"{statistics.median(values):.2f} (spread {min(values):.2f}-{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--only", default="overhead,dp,tp,grid,cnn")
    ap.add_argument("--models", default="llama,gpt2,cnn",
                    help="the models of the overhead rows (e.g. gpt2: the per-op figure alone)")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="overhead rows: each contender's median step, or its fastest (the "
                         "least disturbed on a busy machine)")
    ap.add_argument("--foreach", action="store_true",
                    help="optimizers with foreach=True for every contender (torch's default on "
                         "CPU is the per-tensor loop; gt then runs each optimizer op once)")
    a = ap.parse_args()
    only = a.only.split(",")
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        sys.exit("benchmarks/real_models.py needs transformers (pip install -e '.[test]')")
    if "overhead" in only:
        per_model: dict = {}
        for _ in range(a.runs):
            for name, (ops, times) in overhead(a.steps, a.models.split(","), a.stat).items():
                per_model.setdefault(name, []).append((ops, times))
        print("Added time per aten op over the plain step, world of 1, everything replicated "
              "(target for gt <= 8 us):")
        for name, rows in per_model.items():
            ops = rows[0][0]
            line = f"  {name:6s} {ops:4d} aten ops/step   plain " \
                f"{statistics.median([t['plain'] for _, t in rows]) * 1e3:6.2f} ms"
            for who in ("global", "bare", "dtensor"):
                added = [(t[who] - t["plain"]) / ops * 1e6 for _, t in rows]
                line += f"   {who} {statistics.median([t[who] for _, t in rows]) * 1e3:6.2f} ms " \
                    f"+{spread(added)} us/op"
            print(line)
    targets = {"dp": 1.25, "tp": 1.2, "grid": 1.3, "cnn": 1.3}
    titles = {"dp": "GPT-2 1-D data parallel, 4 ranks: gt / torch DDP",
              "tp": "Llama tensor parallel on 4 ranks: gt / DTensor parallelize_module",
              "grid": "Llama 2x2 (DP x TP): gt / DTensor TP + bucketed DP all-reduce",
              "cnn": "CNN data parallel with BatchNorm, 4 ranks: gt (sync-BN) / torch DDP with sync-BN"}
    for what in ("dp", "tp", "grid", "cnn"):
        if what not in only:
            continue
        ratios, medians, counts = [], [], None
        for _ in range(a.runs):
            out = gt.spawn(worker, args=(what, a.steps, a.threads, a.foreach or None),
                           nproc_per_node=4, timeout=1800)[0]
            names = list(out["median"])
            ratios.append(out["median"][names[0]] / out["median"][names[1]])
            medians.append(out["median"])
            counts = out["collectives"]
        print(f"{titles[what]} (target <= {targets[what]}):")
        for n in names:
            c = counts[n]
            planned = f"; redistributions' collectives {c['planned']}" if c["planned"] else ""
            print(f"  {n:10s} {statistics.median([m[n] for m in medians]) * 1e3:8.1f} ms/step   "
                  f"gloo calls/step (rank 0): {sum(c['messages'].values())} {c['messages']}"
                  f"{planned}")
        print(f"  ratio {spread(ratios)}")


if __name__ == "__main__":
    main()
