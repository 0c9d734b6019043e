"""fully_shard on a placement smaller than the world (issue 54, item 6): ranks outside it run
the same program (SPMD) and hold empty pieces; the model trains as one process on its ranks.
A pipeline whose stages are each sharded per block (units inside units) on their own pairs of
ranks trains as one process too."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.testing import run_ranks
from test_pipeline import _one_process as pipeline_reference

S, B = gt.sbp.split, gt.sbp.broadcast
H, STEPS = 8, 3


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Sequential(nn.Linear(H, H), nn.Tanh()),
                         nn.Sequential(nn.Linear(H, H), nn.Tanh()), nn.Linear(H, 3))


def _data(rows=12):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, H, generator=g), torch.randint(0, 3, (rows,), generator=g)


def _one_process(model, x, y, microbatches=1):
    """The same micro-batches in one process (test_pipeline's reference): losses, parameters."""
    losses, params, _ = pipeline_reference([model], microbatches, x, y, steps=STEPS)
    return losses, params


@pytest.mark.parametrize("world", [3, 4])
def test_fully_shard_on_a_sub_placement_trains_as_one_process_with_ranks_outside(world):
    built = _model()
    x, y = _data()
    losses, params = _one_process(built, x, y)
    inner = gt.placement("cpu", [0, 1])

    def body(rank):
        model = copy.deepcopy(built)
        for block in model[:2]:
            gt.nn.fully_shard(block, inner)
        gt.nn.fully_shard(model, inner)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        gx, gy = gt.tensor(x, placement=inner, sbp=S(0)), gt.tensor(y, placement=inner, sbp=S(0))
        got = []
        for _ in range(STEPS):
            opt.zero_grad()
            loss = F.cross_entropy(model(gx), gy)
            loss.backward()
            opt.step()
            got.append(loss.item())
        return got, [p.full_tensor() for p in model.parameters()]
    for rank, (got, got_params) in enumerate(run_ranks(body, world, timeout=90)):
        assert got == pytest.approx(losses, rel=1e-5), rank
        for a, b in zip(got_params, params):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_a_pipeline_of_stages_sharded_per_block_on_their_pairs_trains_as_one_process():
    built = _model()
    x, y = _data(16)
    losses, params = _one_process(built, x, y, microbatches=4)
    pairs = [gt.placement("cpu", [0, 1]), gt.placement("cpu", [2, 3])]

    def body(rank):
        model = copy.deepcopy(built)
        stages = [model[0], nn.Sequential(model[1], model[2])]
        gt.nn.fully_shard(stages[1][0], pairs[1])  # a unit inside the second stage's unit
        for stage, p in zip(stages, pairs):
            gt.nn.fully_shard(stage, p)
        pipe = gt.nn.Pipeline(stages, microbatches=4, schedule="1f1b")
        opt = torch.optim.AdamW(list(pipe.parameters()), lr=0.01)
        gx = gt.tensor(x, placement=pairs[0], sbp=S(0))
        gy = gt.tensor(y, placement=pairs[1], sbp=S(0))
        got = []
        for _ in range(STEPS):
            opt.zero_grad()
            got.append(pipe.step(gx, target=gy, loss_fn=F.cross_entropy))
            opt.step()
        return got, [p.full_tensor() for p in pipe.parameters()]
    for rank, (got, got_params) in enumerate(run_ranks(body, 4, timeout=90)):
        assert got == pytest.approx(losses, rel=1e-5), rank
        for a, b in zip(got_params, params):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_a_unit_on_a_sub_placement_is_traced_and_simulated_on_its_ranks_only():
    """comm_trace's header names fully_shard's collectives as such (not as gt.comm calls), and a
    simulation charges them to the unit's ranks, not to the world; the real run's counts per
    rank are the simulation's."""
    built = _model()
    x, y = _data()
    inner = gt.placement("cpu", [0, 1])

    def step():
        model = copy.deepcopy(built)
        gt.nn.fully_shard(model, inner)
        gx, gy = gt.tensor(x, placement=inner, sbp=S(0)), gt.tensor(y, placement=inner, sbp=S(0))
        with gt.comm_trace() as trace:
            F.cross_entropy(model(gx), gy).backward()
        return trace

    def body(rank):
        trace = step()
        units = {k: v for k, v in trace.counts().items() if k in ("all_gather", "reduce_scatter")}
        return trace.table().splitlines()[0], [r.kind for r in trace.records], units
    real = run_ranks(body, 3, timeout=60)
    header, kinds, _ = real[0]
    assert kinds.count("fully_shard collective") == 2 and "gt.comm call" not in kinds, kinds
    assert "2 fully_shard collectives" in header and "0 gt.comm calls" in header, header
    with gt.simulate(3) as sim:
        step()
    # keyed by the unit's placement axis (an unnamed one: "axis 0"), as step_time prices them
    fully_shard = {(k, a): int(c.sum()) for (k, a), c in sim.recorder.counts.items()
                   if k in ("all_gather", "reduce_scatter") and a != "metadata"}
    assert fully_shard == {("all_gather", "axis 0"): 2, ("reduce_scatter", "axis 0"): 2}
    for rank in range(3):
        units = {k: v for k, v in sim.collectives(rank).items() if k in ("all_gather", "reduce_scatter")}
        assert units == (real[rank][2] if rank < 2 else {}), (rank, units, real[rank][2])
