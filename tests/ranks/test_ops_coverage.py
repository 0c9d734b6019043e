"""Rules added for operator coverage (issue 17): every one against the full-tensor oracle on
[2] and [2, 2], uneven shapes, forward and gradients (helpers.check), and the rows that keep a
split without gathering (the op runs on the pieces)."""
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


def test_triangular_solve_splits_the_right_hand_side():
    a = torch.triu(_wellposed(3, 3))
    check(lambda a, b: torch.linalg.solve_triangular(a, b, upper=True), [a, gen(3, 5)])
    check(lambda a, b: torch.linalg.solve_triangular(a, b, upper=True, left=False),
          [a, gen(5, 3)])
    assert (S(0), S(0)) in _splits("linalg_solve_triangular.default", [(3, 2, 2), (3, 2, 5)])


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
