import numpy as np
import pytest

import globaltensor as gt
from globaltensor.errors import GlobalTensorError, PlacementError, SbpError
from globaltensor.sbp import Broadcast, PartialSum, Split, normalize


def test_sbp_str_repr_and_values():
    # one spelling everywhere: repr, str, plans and errors (SPEC "Vocabulary")
    assert str(gt.sbp.split(0)) == "S(0)" and repr(gt.sbp.split(1)) == "S(1)"
    assert str(gt.sbp.broadcast) == "B" and repr(gt.sbp.broadcast) == "B"
    assert str(gt.sbp.partial_sum) == "P" and repr(gt.sbp.partial_sum) == "P"
    assert repr((gt.sbp.split(0),)) == "(S(0),)" and repr([gt.sbp.S(1), gt.sbp.B]) == "[S(1), B]"
    ns = {"S": gt.sbp.S, "B": gt.sbp.B, "P": gt.sbp.P}
    for v in (gt.sbp.split(2), gt.sbp.broadcast, gt.sbp.partial_sum):
        assert eval(repr(v), ns) == v


def test_sbp_equality_and_hash_classes():
    assert gt.sbp.split(0) == Split(0) and hash(gt.sbp.split(0)) == hash(Split(0))
    assert gt.sbp.split(0) != gt.sbp.split(1)
    assert gt.sbp.broadcast == Broadcast() and gt.sbp.partial_sum == PartialSum()
    assert gt.sbp.broadcast != gt.sbp.partial_sum
    assert len({gt.sbp.split(0), Split(0), gt.sbp.broadcast, Broadcast(), gt.sbp.partial_sum}) == 3
    with pytest.raises(AttributeError):
        gt.sbp.split(0).dim = 1


def test_normalize_one_or_many():
    assert normalize(gt.sbp.split(0)) == (Split(0),)
    assert normalize([gt.sbp.split(0), gt.sbp.broadcast], 2) == (Split(0), Broadcast())
    assert normalize((gt.sbp.partial_sum,), 1) == (PartialSum(),)


@pytest.mark.parametrize("bad", ["S(0)", 0, None, gt.sbp.split, [], [gt.sbp.broadcast, 3]])
def test_normalize_rejects_non_sbp(bad):
    with pytest.raises(SbpError):
        normalize(bad)


def test_sbp_length_must_match_placement_ndim():
    with pytest.raises(SbpError, match="expected 2 sbp values"):
        normalize((gt.sbp.split(0),), 2)
    with pytest.raises(SbpError, match="expected 2 sbp values"):
        normalize((gt.sbp.broadcast,) * 3, 2)


def test_one_b_or_p_on_an_nd_placement_means_every_axis():
    B, P = gt.sbp.broadcast, gt.sbp.partial_sum
    assert normalize(B, 2) == (B, B)
    assert normalize(P, 3) == (P, P, P)
    assert normalize(gt.sbp.broadcast, 1) == (B,)


def test_one_split_on_an_nd_placement_names_the_axes_and_the_dict_form():
    with pytest.raises(SbpError) as e:
        normalize(gt.sbp.split(1), 2, ("dp", "tp"))
    text = str(e.value)
    assert "2 axes: ['dp', 'tp']" in text and "(S(1), B)" in text and "{'dp': S(1)}" in text


def test_split_dim_must_be_int():
    with pytest.raises(SbpError):
        gt.sbp.split(1.5)
    with pytest.raises(SbpError):
        gt.sbp.split(True)


def test_split_negative_resolves_against_ndim():
    assert gt.sbp.split(-1).resolve(3) == Split(2)
    with pytest.raises(SbpError, match="in \\[-2, 2\\)"):
        gt.sbp.split(2).resolve(2)


