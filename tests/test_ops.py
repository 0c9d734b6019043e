"""Operators on global tensors against torch on the full tensors, forward and backward, on real
gloo thread-ranks, for every sbp in {S(d), B, P}^axes of every input on grids [2] and [2, 2].

``check`` builds each input from its full value (a P input's pieces are unequal parts of it),
runs the op on global tensors, then compares the full output and the full gradients (for a
cotangent laid out with the output's dual sbp) with torch on the full tensors.
"""
import itertools

import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.layout import Layout
from globaltensor.sbp import PartialSum, Split
from globaltensor.tensor import GlobalTensor, dual_sbp
from globaltensor.testing import run_ranks

from test_rules import gen, piece

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
G2 = gt.placement("cpu", [0, 1])
G22 = gt.placement("cpu", [[0, 1], [2, 3]])
GRIDS = [G2, G22]


def make_global(full: torch.Tensor, layout: Layout, rank: int) -> GlobalTensor:
    coord = layout.placement.coord_of(rank)
    local = piece(full, layout, coord) if coord is not None else full.new_empty((0,) * full.dim())
    return GlobalTensor._make(local.contiguous(), layout)


def sbp_options(t: torch.Tensor, grid):
    one = [S(d) for d in range(t.dim())] + [B]
    if t.is_floating_point():
        one.append(P)
    return list(itertools.product(one, repeat=grid.ndim))


def combos(inputs, grid):
    """Every sbp of every input: the full product on a 1-D grid; on larger grids each input runs
    through all of its options while the others cycle through theirs."""
    options = [sbp_options(t, grid) for t in inputs]
    if grid.ndim == 1 or len(inputs) == 1:
        return list(itertools.product(*options))
    out = []
    for i, opts in enumerate(options):
        for k, mine in enumerate(opts):
            out.append(tuple(mine if j == i else options[j][(k + 3 * j) % len(options[j])]
                             for j in range(len(inputs))))
    return out


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def reference(fn, inputs, seed=7):
    leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = _first(fn(*leaves))
    cot = gen(*out.shape, seed=seed, dtype=out.dtype) if out.is_floating_point() else None
    grads = None
    if cot is not None and out.requires_grad:
        out.backward(cot)
        grads = [l.grad for l in leaves]
    return out.detach(), cot, grads


def run_global(fn, inputs, grid, sbps, cot, rank):
    xs = []
    for t, sbp in zip(inputs, sbps):
        x = make_global(t, Layout(grid, sbp, t.shape), rank)
        xs.append(x.requires_grad_() if t.is_floating_point() else x)
    out = _first(fn(*xs))
    full = out.full_tensor()
    grads = None
    if cot is not None and out.requires_grad:
        out.backward(make_global(cot, Layout(grid, dual_sbp(out.sbp), cot.shape), rank))
        grads = [x.grad.full_tensor() if x.grad is not None else None for x in xs]
    return full, grads, out.sbp


def check(fn, inputs, grids=GRIDS, atol=1e-6, only=None, timeout=120):
    """Compare ``fn`` on global tensors with ``fn`` on the full ``inputs`` for every layout."""
    ref_out, cot, ref_grads = reference(fn, inputs)
    for grid in grids:
        cases = [c for c in combos(inputs, grid) if only is None or only(c)]

        def body(rank):
            errors = []
            for sbps in cases:
                try:
                    full, grads, out_sbp = run_global(fn, inputs, grid, sbps, cot, rank)
                except Exception as e:  # noqa: BLE001 - reported with the layout
                    errors.append(f"{sbps}: {type(e).__name__}: {e}")
                    break
                what = f"in {gt.sbp.format_sbp(sbps[0]) if len(sbps) == 1 else sbps} -> {out_sbp}"
                if not torch.allclose(full.to(ref_out.dtype), ref_out, atol=atol, rtol=1e-5):
                    errors.append(f"forward differs for {what}")
                if ref_grads is not None:
                    for i, (g, r) in enumerate(zip(grads, ref_grads)):
                        if r is not None and (g is None or not torch.allclose(g, r, atol=atol, rtol=1e-5)):
                            errors.append(f"grad of input {i} differs for {what}")
            return errors

        results = run_ranks(body, grid.size, timeout=timeout)
        assert results[0] == [], "\n".join(results[0][:10])
    return ref_out


