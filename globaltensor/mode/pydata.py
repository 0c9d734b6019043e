"""Python data meeting a global tensor: lists and numpy arrays in indexing, ``new_tensor`` /
``new``, numpy arrays in arithmetic.

Such data is written in the program, so every rank holds the same value (SPMD): it becomes a
broadcast global tensor on the global tensor's placement (OneFlow does the same with index
lists). With ``GT_DEBUG=1`` the ranks' values are compared and a difference names the ranks.
Without this, torch would turn the data into a *local* tensor mid-op (``x[[1, 2]]``), or numpy
would compute a plain local result from the full value (``x + np.ones(4)``).

A local *tensor* stays what SPEC says: an error outside global mode, a broadcast value inside.

The other way round, a global tensor read as Python data: ``torch.tensor_split(x, indices)``
with ``indices`` a tensor is a C++ composite that reads the indices' memory directly, above
the dispatcher, where a global tensor has none. ``torch.tensor_split`` and
``Tensor.tensor_split`` take a global ``indices`` as its whole value (a local tensor, the same
on every rank: the collective ``full_tensor``, free for a broadcast one), so torch's own checks
and messages apply and the split itself runs on global tensors as usual.
"""
from __future__ import annotations

import functools
import numbers

import numpy as np
import torch

from .. import debug as _debug
from ..dispatch.adopt import agree_on_value
from ..errors import GlobalTensorError
from ..sbp import replicated
from ..tensor import GlobalTensor

_getitem = torch.Tensor.__getitem__
_setitem = torch.Tensor.__setitem__
_tensor_split = torch.tensor_split
_tensor_split_method = torch.Tensor.tensor_split


def _broadcast(x: GlobalTensor, data, dtype=None) -> GlobalTensor:
    from ..factories import tensor

    value = torch.as_tensor(data, dtype=dtype)
    if _debug.is_debug():
        agree_on_value("python data used with a global tensor", value)
    return tensor(value, placement=x.placement, sbp=replicated(x.placement.ndim),
                  dtype=value.dtype)


def _index(x: GlobalTensor, index):
    """``index`` with its lists and numpy arrays as broadcast global tensors."""
    if isinstance(index, tuple):
        if not any(isinstance(p, (list, np.ndarray)) for p in index):
            return index
        return tuple(_broadcast(x, p) if isinstance(p, (list, np.ndarray)) else p for p in index)
    if isinstance(index, (list, np.ndarray)):
        if isinstance(index, list) and any(isinstance(p, (slice, type(None), type(...)))
                                           or isinstance(p, torch.Tensor) for p in index):
            return tuple(_index(x, tuple(index)))  # numpy's old list-as-tuple form
        return _broadcast(x, index)
    return index


def getitem(self, index):
    return _getitem(self, _index(self, index))


def setitem(self, index, value):
    if isinstance(value, (list, np.ndarray)):
        value = _broadcast(self, value, dtype=self.dtype)
    return _setitem(self, _index(self, index), value)


def new_tensor(self, data, dtype=None, device=None, requires_grad=False, **_):
    """A broadcast global tensor on this tensor's placement holding ``data`` (the same on every
    rank), with this tensor's dtype unless ``dtype`` is given."""
    out = _broadcast(self, data.detach() if isinstance(data, torch.Tensor) else data,
                     dtype=dtype or self.dtype)
    return out.requires_grad_() if requires_grad else out


def new(self, *args, **kwargs):
    """``x.new(*sizes)`` (uninitialised) or ``x.new(data)``: a broadcast global tensor on this
    tensor's placement, with this tensor's dtype."""
    from ..factories import empty

    kwargs.pop("device", None)  # a global tensor's device is its placement's
    if not args:  # torch's x.new(): an empty tensor of shape (0,)
        args = (0,)
    if len(args) == 1 and not isinstance(args[0], numbers.Integral):
        if isinstance(args[0], torch.Size):
            args = tuple(args[0])
        else:
            return new_tensor(self, args[0])
    if not all(isinstance(a, numbers.Integral) for a in args):
        raise GlobalTensorError(
            f"x.new(...) on a global tensor expects sizes (ints) or data, found {args!r}; use "
            f"x.new_empty(size) or gt.tensor(data, placement=..., sbp=...)")
    return empty(*args, placement=self.placement, sbp=replicated(self.placement.ndim),
                 dtype=self.dtype)


def array_ufunc(self, ufunc, method, *inputs, **kwargs):
    """``np.ones(4) + x``, ``x * np.arange(4)``: numpy hands the ufunc to the global tensor,
    which runs torch's op of the same name with the arrays as broadcast global tensors."""
    fn = getattr(torch, ufunc.__name__, None)
    if method != "__call__" or fn is None or kwargs:
        return NotImplemented
    args = [_broadcast(self, v) if isinstance(v, (np.ndarray, np.generic)) else v for v in inputs]
    return fn(*args)


def _whole(args, kwargs):
    """tensor_split's arguments after ``input`` with a global tensor of indices or sections as
    its whole value (the keyword form is ``tensor_indices_or_sections``)."""
    if args and isinstance(args[0], GlobalTensor):
        args = (args[0].full_tensor(),) + tuple(args[1:])
    value = kwargs.get("tensor_indices_or_sections")
    if isinstance(value, GlobalTensor):
        kwargs = dict(kwargs, tensor_indices_or_sections=value.full_tensor())
    return args, kwargs


@functools.wraps(_tensor_split)  # torch's doc; a global tensor of indices: the module's doc
def tensor_split(input, *args, **kwargs):
    args, kwargs = _whole(args, kwargs)
    return _tensor_split(input, *args, **kwargs)


@functools.wraps(_tensor_split_method)
def tensor_split_method(self, *args, **kwargs):
    args, kwargs = _whole(args, kwargs)
    return _tensor_split_method(self, *args, **kwargs)


def install() -> None:
    """The methods above on GlobalTensor (called once by globaltensor/__init__.py)."""
    GlobalTensor.__getitem__ = getitem
    GlobalTensor.__setitem__ = setitem
    GlobalTensor.new_tensor = new_tensor
    GlobalTensor.new = new
    GlobalTensor.__array_ufunc__ = array_ufunc
    # tensor_split reads a tensor of indices above dispatch, for local inputs too
    torch.tensor_split = tensor_split
    torch.Tensor.tensor_split = tensor_split_method