@pytest.mark.parametrize("ranks, shape, flat", [
    (3, (1,), (3,)),
    ([0, 1], (2,), (0, 1)),
    ([1, 0], (2,), (1, 0)),
    ([[0, 1], [2, 3]], (2, 2), (0, 1, 2, 3)),
    ([[3, 1], [2, 0]], (2, 2), (3, 1, 2, 0)),
    (range(4), (4,), (0, 1, 2, 3)),
    (np.arange(6).reshape(2, 3), (2, 3), (0, 1, 2, 3, 4, 5)),
    ((0, 2), (2,), (0, 2)),
])
def test_placement_forms(ranks, shape, flat):
    p = gt.placement("cpu", ranks)
    assert p.shape == shape and p.ndim == len(shape) and p.flat_ranks == flat
    assert isinstance(p.ranks, np.ndarray) and p.ranks.shape == shape
    assert p.type == "cpu"
    assert eval(repr(p), {"placement": gt.placement}) == p


def test_placement_order_is_honoured():
    p = gt.placement("cpu", [[3, 1], [2, 0]])
    assert p.rank_at((0, 0)) == 3 and p.rank_at((1, 1)) == 0
    assert p.coord_of(1) == (0, 1) and p.coord_of(7) is None
    assert p.group_along(0, (0, 1)) == (1, 0) and p.group_along(1, (1, 0)) == (2, 0)
    assert p.groups_along(0) == [(3, 2), (1, 0)]
    assert p.groups_along(1) == [(3, 1), (2, 0)]


def test_placement_equality_and_hash_classes():
    a = gt.placement("cpu", [0, 1])
    assert a == gt.placement("cpu", range(2)) == gt.placement("cpu", np.array([0, 1]))
    assert hash(a) == hash(gt.placement("cpu", (0, 1)))
    assert a != gt.placement("cpu", [1, 0])
    assert a != gt.placement("cuda", [0, 1])
    assert gt.placement("cpu", [0, 1, 2, 3]) != gt.placement("cpu", [[0, 1], [2, 3]])
    assert len({a, gt.placement("cpu", [0, 1]), gt.placement("cpu", [[0, 1]])}) == 2
    with pytest.raises(AttributeError):
        a.type = "cuda"


def test_placement_all():
    assert gt.placement.all("cpu", world_size=3) == gt.placement("cpu", [0, 1, 2])
    assert gt.placement.all("cpu").ranks.tolist() == list(range(gt.env.get_world_size()))


def test_oneflow_spellings():
    """split(axis=1), placement.hierarchy and env.all_device_placement, as OneFlow spells them."""
    assert gt.sbp.split(axis=1) == gt.sbp.split(1) == Split(1)
    assert str(gt.sbp.split(axis=-1)) == "S(-1)"
    for call, found in ((lambda: gt.sbp.split(), "found neither"),
                        (lambda: gt.sbp.split(0, axis=1), "found both dim=0 and axis=1")):
        with pytest.raises(SbpError) as e:
            call()
        assert "split(1) or OneFlow's split(axis=1)" in str(e.value) and found in str(e.value)
    p = gt.placement("cpu", [[0, 1, 2], [3, 4, 5]])
    assert p.hierarchy == p.shape == (2, 3)
    assert gt.placement("cpu", [4]).hierarchy == (1,)
    assert gt.env.all_device_placement("cpu") == gt.placement.all("cpu")
    assert gt.env.all_device_placement().type == "cpu"


@pytest.mark.parametrize("type_, ranks, match", [
    ("cpu", [0, 0], "distinct"),
    ("cpu", [[0, 1], [1, 2]], "distinct"),
    ("cpu", [-1, 0], ">= 0"),
    ("cpu", [[0, 1], [2]], "ragged"),
    ("cpu", [], "non-empty"),
    ("cpu", [0.5, 1], "integer"),
    ("cpu", ["0"], "integer"),
    ("tpu", [0], "device type"),
    (3, [0], "device type"),
    ("cpu", None, "expected ranks"),
])
def test_placement_errors(type_, ranks, match):
    with pytest.raises(PlacementError, match=match):
        gt.placement(type_, ranks)


def test_placement_errors_are_global_tensor_errors():
    with pytest.raises(GlobalTensorError):
        gt.placement("cpu", [0, 0])
    with pytest.raises(ValueError):
        gt.placement("cpu", [0, 0])


def test_ranks_beyond_world():
    p = gt.placement("cpu", [0, 5])
    p.check_world(6)
    with pytest.raises(PlacementError, match="world size 4"):
        p.check_world(4)
