"""Results that used to be silently wrong, each against the full-tensor oracle on
thread-ranks: in-place shape ops, None among an op's outputs, squeeze of uneven pieces."""
import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.layout import Layout
from globaltensor.testing import run_ranks

from helpers import G2, G22, check, gen, make_global

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


def _grad_of_param_only(fn, x_full, w_full, grid, x_sbp, w_sbp):
    """``fn(x, w).sum()``'s gradient for ``w`` alone (x gets none: the backward op runs with an
    output mask that leaves x's gradient out), on every rank, and torch's."""
    w_ref = w_full.clone().requires_grad_()
    fn(x_full, w_ref).sum().backward()

    def body(rank):
        x = make_global(x_full, Layout(grid, x_sbp, x_full.shape), rank)
        w = make_global(w_full, Layout(grid, w_sbp, w_full.shape), rank).requires_grad_()
        fn(x, w).sum().backward()
        return w.grad.full_tensor()

    for got in run_ranks(body, grid.size, timeout=60):
        torch.testing.assert_close(got, w_ref.grad)


@pytest.mark.parametrize("grid", [G2, G22], ids=["2", "2x2"])
@pytest.mark.parametrize("x_sbp", [S(0), B], ids=str)
def test_a_none_output_keeps_the_places_of_the_outputs_after_it(grid, x_sbp):
    # convolution_backward with output_mask [False, True, False]: the weight gradient is the
    # second output; it used to take the first output's sbp (the input gradient's)
    x, w = gen(4, 2, 5, 5, seed=1), gen(3, 2, 3, 3, seed=2)
    sbps = (x_sbp,) * grid.ndim
    _grad_of_param_only(lambda a, b: F.conv2d(a, b), x, w, grid, sbps, (B,) * grid.ndim)
    # native_layer_norm_backward with the input's gradient masked out
    x, w = gen(4, 6, seed=3), gen(6, seed=4)
    _grad_of_param_only(lambda a, b: F.layer_norm(a, (6,), weight=b), x, w, grid, sbps,
                        (B,) * grid.ndim)


@pytest.mark.parametrize("dims", [(), (0,), (1,), (0, 1)], ids=str)
def test_squeeze_removes_only_dims_of_global_size_one(dims):
    # (3, 1, 4) split on dim 0 over 2 ranks: pieces (2, 1, 4) and (1, 1, 4); over 3 ranks every
    # piece has size 1 on dim 0, which the tensor has not
    full = gen(3, 1, 4, seed=5)
    want = full.squeeze(dims) if dims else full.squeeze()
    for world in (2, 3):
        placement = gt.placement("cpu", list(range(world)))

        def body(rank):
            x = make_global(full, Layout(placement, (S(0),), full.shape), rank)
            y = x.squeeze(dims) if dims else x.squeeze()
            return tuple(y.shape), tuple(y.to_local().shape), y.full_tensor()

        for rank, (shape, local, value) in enumerate(run_ranks(body, world, timeout=60)):
            assert shape == tuple(want.shape)
            assert len(local) == want.dim()
            torch.testing.assert_close(value, want)


INPLACE_SHAPE_OPS = {
    "squeeze_": (lambda x: x.clone().squeeze_(1), [gen(3, 1, 4, seed=6)]),
    "squeeze_ all": (lambda x: x.clone().squeeze_(), [gen(3, 1, 4, seed=6)]),
    "unsqueeze_": (lambda x: x.clone().unsqueeze_(1), [gen(3, 4, seed=7)]),
    "t_": (lambda x: x.clone().t_(), [gen(3, 4, seed=8)]),
    "transpose_": (lambda x: x.clone().transpose_(0, 2), [gen(3, 2, 5, seed=9)]),
    "vector @ matrix": (lambda v, m: v @ m, [gen(3, seed=10), gen(3, 5, seed=11)]),
}


@pytest.mark.parametrize("name", INPLACE_SHAPE_OPS)
def test_inplace_shape_ops_give_self_its_new_shape(name):
    # the wrapper's shape used to stay (squeeze_ kept (3, 1, 4); v @ m, which torch runs as
    # mm(...).squeeze_(0), came out (1, 5)); forward and gradients over every sbp of [2], [2, 2]
    fn, inputs = INPLACE_SHAPE_OPS[name]
    check(fn, inputs)


