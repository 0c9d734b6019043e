"""torch.compile on global tensors (docs/compile.md): real processes, since the
functional collectives a compiled graph holds find their process group by its name in the
process-wide registry (thread-ranks share one process, so their group names collide).

Default run: the traced executor (every kind of step, even and uneven pieces, a change of
placement) gives the eager executor's bits, and a data-parallel MLP with an uneven batch trains
compiled (aot_eager) exactly as eager global and one process, with no recompile and no Python
dispatch in a steady step. Slow: tensor parallel, ZeRO, 2x2, inductor, a CNN with BatchNorm,
a warm inductor cache. HF models and a model of the user's own, compiled as users compile them:
test_compile_models.py.
"""
import pytest
import torch

import globaltensor as gt
from globaltensor.testing import dispatches_in

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
STEPS = 3


# --------------------------------------------------------------------------- the executor


def _grid(world):
    return gt.placement("cpu", [0, 1]) if world == 2 else gt.placement("cpu", [[0, 1], [2, 3]])


def _cases(world):
    """(name, shape, src placement, src sbp, dst placement, dst sbp): every kind of step."""
    p = _grid(world)
    if world == 2:
        other = gt.placement("cpu", [1, 0])
        return [
            ("S0->B even", (4, 6), p, S(0), p, B), ("S0->B uneven", (5, 3), p, S(0), p, B),
            ("S1->B uneven", (2, 5), p, S(1), p, B), ("P->B", (3, 4), p, P, p, B),
            ("P->S0 uneven", (5, 2), p, P, p, S(0)), ("P->S1 uneven", (2, 7), p, P, p, S(1)),
            ("S0->S1 uneven", (5, 7), p, S(0), p, S(1)), ("B->S1", (3, 5), p, B, p, S(1)),
            ("S0->S0 other placement", (5, 3), p, S(0), other, S(0)),
            ("S1 -> one rank", (3, 5), p, S(1), gt.placement("cpu", [1]), B),
        ]
    return [
        ("(S0,S1)->(B,B)", (5, 7), p, (S(0), S(1)), p, (B, B)),
        ("(P,S0)->(S1,B)", (4, 6), p, (P, S(0)), p, (S(1), B)),
        ("(P,P)->(B,S0)", (3, 5), p, (P, P), p, (B, S(0))),
        ("(S0,S0)->(S1,B)", (5, 3), p, (S(0), S(0)), p, (S(1), B)),
        ("(S0,B)->row 1", (4, 3), p, (S(0), B), gt.placement("cpu", [2, 3]), S(1)),
    ]


def _check_executor(local_rank):
    """Each case: the graph make_fx traces on fake pieces, run on the real piece, equals the
    eager executor's result, and holds a functional collective where the plan communicates."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from globaltensor.runtime.execute import run

    gt.init()
    rank, world = gt.env.get_rank(), gt.env.get_world_size()
    out = []
    for name, shape, src_p, src_sbp, dst_p, dst_sbp in _cases(world):
        full = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
        every = (B,) * src_p.ndim
        x = full.to_global(placement=src_p, sbp=every).to_global(sbp=src_sbp)
        explained = gt.explain(x, placement=dst_p, sbp=dst_sbp)
        piece = x.to_local()
        eager = run(explained.plan, piece, rank)
        graph = make_fx(lambda t: run(explained.plan, t, rank), tracing_mode="fake")(piece)
        traced = graph(piece)
        collectives = sorted({str(n.target).split(".")[1] for n in graph.graph.nodes
                              if "_c10d_functional" in str(n.target)})
        kinds = sorted({type(s).__name__ for s in explained.steps})
        out.append((name, kinds, collectives, torch.equal(traced, eager), tuple(eager.shape)))
    return out


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_traced_executor_gives_the_eager_bits_for_every_kind_of_step(world):
    results = gt.spawn(_check_executor, nproc_per_node=world, timeout=240)
    kinds = set()
    for rank, rows in enumerate(results):
        for name, step_kinds, collectives, equal, shape in rows:
            assert equal, f"rank {rank}, {name}: traced != eager (shape {shape})"
            kinds.update(step_kinds)
            if set(step_kinds) - {"LocalSlice", "ZeroFill"}:
                assert collectives, f"{name}: {step_kinds} traced without a collective"
    kinds = {k.removesuffix("V") for k in kinds}  # AllGatherV: the gather of uneven pieces
    if world == 2:
        assert {"AllGather", "AllReduce", "ReduceScatter", "AllToAll", "Exchange"} <= kinds, kinds
    else:
        assert {"AllGather", "ReduceScatter", "Exchange"} <= kinds, kinds


# --------------------------------------------------------------------------- an MLP trained


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _batches(rows):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g))
            for _ in range(STEPS)]


_TP = {"0.weight": S(0), "0.bias": S(0), "2.weight": S(1)}  # Megatron: column, then row


def _layout(name, world):
    """(placement, sbp_fn for the parameters, sbp of the batch)."""
    p = _grid(world)
    if name == "dp":
        return p, B, S(0)
    if name == "tp":
        return p, lambda n, t: _TP.get(n, B), B
    if name == "zero":
        return p, S(0), S(0)
    return p, lambda n, t: (B, _TP.get(n, B)), (S(0), B)  # 2x2: data x tensor parallel


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _step(model, opt, x, y):
    """One training step, the loss inside: compiled whole (the backward and the optimizer
    step run eagerly after the graph break at backward)."""
    opt.zero_grad()
    loss = _loss(model, x, y)
    loss.backward()
    opt.step()
    return loss.detach()


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train(model, opt, batches, step, place):
    losses = []
    for x, y in batches:
        losses.append(step(model, opt, *place(x, y)))
    return losses


def _full(t):
    return t.full_tensor() if isinstance(t, gt.GlobalTensor) else t


def _collectives(backend):
    """A backend recording the functional collectives of the graphs it compiles."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.testing import CompileCounterWithBackend

    seen = []  # "forward: <op>" / "backward: <op>"

    def record(which):
        def compiler(gm, example_inputs):
            seen.extend(f"{which}: {n.target}" for n in gm.graph.nodes
                        if "_c10d_functional" in str(n.target))
            return gm
        return compiler

    if backend == "aot_eager":
        inner = aot_autograd(fw_compiler=record("forward"), bw_compiler=record("backward"))
    else:
        inductor = lookup_backend("inductor")

        def inner(gm, example_inputs):  # inductor compiles dynamo's graph; read it first
            return inductor(gm, example_inputs)
    return CompileCounterWithBackend(inner), seen


