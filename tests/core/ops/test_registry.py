"""The registry: one entry per op (``ops.OPS[name]``) holding what every family registered for
it, and ``ops.describe`` printing it."""
import re

import pytest
import torch

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
    from globaltensor.mode import global_mode as mode

    roles = ops.factory_roles()
    assert roles["arange"] == "same" and roles["randn"] == "normal" and roles["randperm"] == "first"
    assert mode._FACTORIES[torch.zeros_like] == "same"


def test_describe_prints_an_entry_and_the_rows_for_a_sample_call():
    text = ops.describe("transpose.int")
    assert "rule: globaltensor.ops.views.transpose" in text and "write_back:" in text
    text = ops.describe("mm", Call("mm.default", ((8, 6), (6, 10)), (Ref(0), Ref(1))))
    assert "rows for ([8, 6], [6, 10]):" in text and "S(0) B -> S(0)" in text
    assert "nothing registered" in ops.describe("no_such_op")


@torch.library.custom_op("gt_naming::cumsum", mutates_args=())
def _my_cumsum(x: torch.Tensor) -> torch.Tensor:  # named like aten's cumsum: not its rule
    return x.cumsum(0) * 2


@torch.library.custom_op("gt_naming::cube", mutates_args=())
def _cube(x: torch.Tensor) -> torch.Tensor:
    return x * x * x


@pytest.mark.parametrize("spelling", [
    "gt_naming::cube", "gt_naming::cube.default", "gt_naming.cube.default", "gt_naming.cube",
    torch.ops.gt_naming.cube, torch.ops.gt_naming.cube.default])
def test_register_accepts_torchs_spellings_of_an_op(spelling):
    key = ops.naming.op_key(spelling)
    assert key in ("gt_naming::cube", "gt_naming::cube.default")
    assert ops.qualified(torch.ops.gt_naming.cube.default) == "gt_naming::cube.default"
    assert ops.qualified(torch.ops.aten.add.Tensor) == "add.Tensor"
    assert ops.naming.op_key("aten::add.Tensor") == ops.naming.op_key(torch.ops.aten.add.Tensor) \
        == "add.Tensor"


@pytest.mark.parametrize("spelling,message", [
    ("cube", "did you mean 'gt_naming::cube'"),                   # a custom op's bare name
    ("cube.default", "did you mean 'gt_naming::cube.default'"),
    ("gt_naming::cube.out", "has no overload 'out'; its overloads: ['default']"),
    ("gt_naming::nope", "define the op first"),
    ("relux", "no op 'relux' in torch.ops"),
    (3, "expects op names"),
])
def test_register_refuses_names_that_cannot_match(spelling, message):
    with pytest.raises(GlobalTensorError, match=re.escape(message)):
        ops.register(spelling, rule=lambda call: ())


def test_a_custom_op_named_like_an_aten_op_never_takes_its_entry():
    # "cumsum" is aten's (reductions.py); gt_naming::cumsum is looked up under its own key
    assert ops.qualified(torch.ops.gt_naming.cumsum.default) == "gt_naming::cumsum.default"
    call = Call("gt_naming::cumsum.default", ((4,),), (Ref(0),))
    assert ops.rule_for(call) is None
    assert ops.rule_for(Call("cumsum.default", ((4,),), (Ref(0), 0))) is not None
    assert ops.rules.arg_names("gt_naming::cumsum.default") == ("x",)