# ----------------------------------------------------------------------------- pointwise

X46, Y46 = gen(4, 6), gen(4, 6, seed=1)

POINTWISE = {
    "add": (lambda x, y: x + y, [X46, Y46]),
    "sub broadcast": (lambda x, y: x - y, [X46, gen(6, seed=1)]),
    "mul": (lambda x, y: x * y, [X46, Y46]),
    "div": (lambda x, y: x / y, [X46, Y46.abs() + 1]),
    "scalar ops": (lambda x: (x * 3 + 1) / 2 - 0.5, [X46]),
    "relu exp tanh": (lambda x: torch.relu(x).exp() + torch.tanh(x), [X46]),
    "gelu sigmoid": (lambda x: F.gelu(x) * torch.sigmoid(x), [X46]),
    "where gt": (lambda x, y: torch.where(x > y, x, y * 2), [X46, Y46]),
    "pow sqrt": (lambda x: (x * x + 1).sqrt() ** 1.5, [X46]),
}


@pytest.mark.parametrize("name", list(POINTWISE))
def test_pointwise(name):
    fn, inputs = POINTWISE[name]
    check(fn, inputs)


def test_uneven_pointwise():
    check(lambda x, y: x * y + x, [gen(5, 3), gen(5, 3, seed=1)])


# ----------------------------------------------------------------------------- matmul

MATMUL = {
    "mm": (lambda x, w: x @ w, [gen(4, 6), gen(6, 8, seed=1)]),
    "mm uneven": (lambda x, w: x @ w, [gen(5, 3), gen(3, 5, seed=1)]),
    "bmm": (lambda x, w: torch.bmm(x, w), [gen(2, 4, 6), gen(2, 6, 4, seed=1)]),
    "matmul 3d@2d": (lambda x, w: torch.matmul(x, w), [gen(2, 4, 6), gen(6, 4, seed=1)]),
    "linear": (lambda x, w, b: F.linear(x, w, b), [gen(4, 6), gen(8, 6, seed=1), gen(8, seed=2)]),
    "einsum": (lambda x, w: torch.einsum("bij,jk->bik", x, w), [gen(2, 4, 6), gen(6, 4, seed=1)]),
}


@pytest.mark.parametrize("name", list(MATMUL))
def test_matmul(name):
    fn, inputs = MATMUL[name]
    check(fn, inputs, atol=1e-5)


# ----------------------------------------------------------------------------- reductions

REDUCTIONS = {
    "sum": (lambda x: x.sum(), [X46]),
    "sum dim": (lambda x: x.sum(0), [X46]),
    "sum keepdim": (lambda x: x.sum(1, keepdim=True), [X46]),
    "mean": (lambda x: x.mean(), [X46]),
    "mean dim": (lambda x: x.mean(dim=1), [gen(5, 3)]),
    "max": (lambda x: x.amax(dim=1), [X46]),
    "max dim": (lambda x: x.max(dim=0).values, [X46]),
    "min": (lambda x: x.min(), [X46]),
    "argmax": (lambda x: x.argmax(dim=1), [X46]),
    "norm": (lambda x: x.norm(dim=1), [X46]),
    "var": (lambda x: x.var(dim=0), [X46]),
}


@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_reduction(name):
    fn, inputs = REDUCTIONS[name]
    check(fn, inputs)


def test_sum_over_split_dim_is_partial_and_free():
    def body(rank):
        x = make_global(X46, Layout(G2, (S(0),), X46.shape), rank)
        y = x.sum(0)
        return y.sbp, y.full_tensor()

    out = run_ranks(body, 2, timeout=30)
    assert out[0][0] == (P,)
    torch.testing.assert_close(out[0][1], X46.sum(0))


# ----------------------------------------------------------------------------- softmax

SOFTMAX = {
    "softmax": (lambda x: torch.softmax(x, dim=1), [X46]),
    "log_softmax": (lambda x: torch.log_softmax(x, dim=0), [X46]),
}


@pytest.mark.parametrize("name", list(SOFTMAX))
def test_softmax(name):
    fn, inputs = SOFTMAX[name]
    check(fn, inputs)
