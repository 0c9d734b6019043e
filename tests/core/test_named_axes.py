"""Named placement axes (DTensor's mesh_dim_names): sbp given by axis name, sub-placements,
and the sbp_fn helpers for tensor-parallel styles. Pure: no ranks."""
import pickle

import pytest
import torch

import globaltensor as gt
from globaltensor.errors import PlacementError, SbpError
from globaltensor.sbp import normalize

S, B, P = gt.sbp.S, gt.sbp.B, gt.sbp.P
GRID = gt.placement("cpu", [[0, 1], [2, 3]], axes=("dp", "tp"))


def test_named_placement_value_semantics():
    assert GRID.axes == ("dp", "tp") and gt.placement("cpu", [0, 1]).axes is None
    assert repr(GRID) == "placement('cpu', ranks=[[0, 1], [2, 3]], axes=('dp', 'tp'))"
    assert eval(repr(GRID), {"placement": gt.placement}) == GRID
    assert pickle.loads(pickle.dumps(GRID)) == GRID
    assert GRID != gt.placement("cpu", [[0, 1], [2, 3]])  # names are part of the value
    assert GRID.axis_index("tp") == 1 and GRID.axis_index(0) == 0


def test_sub_placement_along_a_named_axis():
    assert GRID.along("tp", 2) == gt.placement("cpu", [2, 3], axes=("tp",))
    assert GRID.along("dp", 1) == gt.placement("cpu", [1, 3], axes=("dp",))
    assert GRID.along(1, 0).ranks.tolist() == [0, 1]
    with pytest.raises(PlacementError, match="rank 7, which holds no cell"):
        GRID.along("tp", 7)
    with pytest.raises(PlacementError, match=r"found 'pp'.*named \['dp', 'tp'\]"):
        GRID.along("pp", 0)
    # p["tp"] asks which rank runs: a world of 1 is rank 0
    assert gt.placement("cpu", [[0], [1]], axes=("dp", "tp"))["dp"].ranks.tolist() == [0, 1]


@pytest.mark.parametrize("axes", [("dp",), "dp", ("dp", "dp"), ("dp", "")])
def test_bad_axis_names(axes):
    with pytest.raises(PlacementError, match="axes"):
        gt.placement("cpu", [[0, 1], [2, 3]], axes=axes)


def test_sbp_by_axis_name_or_number():
    assert normalize({"tp": S(0)}, 2, GRID.axes) == (B, S(0))
    assert normalize({"dp": S(0), "tp": P}, 2, GRID.axes) == (S(0), P)
    assert normalize({1: S(1)}, 2, None) == (B, S(1))
    assert gt.Layout(GRID, {"tp": S(1)}, (4, 6)).sbp == (B, S(1))
    with pytest.raises(SbpError, match=r"found 'pp'; this placement's axes are named"):
        normalize({"pp": S(0)}, 2, GRID.axes)
    with pytest.raises(SbpError, match="unnamed"):
        normalize({"tp": S(0)}, 2, None)


def test_tensor_parallel_styles():
    plan = gt.nn.sbp_plan({"*.up": gt.nn.colwise("tp"), "*.down": gt.nn.rowwise("tp")})
    w, b = torch.zeros(8, 4), torch.zeros(8)
    assert plan("mlp.up.weight", w) == {"tp": S(0)} and plan("mlp.up.bias", b) == {"tp": S(0)}
    assert plan("mlp.down.weight", w) == {"tp": S(1)} and plan("mlp.down.bias", b) is None
    assert plan("norm.weight", b) is None
    assert gt.nn.sequence("tp") == {"tp": S(1)}
    default = gt.nn.sbp_plan({}, default=lambda name, t: {"dp": S(0)})
    assert default("x.weight", w) == {"dp": S(0)}
