"""The view rule against the full tensors, exhaustively on small shapes: every view between
regroupings of a few sizes, every input layout (B and splits) on [2] and [2, 2] grids.

- Sound: every candidate the rule accepts, run with the rule's own size rewrite on every
  coordinate's piece, assembles to the view of the full tensor.
- Complete: when some output layout exists whose pieces are the local views of the input's
  pieces (found by brute force over every output sbp), the choice moves nothing (an input
  that splits a dim of size 1 aside: its empty pieces match about anything).
- The nested case of OneFlow's tests: (8, 4) as (S(0), S(0)) viewed as (2, 4, 4) is
  (S(0), S(1)), and back.
"""
import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from globaltensor import ops
from globaltensor.layout import Layout
from globaltensor.ops import B, S, Call, Ref, choose
from globaltensor.ops.views import rewrite_view

from helpers import G2, G22


def make_call(op, args):
    """The Call dispatch builds for ``view(x, size)``."""
    x, size = args
    return Call(op, (tuple(x.shape),), (Ref(0), tuple(size)))


def factorizations(n: int, parts: int):
    """Ordered factorizations of ``n`` into ``parts`` factors > 1."""
    if parts == 1:
        return [(n,)] if n > 1 else []
    out = []
    for f in range(2, n + 1):
        if n % f == 0:
            out += [(f,) + rest for rest in factorizations(n // f, parts - 1)]
    return out


def shapes_of(n: int):
    return [s for parts in (1, 2, 3) for s in factorizations(n, parts)]


# every pair of regroupings of 8, 12 and 16 elements, plus views with size-1 dims and a
# trailing dim the view keeps
PAIRS = [(a, b) for n in (8, 12, 16) for a in shapes_of(n) for b in shapes_of(n) if a != b]
PAIRS += [((8, 4), (2, 4, 4)), ((2, 4, 4), (8, 4)), ((8, 1, 3), (2, 4, 3)), ((4, 6), (4, 1, 6)),
          ((6, 4), (2, 3, 4)), ((5, 6), (5, 2, 3)), ((12,), (3, 4)), ((3, 4), (12,))]


def sbp_choices(ndim: int, grid):
    one = [B] + [S(d) for d in range(ndim)]
    return list(itertools.product(one, repeat=grid.ndim))


def run_view(full: torch.Tensor, in_layout: Layout, out_layout: Layout) -> torch.Tensor:
    """Each coordinate's piece viewed with the rule's size rewrite, assembled."""
    decision = SimpleNamespace(outs=SimpleNamespace(layout=out_layout), targets=(in_layout,))
    out = torch.full(out_layout.shape, float("nan"), dtype=full.dtype)
    for coord in in_layout.placement.coords():
        piece = full[in_layout.slices(coord)].clone()
        largs = [piece, list(out_layout.shape)]
        rewrite_view(decision, largs, [piece])
        local = largs[0].view(largs[1])
        assert tuple(local.shape) == out_layout.local_shape(coord), (in_layout, out_layout, coord)
        out[out_layout.slices(coord)] = local
    return out


def pieces_match(full: torch.Tensor, in_layout: Layout, out_layout: Layout) -> bool:
    """Brute force: every coordinate's input piece, viewed as its output piece's shape, is it."""
    viewed = full.reshape(out_layout.shape)
    for coord in in_layout.placement.coords():
        mine = full[in_layout.slices(coord)].contiguous()
        want = viewed[out_layout.slices(coord)]
        if mine.numel() != want.numel() or not torch.equal(mine.reshape(want.shape), want):
            return False
    return True


@pytest.mark.parametrize("grid", [G2, G22], ids=["[2]", "[2,2]"])
def test_every_accepted_view_is_the_full_view_and_no_free_view_is_missed(grid):
    checked = free = 0
    for src, dst in PAIRS:
        full = torch.arange(math.prod(src), dtype=torch.float64).reshape(src)
        expected = full.reshape(dst)
        call = make_call("view.default", [full, list(dst)])
        rule = ops.rows_for(call)
        for sbp_in in sbp_choices(len(src), grid):
            in_layout = Layout(grid, sbp_in, src)
            accepted = []
            for combo in itertools.product(rule.rows, repeat=grid.ndim):
                if tuple(r.ins[0] for r in combo) != sbp_in:
                    continue
                outs = ops.outs_of(combo)
                if rule.check(call, grid.shape, [sbp_in], outs):
                    accepted.append(outs[0])
            for sbp_out in accepted:
                out_layout = Layout(grid, sbp_out, dst)
                got = run_view(full, in_layout, out_layout)
                assert torch.equal(got, expected), (src, dst, sbp_in, sbp_out)
                checked += 1
            if any(v != B and src[v.dim] == 1 for v in sbp_in):
                continue  # a size-1 dim split: empty pieces match about anything
            possible = [o for o in sbp_choices(len(dst), grid)
                        if pieces_match(full, in_layout, Layout(grid, o, dst))]
            choice = choose(call, (in_layout,), (8,))
            if possible:
                free += 1
                assert choice.ins == (in_layout,), (src, dst, sbp_in, possible, choice)
                assert choice.outs[0] in possible, (src, dst, sbp_in, possible, choice)
    assert checked > 200 and free > 100


@pytest.mark.parametrize("src,sbp_in,dst,sbp_out", [
    ((8, 4), (S(0), S(0)), (2, 4, 4), (S(0), S(1))),      # OneFlow's test
    ((2, 4, 4), (S(0), S(1)), (8, 4), (S(0), S(0))),      # its backward
    ((16,), (S(0), S(0)), (2, 2, 4), (S(0), S(1))),
    ((16,), (S(0), S(0)), (4, 4), (S(0), S(0))),          # both cuts in the first factor
    ((4, 4), (S(0), S(0)), (16,), (S(0), S(0))),
    ((4, 6), (S(0), B), (2, 2, 6), (S(0), B)),
])
def test_nested_splits_follow_the_factor_dims(src, sbp_in, dst, sbp_out):
    call = make_call("view.default", [torch.zeros(src), list(dst)])
    choice = choose(call, (Layout(G22, sbp_in, src),), (4,))
    assert choice.ins == (Layout(G22, sbp_in, src),) and choice.outs == (sbp_out,)


def test_nested_splits_in_the_wrong_axis_order_move_data():
    # (S(1), S(0)) of (2, 4, 4): axis 0 cuts the inner dim, so no split of (8, 4) has these pieces
    src = (2, 4, 4)
    call = make_call("view.default", [torch.zeros(src), [8, 4]])
    layout = Layout(G22, (S(1), S(0)), src)
    full = torch.arange(32.).reshape(src)
    assert not any(pieces_match(full, layout, Layout(G22, o, (8, 4))) for o in sbp_choices(2, G22))
    assert choose(call, (layout,), (4,)).ins != (layout,)
