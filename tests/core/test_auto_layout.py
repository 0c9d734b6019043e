"""gt.auto_layout in one process: the Megatron plan found from the model, the candidates and
their bounds, the search's table against gt.simulate of the same layouts, the user's plan kept,
and bad input. (Real runs of applied layouts: tests/ranks/test_auto_layout_applied.py.)"""
import pytest
import torch
import torch.nn as nn

import globaltensor as gt
from globaltensor.auto.build import Blocks, apply, make_placement, stage_modules, train_step
from globaltensor.auto.figures import measured, snapshot
from globaltensor.auto.megatron import find_plan, patterns
from globaltensor.auto.space import Batch, Layout, Links, enumerate_layouts, static_bound
from globaltensor.errors import GlobalTensorError
from helpers import gpt, llama

S, B = gt.sbp.split, gt.sbp.broadcast


def _run(batch):
    def run(model):
        from globaltensor.auto.build import loss_of
        ids = torch.randint(0, 64, (2, 8), device="meta")
        loss_of(model, batch, ids)
    return run


def test_megatron_pairs_are_found_in_hf_llama():
    with torch.device("meta"):
        model = llama(2)
    plan = patterns(find_plan(model, _run(Batch((2, 8)))))
    col = {f"model.layers.*.{n}" for n in ("self_attn.q_proj", "self_attn.k_proj",
                                           "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
    row = {"model.layers.*.self_attn.o_proj", "model.layers.*.mlp.down_proj"}
    assert plan == {**{n: "colwise" for n in col}, **{n: "rowwise" for n in row},
                    "lm_head": "colwise", "model.embed_tokens": "vocab"}


def test_megatron_pairs_are_found_in_a_sequential_gpt_and_not_across_a_norm():
    with torch.device("meta"):
        model = gpt()
    plan = patterns(find_plan(model, _run(Batch((2, 8)))))
    assert plan == {"*.attn.q": "colwise", "*.attn.k": "colwise", "*.attn.v": "colwise",
                    "*.up": "colwise", "*.attn.o": "rowwise", "*.down": "rowwise",
                    "6": "colwise", "0": "vocab"}
    # a Linear whose output meets a norm before the next Linear: a split there would need
    # communication, so neither is paired
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 8))
        found = find_plan(net, lambda m: m(torch.randn(2, 3, 8, device="meta")).sum())
    assert found == {"2": "colwise", "3": "rowwise"}


def test_the_candidates_are_every_factorization_the_project_can_apply():
    layouts = enumerate_layouts(8, blocks=4, sequences=8, tp_ok=lambda t: t in (1, 2),
                                pipeline=True)
    assert all(l.world == 8 and l.tp in (1, 2) and l.pp <= 4 for l in layouts)
    assert all(l.dp * l.fsdp * l.microbatches <= 8 for l in layouts)
    assert all(l.reshard_after_forward for l in layouts if l.fsdp == 1)
    assert all(l.microbatches == 1 for l in layouts if l.pp == 1)
    structures = {(l.pp, l.dp, l.fsdp, l.tp) for l in layouts}
    assert (2, 2, 1, 2) in structures and (1, 2, 2, 2) in structures and (4, 1, 1, 2) in structures
    assert (8, 1, 1, 1) not in structures  # more stages than blocks
    assert len(structures) == 15  # pp 1: 4 + 3 (tp 2), pp 2: 3 + 2, pp 4: 2 + 1
    assert Layout(pp=2, dp=2, tp=2, microbatches=4) in layouts
    assert Layout(pp=2, dp=2, tp=2, microbatches=8) not in layouts  # 8 micro-batches x 2 > 8
    only = enumerate_layouts(8, blocks=4, sequences=8, tp_ok=lambda t: True, pipeline=False,
                             allowed={"tp": [2], "checkpoint": [False]})
    assert only and all(l.tp == 2 and not l.checkpoint and l.pp == 1 for l in only)


