"""``_grouped_mm``'s rows (ops/matmul.py), checked in one process: every candidate of every form
on a 1-D and a 2x2 grid runs kernel "grouped_mm" on the pieces of each coordinate, and the
assembled output equals torch's op on the full tensors (float32: the CPU kernel's dtypes)."""
import itertools

import pytest
import torch

from globaltensor import ops
from globaltensor.layout import Layout
from globaltensor.ops import KERNELS, Call, KernelContext, Ref
from globaltensor.sbp import Broadcast, PartialSum

from helpers import G2, G22, gen, piece

aten = torch.ops.aten
OFFS = torch.tensor([3, 3, 7, 12], dtype=torch.int32)  # 4 groups over 12 tokens, one empty


class Out:
    """What a kernel reads of an output spec."""

    def __init__(self, layout, dtype):
        self.layout, self.dtype = layout, dtype


def assemble(pieces: dict, layout: Layout) -> torch.Tensor:
    full = torch.zeros(layout.shape, dtype=next(iter(pieces.values())).dtype)
    for coord, p in pieces.items():
        if any(c != 0 for a, c in enumerate(coord) if isinstance(layout.sbp[a], Broadcast)):
            continue
        full[layout.slices(coord)] += p
    return full


def run_rows(a, b, offs, grid, expected_rows):
    """Every candidate of the rule on ``grid``: pieces through the kernel, compared with torch."""
    inputs = [a, b] + ([offs] if offs is not None else [])
    args = (Ref(0), Ref(1)) + ((Ref(2),) if offs is not None else ())
    call = Call("_grouped_mm.default", tuple(tuple(t.shape) for t in inputs), args)
    rule = ops.rows_for(call)
    assert len(rule.rows) == expected_rows and all(r.kernel == "grouped_mm" for r in rule.rows)
    expected = aten._grouped_mm.default(a, b, offs=offs)
    checked = 0
    for combo in itertools.product(rule.rows, repeat=grid.ndim):
        ins = [tuple(r.ins[i] for r in combo) for i in range(len(inputs))]
        in_layouts = [Layout(grid, sbp, t.shape) for t, sbp in zip(inputs, ins)]
        out = Layout(grid, ops.outs_of(combo)[0], tuple(expected.shape))
        got = {}
        for coord in grid.coords():
            pieces = [piece(t, l, coord) for t, l in zip(inputs, in_layouts)]
            ctx = KernelContext(aten._grouped_mm.default, call, tuple(in_layouts),
                                Out(out, expected.dtype), coord, pieces, None, None)
            got[coord] = KERNELS["grouped_mm"](ctx, list(pieces), {})
            assert tuple(got[coord].shape) == out.local_shape(coord)
        torch.testing.assert_close(assemble(got, out), expected, rtol=1e-5, atol=1e-5,
                                   msg=f"ins {ins} -> {out.sbp} on {grid.shape}")
        checked += 1
    return checked


@pytest.mark.parametrize("grid", [G2, G22], ids=["[2]", "[2,2]"])
def test_tokens_times_stacked_experts(grid):
    # (12 tokens, K) x (4 experts, K, N): features of 16 so that pieces of 4 keep 16 bytes
    a, b = gen(12, 16, dtype=torch.float32), gen(4, 16, 16, seed=1, dtype=torch.float32)
    assert run_rows(a, b, OFFS, grid, 7) == 7 ** grid.ndim


@pytest.mark.parametrize("grid", [G2, G22], ids=["[2]", "[2,2]"])
def test_tokens_times_transposed_experts_of_odd_features(grid):
    # HF passes weight.transpose(-2, -1); 6 features split in 3 + 3 give a 12-byte stride,
    # which the kernel aligns; 3 experts split 2 + 1 (uneven)
    a = torch.zeros(12, 8)[:, :6].copy_(gen(12, 6, dtype=torch.float32))
    b = torch.zeros(3, 6, 8)[..., :6].copy_(gen(3, 6, 6, seed=1, dtype=torch.float32))
    b = b.transpose(-2, -1)  # strides (48, 1, 8): 32-byte columns, as torch's kernel asks
    offs = torch.tensor([5, 5, 12], dtype=torch.int32)
    assert run_rows(a, b, offs, grid, 7) == 7 ** grid.ndim


@pytest.mark.parametrize("grid", [G2, G22], ids=["[2]", "[2,2]"])
def test_weight_gradients_form(grid):
    # (K, 12 tokens) x (12 tokens, N) -> (4 experts, K, N): the experts' weight gradients
    a = gen(16, 12, dtype=torch.float32).t().contiguous().t()  # a transposed view, as autograd's
    b = gen(12, 16, seed=1, dtype=torch.float32)
    assert run_rows(a, b, OFFS, grid, 7) == 7 ** grid.ndim


@pytest.mark.parametrize("grid", [G2, G22], ids=["[2]", "[2,2]"])
def test_stacked_tokens_times_columns_and_batched(grid):
    a3 = gen(3, 8, 16, dtype=torch.float32)
    b2 = gen(16, 12, seed=1, dtype=torch.float32)
    offs = torch.tensor([4, 8, 12], dtype=torch.int32)
    assert run_rows(a3, b2, offs, grid, 5) == 5 ** grid.ndim
    b3 = gen(3, 16, 8, seed=2, dtype=torch.float32)
    assert run_rows(a3, b3, None, grid, 7) == 7 ** grid.ndim


def test_with_a_bias_no_row():
    call = Call("_grouped_mm.default", ((12, 16), (4, 16, 16), (4,), (4, 16)),
                (Ref(0), Ref(1), Ref(2), Ref(3)))
    assert ops.rows_for(call).rows == ()


def test_expert_parallel_rows_read_the_offsets_whole():
    call = Call("_grouped_mm.default", ((12, 16), (4, 16, 16), (4,)), (Ref(0), Ref(1), Ref(2)))
    assert all(isinstance(r.ins[2], Broadcast) for r in ops.rows_for(call).rows)
    assert any(isinstance(r.outs[0], PartialSum) and r.ins[1] == ops.S(0)
               for r in ops.rows_for(call).rows)
