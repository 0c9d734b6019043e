"""What a port of OneFlow's global-tensor tests found, and two smaller gaps, on thread-ranks against the full tensors: full_tensor() never aliases, torch.save's
message, the factories OneFlow has (linspace, logspace, eye, randperm, normal, hann_window),
rrelu in training, module.to_global / to_local round trips, x.new(), and a view of a tensor
split twice on one dim that moves nothing."""
import io

import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.errors import GlobalTensorError
from globaltensor.testing import RankFailed, run_ranks

from helpers import gen

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
G2 = gt.placement("cpu", [0, 1])
P4 = gt.placement("cpu", [0, 1, 2, 3])
G22 = gt.placement("cpu", [[0, 1], [2, 3]])
# 1-D and 2x2 grids, even and uneven splits (sizes 7 and 10 over 2, 3 and 4 pieces)
LAYOUTS_1D = [(G2, (B,)), (G2, (S(0),)), (P4, (S(0),)), (P4, (B,)), (G22, (S(0), S(0))),
              (G22, (B, S(0))), (G22, (S(0), B)), (G22, (B, B))]


# ------------------------------------------------------------------------- item 6: full_tensor


@pytest.mark.parametrize("placement,sbp", [(G2, (B,)), (G22, (B, B)), (G2, (S(0),)),
                                           (G22, (S(0), B)), (G2, (P,))])
def test_full_tensor_is_a_snapshot_never_an_alias(placement, sbp):
    def body(rank):
        out = []
        for context in (torch.enable_grad, torch.no_grad, torch.inference_mode):
            with context():
                x = gt.tensor(torch.arange(4.0), placement=placement, sbp=sbp)
                snap = x.full_tensor()
                x.mul_(10)                        # a write to the global tensor ...
                first = snap.clone()
                snap.add_(1)                      # ... and to the snapshot
                out.append((first, x.full_tensor(), type(snap)))
        return out

    for results in run_ranks(body, 4, timeout=60):
        for first, after, kind in results:
            assert torch.equal(first, torch.arange(4.0))
            assert torch.equal(after, torch.arange(4.0) * 10)
            assert kind is torch.Tensor


def test_a_gradient_snapshot_is_unchanged_by_clip_grad_norm():
    w_full, x_full = gen(3, 4, seed=1), gen(5, 3, seed=2)

    def body(rank):
        w = torch.nn.Parameter(gt.tensor(w_full, placement=G22, sbp=(B, B)))
        x = gt.tensor(x_full, placement=G22, sbp=(S(0), B))
        (x @ w).pow(2).sum().backward()
        snap = w.grad.full_tensor()
        before = snap.clone()
        torch.nn.utils.clip_grad_norm_([w], max_norm=0.01)
        return before, snap, w.grad.full_tensor()

    w = w_full.clone().requires_grad_()
    (x_full @ w).pow(2).sum().backward()
    for before, snap, clipped in run_ranks(body, 4, timeout=60):
        torch.testing.assert_close(before, w.grad)
        assert torch.equal(snap, before)                    # the snapshot did not move
        torch.testing.assert_close(clipped.norm(), torch.tensor(0.01, dtype=clipped.dtype))


def test_torch_save_of_a_global_state_dict_names_the_ways_to_save():
    def body(rank):
        model = torch.nn.Linear(4, 2).to_global(G2, S(0))
        try:
            torch.save(model.state_dict(), io.BytesIO())
        except GlobalTensorError as e:
            return str(e)
        return None

    for message in run_ranks(body, 2, timeout=60):
        for name in ("gt.checkpoint.save", "dcp.save", "dcp_to_torch_save", "full_tensor()",
                     "torch.save"):
            assert name in message, message


# ------------------------------------------------------------------------- item 7: factories


def _fulls_per_layout(make, layouts=LAYOUTS_1D, seed=None):
    """On 4 ranks, the full value of ``make(placement, sbp)`` for each layout, and its sbp."""
    def body(rank):
        out = []
        for placement, sbp in layouts:
            if seed is not None:
                gt.manual_seed(seed)
            x = make(placement, sbp)
            out.append((x.full_tensor(), x.sbp, x.dtype, x.requires_grad))
        return out

    results = run_ranks(body, 4, timeout=120)
    for r in results[1:]:
        for (a, *_), (b, *_) in zip(results[0], r):
            assert torch.equal(a, b)
    for (value, sbp, _, _), (_, want) in zip(results[0], layouts):
        assert sbp == want
    return results[0]


