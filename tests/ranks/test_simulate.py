"""gt.simulate against real runs of the same code: per rank, the collectives and bytes that
gt.comm_trace records, the parameter / gradient / optimizer bytes of the real pieces, and the
peak of live bytes (gt.memory) within 10%; on a 2x2 grid (Megatron TP x DP) and an uneven 2x3
grid; values refused inside the block; the process as before after it."""
import pytest
import torch

import globaltensor as gt
from globaltensor.errors import GlobalTensorError
from globaltensor.testing import run_ranks

S, B = gt.sbp.split, gt.sbp.broadcast
TIMEOUT = 90


class Block(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)
        self.up = torch.nn.Linear(h, 4 * h)
        self.down = torch.nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def train_step(grid, hidden, rows, zero=False):
    """One AdamW step of a 2-block model, Megatron TP on "tp" (and with ``zero`` every
    parameter of two dims split over "dp" too, ZeRO's layout), the batch split on "dp"; the
    same code real and simulated (values do not matter: only layouts do)."""
    gt.init()
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), Block(hidden), Block(hidden),
                                torch.nn.Linear(hidden, 3))
    tp = gt.nn.sbp_plan({"*.up": gt.nn.colwise("tp"), "*.down": gt.nn.rowwise("tp")})

    def layout(name, t):
        sbp = dict(tp(name, t) or {})
        if zero and t.dim() == 2:
            sbp["dp"] = S(1) if sbp.get("tp") == S(0) else S(0)
        return sbp or None
    model.to_global(grid, layout)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(rows, 8).to_global(grid, (B, B)).to_global(sbp=(S(0), B))
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    return model, opt