def test_inplace_shape_op_on_a_global_tensor_keeps_it_usable():
    def body(rank):
        x = gt.tensor(torch.arange(6.0).reshape(1, 6), placement=G2, sbp=S(1))
        x.squeeze_(0)
        y = x * 2  # the new layout is the one ops see
        return tuple(x.shape), x.sbp, tuple(y.shape), y.full_tensor().tolist()

    for shape, sbp, yshape, values in run_ranks(body, 2, timeout=60):
        assert shape == (6,) and sbp == (S(0),) and yshape == (6,)
        assert values == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]


def _global_like(x, full):
    """``full`` as a broadcast global tensor on ``x``'s placement (a local tensor for a local x)."""
    if not x.is_global:
        return full
    return gt.tensor(full, placement=x.placement, sbp=[B] * x.placement.ndim)


WRITES = {
    "x[1] = 5": lambda x: x.__setitem__(1, 5.0),
    "x[:, :2] = v": lambda x: x.__setitem__((slice(None), slice(None, 2)),
                                            _global_like(x, torch.full((x.shape[0], 2), 3.0))),
    "x[1] = row": lambda x: x.__setitem__(1, _global_like(x, torch.arange(3.0))),
    "x[0:2].mul_(3)": lambda x: x[0:2].mul_(3),
    "narrow().fill_": lambda x: x.narrow(0, 1, 2).fill_(1),
    "diagonal().zero_": lambda x: x.diagonal().zero_(),
    "x[1:3][0].fill_": lambda x: x[1:3][0].fill_(7),  # a view of a view
    "t()[2].add_": lambda x: x.t()[2].add_(1),
    "unbind()[1].fill_": lambda x: x.unbind(0)[1].fill_(4),
    "split()[1].mul_": lambda x: x.split(2)[1].mul_(2),
    # a view of a strided piece that torch can view as it is: an alias, not a copy
    "x[:, :2].view().mul_": lambda x: x[:, :2].view(x.shape[0], 1, 2).mul_(3),
}
LAYOUTS = [(G2, (S(0),)), (G2, (S(1),)), (G2, (B,)), (G2, (P,)),
           (G22, (S(0), S(1))), (G22, (B, S(0))), (G22, (P, B)), (G22, (S(1), P))]


@pytest.mark.parametrize("shape", [(4, 3), (5, 3)], ids=["4x3", "5x3"])
@pytest.mark.parametrize("name", WRITES)
def test_writes_through_views_reach_the_tensor(name, shape):
    # a view that needed a redistribution is a copy; the write used to stop there
    fn = WRITES[name]
    full = gen(*shape, seed=12)
    want = full.clone()
    fn(want)
    for grid, sbp in LAYOUTS:
        def body(rank):
            x = make_global(full, Layout(grid, sbp, full.shape), rank)
            fn(x)
            return x.full_tensor(), x.sbp

        for value, got_sbp in run_ranks(body, grid.size, timeout=60):
            assert got_sbp == sbp
            torch.testing.assert_close(value, want, msg=f"{name} on {sbp}")


@pytest.mark.parametrize("grid, sbp", [(G2, (S(0),)), (G2, (P,)), (G22, (S(1), B))],
                         ids=["S(0)", "P", "(S(1),B)"])
def test_assigning_data_replaces_the_value(grid, sbp):
    full = gen(5, 3, seed=13)

    def body(rank):
        p = make_global(full, Layout(grid, sbp, full.shape), rank).requires_grad_()
        value = p.data * 2 + 1  # the optimizer idiom; p stays the same leaf
        p.data = value
        same = (p.full_tensor().detach(), p.sbp == value.sbp, p.requires_grad, p.is_leaf)
        p.data = gt.tensor(torch.arange(4.0), placement=grid, sbp=[B] * grid.ndim)  # new shape
        other = (tuple(p.shape), p.sbp, p.full_tensor().detach())
        try:
            p.data = torch.zeros(4)
            error = None
        except gt.GlobalTensorError as e:
            error = str(e)
        return same, other, error

    for same, other, error in run_ranks(body, grid.size, timeout=60):
        torch.testing.assert_close(same[0], full * 2 + 1)
        assert same[1:] == (True, True, True)
        assert other[0] == (4,) and other[1] == (B,) * grid.ndim
        torch.testing.assert_close(other[2], torch.arange(4.0))
        assert "expects a global tensor" in error