def test_bounds_and_links():
    assert static_bound(Layout(fsdp=4, tp=2), 800) == 400  # 4 x 800 bytes over 8 shards
    links = Links(alpha=1e-5, bandwidth=1e9, node=(1e-6, 1e11), ranks_per_node=8)
    lay = Layout(dp=4, fsdp=4, tp=2)
    assert links.of("tp", lay) == (1e-6, 1e11)      # ranks 0-1: one node
    assert links.of("fsdp", lay) == (1e-6, 1e11)    # stride 2 x 4 = 8: one node
    assert links.of("dp", lay) == (1e-5, 1e9)       # stride 8: across nodes
    assert links.of("dp+tp", lay) == (1e-5, 1e9)
    assert links.of(None, lay) == (1e-5, 1e9)


def _simulated(model_fn, layout, batch, world):
    """A layout simulated directly (as a user would): the peak and bytes of its second step."""
    with torch.device("meta"):
        model = model_fn()
    with gt.simulate(world) as sim:
        target = apply(model, layout, "cpu")
        model.to_empty(device="cpu")
        opt = torch.optim.AdamW(target.parameters(), lr=1e-4)
        grid = make_placement(layout)
        ids = gt.randint(0, 256, batch.shape, placement=grid,
                         sbp=tuple(B if n == "tp" else S(0) for n in grid.axes))
        train_step(target, layout, batch, ids, opt)
        mark = snapshot(sim)
        train_step(target, layout, batch, ids, opt)
    return measured(sim, mark)


def test_the_table_agrees_with_gt_simulate_and_fits_its_budget():
    batch = Batch((8, 32))
    table = gt.auto_layout(lambda: llama(6), 4, memory_per_rank="3MiB", batch=(8, 32),
                           progress=False)
    best = table[0]
    assert best.fits and best.verified and best.peak <= 3 * 2**20
    assert [r.step.total for r in table.fitting] == sorted(r.step.total for r in table.fitting)
    assert any(not r.fits and r.step is not None for r in table)  # the budget rules some out
    # the verified row is the layout simulated whole: its peak and traffic are gt.simulate's
    direct = _simulated(lambda: llama(6), best.layout, batch, 4)
    assert best.peak == int(direct.peak.max())
    # an extrapolated row (two and three blocks) against the whole model simulated: the traffic
    # of every axis exactly (it is linear in the blocks), the peak within 3%
    row = next(r for r in table.fitting if not r.verified)
    whole = _simulated(lambda: llama(6), row.layout, batch, 4)
    sent = {}
    for (_, axis), v in whole.sent.items():
        if axis != "metadata" and v[row.step.rank]:
            sent[axis] = sent.get(axis, 0) + int(v[row.step.rank])
    assert row.sent == sent
    assert abs(row.peak - whole.peak.max()) <= 0.03 * whole.peak.max()
    text = str(table)
    assert "verified: simulated whole" in text and str(best.layout) in text


def test_a_user_plan_is_kept_and_the_code_spells_it():
    plan = {"model.layers.*.mlp.up_proj": gt.nn.colwise("tp"),
            "model.layers.*.mlp.down_proj": gt.nn.rowwise("tp")}
    table = gt.auto_layout(lambda: llama(2), 4, memory_per_rank="1GiB", batch=(8, 16),
                           progress=False, candidates={"tp": [2], "sbp_plan": plan,
                                                       "checkpoint": [False]})
    assert all(r.layout.tp == 2 and not r.layout.checkpoint for r in table)
    assert dict(table[0].layout.plan) == plan
    code = table[0].code()
    assert '"model.layers.*.mlp.up_proj": gt.nn.colwise(\'tp\')' in code
    assert "q_proj" not in code


def test_pipelines_are_candidates_of_a_sequential_model():
    table = gt.auto_layout(gpt, 4, memory_per_rank="1GiB", batch=(8, 16), progress=False,
                           candidates={"pp": [2], "checkpoint": [False], "microbatches": [2],
                                       "reshard_after_forward": [True], "dp": [1]})
    assert table[0].layout.pp == 2 and all(r.layout.pp == 2 for r in table)
    model = gpt()
    stages, spans = stage_modules(model, 2)
    assert [list(s._modules) for s in stages] == [["0", "1", "2"], ["3", "4", "5", "6"]]
    assert spans == [(1, 3), (0, 2)]
    assert "gt.nn.Pipeline(stages, microbatches=" in table[0].code()