@pytest.mark.parametrize("name,make,expected,rtol", [
    ("linspace", lambda p, s: gt.linspace(-2, 3, 10, placement=p, sbp=s),
     torch.linspace(-2, 3, 10), 0),
    ("linspace float64", lambda p, s: gt.linspace(0.1, 7.3, 7, placement=p, sbp=s, dtype=torch.float64),
     torch.linspace(0.1, 7.3, 7, dtype=torch.float64), 0),
    ("linspace int", lambda p, s: gt.linspace(0, 20, 7, placement=p, sbp=s, dtype=torch.int64),
     torch.linspace(0, 20, 7, dtype=torch.int64), 0),
    ("linspace one step", lambda p, s: gt.linspace(4, 9, 1, placement=p, sbp=s),
     torch.linspace(4, 9, 1), 0),
    ("logspace", lambda p, s: gt.logspace(-2, 3, 10, placement=p, sbp=s),
     torch.logspace(-2, 3, 10), 1e-5),
    ("logspace base 2", lambda p, s: gt.logspace(0, 6, 7, base=2, placement=p, sbp=s, dtype=torch.float64),
     torch.logspace(0, 6, 7, base=2, dtype=torch.float64), 1e-12),
    ("hann", lambda p, s: gt.hann_window(10, placement=p, sbp=s), torch.hann_window(10), 1e-5),
    ("hann symmetric", lambda p, s: gt.hann_window(7, periodic=False, placement=p, sbp=s,
                                                   dtype=torch.float64),
     torch.hann_window(7, periodic=False, dtype=torch.float64), 1e-12),
    ("hann one", lambda p, s: gt.hann_window(1, placement=p, sbp=s), torch.hann_window(1), 0),
])
def test_deterministic_factories_are_torchs_values_whatever_the_layout(name, make, expected, rtol):
    for value, _, dtype, _ in _fulls_per_layout(make):
        assert dtype == expected.dtype
        torch.testing.assert_close(value, expected, rtol=rtol, atol=1e-6 if rtol else 0)


EYE_LAYOUTS = [(G2, (S(0),)), (G2, (S(1),)), (P4, (S(1),)), (G22, (S(0), S(1))),
               (G22, (S(1), S(1))), (G22, (B, S(0))), (G22, (B, B))]


@pytest.mark.parametrize("n,m", [(5, None), (3, 7), (6, 2)])
def test_eye_whatever_the_layout(n, m):
    results = _fulls_per_layout(lambda p, s: gt.eye(n, m, placement=p, sbp=s, dtype=torch.float64,
                                                    requires_grad=True), EYE_LAYOUTS)
    for value, _, dtype, requires_grad in results:
        expected = torch.eye(n, m if m is not None else n, dtype=torch.float64)
        assert torch.equal(value.detach(), expected) and requires_grad


def test_eye_on_a_partial_layout_sums_to_the_identity():
    results = _fulls_per_layout(lambda p, s: gt.eye(4, placement=p, sbp=s), [(G22, (P, S(0)))])
    assert torch.equal(results[0][0], torch.eye(4))


def test_randperm_is_one_permutation_whatever_the_layout():
    results = _fulls_per_layout(lambda p, s: gt.randperm(10, placement=p, sbp=s), seed=5)
    perm = results[0][0]
    assert results[0][2] == torch.int64
    assert torch.equal(perm.sort().values, torch.arange(10))
    assert not torch.equal(perm, torch.arange(10))
    other = _fulls_per_layout(lambda p, s: gt.randperm(10, placement=p, sbp=s), seed=6)[0][0]
    assert not torch.equal(other, perm)                                   # another seed
    big = _fulls_per_layout(lambda p, s: gt.randperm(1000, placement=p, sbp=s, dtype=torch.int32),
                            LAYOUTS_1D[:3], seed=5)[0][0]
    assert big.dtype == torch.int32 and torch.equal(big.sort().values, torch.arange(1000, dtype=torch.int32))


