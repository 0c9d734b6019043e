"""gt.nn.Pipeline on thread-ranks: every schedule, data and tensor parallel stages, interleaved
stages and uneven micro-batches train as one process running the same micro-batches; one
data-parallel reduction per step; comm_trace sees the sends; 1F1B keeps fewer activations than
GPipe; bad input is refused on every rank before anything is sent."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.errors import GlobalTensorError
from globaltensor.testing import run_ranks

S, B = gt.sbp.split, gt.sbp.broadcast
H = 8


def _stages(n: int, seed: int = 0):
    """``n`` stages of an MLP classifier (built once, in the test's thread: thread-ranks share
    torch's random generator)."""
    torch.manual_seed(seed)
    body = [nn.Sequential(nn.Linear(H, H), nn.Tanh()) for _ in range(n - 1)]
    return body + [nn.Sequential(nn.Linear(H, H), nn.Tanh(), nn.Linear(H, 3))]


def _data(rows: int):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, H, generator=g), torch.randint(0, 3, (rows,), generator=g)


def _one_process(stages, mb: int, x, y, steps: int = 3):
    """The same micro-batches in one process: mean of their losses, AdamW."""
    model = nn.Sequential(*copy.deepcopy(stages))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(torch.tensor_split(x, mb), torch.tensor_split(y, mb)):
            loss = F.cross_entropy(model(xm), ym) / mb
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses, [p.detach() for p in model.parameters()], model(x).detach()


def _tensor_parallel(name, t):
    """Megatron inside a stage: the first linear by columns, the last by rows."""
    if name in ("0.weight", "0.bias"):
        return S(0)
    return S(1) if name == "2.weight" else B


def _pipeline_run(stages, places, mb, schedule, x, y, sbp_fn=None, steps=3):
    def body(rank):
        gt.init()
        mine = copy.deepcopy(stages)
        for i, stage in enumerate(mine):
            stage.to_global(places[i % len(places)], sbp_fn)
        pipe = gt.nn.Pipeline(mine, microbatches=mb, schedule=schedule)
        opt = torch.optim.AdamW([p for s in mine for p in s.parameters()], lr=0.01)
        world = gt.placement("cpu", list(range(gt.env.get_world_size())))
        gx, gy = gt.tensor(x, placement=world, sbp=S(0)), gt.tensor(y, placement=world, sbp=S(0))
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            losses.append(pipe.step(gx, target=gy, loss_fn=F.cross_entropy))
            opt.step()
        out = pipe(gx)
        return losses, [p.full_tensor() for s in mine for p in s.parameters()], out.full_tensor()

    world = max(r for p in places for r in p.flat_ranks) + 1
    return run_ranks(body, world, timeout=120)


P = gt.placement
LINE4 = [P("cpu", [i]) for i in range(4)]
PAIRS = [P("cpu", [0, 1]), P("cpu", [2, 3])]


@pytest.mark.parametrize("stages,places,mb,schedule,rows,sbp_fn", [
    (4, LINE4, 8, "gpipe", 16, None),
    (4, LINE4, 8, "1f1b", 16, None),
    (2, PAIRS, 4, "1f1b", 16, None),               # 2 stages x 2 data-parallel ranks
    (2, PAIRS, 4, "1f1b", 16, _tensor_parallel),   # 2 stages x 2 tensor-parallel ranks
    (4, PAIRS, 4, "interleaved-1f1b", 16, None),   # 4 stages on 2 placements
    (2, PAIRS, 4, "gpipe", 10, None),              # uneven micro-batches: 10 rows into 4
], ids=["4x1-gpipe", "4x1-1f1b", "2x2dp", "2x2tp", "interleaved", "uneven"])
def test_training_through_a_pipeline_equals_one_process(stages, places, mb, schedule, rows, sbp_fn):
    built = _stages(stages)
    x, y = _data(rows)
    losses, params, out = _one_process(built, mb, x, y)
    for rank, (got_losses, got_params, got_out) in enumerate(
            _pipeline_run(built, places, mb, schedule, x, y, sbp_fn)):
        assert got_losses == pytest.approx(losses, rel=1e-5), rank
        for a, b in zip(got_params, params):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got_out, out, atol=1e-5, rtol=1e-4)