def test_nothing_fits_names_the_closest_candidate():
    # all pruned by the bound: its figure is a lower bound
    with pytest.raises(GlobalTensorError, match=r"closest, .* needs at least .* per rank .* "
                                                r"more; at its peak: parameters, gradients"):
        gt.auto_layout(lambda: llama(2), 4, memory_per_rank=2**16, batch=(8, 16),
                       progress=False, candidates={"pp": [1], "checkpoint": [True]})
    # simulated, none fits: the closest simulated one, and what its peak holds
    with pytest.raises(GlobalTensorError, match=r"The closest, .*checkpoint, needs [\d.]+ MiB "
                                                r"per rank .* activations"):
        gt.auto_layout(lambda: llama(2), 4, memory_per_rank=2**20, batch=(8, 32),
                       progress=False, candidates={"pp": [1], "checkpoint": [True]})


@pytest.mark.parametrize("kwargs,match", [
    (dict(world_size=0), "world_size"),
    (dict(memory_per_rank="lots"), "memory_per_rank"),
    (dict(batch="8x16"), "batch="),
    (dict(costs=3.0), "costs="),
])
def test_bad_input_is_a_clear_error(kwargs, match):
    args = dict(world_size=4, memory_per_rank="1GiB", batch=(8, 16), progress=False)
    args.update(kwargs)
    with pytest.raises(GlobalTensorError, match=match):
        gt.auto_layout(lambda: llama(2), args.pop("world_size"), **args)


def test_blocks_are_the_largest_run_of_one_class():
    model = llama(3)
    blocks = Blocks(model)
    assert blocks.prefix == "model.layers" and blocks.names == ["0", "1", "2"]
    twin = blocks.truncated(model, 1)
    assert len(twin.model.layers) == 1 and len(model.model.layers) == 3
    with pytest.raises(GlobalTensorError, match="blocks"):
        Blocks(nn.Linear(2, 2))


def test_the_estimate_prices_work_traffic_and_a_pipelines_bubble():
    import numpy as np

    from globaltensor.auto.figures import Figures, priced
    world = 8
    f = Figures(np.zeros(world), {}, {("all_gather", "fsdp"): np.full(world, 3)},
                {("all_gather", "fsdp"): np.full(world, 2 * 10**9)}, flops=4e12, ops=1000)
    links = Links(alpha=1e-3, bandwidth=1e9, overhead=1e-5)
    step, sent = priced(f, Layout(pp=2, fsdp=4, microbatches=2), links, rate=1e12)
    work = 4.0 + 1000 * 1e-5  # the stage's flops over the rate, its operators' overhead
    assert step.compute == pytest.approx(work * 1.5)  # 1F1B's (2 + 2 - 1) / 2
    assert step.matmul == pytest.approx(4.0 * 1.5)
    assert step.communication == {"fsdp": pytest.approx(3e-3 + 2.0)}
    assert sent == {"fsdp": 2 * 10**9}
    assert step.total == pytest.approx(work * 1.5 + 2.003)
    # two ranks to a processor: an idle stage's share goes to the busy one
    shared = Links(alpha=1e-3, bandwidth=1e9, overhead=1e-5, ranks_per_processor=2)
    step, _ = priced(f, Layout(pp=2, fsdp=4, microbatches=2), shared, rate=1e12)
    assert step.compute == pytest.approx(work)


def test_simulations_run_in_forks_that_answer_fail_or_are_stopped(monkeypatch):
    import time

    from globaltensor.auto import forks
    seen = []

    def double(x):
        seen.append(x)  # in the child: the parent's list stays empty
        return 2 * x
    assert forks.run_all(double, [(1,), (2,), (3,)]) == [2, 4, 6] and seen == []

    def bad(x):
        raise ValueError(f"bad {x}")
    with pytest.raises(ValueError, match="bad 1"):
        forks.run_all(bad, [(1,), (2,)])
    monkeypatch.setattr(forks, "TIMEOUT_S", 0.5)
    start = time.monotonic()
    with pytest.raises(GlobalTensorError, match=r"to finish within 0.5 s"):
        forks.run_all(lambda: time.sleep(30), [()], describe=lambda t: "a slow layout")
    assert time.monotonic() - start < 10
