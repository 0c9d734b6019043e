"""to_global on global tensors through the user API: values, identity, explain, and gradients
compared with single-process autograd (real gloo, thread ranks)."""
import itertools

import pytest
import torch

import globaltensor as gt
from globaltensor.layout import Layout
from globaltensor.testing import run_ranks

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
P2 = gt.placement("cpu", [0, 1])
G22 = gt.placement("cpu", [[0, 1], [2, 3]])
ONE_D = [S(0), S(1), B, P]


def _replicas(layout: Layout, coord) -> int:
    """How many ranks hold the same piece as ``coord`` (broadcast axes only)."""
    n = 1
    for axis, v in enumerate(layout.sbp):
        if v == B:
            n *= layout.placement.shape[axis]
    return n


def _assemble(pieces, layout: Layout):
    full = torch.zeros(layout.shape, dtype=torch.float64)
    for coord in layout.placement.coords():
        piece = pieces[layout.placement.rank_at(coord)]
        full[layout.slices(coord)] += piece / _replicas(layout, coord)
    return full


def _data(shape):
    """The same full value and weight on every thread-rank (torch's global RNG is shared)."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(shape, dtype=torch.float64, generator=g),
            torch.randn(shape, dtype=torch.float64, generator=g))


def _grad_check(rank, pairs, placement, shape):
    """For each (src, dst): loss = sum(y * W) with y = x.to_global(dst); x.grad must equal W."""
    full, weight = _data(shape)
    out = []
    for src, dst in pairs:
        x = gt.tensor(full, placement=placement, sbp=src, requires_grad=True)
        y = x.to_global(sbp=dst)
        coord = placement.coord_of(rank)
        box = y._layout.slices(coord)
        value = y.to_local()
        scale = 1.0 / _replicas(y._layout, coord)
        (value * weight[box] * scale).sum().backward()
        out.append((value.detach().clone(), y._layout, x.grad.to_local().clone(), x.grad._layout))
    return out


@pytest.mark.parametrize("shape", [(4, 6), (5, 3)])
def test_every_1d_pair_value_and_gradient(shape):
    pairs = list(itertools.product(ONE_D, repeat=2))
    out = run_ranks(_grad_check, 2, pairs, P2, shape, timeout=60)
    full, weight = _data(shape)
    for i, (src, dst) in enumerate(pairs):
        _, y_layout, _, g_layout = out[0][i]
        value = _assemble([out[r][i][0] for r in range(2)], y_layout)
        grad = _assemble([out[r][i][2] for r in range(2)], g_layout)
        assert torch.allclose(value, full), (src, dst)
        assert torch.allclose(grad, weight), (src, dst, g_layout.sbp)


def test_2d_pairs_value_and_gradient():
    pairs = [((S(0), S(1)), (B, B)), ((B, B), (S(0), S(1))), ((P, S(0)), (S(1), B)),
             ((S(0), S(0)), (S(1), S(1))), ((P, P), (B, S(1))), ((B, S(1)), (P, S(0)))]
    out = run_ranks(_grad_check, 4, pairs, G22, (5, 6), timeout=60)
    full, weight = _data((5, 6))
    for i, pair in enumerate(pairs):
        _, y_layout, _, g_layout = out[0][i]
        assert torch.allclose(_assemble([out[r][i][0] for r in range(4)], y_layout), full), pair
        assert torch.allclose(_assemble([out[r][i][2] for r in range(4)], g_layout), weight), pair


def test_grad_sbp_fixes_the_gradient_layout():
    def body(rank):
        x = gt.ones(4, 2, placement=P2, sbp=B, requires_grad=True)
        y = x.to_global(sbp=S(0), grad_sbp=B)
        y.to_local().sum().backward()
        return x.grad.sbp, x.grad.to_local().tolist()

    out = run_ranks(body, 2, timeout=30)
    assert [o[0] for o in out] == [(B,), (B,)]
    assert out[0][1] == [[1.0, 1.0]] * 4


def test_default_dual_gradient_sbp():
    def body(rank):
        x = gt.ones(4, placement=P2, sbp=B, requires_grad=True)
        arriving = []
        x.register_hook(lambda g: arriving.append((g.sbp, g.to_local().tolist())))
        x.to_global(sbp=S(0)).to_local().sum().backward()   # B -> S forward is a local slice
        return arriving[0], x.grad.sbp, x.grad.to_local().tolist()

    out = run_ranks(body, 2, timeout=30)
    assert [o[0][0] for o in out] == [(P,), (P,)]         # ... and S -> P backward a zero-fill
    assert [sum(v) for v in zip(out[0][0][1], out[1][0][1])] == [1.0] * 4
    # the leaf's .grad then takes the leaf's own sbp (SPEC): the partial sums, summed
    assert [o[1] for o in out] == [(B,), (B,)] and out[0][2] == out[1][2] == [1.0] * 4


def test_same_layout_is_same_object_and_explain_and_visualize():
    def body(rank):
        x = gt.arange(8, placement=P2, sbp=S(0))
        e = gt.explain(x, sbp=B)
        return (x.to_global(sbp=S(0)) is x, x.to_global(placement=P2) is x, e.collectives,
                e.bytes_per_rank, "all_gather" in str(e), "rank 1 at (1,): [4:8]" in gt.visualize(x),
                x.to_global(sbp=B).tolist(), x.to_global(sbp=S(0), copy=True) is not x)

    out = run_ranks(body, 2, timeout=30)
    assert out[0] == (True, True, 1, 32, True, True, list(range(8)), True)


def test_full_tensor_item_numpy_and_print_reach_every_rank():
    def body(rank):
        x = gt.arange(6, placement=gt.placement("cpu", [1, 2]), sbp=S(0))
        s = gt.tensor(3.5, placement=gt.placement("cpu", [2]), sbp=B)
        return x.full_tensor().tolist(), x.numpy().tolist(), s.item(), str(x)

    out = run_ranks(body, 3, timeout=30)
    for full, arr, item, text in out:
        assert full == arr == list(range(6)) and item == 3.5
        assert text.startswith("GlobalTensor([0, 1, 2, 3, 4, 5]") and "S(0)" in text


@pytest.mark.parametrize("src_ranks, dst_ranks", [([0, 1], [2, 3]), ([0, 1, 2], [1, 3]),
                                                  ([0], [0, 1, 2, 3]), ([[0, 1], [2, 3]], [3, 1])])
def test_placement_change_through_to_global(src_ranks, dst_ranks):
    src_p, dst_p = gt.placement("cpu", src_ranks), gt.placement("cpu", dst_ranks)
    full = torch.arange(35.).reshape(5, 7)

    def body(rank):
        src_sbp = (S(0),) * src_p.ndim
        x = gt.tensor(full, placement=src_p, sbp=src_sbp)
        y = x.to_global(placement=dst_p, sbp=(S(1),) * dst_p.ndim)
        return y.placement, y.sbp, y.full_tensor()

    for placement, sbp, value in run_ranks(body, 4, timeout=30):
        assert placement == dst_p and torch.equal(value, full)