def test_stages_sharded_with_fully_shard_and_on_a_2x2_grid_train_as_one_process():
    """Any layout inside a stage: a fully_shard stage (FSDP2's API, one unit per stage) on
    [0, 1] feeding a data x tensor parallel stage on a 2x2 grid [2..5]."""
    built = _stages(2)
    x, y = _data(16)
    losses, params, _ = _one_process(built, 4, x, y)
    grid = gt.placement("cpu", [[2, 3], [4, 5]], axes=("dp", "tp"))

    def body(rank):
        gt.init()
        first, second = copy.deepcopy(built)
        gt.nn.fully_shard(first, PAIRS[0])
        second.to_global(grid, lambda name, t: {"tp": _tensor_parallel(name, t)})
        pipe = gt.nn.Pipeline([first, second], microbatches=4, schedule="1f1b")
        opt = torch.optim.AdamW(list(pipe.parameters()), lr=0.01)
        gx = gt.tensor(x, placement=PAIRS[0], sbp=S(0))
        gy = gt.tensor(y, placement=grid, sbp=(S(0), B))
        got = []
        for _ in range(3):
            opt.zero_grad()
            got.append(pipe.step(gx, target=gy, loss_fn=F.cross_entropy))
            opt.step()
        return got, [p.full_tensor() for p in pipe.parameters()]

    for rank, (got, got_params) in enumerate(run_ranks(body, 6, timeout=120)):
        assert got == pytest.approx(losses, rel=1e-5), rank
        for a, b in zip(got_params, params):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_the_data_parallel_reduction_runs_once_per_step_and_comm_trace_sees_the_sends():
    built = _stages(2)
    x, y = _data(16)

    def body(rank):
        gt.init()
        mine = copy.deepcopy(built)
        for stage, p in zip(mine, PAIRS):
            stage.to_global(p)
        pipe = gt.nn.Pipeline(mine, microbatches=4, schedule="1f1b")
        gx = gt.tensor(x, placement=PAIRS[0], sbp=S(0))
        gy = gt.tensor(y, placement=PAIRS[1], sbp=S(0))
        pipe.step(gx, target=gy, loss_fn=F.cross_entropy)  # the first step learns the layouts
        for p in pipe.parameters():
            p.grad = None
        with gt.comm_trace() as trace:
            pipe.step(gx, target=gy, loss_fn=F.cross_entropy)
        return [r.op for r in trace], trace.bytes_per_rank

    for rank, (ops, sent) in enumerate(run_ranks(body, 4, timeout=120)):
        buckets = [op for op in ops if op.startswith("gradient bucket")]
        assert len(buckets) == 1, (rank, ops)  # one bucket of the stage's 2 (or 4) gradients
        way = "1 -> 0 gradients" if rank >= 2 else "0 -> 1 activations"
        assert sum(way in op for op in ops) == 4, (rank, ops)  # one per micro-batch
        # each micro-batch is 4 rows over 2 ranks: 2 rows x 8 floats out, the same back
        assert sent >= 4 * 2 * H * 4, (rank, sent)


def test_one_f_one_b_keeps_fewer_activations_on_the_first_stage_than_gpipe():
    built = _stages(4)
    x, y = _data(512)  # 8 micro-batches of 64 rows

    def body(rank, schedule):
        gt.init()
        mine = copy.deepcopy(built)
        for stage, p in zip(mine, LINE4):
            stage.to_global(p)
        pipe = gt.nn.Pipeline(mine, microbatches=8, schedule=schedule)
        gx = gt.tensor(x, placement=LINE4[0], sbp=B)
        gy = gt.tensor(y, placement=LINE4[-1], sbp=B)
        pipe.step(gx, target=gy, loss_fn=F.cross_entropy)
        with gt.memory() as mem:
            pipe.step(gx, target=gy, loss_fn=F.cross_entropy)
        # what the step adds to what was live (the batch itself, the parameters)
        return mem.peak_bytes("activations") - mem.start_bytes("activations")

    gpipe = run_ranks(body, 4, "gpipe", timeout=120)
    one_f = run_ranks(body, 4, "1f1b", timeout=120)
    saved = 64 * H * 4  # one micro-batch's saved activation (tanh's output) on stage 0
    assert gpipe[0] >= 8 * saved, gpipe  # GPipe keeps all 8 micro-batches
    assert one_f[0] <= 0.75 * gpipe[0], (one_f, gpipe)  # 1F1B: 4 in flight on stage 0 of 4
    assert one_f[3] <= 0.5 * gpipe[3], (one_f, gpipe)   # and 1 on the last stage