def _check_training(local_rank, name, backend, rows):
    gt.init()
    world = gt.env.get_world_size()
    placement, param_sbp, batch_sbp = _layout(name, world)
    batches = _batches(rows)
    every = (B,) * placement.ndim

    def place(x, y):
        return (x.to_global(placement=placement, sbp=every).to_global(sbp=batch_sbp),
                y.to_global(placement=placement, sbp=every).to_global(sbp=batch_sbp))

    eager_model = _mlp().to_global(placement, param_sbp)
    eager = [_full(v).item() for v in _train(eager_model, _sgd(eager_model), batches, _step, place)]
    counter, seen = _collectives(backend)
    model = _mlp().to_global(placement, param_sbp)
    opt = _sgd(model)
    compiled_step = torch.compile(_step, backend=counter)
    # step 1 compiles (several graphs: the step breaks at backward), step 2 once more: the
    # optimizer's state went from empty to filled (torch's guard, plain tensors alike); then
    # steady: no graph after step 2
    losses = [_full(v).item() for v in _train(model, opt, batches[:2], compiled_step, place)]
    second = counter.frame_count
    losses += [_full(v).item() for v in _train(model, opt, batches[2:], compiled_step, place)]
    frames = (second, counter.frame_count)
    compiled_loss = torch.compile(_loss, backend=backend, fullgraph=True)
    x, y = place(*batches[0])
    compiled_loss(model, x, y)
    steady = dispatches_in(compiled_loss, model, x, y)
    out_loss = _full(compiled_loss(model, x, y)).item()
    out = {"eager": eager, "compiled": losses, "frames": frames, "collectives": sorted(set(seen)),
           "steady_dispatches": steady, "loss": out_loss,
           "eager_loss": _full(_loss(model, x, y)).item(),
           # lists, not tensors: a tensor would travel back through shared memory
           "params": [_full(p.detach()).tolist() for p in model.parameters()],
           "grads": [_full(p.grad).tolist() for p in model.parameters()]}
    out["sum_grads"] = _sum_backward(model, eager_model, x, backend) if name != "dp" else None
    return out


def _sum_backward(model, eager_model, x, backend):
    """``out.sum().backward()`` on a compiled model's output (the gradient reaches the compiled
    backward as B where the trace may have guessed another layout: coerced) and on the eager
    model (trained alike): the largest difference of the parameters' gradients."""
    for m in (model, eager_model):
        m.zero_grad(set_to_none=True)
    torch.compile(model, backend=backend)(x).sum().backward()
    eager_model(x).sum().backward()
    return max((_full(a.grad) - _full(b.grad)).abs().max().item()
               for a, b in zip(model.parameters(), eager_model.parameters()))


def _single(rows):
    model = _mlp()
    losses = [v.item() for v in _train(model, _sgd(model), _batches(rows), _step,
                                       lambda x, y: (x, y))]
    return losses, [p.detach() for p in model.parameters()], [p.grad for p in model.parameters()]


