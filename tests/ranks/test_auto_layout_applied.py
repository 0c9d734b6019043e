"""gt.auto_layout's layouts applied on thread-ranks (as ``row.apply`` and the pasted
``row.code()`` do) train as one process: data, fully_shard, tensor parallel with the plan found
from the model, activation checkpointing, pipelines of an nn.Sequential, and their mixes."""
import copy

import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.auto.build import Blocks, apply, make_placement, train_step
from globaltensor.auto.megatron import find_plan, patterns
from globaltensor.auto.space import Batch, Layout
from globaltensor.testing import run_ranks
from helpers import gpt

TIMEOUT = 120
S, B = gt.sbp.split, gt.sbp.broadcast
IDS = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))


def _plan():
    with torch.device("meta"):
        model = gpt()
    return tuple(patterns(find_plan(model, lambda m: F.cross_entropy(
        m(torch.randint(0, 64, (2, 8), device="meta")).flatten(0, 1), torch.zeros(
            16, dtype=torch.long, device="meta")))).items())


def _reference(steps=2):
    torch.manual_seed(0)
    model = gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(IDS).flatten(0, -2), IDS.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


PLAN = _plan()
LAYOUTS = [Layout(dp=4), Layout(fsdp=4, checkpoint=True), Layout(dp=2, tp=2),
           Layout(fsdp=2, tp=2, reshard_after_forward=False, checkpoint=True),
           Layout(pp=2, dp=2, microbatches=2), Layout(pp=2, fsdp=2, tp=1, microbatches=4),
           Layout(pp=2, tp=2, microbatches=2, checkpoint=True)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_an_applied_layout_trains_as_one_process(layout):
    layout = Layout(**{k: getattr(layout, k) for k in (
        "pp", "dp", "fsdp", "tp", "reshard_after_forward", "checkpoint", "microbatches")},
        plan=PLAN)
    expected_losses, expected_params = _reference()
    torch.manual_seed(0)
    reference = gpt()

    def body(rank):
        model = copy.deepcopy(reference)
        target = apply(model, layout, "cpu")
        opt = torch.optim.SGD(target.parameters(), lr=0.1)  # (AdamW magnifies rounding where a gradient is near 0)
        grid = make_placement(layout, "cpu", 0)
        ids = IDS.to_global(grid, tuple(B for _ in grid.axes)).to_global(
            sbp=tuple(B if n == "tp" else S(0) for n in grid.axes))
        losses = []
        for _ in range(2):
            loss = train_step(target, layout, Batch(IDS.shape), ids, opt)
            losses.append(float(loss.detach()) if torch.is_tensor(loss) else loss)
        return losses, [p.full_tensor() for p in model.parameters()]
    for losses, params in run_ranks(body, 4, timeout=TIMEOUT):
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        for got, want in zip(params, expected_params):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_pasted_code_lays_out_what_apply_does():
    layout = Layout(dp=1, fsdp=2, tp=2, reshard_after_forward=False, checkpoint=True, plan=PLAN)
    table_row = gt.auto.Row(layout, True, 0, {}, {}, None, "", blocks=Blocks(gpt()))
    source = table_row.code(device="cpu")
    torch.manual_seed(0)
    reference = gpt()

    def body(rank):
        by_apply = apply(copy.deepcopy(reference), layout, "cpu")
        model = copy.deepcopy(reference)
        exec(source, {"model": model})
        return ([(n, p.placement, p.sbp) for n, p in by_apply.named_parameters()],
                [(n, p.placement, p.sbp) for n, p in model.named_parameters()])
    for want, got in run_ranks(body, 4, timeout=TIMEOUT):
        assert got == want and any(s != (B, B) for _, _, s in got)


def test_an_hf_model_laid_out_by_the_table_trains_as_one_process():
    # the user's spelling: search, then table[0].apply(model) on HF Llama (its plan found from
    # the model: q/k/v/gate/up column-wise, o/down row-wise, embedding and head on the
    # vocabulary), fully_shard and checkpointing on a 2x2 grid
    from helpers import llama
    table = gt.auto_layout(lambda: llama(2), 4, memory_per_rank="1GiB", batch=(8, 16),
                           progress=False, candidates={"fsdp": [2], "tp": [2], "checkpoint": [True],
                                                       "reshard_after_forward": [True]})
    row = table[0]
    assert dict(row.layout.plan)["model.layers.*.self_attn.q_proj"] == "colwise"
    torch.manual_seed(0)
    reference = llama(2)
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    model = copy.deepcopy(reference)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = []
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())

    def body(rank):
        m = row.apply(copy.deepcopy(reference), "cpu")
        sgd = torch.optim.SGD(m.parameters(), lr=0.1)
        grid = make_placement(row.layout, "cpu")
        x = ids.to_global(grid, (B, B)).to_global(sbp=(S(0), B))
        losses = [float(train_step(m, row.layout, Batch((8, 16)), x, sgd).detach())
                  for _ in range(2)]
        return losses, [p.full_tensor() for p in m.parameters()]
    for losses, params in run_ranks(body, 4, timeout=TIMEOUT):
        assert losses == pytest.approx(expected, rel=1e-5)
        for got, want in zip(params, model.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-5)