def test_table_shows_the_schedule():
    built = _stages(2)

    def body(rank):
        gt.init()
        mine = copy.deepcopy(built)
        for stage, p in zip(mine, [P("cpu", [0]), P("cpu", [1])]):
            stage.to_global(p)
        return gt.nn.Pipeline(mine, microbatches=2, schedule="1f1b").table()

    text = run_ranks(body, 2, timeout=60)[0]
    assert text.splitlines()[1] == "stage 1 (placement 1):  . F0 B0 F1 B1  ."


def _refused(make, world=4):
    """``make()`` on every rank; each rank's GlobalTensorError message (None if it passed)."""
    def body(rank):
        gt.init()
        try:
            make()
        except GlobalTensorError as e:
            return str(e)
        return None
    return run_ranks(body, world, timeout=60)


def test_bad_input_is_refused_on_every_rank_before_anything_is_sent():
    built = _stages(2)

    def laid(places):
        mine = copy.deepcopy(built)
        for stage, p in zip(mine, places):
            stage.to_global(p)
        return mine

    def two_placements():
        mine = laid(PAIRS)
        mine[0][0].weight = nn.Parameter(gt.zeros(H, H, placement=PAIRS[1], sbp=B))
        gt.nn.Pipeline(mine, microbatches=2)

    def overlapping():
        gt.nn.Pipeline(laid([P("cpu", [0, 1]), P("cpu", [1, 2])]), microbatches=2)

    def too_many_micro_batches():
        pipe = gt.nn.Pipeline(laid(PAIRS), microbatches=8)
        x = gt.zeros(4, H, placement=PAIRS[0], sbp=S(0))
        y = gt.zeros(4, dtype=torch.long, placement=PAIRS[1], sbp=S(0))
        pipe.step(x, target=y, loss_fn=F.cross_entropy)

    def local_input():
        pipe = gt.nn.Pipeline(laid(PAIRS), microbatches=2)
        pipe.step(torch.zeros(4, H), target=torch.zeros(4), loss_fn=F.cross_entropy)

    def local_stage():
        gt.nn.Pipeline([copy.deepcopy(built[0]), laid(PAIRS)[1]], microbatches=2)

    for make, words in [(two_placements, "parameters on one placement"),
                        (overlapping, "sharing ranks [1]"),
                        (too_many_micro_batches, "at most 4 micro-batches"),
                        (local_input, "expected input 0 to be a global tensor"),
                        (local_stage, "expected every parameter and buffer to be global")]:
        messages = _refused(make)
        assert all(m is not None and words in m for m in messages), (make.__name__, messages)


def _pipeline_step(stages, places, schedule, rows):
    """Lay the stages out and run one step on data made here (real or simulated: the same code;
    values do not matter, only layouts do)."""
    gt.init()
    mine = copy.deepcopy(stages)
    for i, stage in enumerate(mine):
        stage.to_global(places[i % len(places)])
    pipe = gt.nn.Pipeline(mine, microbatches=4, schedule=schedule)
    gx = gt.randn(rows, H, placement=places[0], sbp=S(0))
    gy = gt.randint(0, 3, (rows,), placement=places[-1], sbp=S(0))
    return pipe, pipe.step(gx, target=gy, loss_fn=F.cross_entropy)


