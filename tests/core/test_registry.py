"""The registry: one entry per op (``ops.OPS[name]``) holding what every family registered for
it, and ``ops.describe`` printing it."""
import pytest

from globaltensor import ops
from globaltensor.errors import GlobalTensorError
from globaltensor.ops import Call, Ref


def test_one_entry_holds_what_several_families_registered():
    # rand_like: its rule and kernel (random_ops.py), its role in global mode (creation.py)
    e = ops.OPS["rand_like"]
    assert e.rule is not None and e.kernels == ("random",) and e.factory == "uniform"
    # select: its rule and the write-back of its views, in ops/views.py
    assert ops.OPS["select"].rule is not None and ops.OPS["select"].write_back is not None
    assert ops.entry("no_such_op") == ops.OpEntry()


def test_a_fact_registered_twice_is_an_internal_error():
    with pytest.raises(GlobalTensorError, match="registered twice"):
        ops.register("select", write_back=lambda get, k: None)


def test_factory_roles_are_read_from_the_registry():
    import torch
    from globaltensor import mode

    roles = ops.factory_roles()
    assert roles["arange"] == "same" and roles["randn"] == "normal" and roles["randperm"] == "first"
    assert mode._FACTORIES[torch.zeros_like] == "same"


def test_describe_prints_an_entry_and_the_rows_for_a_sample_call():
    text = ops.describe("transpose.int")
    assert "rule: globaltensor.ops.views.transpose" in text and "write_back:" in text
    text = ops.describe("mm", Call("mm.default", ((8, 6), (6, 10)), (Ref(0), Ref(1))))
    assert "rows for ([8, 6], [6, 10]):" in text and "S(0) B -> S(0)" in text
    assert "nothing registered" in ops.describe("no_such_op")
