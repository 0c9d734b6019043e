"""How ``register`` names an op: every spelling torch has for it, one registry key.

    aten ops       "add", "add.Tensor", "aten::add", "aten.add.Tensor", torch.ops.aten.add(.Tensor)
                   -> "add" / "add.Tensor" (bare: aten is the default namespace)
    other ops      "mylib::cube", "mylib::cube.default", "mylib.cube.default", "mylib.cube",
                   torch.ops.mylib.cube(.default)  -> "mylib::cube" / "mylib::cube.default"

Dispatch looks ops up by the same keys (``naming.qualified``), so a custom op never takes
the entry of an aten op of the same name. A name that cannot match any op is refused: an op
not defined (yet) in ``torch.ops``, an overload the op does not have, or the bare name of a
custom op (which would have been looked for among aten's). globaltensor's own tables may name
aten ops of other torch versions (``lenient``), as may factory roles (torch functions such as
``torch.asarray``, not aten ops).
"""
from __future__ import annotations

import torch

from ..errors import GlobalTensorError


def qualified(func) -> str:
    """The registry's name of an op overload: "add.Tensor" for aten's, the namespace kept for
    any other ("mylib::cube.default"), so a custom op never takes an aten op's entry."""
    namespace, name = func._schema.name.split("::")
    return _key(namespace, f"{name}.{func._overloadname}")


def op_key(name, lenient: bool = False) -> str:
    """The registry key of ``name``, any of torch's spellings of an op (see the module)."""
    if isinstance(name, torch._ops.OpOverload):
        namespace, base = name._schema.name.split("::")
        return _key(namespace, f"{base}.{name._overloadname}")
    if isinstance(name, torch._ops.OpOverloadPacket):
        namespace, base = name._qualified_op_name.split("::")
        return _key(namespace, base)
    if not isinstance(name, str) or not name:
        raise GlobalTensorError(
            f"ops.register expects op names (\"mylib::cube\", \"add.Tensor\") or torch's op "
            f"objects (torch.ops.mylib.cube), found {name!r} ({type(name).__name__})")
    namespace, rest = _split(name)
    _check(name, namespace, rest, lenient)
    return _key(namespace, rest)


def _key(namespace: str, rest: str) -> str:
    return rest if namespace == "aten" else f"{namespace}::{rest}"


def _split(name: str) -> tuple[str, str]:
    """(namespace, "op[.overload]") of a string spelling."""
    if "::" in name:
        namespace, _, rest = name.partition("::")
        return namespace, rest
    parts = name.split(".")
    if len(parts) == 3:  # str(torch.ops.mylib.cube.default): "mylib.cube.default"
        return parts[0], ".".join(parts[1:])
    if len(parts) == 2 and _packet("aten", parts[0]) is None and _packet(*parts) is not None:
        return parts[0], parts[1]  # str(torch.ops.mylib.cube): "mylib.cube"
    return "aten", name


def _packet(namespace: str, base: str):
    try:
        return getattr(getattr(torch.ops, namespace), base)
    except (AttributeError, RuntimeError):
        return None


def _check(name: str, namespace: str, rest: str, lenient: bool) -> None:
    base, _, overload = rest.partition(".")
    packet = _packet(namespace, base)
    if packet is None:
        if namespace == "aten" and lenient:
            return
        found = _elsewhere(base)
        hint = (f"; did you mean {' or '.join(repr(f + '.' + overload if overload else f) for f in found)}"
                f" (a custom op is named with its namespace)?" if found else
                "; define the op first (torch.library) and register it by torch's name, "
                "\"namespace::op\" or torch.ops.namespace.op")
        raise GlobalTensorError(f"ops.register: no op {name!r} in torch.ops{hint}")
    if overload and overload not in packet.overloads():
        raise GlobalTensorError(
            f"ops.register: op {namespace}::{base} has no overload {overload!r}; its overloads: "
            f"{sorted(packet.overloads())} (or register the op by its name alone, for all)")


def _elsewhere(base: str) -> list[str]:
    """Registered ops named ``base`` in a namespace other than aten (``ns::base``)."""
    found = set()
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, rest = qualified.partition("::")
        if namespace != "aten" and rest.split(".")[0] == base:
            found.add(f"{namespace}::{base}")
    return sorted(found)
