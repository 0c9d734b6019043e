"""Rules added for operator coverage (issue 17): every one against the full-tensor oracle on
[2] and [2, 2], uneven shapes, forward and gradients (helpers.check), and the rows that keep a
split without gathering (the op runs on the pieces)."""
import pytest
import torch

import globaltensor as gt
from globaltensor.ops import Call, Ref, rows_for
from globaltensor.sbp import Split
from helpers import check, gen

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


def _splits(op, shapes, args=(), kwargs=()):
    """The split rows of ``op``'s rule (input sbps of the rows where every input is S); the
    tensors come first in ``args``."""
    refs = tuple(Ref(i) for i in range(len(shapes)))
    rows = rows_for(Call(op, tuple(shapes), refs + tuple(args), tuple(kwargs))).rows
    return [r.ins for r in rows if all(isinstance(v, Split) for v in r.ins)]


def _wellposed(*shape, seed=0):
    n = shape[-1]
    return gen(*shape, seed=seed) + 3 * torch.eye(n, dtype=torch.float64)


# ----------------------------------------------------------------------------- linalg, fft

def test_batched_inverse_and_det():
    check(torch.linalg.inv, [_wellposed(3, 2, 2)])
    check(torch.linalg.det, [_wellposed(3, 2, 2, seed=1)])


def test_batched_svdvals_and_eigh():
    check(torch.linalg.svdvals, [gen(3, 3, 2)])
    check(lambda a: torch.linalg.eigvalsh(a + a.mT), [gen(3, 2, 2, seed=2)])


@pytest.mark.slow  # a long case: run with pytest -m slow (suite time)
def test_triangular_solve_splits_the_right_hand_side():
    a = torch.triu(_wellposed(3, 3))
    check(lambda a, b: torch.linalg.solve_triangular(a, b, upper=True), [a, gen(3, 5)])
    check(lambda a, b: torch.linalg.solve_triangular(a, b, upper=True, left=False),
          [a, gen(5, 3)])
    assert (S(0), S(0)) in _splits("linalg_solve_triangular.default", [(3, 2, 2), (3, 2, 5)])


@pytest.mark.slow  # a long case: run with pytest -m slow (suite time)
def test_solve_over_batch_dims_only_when_not_broadcast():
    check(torch.linalg.solve, [_wellposed(3, 2, 2), gen(3, 2, 1)])
    # B is broadcast over A's batch: its dim 0 is not a batch dim, no split row pairs them
    assert _splits("_linalg_solve_ex.default", [(3, 3, 3), (3, 4)]) == []


def test_fft_keeps_other_dims_split():
    check(lambda x: torch.view_as_real(torch.fft.fft(x, dim=1)), [gen(3, 4)])
    check(lambda x: torch.fft.irfft(torch.fft.rfft(x, dim=0), n=5, dim=0), [gen(5, 3)])
    assert _splits("_fft_r2c.default", [(3, 4)], ([1], 0, True)) == [(S(0),)]


def test_complex_views():
    check(lambda x: torch.view_as_real(torch.view_as_complex(x) * 2), [gen(3, 5, 2)])
    check(lambda x, y: torch.view_as_real(torch.complex(x, y)), [gen(3, 5), gen(3, 5, seed=1)])


# ----------------------------------------------------------------------------- shape ops

def test_flip_roll_repeat_keep_other_dims_split():
    check(lambda x: torch.flip(x, [1]) * 1, [gen(3, 5)])
    check(lambda x: torch.roll(x, 2, 0) * 1, [gen(5, 3)])
    check(lambda x: x.repeat(2, 1, 3), [gen(3, 5)])
    assert (S(0),) in _splits("flip.default", [(3, 5)], ([1],))
    assert (S(1),) in _splits("repeat.default", [(3, 5)], ([2, 1],))


def test_diag_embed_and_its_backward():
    check(lambda x: torch.diag_embed(x, offset=1), [gen(3, 4)])
    check(lambda x: torch.diagonal(x, 0, 1, 2) * 1, [gen(3, 4, 5)])


def test_unfold_and_copies():
    check(lambda x: x.unfold(1, 2, 1) * 1, [gen(3, 5)])
    check(lambda x: torch.ops.aten.permute_copy(x, [1, 0]), [gen(3, 5)])
    check(lambda x: torch.ops.aten.view_copy(x, [3, 2, 2]), [gen(3, 4)])


# ----------------------------------------------------------------------------- element-wise

@pytest.mark.slow  # a long case: run with pytest -m slow (suite time)
def test_activations_without_the_pointwise_tag():
    check(torch.nn.functional.hardswish, [gen(3, 5)])
    check(torch.nn.functional.logsigmoid, [gen(3, 5)])
    check(lambda x: torch.nn.functional.elu(x) + torch.nn.functional.softplus(x), [gen(3, 5)])
    check(lambda x: torch.nn.functional.glu(x, 1), [gen(3, 4)])
    check(lambda x, y: torch.rsub(x, y), [gen(3, 5), gen(3, 5, seed=1)])


def test_bucketize_and_searchsorted_split_the_values():
    bounds = torch.tensor([-1.0, 0.0, 0.5], dtype=torch.float64)
    check(lambda x, b: torch.bucketize(x, b).to(x.dtype) * x, [gen(3, 5), bounds])
    check(lambda s, x: torch.searchsorted(s, x).to(x.dtype) * x, [bounds, gen(3, 5)])


# ----------------------------------------------------------------------------- scans, indices

def test_scans_and_order_statistics_along_one_dim():
    check(lambda x: torch.cummax(x, 1)[0], [gen(3, 5)])
    check(lambda x: torch.logcumsumexp(x, 0), [gen(5, 3)])
    check(lambda x: torch.kthvalue(x, 2, 1)[0], [gen(3, 5)])
    check(lambda x: torch.median(x, 0, keepdim=True)[0], [gen(5, 3)])
    assert (S(0),) in _splits("kthvalue.default", [(3, 5)], (2, 1))


def test_nansum_and_count_nonzero_give_partial_sums():
    x = gen(5, 3)
    x[1, 2] = float("nan")
    check(lambda x: torch.nansum(x, 0), [x])
    check(lambda x: torch.count_nonzero(x > 0, 1).to(x.dtype), [gen(5, 3)])


def test_index_fill_and_copy_along_a_whole_dim():
    idx = torch.tensor([0, 2])
    check(lambda x, i: x.index_fill(1, i, -1.0), [gen(3, 5), idx])
    check(lambda x, s, i: x.index_copy(1, i, s), [gen(3, 5), gen(3, 2, seed=1), idx])
    assert (S(0), B, S(0)) in [r.ins for r in rows_for(Call(
        "index_copy.default", ((3, 5), (2,), (3, 2)), (Ref(0), 1, Ref(1), Ref(2)))).rows]


# ----------------------------------------------------------------------------- padding, interpolation

def test_reflect_and_replicate_padding_keep_leading_dims_split():
    F = torch.nn.functional
    check(lambda x: F.pad(x, (1, 2), mode="reflect"), [gen(3, 2, 5)])
    check(lambda x: F.pad(x, (1, 0, 2, 1), mode="replicate"), [gen(3, 1, 3, 4)])
    assert (S(1),) in _splits("reflection_pad1d.default", [(3, 2, 5)], ([1, 2],))


def test_interpolation_keeps_batch_and_channels_split():
    F = torch.nn.functional
    check(lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), [gen(3, 2, 3)])
    check(lambda x: F.interpolate(x, size=(3, 5), mode="bilinear", align_corners=False),
          [gen(3, 1, 2, 3)])