def test_normal_is_the_same_whatever_the_layout_and_plausible():
    layouts = [(G2, (S(0),)), (G22, (S(0), S(1))), (G22, (S(1), B)), (P4, (S(1),)), (G2, (B,))]
    results = _fulls_per_layout(lambda p, s: gt.normal(3.0, 2.0, (101, 40), placement=p, sbp=s),
                                layouts, seed=11)
    value = results[0][0]
    assert value.shape == (101, 40) and value.dtype == torch.float32
    assert abs(value.mean().item() - 3.0) < 0.15 and abs(value.std().item() - 2.0) < 0.15
    again = _fulls_per_layout(lambda p, s: gt.normal(3.0, 2.0, (101, 40), placement=p, sbp=s),
                              layouts[:1], seed=12)[0][0]
    assert not torch.equal(again, value)


@pytest.mark.parametrize("call,match", [
    (lambda: gt.linspace(0, 1, -1, placement=G2, sbp=S(0)), "non-negative int"),
    (lambda: gt.hann_window(4, placement=G2, sbp=S(0), dtype=torch.int64), "floating point"),
    (lambda: gt.normal(0.0, -1.0, (3,), placement=G2, sbp=S(0)), "std >= 0"),
    (lambda: gt.randperm(4, placement=G2, sbp=S(0), requires_grad=True), "requires_grad"),
    (lambda: gt.eye(3, placement=G2), "placement= and sbp="),
])
def test_bad_factory_arguments_are_clear_errors_on_every_rank(call, match):
    def body(rank):
        with pytest.raises(GlobalTensorError, match=match):
            call()
        return True

    assert run_ranks(body, 2, timeout=30) == [True, True]


# ------------------------------------------------------------------------- item 7: rrelu


def test_rrelu_in_training_is_the_same_whatever_the_layout_and_its_backward_works():
    full = gen(5, 6, seed=3)
    layouts = [(G22, (B, B)), (G22, (S(0), S(1))), (G22, (S(1), S(0))), (G22, (S(0), S(0))),
               (G2, (S(1),)), (P4, (S(0),))]

    def body(rank):
        out = []
        for placement, sbp in layouts:
            x = gt.tensor(full, placement=placement, sbp=sbp, requires_grad=True)
            gt.manual_seed(3)
            y = F.rrelu(x, lower=0.1, upper=0.3, training=True)
            y.backward(gt.tensor(torch.ones(5, 6, dtype=full.dtype), placement=placement,
                                 sbp=sbp))
            out.append((y.full_tensor().detach(), x.grad.full_tensor(), y.sbp))
            gt.manual_seed(3)
        return out

    results = run_ranks(body, 4, timeout=120)
    y0, g0, _ = results[0][0]
    for r in results:
        for (y, g, sbp), (_, want) in zip(r, layouts):
            assert torch.equal(y, y0) and torch.equal(g, g0) and sbp == want
    negative = full <= 0
    slope = y0 / full
    assert torch.all((slope[negative] >= 0.1) & (slope[negative] <= 0.3))
    assert slope[negative].std() > 0                      # random slopes, not one value
    assert torch.equal(y0[~negative], full[~negative])
    torch.testing.assert_close(g0[negative], slope[negative])   # d(x r)/dx = r
    assert torch.all(g0[~negative] == 1)


def test_rrelu_in_eval_is_torchs():
    full = gen(4, 6, seed=4)

    def body(rank):
        x = gt.tensor(full, placement=G22, sbp=(S(0), S(1)))
        return F.rrelu(x, training=False).full_tensor()

    for value in run_ranks(body, 4, timeout=60):
        torch.testing.assert_close(value, F.rrelu(full, training=False))


# ------------------------------------------------------------------------- item 7: modules


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(6, 8, generator=g, dtype=torch.float64))
        self.w2 = torch.nn.Parameter(torch.randn(8, 3, generator=g, dtype=torch.float64))
        self.register_buffer("scale", torch.arange(1.0, 4.0, dtype=torch.float64))

    def forward(self, x):
        return torch.relu(x @ self.w1) @ self.w2 * self.scale


def tp(name, t):
    return {"w1": (B, S(1)), "w2": (B, S(0)), "scale": (S(0), B)}[name]