def _real(grid, hidden, rows, zero):
    def body(rank):
        with gt.comm_trace() as trace:
            with gt.memory() as mem:
                model, opt = train_step(grid, hidden, rows, zero)
        params = sum(p._local.nbytes for p in model.parameters())
        grads = sum(p.grad._local.nbytes for p in model.parameters())
        state = sum(v._local.nbytes if isinstance(v, gt.GlobalTensor) else v.nbytes
                    for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
        kinds = {k: mem.peak_bytes(k) for k in ("parameters", "gradients", "optimizer")}
        return (trace.counts(), sum(r.bytes_per_rank or 0 for r in trace.records), params, grads,
                state, mem.peak_bytes(), kinds)
    return run_ranks(body, grid.size, timeout=TIMEOUT)


@pytest.mark.parametrize("shape,hidden,rows,zero", [((2, 2), 16, 8, False), ((2, 3), 10, 7, False),
                                                    ((2, 2), 16, 8, True)],
                         ids=["2x2", "2x3-uneven", "2x2-zero"])
def test_a_simulated_step_has_the_real_runs_figures_on_every_rank(shape, hidden, rows, zero):
    n = shape[0] * shape[1]
    grid = gt.placement("cpu", torch.arange(n).reshape(shape).tolist(), axes=("dp", "tp"))
    real = _real(grid, hidden, rows, zero)
    with gt.simulate(n) as sim:
        kept = train_step(grid, hidden, rows, zero)  # what the next step starts from
    del kept
    for rank, (counts, sent, params, grads, state, peak, kinds) in enumerate(real):
        assert sim.collectives(rank) == counts, rank
        assert sum(sim.comm_bytes(rank).values()) == sent, rank
        assert sim.live_bytes(rank, "parameters") == params, rank
        assert sim.live_bytes(rank, "gradients") == grads, rank
        assert sim.live_bytes(rank, "optimizer") == state, rank
        assert {k: sim.peak_bytes(rank, k) for k in kinds} == kinds, rank
        assert abs(sim.peak_bytes(rank) - peak) <= 0.1 * peak, (rank, sim.peak_bytes(rank), peak)
    if zero:  # the weights split over "dp" are gathered when an op needs them whole
        assert sim.collectives(0).get("all_gather", 0) > 0
    if shape == (2, 3):  # hidden 10 over 3: the tensor-parallel pieces differ by rank
        assert len({sim.peak_bytes(r, "parameters") for r in range(n)}) > 1
    report = sim.report()
    assert "rank class" in report and "all_reduce" in report


def test_values_are_refused_inside_and_the_process_is_as_before_after():
    grid = gt.placement("cpu", [[0, 1], [2, 3]], axes=("dp", "tp"))
    with pytest.raises(GlobalTensorError, match="holds? no data") as info:
        with gt.simulate(4):
            model, _ = train_step(grid, 16, 8)
            next(model.parameters()).sum().item()
    assert "test_simulate.py" in str(info.value)
    assert not torch.distributed.is_initialized()
    assert not gt.env.simulated()
    assert torch.zeros(3).add(1).tolist() == [1.0, 1.0, 1.0]  # real tensors again


def test_one_rank_of_a_large_world_costs_what_its_classes_cost():
    """A 256-rank 3-D grid in one process: the ranks of a class agree, the report is short."""
    with gt.simulate(256) as sim:
        grid = gt.placement("cpu", torch.arange(256).reshape(4, 8, 8).tolist(),
                            axes=("dp", "fsdp", "tp"))
        gt.init()
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
        model.to_global(grid, gt.nn.sbp_plan({"0": gt.nn.colwise("tp"), "2": gt.nn.rowwise("tp")}))
        x = torch.randn(64, 64).to_global(grid, (B, B, B)).to_global(sbp=(S(0), S(0), B))
        model(x).pow(2).mean().backward()
    assert sim.peak_bytes(0) == sim.peak_bytes(255) > 0
    assert sim.collectives(0) == sim.collectives(255)
    assert sim.step_time(alpha=1e-5, bandwidth=1e9, flops=1e12).total > 0
    with pytest.raises(GlobalTensorError, match="rank in"):
        sim.peak_bytes(256)


def test_an_operator_that_needs_values_is_a_clear_error_naming_it():
    grid = gt.placement("cpu", [0, 1])
    with pytest.raises(GlobalTensorError, match="nonzero") as info:
        with gt.simulate(2):
            x = torch.randn(6, 4).to_global(grid, B)
            torch.nonzero(x > 0)
    assert "gt.simulate" in str(info.value)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("shape,sbp", [((7, 5), (S(0), S(0))), ((7, 5), (S(1), S(0))),
                                       ((3,), (S(0), B)), ((9, 4, 2), (S(2), S(0)))])
def test_piece_bytes_on_every_rank_are_the_layouts_pieces(shape, sbp):
    from globaltensor.layout import Layout
    from globaltensor.sim.ranks import piece_bytes

    grid = gt.placement("cpu", [[4, 0, 5], [1, 3, 2]])
    layout = Layout(grid, sbp, shape)
    got = piece_bytes(layout, 4, 7)
    for coord in grid.coords():
        numel = 1
        for n in layout.local_shape(coord):
            numel *= n
        assert got[grid.rank_at(coord)] == 4 * numel
    assert got[6] == 0  # outside the placement


def test_step_time_is_its_parts_summed_on_the_slowest_rank():
    """Issue 52.10: step_time returns a StepTime: per-axis communication seconds and compute
    seconds of the slowest rank, whose exact sum is the total; float() and format specs give
    the total, str() a one-line summary."""
    import math

    from globaltensor.sim import StepTime

    with gt.simulate(4) as sim:
        grid = gt.placement("cpu", [[0, 1], [2, 3]], axes=("dp", "tp"))
        x = torch.randn(4, 8).to_global(grid, (S(0), S(1)))  # global 8 x 16
        z = x.to_global(sbp=(S(0), B)).to_global(sbp=(B, B))  # one all_gather on tp, one on dp
        # 2 * 8 * 16 * 32 flops, on every rank (no sync_data: a broadcast along each axis)
        z @ torch.randn(16, 32).to_global(grid, (B, B), sync_data=False)
        pair = gt.placement("cpu", [2, 3], axes=("pair",))  # ranks 2 and 3 send more
        torch.randn(2, 4).to_global(pair, S(0)).to_global(sbp=B)
    assert sim.flops() == 2 * 8 * 16 * 32
    t = sim.step_time(alpha=1e-3, bandwidth=1e6, flops=1e9, axes={"tp": (1e-4, 1e8)})
    assert isinstance(t, StepTime) and t.rank == 2  # the first of the busiest ranks
    float32 = 4
    assert t.communication == pytest.approx({
        "tp": 1e-4 + 4 * 8 * float32 / 1e8,  # each rank sends its 4 x 8 piece
        "dp": 1e-3 + 4 * 16 * float32 / 1e6,  # then its 4 x 16 half
        "pair": 1e-3 + 2 * 4 * float32 / 1e6,
        # each to_global of a local tensor exchanges its piece's shape (check_meta): one
        # all_gather of an int64 record of 83 numbers over the 4 ranks; and the first use of
        # each plan checks that its ranks agree: a 1 KiB record sent to each other rank of its
        # placements (runtime/layoutcheck.py; two plans on the grid, one on the pair)
        "metadata": 3 * (1e-3 + 3 * 83 * 8 / 1e6) + 2 * (1e-3 + 3 * 1024 / 1e6)
        + (1e-3 + 1024 / 1e6)}, rel=1e-12)
    assert t.compute == 2 * 8 * 16 * 32 / 1e9
    assert t.total == math.fsum([*t.communication.values(), t.compute])  # exactly
    assert t.communication_total == math.fsum(t.communication.values())
    assert float(t) == t.total and f"{t:.6f}" == f"{t.total:.6f}"
    assert float(t) + 1 == t.total + 1  # arithmetic on the total as before
    assert str(t) == ("step 21.5 ms on rank 2: compute 8.19 us, communication 21.5 ms "
                      "(metadata 19.1 ms, tp 101 us, dp 1.26 ms, pair 1.03 ms)")
    assert "StepTime(total=" in repr(t)
    only_alpha = sim.step_time(alpha=1.0, bandwidth=float("inf"), flops=float("inf"))
    assert only_alpha.communication == {"metadata": 6.0, "tp": 1.0, "dp": 1.0, "pair": 1.0}
    assert only_alpha.total == sum(sim.collectives(2, metadata=True).values()) == 9
    assert sum(sim.collectives(2).values()) == 3  # the model's data, as comm_trace counts it
    assert sim.step_time(alpha=0.0, bandwidth=1.0, flops=float("inf")).communication_total == \
        sum(sim.comm_bytes(2, metadata=True).values())  # over 1 B/s: the bytes rank 2 sends


def test_a_simulation_prices_its_plans_with_the_figures_the_real_job_would_use(monkeypatch):
    """costs= or GT_COSTS ("default" or figures) price the block's plans, the report names
    them, and the process's own figures are back after the block; unset or "measure", the
    figures in use (a simulation measures nothing)."""
    before = gt.costs()
    with gt.simulate(2, costs="alpha=1e-3,beta=1e-9") as sim:
        inside = gt.costs()
    assert (inside.alpha, inside.beta, inside.source) == (1e-3, 1e-9, "given")
    assert "alpha 1e+03 us per collective" in sim.report().splitlines()[0]
    assert gt.costs() == before
    monkeypatch.setenv("GT_COSTS", "alpha=2e-3,beta=2e-9")
    with gt.simulate(2):
        assert (gt.costs().alpha, gt.costs().beta) == (2e-3, 2e-9)
    monkeypatch.setenv("GT_COSTS", "default")
    with gt.simulate(2) as sim:
        assert gt.costs().source == "default"
    monkeypatch.setenv("GT_COSTS", "measure")
    with gt.simulate(2):
        assert gt.costs() == before
    assert gt.costs() == before
    with pytest.raises(GlobalTensorError, match="expected costs="):
        gt.simulate(2, costs=3)


def test_a_simulation_dispatches_attention_as_the_real_device_would():
    """Causal SDPA on q, k, v split on the heads, forward and backward: on meta pieces torch
    took its math decomposition (whose rules gather the heads); a global tensor reports the
    job's device in a simulation, so the CPU flash kernel runs, which keeps the heads split and
    sends nothing, as the real run; and without global mode it no longer fails."""
    import torch.nn.functional as F

    def program():
        p = gt.placement("cpu", [0, 1])
        q, k, v = (gt.randn(8, 4, 16, 16, placement=p, sbp=S(1), requires_grad=True)
                   for _ in range(3))
        with gt.comm_trace() as trace:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        return trace.counts(), q.device.type
    real = run_ranks(lambda rank: program(), 2, timeout=TIMEOUT)
    with gt.simulate(2) as sim:
        simulated, device = program()
    assert device == "cpu"
    assert simulated == real[0][0], (simulated, real[0][0])
    assert "all_gather" not in {k for k, _ in sim.recorder.counts}


def test_hf_use_cache_false_runs_in_a_simulation_on_known_positions():
    """Issue 54, item 4: HF's causal mask reads the position ids (masking_utils'
    ``if ... .all():``) when use_cache=False. Positions are knowable without data (an integer
    arange), so a simulation keeps their values and the model runs, with the traffic of the
    real run; a value computed from data is still a GlobalTensorError naming the line."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

    def program():
        p = gt.placement("cpu", [0, 1])
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        model.to_global(p)
        ids = gt.randint(0, 64, (2, 8), placement=p, sbp=S(0))
        with gt.comm_trace() as trace:
            model(ids, labels=ids, use_cache=False).loss.backward()
        return trace.counts()

    real = run_ranks(lambda rank: program(), 2, timeout=TIMEOUT)
    with gt.simulate(2) as sim:
        simulated = program()
    assert simulated == real[0], (simulated, real[0])  # the step's traffic, as the real run's

    with gt.simulate(2):
        p = gt.placement("cpu", [0, 1])
        positions = gt.arange(8, placement=p, sbp=B)
        assert bool((positions.diff() == 1).all()) and int(positions[-1]) == 7  # known
        assert int(positions[2:][0]) == 2  # local slices of a known value stay known
        split = gt.arange(8, placement=p, sbp=S(0))
        noise = gt.randn(8, placement=p, sbp=B)
        with pytest.raises(GlobalTensorError, match=r"test_simulate\.py:\d+"):
            bool(((positions + noise) > 0).all())  # computed from data: no value
        with pytest.raises(GlobalTensorError, match=r"test_simulate\.py:\d+"):
            int(split.sum())  # summed over ranks: only this rank's piece is known here


def test_step_time_defaults_to_the_figures_the_plans_were_priced_with():
    with gt.simulate(2, costs="alpha=1e-3,beta=1e-9") as sim:
        p = gt.placement("cpu", [0, 1])
        gt.ones(64, 64, placement=p, sbp=S(0)).to_global(sbp=B)
    assert sim.step_time().total == pytest.approx(
        sim.step_time(alpha=1e-3, bandwidth=1e9).total)
    assert sim.step_time().total != pytest.approx(sim.step_time(alpha=1e-5, bandwidth=25e9).total)
