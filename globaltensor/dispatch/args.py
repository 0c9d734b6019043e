"""One walk over an op's (args, kwargs) per call, and what is derived from it.

:func:`flatten` is the only walk on the warm path. It gives the cache key *by id* (a global
tensor counts as ``(id(layout), dtype)``: hashing ints, not layouts), the global tensors in
order; a non-scalar local tensor (which only autograd's engine may pass) stops it. On a
miss, the key by value (:func:`by_value`), the :class:`~globaltensor.ops.Call` a rule sees
(:func:`call_of`) and the fast-path slots (:func:`slots_of`) are derived from that key, not from
another walk over the arguments. :func:`local_args` puts the local pieces in the global tensors'
places for the local op.

Floats and complex numbers enter neither key nor Call (``NUMBER``): no rule looks at a value like
lr, eps or alpha, so calls that differ only there share one decision.
"""
from __future__ import annotations

import torch

from ..errors import GlobalTensorError
from ..ops import LOCAL, NUMBER, Call, Ref
from ..tensor import GlobalTensor


class LocalTensorFound(Exception):
    """A non-scalar local tensor among the arguments (allowed only from autograd's engine)."""

    def __init__(self, value):
        super().__init__()
        self.value = value


def flatten(func, args, kwargs):
    """``(key, tensors)``: the cache key by id (``(op, *args parts, *kwargs names and parts)``,
    flat: nested tuples hash slower) and the global tensors in argument order. Raises
    :class:`LocalTensorFound` at a non-scalar local tensor."""
    tensors: list = []
    parts = [func._op]  # the C++ op behind the OpOverload: hashed in C (OpOverload's __hash__ is Python)
    for a in args:
        if type(a) is GlobalTensor:  # _part's global-tensor case, inline: the rows of benchmarks/dispatch.py
            tensors.append(a)
            parts.append((id(a._layout), a.dtype))
        else:
            parts.append(_part(a, tensors))
    if kwargs:
        for k, v in kwargs.items():
            parts.append(k)
            parts.append(_part(v, tensors))
    return tuple(parts), tensors


# argument types that enter the key as they are: checked first, by exact type (an isinstance
# test against torch.Generator runs a Python metaclass hook in torch >= 2.13)
_AS_IS = frozenset({int, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                    torch.memory_format})


def _part(value, tensors: list):
    cls = type(value)
    if cls in _AS_IS:
        return value
    if cls is float or cls is complex:
        return NUMBER
    if cls is list or cls is tuple:
        for v in value:  # sizes and dims: a tuple of the ints, without a walk per element
            if type(v) is not int:
                return tuple([_part(v, tensors) for v in value])
        return tuple(value)
    if isinstance(value, GlobalTensor):
        tensors.append(value)
        return id(value._layout), value.dtype
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise LocalTensorFound(value)
        return LOCAL, value.dtype
    if isinstance(value, torch.Generator):
        return None
    return value


def _is_global(part) -> bool:
    """A global tensor's part of the key: ``(id, dtype)``. No aten op takes a list holding a
    dtype, and a 0-dim local tensor's part starts with LOCAL, so nothing else looks like it."""
    return type(part) is tuple and len(part) == 2 and type(part[0]) is int and \
        isinstance(part[1], torch.dtype)


def _map(part, fn):
    """``part`` with every global tensor's entry replaced by ``fn(entry)``."""
    if type(part) is tuple:
        if _is_global(part):
            return fn(part)
        return tuple(_map(p, fn) for p in part)
    return part


def by_value(key, tensors) -> tuple:
    """The key with layouts compared by value: equal layouts made apart share a decision."""
    it = iter(tensors)
    return (key[0],) + _map(key[1:], lambda part: (next(it)._layout, part[1]))


def _split(key, nargs: int):
    """The key's (args parts, kwargs (name, part) pairs) for a call with ``nargs`` positional args."""
    rest = key[1 + nargs:]
    return key[1:1 + nargs], tuple(zip(rest[::2], rest[1::2]))


def call_of(name: str, key, nargs: int, tensors, tags) -> Call:
    """What a rule sees of this call: global tensors as ``Ref(i)``, shapes by index."""
    counter = iter(range(len(tensors)))

    def mark(part):
        if type(part) is not tuple:
            return part
        if _is_global(part):
            return Ref(next(counter))
        if len(part) == 2 and part[0] is LOCAL:
            return LOCAL
        return tuple(mark(p) for p in part)

    arg_parts, kwarg_parts = _split(key, nargs)
    args = tuple(mark(p) for p in arg_parts)
    kwargs = tuple(sorted((k, mark(v)) for k, v in kwarg_parts))
    return Call(name, tuple(t._layout.shape for t in tensors), args, kwargs, tags)


def slots_of(key, nargs: int) -> tuple[int, ...] | None:
    """Positions of the global tensors if every one is a plain positional arg, else None."""
    def nested(part):
        return type(part) is tuple and not _is_global(part) and any(
            _is_global(p) or nested(p) for p in part)
    arg_parts, kwarg_parts = _split(key, nargs)
    if any(_is_global(v) or nested(v) for _, v in kwarg_parts):
        return None
    if any(nested(p) for p in arg_parts):
        return None
    return tuple(i for i, p in enumerate(arg_parts) if _is_global(p))


def _swap(value, it):
    """``value`` with every global tensor replaced by the next piece from ``it``."""
    cls = type(value)
    if cls is GlobalTensor:
        return next(it)
    if cls is list or cls is tuple:
        if not any(isinstance(v, GlobalTensor) for v in value):
            return value
        return cls(_swap(v, it) for v in value)
    return value


def local_args(args, kwargs, pieces):
    """``(args, kwargs)`` for the local op: each global tensor replaced by its piece."""
    it = iter(pieces)
    largs = [_swap(a, it) for a in args]
    lkwargs = {k: _swap(v, it) for k, v in kwargs.items()} if kwargs else {}
    return largs, lkwargs


def local_tensor_error(value: torch.Tensor, op: str | None = None) -> GlobalTensorError:
    """``op``: the aten op's name ("quantile.default"), named first when known."""
    return GlobalTensorError(
        (f"aten.{op}: " if op else "") +
        f"an operator got a global tensor and a local tensor of shape {list(value.shape)}; "
        f"expected global tensors (or 0-dim local scalars) only. Make the local tensor "
        f"global first, e.g. t.to_global(placement=x.placement, sbp=gt.sbp.broadcast) for "
        f"a full value on every rank, or run the code under gt.global_mode(placement), where "
        f"local tensors are taken as broadcast values (torch ops that build a local tensor "
        f"inside, such as quantile or matrix_power(x, 0), need it)")