def test_ranks_outside_the_placement_take_the_members_dtype_and_ndim():
    # rank 2 is outside [0, 1] and passes an ignored tensor of another dtype and ndim
    def body(rank):
        p = gt.placement("cpu", [0, 1])
        local = torch.full((2, 3), float(rank)) if rank < 2 else torch.zeros(5, dtype=torch.int64)
        x = local.to_global(placement=p, sbp=S(1))  # S(1): resolvable on 2-D pieces only
        y = (x * 2).sum(0)
        return x.dtype, tuple(x.shape), tuple(x.to_local().shape), y.dtype, y.full_tensor()

    want = torch.tensor([0.0, 0.0, 0.0, 4.0, 4.0, 4.0])  # rank 0's zeros beside rank 1's ones
    for rank, (dtype, shape, local, ydtype, value) in enumerate(run_ranks(body, 3, timeout=60)):
        assert dtype == torch.float32 and ydtype == torch.float32 and shape == (2, 6)
        assert local == ((2, 3) if rank < 2 else (0, 0))
        torch.testing.assert_close(value, want)


@pytest.mark.parametrize("stats_sbp", [S(0), B], ids=str)
@pytest.mark.parametrize("x_sbp", [S(0), S(1), B], ids=str)
def test_an_op_updates_inputs_other_than_self_in_their_own_layout(x_sbp, stats_sbp):
    # native_batch_norm updates running_mean / running_var; with channel-split stats the op ran
    # on gathered copies and the update was lost
    xs = [gen(6, 4, seed=20 + k, dtype=torch.float32) * (k + 1) for k in range(2)]
    ref = torch.nn.BatchNorm1d(4)
    want = [ref(x) for x in xs]

    def body(rank):
        bn = torch.nn.BatchNorm1d(4)
        for name in ("running_mean", "running_var"):
            setattr(bn, name, make_global(getattr(bn, name), Layout(G2, (stats_sbp,), (4,)), rank))
        for name in ("weight", "bias"):
            full = getattr(bn, name).detach()
            setattr(bn, name, torch.nn.Parameter(make_global(full, Layout(G2, (B,), (4,)), rank)))
        outs = [bn(make_global(x, Layout(G2, (x_sbp,), x.shape), rank)).full_tensor().detach()
                for x in xs]
        return outs, bn.running_mean.full_tensor(), bn.running_var.full_tensor(), bn.running_mean.sbp

    for outs, mean, var, sbp in run_ranks(body, 2, timeout=60):
        for got, ref_out in zip(outs, want):
            torch.testing.assert_close(got, ref_out.detach())
        torch.testing.assert_close(mean, ref.running_mean)
        torch.testing.assert_close(var, ref.running_var)
        assert sbp == (stats_sbp,)


def _complex(*shape, seed):
    return torch.complex(gen(*shape, seed=seed), gen(*shape, seed=seed + 100))


CONJ = {
    "conj + 1": (lambda z: torch.conj(z) + 1, [_complex(5, 3, seed=30)]),
    "conj * w": (lambda z, w: torch.conj(z) * w, [_complex(5, 3, seed=31), _complex(5, 3, seed=32)]),
    "conj().sum(0)": (lambda z: torch.conj(z).sum(0), [_complex(5, 3, seed=33)]),
    "conj().t() @ w": (lambda z, w: torch.conj(z).t() @ w, [_complex(5, 3, seed=34), _complex(5, 2, seed=35)]),
    "neg of conj": (lambda z: -torch.conj(z) * 2, [_complex(5, 3, seed=36)]),
}


@pytest.mark.parametrize("name", CONJ)
def test_the_conjugate_bit_is_kept(name):
    # the wrapper dropped its piece's conjugate bit: ops below it saw the unconjugated values
    fn, inputs = CONJ[name]
    check(fn, inputs)


@pytest.mark.parametrize("grid, sbp", [(G2, (S(0),)), (G2, (B,)), (G2, (P,)), (G22, (S(1), B)),
                                       (G22, (P, S(0)))], ids=["S(0)", "B", "P", "(S(1),B)", "(P,S(0))"])
def test_full_tensor_is_the_identity_for_gradients(grid, sbp):
    # a loss computed from full_tensor() on every rank gave world_size times the gradient
    full = gen(5, 3, seed=40)

    def body(rank):
        x = make_global(full, Layout(grid, sbp, full.shape), rank).requires_grad_()
        (x.full_tensor() ** 2).sum().backward()
        return x.grad.full_tensor()

    for grad in run_ranks(body, grid.size, timeout=60):
        torch.testing.assert_close(grad, 2 * full)