@pytest.mark.parametrize("schedule,n", [("1f1b", 2), ("interleaved-1f1b", 4)])
def test_a_simulated_pipeline_step_has_the_real_runs_sends_and_memory_on_every_rank(schedule, n):
    built = _stages(n)
    rows = 256  # activations, not the set-up, make the peak
    places = [P("cpu", [0, 1]), P("cpu", [2, 3])]

    def body(rank):
        with gt.comm_trace() as trace, gt.memory() as mem:
            pipe, _ = _pipeline_step(built, places, schedule, rows)
        grads = sum(p.grad._local.nbytes for p in pipe.parameters() if p.grad is not None)
        return trace.counts(), trace.bytes_per_rank, grads, mem.peak_bytes("gradients"), mem.peak_bytes()

    real = run_ranks(body, 4, timeout=120)
    for played in (0, 2):  # the process plays one rank: its stage's ranks are exact
        with gt.simulate(4, rank=played) as sim:
            _, loss = _pipeline_step(built, places, schedule, rows)
        assert loss != loss  # a simulated step has no values: nan
        for rank, (counts, sent, grads, grad_peak, peak) in enumerate(real):
            assert sim.collectives(rank) == counts, (rank, sim.collectives(rank), counts)
            assert sum(sim.comm_bytes(rank).values()) == sent, rank
            assert sim.live_bytes(rank, "gradients") == grads, rank
            if (rank < 2) == (played < 2):
                assert sim.peak_bytes(rank, "gradients") == grad_peak, rank
                assert abs(sim.peak_bytes(rank) - peak) <= 0.1 * peak, (rank, sim.peak_bytes(rank), peak)
    assert sim.comm_bytes(0)["send"] > 0 and sim.comm_bytes(3)["send"] > 0


class _RaisesOnce(nn.Module):
    """A stage that raises at its second forward on rank ``rank``."""

    def __init__(self, rank: int):
        super().__init__()
        self.linear, self.rank, self.calls = nn.Linear(H, H), rank, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 2 and gt.env.get_rank() == self.rank:
            raise RuntimeError("the stage's own bug")
        return self.linear(x)


def test_a_stage_that_raises_on_one_rank_gives_every_rank_its_error_within_seconds():
    """Stage 2 of 4 (rank 2) raises in its second micro-batch's forward; the stages before it
    wait on its gradients, the one after it on its activations. Every rank raises the same
    error naming the stage, the micro-batch and the cause, long before the world's timeout
    (300 s): the failing rank publishes it and closes its connections, each waiting receive
    ends and reads it (runtime/failure.py)."""
    import time

    def body(rank):
        gt.init()
        torch.manual_seed(0)
        stages = _stages(4)
        stages[2] = _RaisesOnce(2)
        for stage, place in zip(stages, LINE4):
            stage.to_global(place)
        pipe = gt.nn.Pipeline(stages, microbatches=4)
        world = gt.placement("cpu", [0, 1, 2, 3])
        x, y = _data(8)
        gx, gy = gt.tensor(x, placement=world, sbp=S(0)), gt.tensor(y, placement=world, sbp=S(0))
        start = time.monotonic()
        try:
            pipe.step(gx, target=gy, loss_fn=F.cross_entropy)
        except GlobalTensorError as e:
            return str(e), time.monotonic() - start
        return None, time.monotonic() - start
    for rank, (message, took) in enumerate(run_ranks(body, 4, timeout=120)):
        assert message is not None, f"rank {rank} raised nothing"
        assert message.startswith("gt.nn.Pipeline: stage 2's forward of micro-batch 1 raised on "
                                  "rank 2: RuntimeError: the stage's own bug."), message
        assert took < 60, f"rank {rank} took {took:.0f}s"


def test_uneven_micro_batches_are_said_once_on_rank_0():
    """Three steps on four ranks, two of them with uneven micro-batches: one warning in all
    (warnings are recorded for the whole process: thread-ranks share it)."""
    import warnings

    def body(rank):
        gt.init()
        torch.manual_seed(0)
        stages = _stages(2)
        for stage, place in zip(stages, PAIRS):
            stage.to_global(place)
        pipe = gt.nn.Pipeline(stages, microbatches=4)
        world = gt.placement("cpu", [0, 1, 2, 3])
        for rows in (10, 10, 8):
            x, y = _data(rows)
            pipe.step(gt.tensor(x, placement=world, sbp=S(0)),
                      target=gt.tensor(y, placement=world, sbp=S(0)), loss_fn=F.cross_entropy)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run_ranks(body, 4, timeout=120)
    said = [str(w.message) for w in seen if "micro-batches" in str(w.message)]
    assert len(said) == 1, said
    assert "10 rows in 4 micro-batches" in said[0] and "(3, 3, 2, 2 rows)" in said[0]
    assert "not the whole batch's mean" in said[0]
