"""Seeing what happens, on thread-ranks: gt.comm_trace() records every redistribution (asked for
or chosen by an operator) and gt.comm call, torch.profiler shows each under its call's name,
gt.print0 prints once while reading values stays collective, and GT_DEBUG names the user's call
(item(), print, full_tensor()) rather than an internal redistribution."""
import copy
import io

import torch

import globaltensor as gt
from globaltensor.testing import run_ranks

from helpers import error_or_none

P2 = gt.placement("cpu", [0, 1])


def test_comm_trace_records_explicit_and_operator_redistributions():
    def body(rank):
        x = torch.arange(8.0).reshape(4, 2).to_global(P2, gt.sbp.split(0))   # global [8, 2]
        w = torch.ones(2, 2).to_global(P2, gt.sbp.split(1))                  # global [2, 4]
        with gt.comm_trace() as t:
            y = x @ w                                   # the operator gathers w: S(1) -> B
            total = y.sum().item()                      # item(): P -> B, an all_reduce
            full = y.to_global(sbp=gt.sbp.broadcast)    # asked for: S(0) -> B
            one = torch.ones(1)
            gt.comm.all_reduce(one)
        with gt.comm_trace() as quiet:
            z = x * 2                                   # moves nothing
        rows = [(r.op, r.layouts(), list(r.source.shape) if r.source else None, r.bytes_per_rank,
                 r.steps) for r in t]
        return rows, t.counts(), t.bytes_per_rank, str(t), total, full.to_local().shape, \
            len(quiet), quiet.counts(), z.shape

    out = run_ranks(body, 2, timeout=60)
    assert out[0][:3] == out[1][:3]  # every rank records the same plans
    rows, counts, sent, table, total, shape, quiet, quiet_counts, zshape = out[0]
    assert rows == [
        ("aten.mm.default", "(S(1),) -> (B,)", [2, 4], 2 * 2 * 4, ("all_gather axis 0 dim 1",)),
        ("item()", "(P,) -> (B,)", [], 4, ("all_reduce axis 0",)),
        ("to_global", "(S(0),) -> (B,)", [8, 4], 4 * 4 * 4, ("all_gather axis 0 dim 0",)),
        ("gt.comm.all_reduce", "-", None, None, ()),
    ]
    assert counts == {"all_gather": 2, "all_reduce": 1, "gt.comm.all_reduce": 1}
    assert sent == 16 + 4 + 64
    assert total == sum(range(8)) * 2 * 2 * 2  # every row of x summed, times 4 columns of ones
    assert tuple(shape) == (8, 4) and quiet == 0 and quiet_counts == {} and list(zshape) == [8, 2]
    assert table.splitlines()[0] == "comm_trace: 3 redistributions, 1 gt.comm call, 84 B sent per rank"
    assert "item()" in table and "(P,) -> (B,)" in table
    assert table.splitlines()[-1] == "collectives: all_gather 2, all_reduce 1, gt.comm.all_reduce 1"


def test_nested_traces_and_print_named_in_the_trace():
    def body(rank):
        x = torch.arange(4.0).to_global(P2, gt.sbp.split(0))
        with gt.comm_trace() as outer:
            with gt.comm_trace() as inner:
                text = str(x)
            x.full_tensor()
        return [r.op for r in inner], [r.op for r in outer], text

    inner, outer, text = run_ranks(body, 2, timeout=60)[1]
    assert inner == ["print"] and outer == ["print", "full_tensor()"]
    assert text.startswith("GlobalTensor([0., 1., 2., 3., 0., 1., 2., 3.]") and "sbp=(S(0),)" in text


def test_profiler_shows_each_redistribution_under_its_call():
    """One rank: torch.profiler is one per process (two threads profiling at once crash)."""
    def body(rank):
        x = torch.arange(4.0).to_global(gt.placement("cpu", [0]), gt.sbp.split(0))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            x.to_global(sbp=gt.sbp.broadcast)
            (x * 2).sum().item()
        return sorted({e.key for e in prof.key_averages() if e.key.startswith("gt.")})

    assert run_ranks(body, 1, timeout=60)[0] == ["gt.redistribute: item()",
                                                 "gt.redistribute: to_global"]


def test_print0_prints_once_and_reads_values_on_every_rank():
    def body(rank):
        x = torch.full((2,), float(rank + 1)).to_global(P2, gt.sbp.split(0))
        buf = io.StringIO()
        gt.print0("x =", x, "sum", x.sum(), sep=" ", end="!\n", file=buf)  # collective reads

        @gt.env.rank_zero_only
        def log(value):
            buf.write(f"logged {value}\n")
            return "rank 0 ran it"

        ran = log(x.sum().item())  # the read on every rank, the call on rank 0
        return buf.getvalue(), ran

    out = run_ranks(body, 2, timeout=60)
    assert out[1] == ("", None)
    text, ran = out[0]
    assert ran == "rank 0 ran it"
    assert text.startswith("x = GlobalTensor([1., 1., 2., 2.], placement=placement('cpu', ranks=[0, 1]), "
                           "sbp=(S(0),)) sum GlobalTensor(6., ")
    assert text.endswith("!\nlogged 6.0\n")


def test_gt_debug_names_print_and_item_not_an_internal_redistribution():
    def body(rank):
        gt.set_debug(True, timeout=10)
        x = torch.ones(1).to_global(P2, gt.sbp.partial_sum)
        if rank == 0:
            return error_or_none(lambda: print(x, file=io.StringIO()))
        return error_or_none(lambda: x.item())

    out = run_ranks(body, 2, timeout=60)
    assert out[0] == out[1] and out[0][0] == "RankMismatchError"
    assert "rank 0: #1 print(dtype=torch.float32, source=Layout(placement('cpu', ranks=[0, 1]), " \
        "(P,), [1])" in out[0][1]
    assert "rank 1 differs: op: item() instead of print" in out[0][1]
    assert "redistribute" not in out[0][1]


def test_models_section_of_the_user_guide():
    """docs/user_guide.md "Models": sbp_fn by name, buffers, the optimizer built after converting,
    gradients in each parameter's layout, equal to one process's."""
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6),
                                   torch.nn.Linear(6, 2))

    batch = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    base = make()  # once: thread-ranks share torch's global generator, so no seeding in body
    ref = copy.deepcopy(base)
    ref(batch).pow(2).mean().backward()
    expected = {n: p.grad for n, p in ref.named_parameters()}

    def body(rank):
        model = copy.deepcopy(base)
        p = gt.placement("cpu", [0, 1])

        def sbp_fn(name, tensor):
            return gt.sbp.split(0) if name == "0.weight" else None

        model.to_global(p, sbp_fn)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x = batch[4 * rank:4 * rank + 4].to_global(placement=p, sbp=gt.sbp.split(0))
        model(x).pow(2).mean().backward()
        fmt = gt.sbp.format_sbp
        sbps = {n: (fmt(q.sbp), fmt(q.grad.sbp)) for n, q in model.named_parameters()}
        grads = {n: q.grad.full_tensor() for n, q in model.named_parameters()}
        buffer = fmt(model[1].running_mean.sbp)
        optimizer.step()
        return sbps, grads, buffer

    for sbps, grads, buffer in run_ranks(body, 2, timeout=60):
        assert sbps["0.weight"] == ("(S(0),)", "(S(0),)") and sbps["2.bias"] == ("(B,)", "(B,)")
        assert buffer == "(B,)"
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], msg=name)