@pytest.mark.parametrize("mode", [None, "floor", "trunc"])
def test_division_with_rounding_keeps_no_partial_sum(mode):
    # div(P, B, rounding_mode=...) kept P: floor(a / b) is not the sum of floor(part / b)
    check(lambda a, b: torch.div(a, b, rounding_mode=mode), [gen(4, 3, seed=41) * 10,
                                                             gen(4, 3, seed=42).abs() + 0.5],
          only=lambda sbps: any(v == P for sbp in sbps for v in sbp))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.bool])
@pytest.mark.parametrize("args", [(), (5,), (-3, 7)], ids=["default", "to", "from-to"])
def test_random_fill_draws_integers_in_torchs_range(dtype, args):
    if dtype == torch.bool and args:
        pytest.skip("a bool tensor takes only the default range")
    low, high = ((0, args[0]) if len(args) == 1 else args) if args else (0, None)

    def body(rank):
        gt.manual_seed(3)
        x = gt.zeros(64, 8, dtype=dtype, placement=G2, sbp=S(0))
        x.random_(*args)
        again = gt.zeros(64, 8, dtype=dtype, placement=G2, sbp=B)
        gt.manual_seed(3)
        again.random_(*args)
        return x.full_tensor(), again.full_tensor()

    for value, same in run_ranks(body, 2, timeout=60):
        assert torch.equal(value, same)  # the same values whatever the sbp
        assert value.to(torch.float64).min() >= low and len(value.unique()) > 1
        if dtype.is_floating_point:
            assert torch.equal(value, value.round())  # integers, as torch draws
        if high is not None:
            assert value.to(torch.float64).max() < high
        elif dtype == torch.float32:
            assert value.max() <= 2 ** 24


def test_a_cast_and_its_gradient_run_on_every_layout():
    # backward of .float() is a _to_copy with device=: its output shape came from a meta run
    # that tried to copy to the device (found by tests/ranks/ops/test_fuzz.py)
    check(lambda x: x.float().double() * 2, [gen(5, 3, seed=43)], atol=1e-5)


@pytest.mark.parametrize("grid, sbp", [(G2, (B,)), (G2, (S(0),)), (G2, (P,)), (G22, (S(1), B)),
                                       (G22, (B, P))], ids=["B", "S(0)", "P", "(S(1),B)", "(B,P)"])
@pytest.mark.parametrize("how", ["requires_grad_", "attribute", "factory"])
def test_a_leaf_gets_its_grad_in_its_own_layout(grid, sbp, how):
    # a B leaf outside a module got a P gradient (each rank a part of it)
    full, w = gen(5, 3, seed=44), gen(3, 2, seed=45)
    leaf = full.clone().requires_grad_()
    for _ in range(2):  # two backward passes accumulate
        (torch.tanh(leaf) @ w).sum().backward()

    def body(rank):
        x = make_global(full, Layout(grid, sbp, full.shape), rank)
        if how == "requires_grad_":
            x.requires_grad_()
        elif how == "attribute":
            x.requires_grad = True
        else:
            x = gt.tensor(full, placement=grid, sbp=sbp, requires_grad=True)
        wg = gt.tensor(w, placement=grid, sbp=[B] * grid.ndim)
        for _ in range(2):
            (torch.tanh(x) @ wg).sum().backward()
        return x.grad.sbp, x.grad.full_tensor()

    for got_sbp, grad in run_ranks(body, grid.size, timeout=60):
        assert got_sbp == sbp
        torch.testing.assert_close(grad, leaf.grad)


def test_an_op_that_rejects_an_empty_piece_runs_on_every_rank():
    # one output channel split over 2 ranks: rank 1's weight piece is empty and conv3d raises
    # there alone, while rank 0 went on to the next collective and waited
    check(lambda x, w: F.conv3d(x, w), [gen(2, 3, 3, 3, 3, seed=46), gen(1, 3, 2, 2, 2, seed=47)],
          grids=[G2], only=lambda sbps: sbps[1] == (S(0),))
    check(lambda x, w: F.conv2d(x, w), [gen(2, 3, 4, 4, seed=48), gen(1, 3, 2, 2, seed=49)],
          grids=[G22], only=lambda sbps: S(0) in sbps[1])


