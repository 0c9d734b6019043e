"""Operators on global tensors against torch on the full tensors, forward and backward, on real
gloo thread-ranks, for every sbp in {S(d), B, P}^axes of every input on grids [2] and [2, 2].

``check`` (in helpers) builds each input from its full value (a P input's pieces are unequal
parts of it), runs the op on global tensors, then compares the full output and the full
gradients (for a cotangent laid out with the output's dual sbp) with torch on the full tensors.
"""
import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.layout import Layout
from globaltensor.testing import run_ranks

from helpers import G2, check, gen, make_global

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


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


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "einsum" else n
                                  for n in MATMUL])  # einsum: matmul 3d@2d's decomposition (suite time)
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