def _assert_trained(results, rows, backend, name):
    losses, params, grads = _single(rows)
    for rank, r in enumerate(results):
        where = f"rank {rank}"
        assert r["compiled"] == pytest.approx(r["eager"], rel=1e-5), where
        assert r["compiled"] == pytest.approx(losses, rel=1e-5), where
        assert r["loss"] == pytest.approx(r["eager_loss"], rel=1e-5), where
        for got, want in zip(r["grads"], grads):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-4, atol=1e-5, msg=where)
        for got, want in zip(r["params"], params):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-4, atol=1e-5, msg=where)
        if r["sum_grads"] is not None:
            assert r["sum_grads"] < 1e-5, f"{where}: out.sum().backward() compiled differs"
        second, last = r["frames"]
        assert second == last, f"{where}: {second} graphs after step 2, {last} after {STEPS}"
        assert r["steady_dispatches"] == 0, where
        if backend == "aot_eager" and name == "dp":
            # the mean of a split batch is P (no forward collective); its gradient reaches the
            # compiled backward as B, as the trace expects (no all-reduce of the seed); the
            # parameters' gradients leave as P for the bucketed hooks
            assert r["collectives"] == [], r["collectives"]
        elif backend == "aot_eager":  # the graph holds the redistributions
            assert any("wait_tensor" in c for c in r["collectives"]), r["collectives"]


@pytest.mark.slow  # a long case: run with pytest -m slow (suite time)
def test_data_parallel_mlp_with_an_uneven_batch_trains_compiled_as_eager_and_one_process():
    rows = 5  # S(0) over 2 ranks: pieces of 3 and 2 rows (the mean divides by the global 5)
    results = gt.spawn(_check_training, args=("dp", "aot_eager", rows), nproc_per_node=2,
                       timeout=300)
    _assert_trained(results, rows, "aot_eager", "dp")


@pytest.mark.slow
@pytest.mark.parametrize("name,world", [("tp", 2), ("zero", 2), ("2x2", 4)])
def test_tensor_parallel_zero_and_2x2_mlps_train_compiled(name, world):
    results = gt.spawn(_check_training, args=(name, "aot_eager", 6), nproc_per_node=world,
                       timeout=400)
    _assert_trained(results, 6, "aot_eager", name)


@pytest.mark.slow
def test_tensor_parallel_mlp_trains_compiled_with_inductor():
    results = gt.spawn(_check_training, args=("tp", "inductor", 6), nproc_per_node=2, timeout=600)
    _assert_trained(results, 6, "inductor", "tp")


# --------------------------------------------------------------------------- user redistributions


def _moves(x):
    """to_global (B, then P -> S(1)), to_local and full_tensor in user code, under autograd."""
    y = (x * 2).to_global(sbp=B)
    z = x.to_global(sbp=P).to_global(sbp=S(1))
    return y.to_local().sum() + (z * z).full_tensor().sum()


def _moves_no_grad(x):
    return (x * 2).to_global(sbp=B).to_local() + 1


def _from_local_moves(placement):
    """A plain piece made global inside the compiled function (gt.from_local), then moved (the
    placement made outside it, as a model's is)."""
    return lambda piece: _moves(gt.from_local(piece, placement, S(0), shape=(5, 4)))


def _check_user_moves(local_rank):
    gt.init()
    placement = _grid(2)
    out = {}
    full = torch.arange(20.).reshape(5, 4)
    for name, fn, grad in (("grad", _moves, True), ("no grad", _moves_no_grad, False),
                           ("from_local", _from_local_moves(placement), True)):
        # 5 rows over 2 ranks: uneven pieces
        if name == "from_local":  # this rank's piece, a plain tensor
            x = (full[:3] if gt.env.get_rank() == 0 else full[3:]).clone().requires_grad_(True)
        else:
            x = gt.tensor(full, placement=placement, sbp=S(0)).requires_grad_(grad)
        counter, seen = _collectives("aot_eager")
        compiled = torch.compile(fn, backend=counter, fullgraph=True)
        got, want = compiled(x), fn(x)
        row = {"equal": torch.equal(got, want), "frames": counter.frame_count,
               "collectives": sorted({c.split(".")[1] for c in seen})}
        if grad:
            got.backward()
            grad_compiled = x.grad.to_local()  # the piece's gradient (a plain one: itself)
            x.grad = None
            want.backward()
            row["grad_equal"] = torch.equal(grad_compiled, x.grad.to_local())
        compiled(x)
        row["steady_dispatches"] = dispatches_in(compiled, x)
        out[name] = row
    return out


