"""GT_DEBUG consistency checks in one process: the flag, descriptors and messages, and a world
of one (the checks between ranks are in tests/ranks/test_debug_ranks.py)."""
import pytest
import torch

import globaltensor as gt
from globaltensor import debug
from globaltensor.runtime.agreement import check
from globaltensor.debug import Descriptor, disagreement, fact_text, missing_message
from globaltensor.errors import CollectiveTimeoutError, GlobalTensorError, RankMismatchError


# --- pure: flag, descriptors, messages --------------------------------------------------------


def _fresh(fn):
    """Run ``fn`` in a fresh context, as a new thread-rank would."""
    import contextvars

    return contextvars.Context().run(fn)


def test_flag_follows_env_until_set(monkeypatch):
    monkeypatch.setenv("GT_DEBUG", "1")
    assert _fresh(debug.is_debug) is True
    monkeypatch.setenv("GT_DEBUG", "0")
    assert _fresh(debug.is_debug) is False

    def overridden():
        debug.set_debug(True)
        return debug.is_debug()

    assert _fresh(overridden) is True


def test_bad_env_value_is_explained(monkeypatch):
    monkeypatch.setenv("GT_DEBUG", "maybe")
    with pytest.raises(GlobalTensorError, match=r"GT_DEBUG .*found 'maybe'"):
        _fresh(debug.is_debug)


def test_debugging_block_restores(monkeypatch):
    monkeypatch.delenv("GT_DEBUG", raising=False)

    def body():
        with debug.debugging(timeout=3):
            inside = (debug.is_debug(), debug.timeout_seconds())
        return inside, (debug.is_debug(), debug.timeout_seconds())

    assert _fresh(body) == ((True, 3.0), (False, None))


@pytest.mark.parametrize("bad", [0, -1, "5", True])
def test_bad_timeout(bad):
    with pytest.raises(GlobalTensorError, match="debug timeout in seconds > 0"):
        _fresh(lambda: debug.set_debug(True, timeout=bad))


def test_set_debug_rejects_non_bool():
    with pytest.raises(GlobalTensorError, match="True, False or None, found 1"):
        debug.set_debug(1)


def test_fact_text_is_compact_and_data_free():
    p = gt.placement("cpu", [0, 1])
    assert fact_text((gt.sbp.split(0), gt.sbp.broadcast)) == "(S(0), B)"
    assert fact_text(torch.float32) == "torch.float32"
    assert fact_text(torch.zeros(2, 3)) == "tensor(shape=[2, 3], dtype=torch.float32)"
    assert fact_text(p) == "placement('cpu', ranks=[0, 1])"
    assert len(fact_text("x" * 5000)) == 1000


def test_descriptor_round_trip():
    d = Descriptor.of(7, "to_global", {"sbp": (gt.sbp.partial_sum,), "dtype": torch.int64})
    assert Descriptor.decode(d.encode()) == d
    assert str(d) == "#7 to_global(dtype=torch.int64, sbp=(P,))"


def test_disagreement_names_minority_and_fields():
    same = Descriptor.of(3, "to_global", {"sbp": (gt.sbp.broadcast,)})
    other = Descriptor.of(3, "to_global", {"sbp": (gt.sbp.split(0),)})
    assert disagreement({0: same, 1: same}) is None
    msg = disagreement({0: same, 1: other, 2: same})
    assert "ranks [0, 2]: #3 to_global(sbp=(B,))" in msg
    assert "rank 1 differs: sbp: (S(0),) instead of (B,)" in msg


def test_disagreement_on_op_and_seq_tie_goes_to_lowest_rank():
    a = Descriptor.of(4, "to_global", {})
    b = Descriptor.of(5, "gt.zeros", {})
    msg = disagreement({0: a, 1: b})
    assert "rank 0: #4 to_global()" in msg
    assert "rank 1 differs: op: gt.zeros instead of to_global, at #5 gt.zeros()" in msg


def test_user_lines_travel_with_descriptors_and_are_shown_not_compared():
    a = Descriptor.of(2, "to_global", {"sbp": (gt.sbp.broadcast,)}, where="train.py:10 (`a`)")
    b = Descriptor.of(2, "to_global", {"sbp": (gt.sbp.broadcast,)}, where="train.py:12 (`b`)")
    c = Descriptor.of(2, "to_global", {"sbp": (gt.sbp.split(0),)}, where="train.py:14 (`c`)")
    assert Descriptor.decode(a.encode()).where == "train.py:10 (`a`)"
    assert Descriptor.decode(b"[1, \"x\", []]") == Descriptor(1, "x", ())  # no line: ""
    assert a == b and disagreement({0: a, 1: b}) is None  # another line, the same operation
    lines = disagreement({0: a, 1: b, 2: c}).splitlines()
    assert lines[1:6] == ["  ranks [0, 1]: #2 to_global(sbp=(B,))",
                          "    rank 0 at train.py:10 (`a`)", "    rank 1 at train.py:12 (`b`)",
                          "  rank 2 differs: sbp: (S(0),) instead of (B,)",
                          "    at train.py:14 (`c`)"]
    msg = missing_message(0, c, [1], {1: a}, 2.0)
    assert "Source lines: rank 0 is at train.py:14 (`c`); rank 1 checked in last from " \
           "train.py:10 (`a`). Make every rank" in msg


# --- a world of one: no store -----------------------------------------------------------------


def test_world_of_one_and_uninitialised_need_no_store():
    debug.set_debug(True)
    try:
        check("anything", x=1)  # not initialised: nothing to agree with
        x = gt.zeros(2, placement=gt.placement("cpu", [0]), sbp=gt.sbp.broadcast)
        assert x.to_local().tolist() == [0.0, 0.0]
    finally:
        debug.set_debug(None)


def test_errors_are_global_tensor_errors():
    assert issubclass(RankMismatchError, GlobalTensorError)
    assert issubclass(CollectiveTimeoutError, GlobalTensorError)
