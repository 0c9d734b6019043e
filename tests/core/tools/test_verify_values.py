"""gt.verify's comparison (verify_values.py): rounding passes, bugs fail, the floor widens the
tolerance, integers and shapes compare exactly, NaN equals NaN."""
import math

import torch

from globaltensor.tools.verify_values import compare, floor_of, tolerance, widened


def test_rounding_passes_and_a_real_difference_fails():
    ref = torch.tensor([1.0, 2.0, 3.0])
    assert compare(ref + 1e-7, ref).ok
    bad = compare(ref * 2, ref)
    assert not bad.ok and bad.max_abs == 3.0 and bad.max_rel == 1.0


def test_the_floor_widens_the_tolerance_only_where_needed():
    ref = torch.tensor([1000.0])
    out = ref + 0.01                                    # beyond rtol 1.3e-6 * 1000 + 1e-5
    assert not compare(out, ref).ok
    asked = []
    diff = compare(out, ref, floor=lambda: asked.append(1) or 0.01)
    assert diff.ok and diff.floor == 0.01 and asked == [1]
    assert compare(ref, ref, floor=lambda: asked.append(2) or 1.0).floor is None and asked == [1]


def test_exact_kinds_shapes_nan_and_numbers():
    assert not compare(torch.tensor([1, 2]), torch.tensor([1, 3])).ok
    assert compare(torch.tensor([True]), torch.tensor([True])).ok
    assert "shape [2] instead of [3]" == compare(torch.zeros(2), torch.zeros(3)).note
    assert compare(torch.tensor([math.nan, math.inf]), torch.tensor([math.nan, math.inf])).ok
    assert not compare(torch.tensor([math.nan]), torch.tensor([0.0])).ok
    assert compare(3, 3).ok and not compare(True, False).ok and compare(None, None).ok
    assert tolerance(torch.float32, None, 0.5) == (1.3e-6, 0.5) and tolerance(torch.int64, None, None) == (0, 0)


def test_floor_of_is_the_float64_gap():
    x = torch.tensor([0.1, 0.2, 0.3])
    ref = x.sum()
    assert floor_of(ref, widened(x).sum()) == abs(float(ref.double()) - float(widened(x).sum()))
    assert floor_of(torch.tensor([1]), torch.tensor([1])) is None
