"""Bad input sweep in a world of one: every public entry point rejects bad arguments quickly and
clearly (the same sweep on several ranks, and awkward but valid input:
tests/ranks/test_bad_input_ranks.py)."""
import pytest
import torch

import globaltensor as gt
from globaltensor.errors import GlobalTensorError, SbpError, ShapeMismatchError

from helpers import BAD_INPUT_CASES, p1

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


# BAD_INPUT_CASES: (id, call, error class, words the message must hold), each cheap and local
@pytest.mark.parametrize("case", BAD_INPUT_CASES, ids=[c[0] for c in BAD_INPUT_CASES])
def test_bad_input_in_a_world_of_one(case, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _, call, kind, words = case
    with pytest.raises(kind) as info:
        call()
    assert words in str(info.value)


def test_world_of_one_needs_no_init(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p = p1()
    x = torch.arange(4.0).to_global(placement=p, sbp=B)
    y = torch.arange(4.0).to_global(placement=p, sbp=S(0))
    assert x.to_local().tolist() == y.to_global(sbp=B).to_local().tolist() == [0, 1, 2, 3]


def test_forgotten_init_in_a_bigger_job_is_explained(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(GlobalTensorError, match=r"expected gt.init\(\) before global operations "
                                                r"in a job of 2 ranks"):
        torch.ones(2).to_global(placement=gt.placement("cpu", [0, 1]), sbp=S(0))


def test_shape_mismatch_error_is_a_global_tensor_error():
    assert issubclass(ShapeMismatchError, GlobalTensorError)
    assert issubclass(GlobalTensorError, ValueError) and issubclass(GlobalTensorError, RuntimeError)


def test_an_sbp_is_normalised_once_per_to_global(monkeypatch):
    # the Layout normalises; the boundary that needs the values first (a local tensor's
    # to_global) normalises once and builds its layouts from the values
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    from globaltensor import _cache, convert, layout, sbp
    _cache.clear_all()  # the targets of to_global(sbp=...) are cached
    calls = []

    def counting(*args, **kwargs):
        calls.append(args)
        return sbp.normalize(*args, **kwargs)

    for module in (convert, layout):
        monkeypatch.setattr(module, "normalize", counting)
    p = p1()
    x = torch.arange(4.0).to_global(placement=p, sbp=S(0))
    assert len(calls) == 1
    calls.clear()
    x.to_global(sbp=(B,))  # a list-like argument: not taken from the warm path's memo
    assert len(calls) == 1
    calls.clear()
    x.to_global(placement=p, sbp=[B])  # unhashable: computed, not cached
    assert len(calls) == 1


@pytest.mark.parametrize("dim", [2**100, -2**100, 2**62, 64, -65])
def test_a_split_dim_past_int64_is_named_not_overflowed(dim, monkeypatch):
    """Issue 52.9: split(2**100) died in the piece-shape exchange as a raw ValueError
    ('Overflow when unpacking long long'). A split dim no tensor has travels saturated in the
    exchange's int64 records; the sbp this rank passed raises the SbpError naming its dim."""
    from globaltensor.convert import _shown
    from globaltensor.runtime.meta import MAX_NDIM, _meta, _records

    rows = _records([torch.ones(2, 3)], (S(dim), B), "test")
    (record,) = torch.tensor(rows, dtype=torch.int64).tolist()  # raised ValueError for 2**100
    far = "S(64 or more)" if dim >= MAX_NDIM else "S(-65 or less)"
    assert _shown(_meta(record).sbp) == f"({far}, B)"  # as the disagreement message writes it
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SbpError, match=rf"split\({dim}\) needs a tensor dim in \[-2, 2\)"):
        torch.ones(2, 3).to_global(placement=p1(), sbp=S(dim))
