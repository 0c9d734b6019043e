"""User collectives, ``gt.comm``: torch.distributed's calls, plus value-style calls.

Two call styles, told apart by the arguments (the full table is in docs/collectives.md):

* torch style -- a tensor (or output arguments) first, exactly as ``torch.distributed``: the call
  works in place, accepts any ``group``, ``async_op`` and every ``ReduceOp``, and returns what torch
  returns, except that where torch returns ``None`` it returns the output argument it wrote into::

      gt.comm.all_reduce(t)                         # t summed in place; returns t
      gt.comm.all_reduce(t, op=gt.comm.ReduceOp.MAX)
      gt.comm.all_gather(out_list, t)               # fills out_list; returns out_list

* value style -- only the data: the call returns the result and never modifies the caller's data::

      gt.comm.all_reduce(t, reduce_op="mean")       # a new tensor; t untouched
      gt.comm.all_reduce({"loss": t, "n": 3})       # the same nested structure, summed
      gt.comm.all_gather(t)                         # tensors stacked on a new dim 0 (a list if shapes differ)
      gt.comm.all_gather(3.0)                       # [3.0, ...], one entry per rank
      gt.comm.broadcast("hello", src=0)             # rank 0's string on every rank

This module holds the calls that have both styles and picks one per call; ``torch_style`` holds
the torch halves and the torch-only calls, ``values`` the value halves, ``barriers`` the barriers,
and ``built`` the operations a backend lacks, built from ones it has (``built.LACKS``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import GlobalTensorError
from . import built, torch_style, values
from .barriers import barrier, monitored_barrier, rank_zero_first
from .common import (ReduceOp, Red, checked_tag, dense, ensure_world, group_rank, group_size, kind,
                     peer, root, stand_in, to_reduce_op, written)
from ..runtime.guard import guarded
from .torch_style import (all_gather_into_tensor, all_to_all, all_to_all_single, gather, irecv,
                          isend, reduce, reduce_scatter, reduce_scatter_tensor, scatter)

__all__ = [
    "ReduceOp", "all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "broadcast", "gather", "irecv", "isend",
    "monitored_barrier", "rank_zero_first", "recv", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "send",
]


@guarded("all_reduce")
def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, *, reduce_op=None):
    """Reduce over the ranks of ``group``.

    torch style (a tensor, no ``reduce_op``): in place; returns the tensor (a work if async_op)::

        gt.comm.all_reduce(t, op=gt.comm.ReduceOp.MAX)

    value style (``reduce_op=`` given, or data that is not one tensor): returns a new value of the
    same structure -- a tensor, a nested dict/list/tuple of tensors and numbers, or a number::

        gt.comm.all_reduce({"loss": loss, "n": 4}, reduce_op="mean")
    """
    ensure_world()
    if reduce_op is None and isinstance(tensor, torch.Tensor):
        return torch_style.all_reduce_tensor(tensor, op, group, async_op)
    if reduce_op is not None and kind(to_reduce_op(op)) != Red.SUM:
        raise GlobalTensorError(f"expected either op= or reduce_op=, found both (op={op!r}, "
                                f"reduce_op={reduce_op!r}); pass one of them")
    return values.all_reduce(tensor, reduce_op if reduce_op is not None else op, group, async_op)


@guarded("all_gather")
def all_gather(tensor_list, tensor=None, group=None, async_op: bool = False):
    """Gather from every rank of ``group``.

    torch style ``all_gather(out_list, t)``: fills ``out_list`` (its tensors may differ in size,
    one per rank's ``t``); returns ``out_list`` (a work if async_op).

    value style ``all_gather(x)``: a tensor -> every rank's tensor stacked on a new dim 0 (a list
    when shapes differ); a nested dict/list/tuple holding tensors -> the same structure, gathered
    leaf by leaf; anything else (numbers, strings, objects) -> a list with one entry per rank.
    """
    ensure_world()
    if tensor is None:
        return values.all_gather(tensor_list, group, async_op)
    return torch_style.all_gather_list(tensor_list, tensor, group, async_op)


@guarded("broadcast")
def broadcast(tensor, src: int | None = None, group=None, async_op: bool = False,
              group_src: int | None = None):
    """Rank ``src``'s value on every rank of ``group`` (``src`` defaults to 0).

    A tensor is broadcast in place, torch style (same shape and dtype on every rank), and also
    returned. Anything else -- numbers, strings, picklable objects, collections -- comes back as
    src's value (value style), whatever the other ranks passed.
    """
    ensure_world()
    gsrc = root(group, src, group_src, "src")
    if isinstance(tensor, torch.Tensor):
        return torch_style.broadcast_tensor(tensor, gsrc, group, async_op)
    return values.broadcast(tensor, gsrc, group, async_op)


@guarded("send")
def send(tensor, dst: int | None = None, group=None, tag: int = 0, group_dst: int | None = None):
    """torch style for a tensor; any other value is pickled and sent (``recv(src=...)`` gets it)."""
    ensure_world()
    gdst = peer(group, dst, group_dst, "dst")
    if isinstance(tensor, torch.Tensor):
        return dist.send(dense(tensor), group=group, tag=checked_tag(tag), group_dst=gdst)
    return values.send(tensor, gdst, group)


@guarded("recv")
def recv(tensor=None, src: int | None = None, group=None, tag: int = 0, group_src: int | None = None):
    """torch style with a tensor (returns the sender's rank); without one, returns the object
    that rank ``src`` sent with ``send(obj, dst)``."""
    ensure_world()
    if tensor is None:
        return values.recv(src, group_src, group)
    gsrc = None if src is None and group_src is None else peer(group, src, group_src, "src")
    stand, back = stand_in(tensor)
    sender = dist.recv(stand, group=group, tag=checked_tag(tag), group_src=gsrc)
    return written(sender, stand, tensor, back, async_op=False)


# the built operations under the names tests/ranks/test_comm.py calls directly
_LACKS, _need, _Lowered = built.LACKS, built.need, built.Lowered
_combine_gathered, _reduce_scatter_built = built.combine_gathered, built.reduce_scatter_built
_gather_by_p2p, _scatter_by_p2p = built.gather_by_p2p, built.scatter_by_p2p
