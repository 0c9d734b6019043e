"""Views and shape ops on global tensors against torch, forward and backward, every sbp."""
import pytest
import torch

import globaltensor as gt

from helpers import check, gen

X46 = gen(4, 6)
X246 = gen(2, 4, 6)

SHAPES = {
    "view merge": (lambda x: x.view(24) * 2, [X46]),
    "reshape split": (lambda x: x.reshape(2, 2, 6) * 2, [X46]),
    "reshape uneven": (lambda x: x.reshape(5, 2, 3) + 1, [gen(5, 6)]),
    "flatten": (lambda x: x.flatten(1) * 2, [X246]),
    "unflatten": (lambda x: x.unflatten(1, (3, 2)) * 2, [X46]),
    "transpose": (lambda x: x.transpose(0, 1) * 2, [X46]),
    "transpose then view": (lambda x: x.transpose(0, 1).reshape(-1) * 2, [X46]),
    "permute": (lambda x: x.permute(2, 0, 1) * 2, [X246]),
    "t": (lambda x: x.t() * 2, [X46]),
    "squeeze unsqueeze": (lambda x: x.unsqueeze(1).squeeze(1) * 2, [X46]),
    "expand": (lambda x: x.unsqueeze(0).expand(3, 4, 6) * 2, [X46]),
    "expand size-1": (lambda x: x.expand(4, 6) * 2, [gen(4, 1)]),
    "contiguous": (lambda x: x.t().contiguous() * 2, [X46]),
    "slice": (lambda x: x[:, 1:5] * 2, [X46]),
    "slice rows": (lambda x: x[1:3] * 2, [X46]),
    "select": (lambda x: x[:, 2] * 2, [X46]),
    "narrow": (lambda x: x.narrow(1, 2, 3) * 2, [X46]),
    "cat": (lambda x, y: torch.cat([x, y], dim=1), [X46, gen(4, 2, seed=1)]),
    "cat dim0": (lambda x, y: torch.cat([x, y], dim=0), [X46, gen(2, 6, seed=1)]),
    "stack": (lambda x, y: torch.stack([x, y], dim=1), [X46, gen(4, 6, seed=1)]),
    "split": (lambda x: torch.split(x, [2, 4], dim=1)[1] * 2, [X46]),
    "chunk": (lambda x: x.chunk(2, dim=0)[1] * 2, [X46]),
    "unbind": (lambda x: x.unbind(1)[3] * 2, [X46]),
    "tril": (lambda x: torch.tril(x) * 2, [gen(2, 4, 4)]),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_shape_op(name):
    fn, inputs = SHAPES[name]
    check(fn, inputs)


def _global_like(t, x):
    """A full local tensor as a broadcast global tensor on ``x``'s placement."""
    return t.to_global(placement=x.placement, sbp=(gt.sbp.broadcast,) * x.placement.ndim)


def test_index_with_a_global_index():
    idx = torch.tensor([[3, 0], [0, 1]])

    def fn(x):
        return x[_global_like(idx, x) if x.is_global else idx] * 2
    check(fn, [X46])


def test_gather_and_scatter_add():
    idx = torch.tensor([[0, 5], [1, 1], [2, 3], [4, 0]])

    def fn(x, src):
        i = _global_like(idx, x) if x.is_global else idx
        return torch.gather(x, 1, i) * 2 + x.scatter_add(1, i, src)[:, :2]
    check(fn, [X46, gen(4, 2, seed=1)])


def test_index_select():
    idx = torch.tensor([3, 0, 0])

    def fn(x):
        i = _global_like(idx, x) if x.is_global else idx
        return torch.index_select(x, 1, i) * 2
    check(fn, [X46])
