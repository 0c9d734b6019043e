"""Writes through views that could not alias their base.

A view op (``select``, ``slice``, ``diagonal``, ``t``, ``view``, ``split``, ...) whose signature
moved its input gives an output whose pieces are copies, not views of the base's pieces: a write
into it (``x[1] = 5``, ``x[0:2].mul_(3)``, ``x.diagonal().zero_()``) would reach only the copy.
Such an output carries a *link* to its base: after an in-place op on it, the base takes the
written value back through the view's scatter (``select_scatter``, ``slice_scatter``,
``diagonal_scatter``, the inverse permutation or shape), and so on up a chain of views. A view
that aliases its input's pieces but whose input is linked inherits a link that only passes the
write on. A linked view whose write cannot be scattered back raises instead of losing the write.
This module is the mechanism; each view op's scatter is registered with the op
(``register(..., write_back=...)`` in ``ops/views.py``).

Reads are not tracked: a detached view read after its base is written holds the value it had.
"""
from __future__ import annotations

import torch

from ..world import world
from ..errors import GlobalTensorError
from ..ops import arg_value, entry
from ..redistribute import redistribute_local
from ..sbp import format_sbp
from ..tensor import GlobalTensor
from .args import local_tensor_error

aten = torch.ops.aten
LINK = "_gt_view_of"  # in a view's __dict__: (base, scatter(base, view) -> new base, or None)


def is_view(func) -> bool:
    """Whether ``func``'s outputs alias its first input (torch's schema: ``Tensor(a)``)."""
    returns = func._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def link(result, base, op: str, args, kwargs, moved: bool) -> None:
    """Give ``result`` (a view op's output or outputs) its link to ``base``: through the op's
    scatter when the view was made from moved pieces, else (aliasing) only when ``base`` is
    itself linked."""
    if not moved and LINK not in base.__dict__:
        return
    outputs = result if isinstance(result, (list, tuple)) else [result]
    make = entry(op.split(".")[0]).write_back  # registered with the op (ops/views.py)
    for k, out in enumerate(outputs):
        if out is None:
            continue
        if not moved:
            scatter = None
        elif make is None:
            scatter = _cannot(op)
        else:
            scatter = make(lambda name, default=None: arg_value(op, args, kwargs, name, default), k)
        out.__dict__[LINK] = (base, scatter)


def _cannot(op: str):
    def scatter(base, view):
        raise GlobalTensorError(
            f"a write into the result of aten.{op} on a global tensor cannot reach its base: the "
            f"view was made from redistributed pieces and the op has no scatter here. Compute the "
            f"new value out of place and write it with base.copy_(...) or index_put_")
    return scatter


def write_back(view) -> None:
    """After an in-place op on ``view``: its base takes the written value, up the chain."""
    linked = view.__dict__.get(LINK)
    while linked is not None:
        base, scatter = linked
        if scatter is not None:
            write_into(base, scatter(base, view))
        view, linked = base, base.__dict__.get(LINK)


def write_into(self: GlobalTensor, value):
    """``self``'s piece := ``value``'s logical value laid out as ``self``."""
    if isinstance(value, GlobalTensor):
        if value.shape != self.shape:
            value = aten.expand.default(value, list(self.shape))
        piece = redistribute_local(value._local, value._layout, self._layout)
        if self._layout.placement.coord_of(world.get_rank()) is not None:
            self._local.copy_(piece)
        return
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        if self._layout.is_partial:
            raise GlobalTensorError(
                f"cannot write a local scalar into a partial_sum global tensor (sbp "
                f"{format_sbp(self.sbp)}): every rank would add it. Convert the target with "
                f".to_global(sbp=gt.sbp.broadcast) first, or write a global tensor")
        self._local.copy_(value)
        return
    raise local_tensor_error(value)

