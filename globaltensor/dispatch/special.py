"""Ops with their own handlers: ``copy_`` (a write into a global tensor), ``item`` (a read of
the whole value), and ``torch._foreach_*`` (the per-tensor op on each element)."""
from __future__ import annotations

import torch

from .. import debug as _debug
from ..errors import GlobalTensorError
from ..layout import Layout
from ..materialize import meta_message
from ..redistribute import redistribute_local, whole_on_every_rank
from ..world.simulated import no_value_in_simulation
from ..sbp import Broadcast, replicated
from ..tensor import GlobalTensor
from .decisions import my_coord
from .aliasing import LINK, write_back, write_into

aten = torch.ops.aten


def _copy_(func, args, kwargs, tensors):
    self, src = args[0], args[1]
    if not isinstance(self, GlobalTensor):
        raise GlobalTensorError(
            f"copy_ of a global tensor into a local tensor of shape {list(self.shape)}; expected "
            f"a global target. Use x.full_tensor() or x.to_local() to get local data")
    if isinstance(src, GlobalTensor) and src.placement != self.placement:
        mixed_placements([self, src], "copy_")
    write_into(self, src)
    write_back(self)
    return self


def _local_scalar_dense(func, args, kwargs, tensors):
    """``bool(x)``, ``float(x)``, ``int(x)`` of a global tensor: while every rank runs the
    program, every rank gets the value, as ``x.item()`` (torch's own code branches on values:
    ``trunc_normal_``'s ``if not mask.any()`` runs on ranks outside a pipeline stage's placement
    at init). Inside a pipeline's stage (only its ranks run it) the placement's ranks only."""
    from ..runtime.groups import groups_frozen

    x = tensors[0]
    if x._local.is_meta:  # a simulation's, or a model built on meta and not materialized
        no_value_in_simulation(x)
        raise GlobalTensorError(meta_message("reading a value (bool, float, int)",
                                             "this global tensor", x))
    if groups_frozen():
        full = Layout(x._layout.placement, replicated(x._layout.placement.ndim), x._layout.shape)
    else:
        full = whole_on_every_rank(x._layout)
    piece = redistribute_local(x._local, x._layout, full)
    if piece.is_meta:  # a simulation's known value, summed or gathered: no longer known
        no_value_in_simulation(x)
    if my_coord(full.placement) is None:
        raise GlobalTensorError(
            f"this rank is outside {x.placement!r}, so it holds no value to read while only "
            f"the ranks of a pipeline's stage run; read the value outside the stage's forward "
            f"(x.item() there: every rank gets it)")
    return piece.item()


def pointwise_on_pieces(func, args, kwargs, tensors) -> bool:
    """Whether the foreach op can run once on the pieces: its per-tensor op is pointwise, the
    global tensors of each element share one layout with no partial sum (aligned pieces of
    equal shapes, so every output is the element's layout), a global scalar tensor outside the
    lists is broadcast, and no keyword is a tensor. An optimizer's ``_foreach_*`` steps are
    (parameters, gradients and states laid out alike)."""
    base, _ = _foreach_base(func)
    if torch.Tag.pointwise not in base.tags:
        return False
    if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        return False
    lists = [a for a in args if isinstance(a, (list, tuple))]
    tensor_lists = [a for a in lists if any(isinstance(v, torch.Tensor) for v in a)]
    if not tensor_lists or any(len(a) != len(tensor_lists[0]) for a in lists):
        return False
    for a in tensor_lists:
        if not all(type(v) is GlobalTensor for v in a):
            return False
    for elements in zip(*tensor_lists):
        layout = elements[0]._layout
        if layout.is_partial or any(v._layout != layout for v in elements[1:]):
            return False
    for a in args:
        if isinstance(a, GlobalTensor) and (a.dim() != 0 or not all(isinstance(v, Broadcast) for v in a._layout.sbp)):
            return False
    return True


def foreach_on_pieces(func, args, kwargs, tensors):
    """``torch._foreach_*`` run once on the pieces (see :func:`pointwise_on_pieces`): one
    dispatch and one local foreach kernel for the whole list instead of one per element."""
    inplace = func._schema.name.endswith("_")
    if _debug.is_debug() or (inplace and any(LINK in t.__dict__ for t in args[0])):
        return foreach(func, args, kwargs, tensors)  # checks per element; writes through views
    largs = [[v._local for v in a] if isinstance(a, (list, tuple)) and a and
             isinstance(a[0], GlobalTensor) else a._local if isinstance(a, GlobalTensor) else a
             for a in args]
    result = func._op(*largs, **kwargs)
    if inplace:
        return result
    first = next(a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], GlobalTensor))
    return [GlobalTensor._make(r, v._layout) for r, v in zip(result, first)]


def foreach(func, args, kwargs, tensors):
    """``torch._foreach_*``: the same op on each element, through dispatch."""
    base, inplace = _foreach_base(func)
    n = max(len(a) for a in args if isinstance(a, (list, tuple)))
    positional = [a.name for a in base._schema.arguments if not a.kwarg_only]
    keyword = [a.name for a in base._schema.arguments if a.kwarg_only]
    results = []
    for i in range(n):
        elem_args = [_element(a, i, func) for a in args]
        elem_kwargs = {k: _element(v, i, func) for k, v in kwargs.items()}
        # a scalar the foreach op takes positionally may be keyword-only in the base op
        extra = elem_args[len(positional):]
        elem_kwargs.update(zip(keyword, extra))
        results.append(base(*elem_args[:len(positional)], **elem_kwargs))
    return None if inplace else results


def _element(value, i, func):
    if isinstance(value, (list, tuple)):
        return value[i]
    if isinstance(value, torch.Tensor) and not isinstance(value, GlobalTensor) and value.dim() == 1 \
            and func._overloadname == "Tensor":
        return value[i].item()  # a tensor of per-element scalars
    return value


def _foreach_base(func):
    name = func._schema.name.split("::")[1][len("_foreach_"):]
    inplace = name.endswith("_")
    packet = getattr(aten, name, None)
    if packet is None:
        raise GlobalTensorError(f"no per-tensor op for {func}; please report this")
    wanted = {"List": ("Tensor", "default"), "Scalar": ("Scalar", "default", "Tensor"),
              "ScalarList": ("Scalar", "default", "Tensor"), "Tensor": ("Scalar", "default", "Tensor"),
              "default": ("default",)}.get(func._overloadname, (func._overloadname, "default"))
    for overload in wanted:
        if overload in packet.overloads():
            return getattr(packet, overload), inplace
    raise GlobalTensorError(f"no per-tensor overload of aten.{name} for {func}; please report this")


def mixed_placements(tensors, op):
    found = sorted({repr(t.placement) for t in tensors})
    raise GlobalTensorError(
        f"{op}: expected global tensors of one placement, found {len(found)}: {', '.join(found)}; "
        f"move them to one placement first with x.to_global(placement=...)")


SPECIAL = {
    aten.copy_.default: _copy_,
    aten._local_scalar_dense.default: _local_scalar_dense,
}