def test_a_sparse_tensor_is_refused_with_a_clear_error():
    def body(rank):
        try:
            torch.eye(3).to_sparse().to_global(placement=G2, sbp=B)
        except gt.GlobalTensorError as e:
            return str(e)

    for message in run_ranks(body, 2, timeout=60):
        assert "expects a dense (strided) tensor" in message and "to_dense" in message


@pytest.mark.parametrize("world", [2, 4])
def test_a_local_op_failing_on_one_rank_raises_the_same_error_on_every_rank(world):
    # gather with split indices: only the last rank's piece holds an index out of range. Every
    # rank must raise the same clear error at once, none may wait for the world's timeout (60 s)
    import time

    def body(rank):
        p = gt.placement("cpu", list(range(world)))
        x = gt.tensor(torch.arange(8.0).reshape(4, 2), placement=p, sbp=B)
        index = torch.tensor([[9] if rank == world - 1 else [rank % 4]])
        idx = index.to_global(placement=p, sbp=S(0))
        start = time.monotonic()
        try:
            y = x.gather(0, idx)
            (y * 2).full_tensor()
        except gt.GlobalTensorError as e:
            return type(e).__name__, str(e), time.monotonic() - start
        return None, "went on", 0.0

    results = run_ranks(body, world, timeout=60)
    cause = f"gather.default: the local computation failed on rank {world - 1} ("
    for name, message, elapsed in results:
        assert name == "LocalOpFailed", message
        assert message.startswith(cause) and "index 9 is out of bounds" in message, message
        assert elapsed < 20, elapsed


def test_an_executor_step_failing_on_one_rank_raises_at_once_on_every_rank(monkeypatch):
    # not a local op: the redistribution step's own code raises on rank 1 only (here a stand-in
    # for a bug or an allocation failure). The other ranks wait in that step's exchange: they
    # must learn the error at once, not after the world's timeout (60 s)
    import time

    from globaltensor.runtime import execute

    real = execute.gather_pairwise

    def flaky(step, local, coord, tag):
        if gt.env.get_rank() == 1:
            raise MemoryError("no room for the gathered piece")
        return real(step, local, coord, tag)

    monkeypatch.setattr(execute, "gather_pairwise", flaky)

    def body(rank):
        x = gt.tensor(torch.arange(6.0), placement=gt.placement("cpu", [0, 1]), sbp=S(0))
        start = time.monotonic()
        try:
            x.full_tensor()
        except gt.GlobalTensorError as e:
            return type(e).__name__, str(e), time.monotonic() - start
        return None, "went on", 0.0

    for name, message, elapsed in run_ranks(body, 2, timeout=60):
        assert name == "LocalOpFailed", message
        assert "failed on rank 1 (MemoryError: no room for the gathered piece)" in message
        assert "redistribution" in message and elapsed < 20, (message, elapsed)


def test_ranks_outside_the_placement_take_the_device_an_op_asks_for():
    # rank 2 outside [0, 1]: empty_like / zeros_like / full_like(device=...) of a meta tensor
    # (Module.to_empty's call) gave it a meta piece, so init on it returned early on rank 2 only
    def body(rank):
        p = gt.placement("cpu", [0, 1])
        x = torch.empty(4, 6, device="meta").to_global(placement=p, sbp=S(0))
        outs = (torch.empty_like(x, device="cpu"), torch.zeros_like(x, device="cpu"),
                torch.full_like(x, 2.0, device="cpu"), torch.empty_like(x))
        return [(o.to_local().device.type, o.device.type, tuple(o.to_local().shape)) for o in outs]
    for rank, outs in enumerate(run_ranks(body, 3, timeout=60)):
        piece = (4, 6) if rank < 2 else (0, 0)  # each member's (4, 6) is its piece
        assert outs[:3] == [("cpu", "cpu", piece)] * 3, rank
        assert outs[3] == ("meta", "meta", piece), rank  # no device asked: the input's


def test_a_rank_outside_the_placement_reads_bool_float_and_int_as_every_rank_does():
    # torch's own code branches on values (trunc_normal_'s `if not mask.any()`): every rank of
    # the world runs it, so every rank must get the value, not only the placement's
    def body(rank):
        p = gt.placement("cpu", [0, 1])
        x = torch.arange(4.0).to_global(placement=p, sbp=B).to_global(sbp=S(0))
        return bool((x > 2).any()), bool((x > 5).any()), float(x.sum()), int(x.max())
    for rank, got in enumerate(run_ranks(body, 3, timeout=60)):
        assert got == (True, False, 6.0, 3), rank