def test_module_to_global_again_lays_out_anew_and_to_local_gives_pieces_that_round_trip():
    ref_net = Net()
    x_full = gen(4, 6, seed=9)
    ref = ref_net(x_full).detach()
    ref_state = {k: v.detach() for k, v in ref_net.state_dict().items()}

    def body(rank):
        net = Net().to_global(G22, tp)
        x = gt.tensor(x_full, placement=G22, sbp=(S(0), B))
        net.to_global(G22, lambda name, t: (S(0), B) if name == "w1" else (B, B))  # anew
        relaid = {k: (v.sbp, v.full_tensor()) for k, v in net.state_dict().items()}
        out_relaid = net(x).full_tensor()
        net.to_global(G22, tp)
        pieces_expected = {k: v.to_local().clone() for k, v in net.state_dict().items()}
        net.to_local()                                          # each tensor its piece
        pieces = {k: (type(v), v.clone()) for k, v in net.state_dict().items()}
        kinds = (type(net.w1), type(net.scale))
        net.to_global(G22, tp)                                  # the pieces, global again
        back = {k: (v.sbp, v.full_tensor()) for k, v in net.state_dict().items()}
        out_back = net(x).full_tensor()
        net.to_local()
        net.to_global(G22, (B, B))                              # pieces laid out otherwise
        other = {k: (v.sbp, v.full_tensor()) for k, v in net.state_dict().items()}
        return relaid, out_relaid, pieces_expected, pieces, kinds, back, out_back, other

    for relaid, out_relaid, expected, pieces, kinds, back, out_back, other in run_ranks(
            body, 4, timeout=120):
        assert relaid["w1"][0] == (S(0), B) and relaid["w2"][0] == (B, B)
        for state in (relaid, back, other):
            for k, v in ref_state.items():
                assert torch.equal(state[k][1], v), k
        torch.testing.assert_close(out_relaid, ref)
        torch.testing.assert_close(out_back, ref)
        assert {k: v[0] for k, v in back.items()} == {"w1": (B, S(1)), "w2": (B, S(0)),
                                                       "scale": (S(0), B)}
        assert all(v[0] == (B, B) for v in other.values())
        for k, (kind, piece) in pieces.items():
            assert kind is torch.Tensor and torch.equal(piece, expected[k]), k
        assert pieces["w1"][1].shape == (6, 4) and pieces["scale"][1].shape in ((2,), (1,))
        assert kinds == (torch.nn.Parameter, torch.Tensor)


def test_to_global_after_to_local_with_pieces_of_a_new_shape_is_a_clear_error():
    def body(rank):
        net = Net().to_global(G2, tp_1d).to_local()
        net.w1 = torch.nn.Parameter(torch.zeros(6, 8, dtype=torch.float64))   # a full value
        net.to_global(G2, tp_1d)

    with pytest.raises(RankFailed, match="module.to_local\\(\\)"):
        run_ranks(body, 2, timeout=30)


def tp_1d(name, t):
    return {"w1": S(1), "w2": S(0), "scale": S(0)}[name]


# ------------------------------------------------------------------------- item 7: x.new()


def test_new_without_arguments_is_an_empty_global_tensor():
    def body(rank):
        x = gt.ones(4, 2, placement=G22, sbp=(S(0), B), dtype=torch.float64)
        e = x.new()
        return tuple(e.shape), e.dtype, e.sbp, e.full_tensor().shape, tuple(x.new(3).shape)

    for shape, dtype, sbp, full_shape, sized in run_ranks(body, 4, timeout=60):
        assert shape == (0,) == tuple(torch.ones(4, 2).new().shape) and full_shape == (0,)
        assert dtype == torch.float64 and sbp == (B, B) and sized == (3,)


# ------------------------------------------------------------------------- item 7: views


def test_a_view_of_a_dim_split_twice_moves_nothing_and_its_backward_neither():
    full = gen(8, 4, seed=5)

    def body(rank):
        x = gt.tensor(full, placement=G22, sbp=(S(0), S(0)), requires_grad=True)
        with gt.comm_trace() as forward:
            y = x.view(2, 4, 4)
        cot = gt.tensor(gen(2, 4, 4, seed=6), placement=G22, sbp=(S(0), S(1)))
        with gt.comm_trace() as backward:
            y.backward(cot)
        z = x.detach().reshape(2, 4, 4)
        return (y.sbp, y.full_tensor().detach(), len(forward), len(backward), x.grad.sbp,
                x.grad.full_tensor(), z.sbp, y.to_local().shape)

    for sbp, value, moves, back_moves, grad_sbp, grad, z_sbp, local in run_ranks(body, 4, timeout=60):
        assert sbp == (S(0), S(1)) and z_sbp == (S(0), S(1)) and local == (1, 2, 4)
        assert torch.equal(value, full.view(2, 4, 4))
        assert moves == 0 and back_moves == 0
        assert grad_sbp == (S(0), S(0)) and torch.equal(grad, gen(2, 4, 4, seed=6).view(8, 4))