@pytest.mark.slow  # the default run keeps the executor and the data-parallel smoke tests
def test_to_global_to_local_and_full_tensor_trace_inside_a_compiled_function():
    """A global tensor's to_global / to_local / full_tensor, and gt.from_local of a plain
    piece, in compiled user code: one graph
    (fullgraph), the redistributions as functional collectives in it, no Python dispatch in a
    steady call, values and gradients as eager."""
    for rank, r in enumerate(gt.spawn(_check_user_moves, nproc_per_node=2, timeout=300)):
        for name, row in r.items():
            where = f"rank {rank}, {name}"
            assert row["equal"] and row.get("grad_equal", True), f"{where}: {row}"
            assert row["frames"] == 1 and row["steady_dispatches"] == 0, f"{where}: {row}"
            assert "all_gather_into_tensor" in row["collectives"], f"{where}: {row}"
        assert "reduce_scatter_tensor" in r["grad"]["collectives"], r["grad"]


# --------------------------------------------------------------------------- a CNN with BatchNorm


def _cnn():
    torch.manual_seed(0)
    c = 4

    def block(cin):
        return [torch.nn.Conv2d(cin, c, 3, padding=1, bias=False), torch.nn.BatchNorm2d(c),
                torch.nn.ReLU()]
    return torch.nn.Sequential(*block(3), torch.nn.MaxPool2d(2), *block(c),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(c, 5))


def _cnn_batches(rows):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(rows, 3, 8, 8, generator=g), torch.randint(0, 5, (rows,), generator=g))
            for _ in range(STEPS)]


def _cnn_loss(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def _cnn_train(model, batches, loss_of, place):
    """Train mode (batch statistics, running statistics updated): losses, then the parameters,
    gradients and BatchNorm buffers after the last step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = loss_of(model, *place(x, y))
        loss.backward()
        opt.step()
        losses.append(_full(loss.detach()).item())
    state = {n: _full(p.detach()).tolist() for n, p in model.named_parameters()}
    state.update({f"{n}.grad": _full(p.grad).tolist() for n, p in model.named_parameters()})
    state.update({n: _full(b).tolist() for n, b in model.named_buffers()})
    return losses, state


def _check_cnn(local_rank, backend, rows):
    from torch._dynamo.testing import CompileCounterWithBackend

    gt.init()
    placement = _grid(gt.env.get_world_size())

    def place(x, y):
        return (gt.tensor(x, placement=placement, sbp=S(0)),
                gt.tensor(y, placement=placement, sbp=S(0)))

    batches = _cnn_batches(rows)
    eager = _cnn_train(_cnn().to_global(placement, B), batches, _cnn_loss, place)
    counter = CompileCounterWithBackend(backend)
    loss_of = torch.compile(_cnn_loss, backend=counter, fullgraph=True)
    compiled = _cnn_train(_cnn().to_global(placement, B), batches, loss_of, place)
    return {"eager": eager, "compiled": compiled, "frames": counter.frame_count}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_cnn_with_batchnorm_trains_compiled_data_parallel_as_eager_and_one_process(backend):
    """BatchNorm in train mode on a batch split over the ranks takes the whole batch's
    statistics (sync-BN semantics): compiled, the losses, gradients, parameters and running
    statistics equal eager global and one process on the whole batch; one graph."""
    rows = 6
    losses, state = _cnn_train(_cnn(), _cnn_batches(rows), _cnn_loss, lambda x, y: (x, y))
    results = gt.spawn(_check_cnn, args=(backend, rows), nproc_per_node=2, timeout=600)
    for rank, r in enumerate(results):
        assert r["frames"] == 1, f"rank {rank}: {r['frames']} graphs"
        for which in ("eager", "compiled"):
            got_losses, got = r[which]
            assert got_losses == pytest.approx(losses, rel=1e-5), f"rank {rank} {which}"
            for name, want in state.items():
                torch.testing.assert_close(torch.tensor(got[name]), torch.tensor(want),
                                           rtol=1e-4, atol=1e-5, msg=f"rank {rank} {which} {name}")


# --------------------------------------------------------------------------- a warm cache


def _check_cached(local_rank):
    gt.init()
    placement, param_sbp, batch_sbp = _layout("tp", 2)
    x, y = (t.to_global(placement=placement, sbp=B) for t in _batches(6)[0])
    model = _mlp().to_global(placement, param_sbp)
    loss = torch.compile(_loss, fullgraph=True)(model, x, y)  # inductor
    loss.backward()
    return [_full(loss).item()] + [_full(p.grad).tolist() for p in model.parameters()]


@pytest.mark.slow
def test_a_compiled_tensor_parallel_graph_runs_from_a_warm_inductor_cache(tmp_path, monkeypatch):
    """The same program twice, new processes, one inductor cache: the second loads graphs
    whose collectives name groups of the first process ("Could not resolve the process group
    registered under the name 1"); groups are named by their ranks, and made before."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    cold = gt.spawn(_check_cached, nproc_per_node=2, timeout=400)
    warm = gt.spawn(_check_cached, nproc_per_node=2, timeout=400)
    assert warm == cold
