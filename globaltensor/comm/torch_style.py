"""torch-style calls: exactly torch.distributed's, in place on the tensors passed, any ``group``,
``async_op`` and ``ReduceOp``; where torch returns ``None`` they return the output argument.

The public names here are torch-style only; the torch halves of the calls that also have a value
style (``all_reduce_tensor`` & co.) are chosen by ``collectives``. Where the backend lacks an
operation, ``built`` builds it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import built
from .common import (ReduceOp, agree, checked_tag, dense, done, ensure_world, finish, op_fact, peer,
                     root, size, stand_in, tensor_fact, written)
from ..runtime.guard import guarded

# ---------------------------------------------------------------------------------------------
# the torch halves of the two-style calls (the world is already joined)
# ---------------------------------------------------------------------------------------------


def all_reduce_tensor(tensor: torch.Tensor, op, group, async_op: bool):
    agree("all_reduce", group, tensor=tensor_fact(tensor), reduce_op=op_fact(op), async_op=async_op)
    stand, back = stand_in(tensor)
    got = built.all_reduce_in_place(stand, op, group, async_op)
    return written(got, stand, tensor, back, async_op)


def all_gather_list(tensor_list, tensor: torch.Tensor, group, async_op: bool):
    """Fill ``tensor_list`` with every rank's ``tensor``; its entries may differ in size."""
    agree("all_gather", group, outputs=[tensor_fact(t) for t in tensor_list],
          tensor=tensor_fact(tensor, shape=False), async_op=async_op)
    stand, back = stand_in(tensor_list)
    if len({tuple(t.shape) for t in stand}) <= 1:
        got = finish(stand, dist.all_gather(stand, dense(tensor), group, async_op), async_op)
    else:
        built.gather_uneven_into(stand, dense(tensor), group)
        got = done(stand, async_op)
    return written(got, stand, tensor_list, back, async_op)


def broadcast_tensor(tensor: torch.Tensor, group_src: int, group, async_op: bool):
    agree("broadcast", group, tensor=tensor_fact(tensor), group_src=group_src, async_op=async_op)
    stand, back = stand_in(tensor)
    work = dist.broadcast(stand, group=group, async_op=async_op, group_src=group_src)
    return written(finish(stand, work, async_op), stand, tensor, back, async_op)


# ---------------------------------------------------------------------------------------------
# rooted collectives: reduce, gather, scatter
# ---------------------------------------------------------------------------------------------


@guarded("reduce")
def reduce(tensor, dst: int | None = None, op=ReduceOp.SUM, group=None, async_op: bool = False,
           group_dst: int | None = None):
    """torch style: the reduction lands in ``tensor`` on ``dst`` (default 0); returns ``tensor``."""
    ensure_world()
    gdst = root(group, dst, group_dst, "dst")
    agree("reduce", group, tensor=tensor_fact(tensor), reduce_op=op_fact(op), group_dst=gdst,
          async_op=async_op)
    stand, back = stand_in(tensor)
    got = built.reduce_in_place(stand, op, group, async_op, lambda t, o, a: dist.reduce(
        t, op=o, group=group, async_op=a, group_dst=gdst))
    return written(got, stand, tensor, back, async_op)


@guarded("gather")
def gather(tensor, gather_list=None, dst: int | None = None, group=None, async_op: bool = False,
           group_dst: int | None = None):
    """torch style: every rank's ``tensor`` into ``gather_list`` on ``dst`` (default 0)."""
    return _gather_or_scatter(_GATHER, tensor, gather_list, dst, group_dst, group, async_op)


@guarded("scatter")
def scatter(tensor, scatter_list=None, src: int | None = None, group=None, async_op: bool = False,
            group_src: int | None = None):
    """torch style: ``scatter_list[r]`` on ``src`` (default 0) lands in rank r's ``tensor``."""
    return _gather_or_scatter(_SCATTER, tensor, scatter_list, src, group_src, group, async_op)


@dataclass(frozen=True, slots=True)
class _Rooted:
    """gather or scatter: what differs between the two."""

    name: str
    role: str              # the root's role: "dst" (gather) or "src" (scatter)
    native: Callable       # torch's call
    by_p2p: Callable       # the call built from send/recv, for backends without torch's
    fills_list: bool       # gather fills the list on the root; scatter fills each rank's tensor


_GATHER = _Rooted("gather", "dst", dist.gather, built.gather_by_p2p, fills_list=True)
_SCATTER = _Rooted("scatter", "src", dist.scatter, built.scatter_by_p2p, fills_list=False)


def _gather_or_scatter(call: _Rooted, tensor, pieces, rank, group_rank, group, async_op: bool):
    ensure_world()
    r = root(group, rank, group_rank, call.role)
    agree(call.name, group, tensor=tensor_fact(tensor), **{f"group_{call.role}": r},
          async_op=async_op)
    if call.fills_list:  # gather: the list is written, the tensor read
        original, (stand, back) = pieces, stand_in(pieces)
        tensor = dense(tensor)
    else:  # scatter: the tensor is written, the list read
        original, (stand, back) = tensor, stand_in(tensor)
        pieces = dense(pieces)
    args = (tensor, stand) if call.fills_list else (stand, pieces)
    if built.lacks_gather_scatter(tensor, group):
        got = done(call.by_p2p(*args, r, group), async_op)
        return written(got, stand, original, back, async_op)
    work = call.native(*args, group=group, async_op=async_op, **{f"group_{call.role}": r})
    return written(finish(stand, work, async_op), stand, original, back, async_op)


# ---------------------------------------------------------------------------------------------
# reduce_scatter, all_gather_into_tensor, all_to_all, isend / irecv
# ---------------------------------------------------------------------------------------------


@guarded("reduce_scatter")
def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """torch style: ``output`` on rank r = reduction of every rank's ``input_list[r]``."""
    ensure_world()
    agree("reduce_scatter", group, output=tensor_fact(output), reduce_op=op_fact(op),
          async_op=async_op)
    stand, back = stand_in(output)
    inputs = dense(list(input_list))
    got = built.reduce_scatter_lowered(
        stand, op, group, async_op, stacked=lambda: torch.stack(inputs),
        native=lambda o: dist.reduce_scatter(stand, inputs, o, group=group, async_op=async_op))
    return written(got, stand, output, back, async_op)


@guarded("reduce_scatter_tensor")
def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """torch style: ``input`` split on dim 0 into group-size pieces; piece r reduced into rank r's ``output``."""
    ensure_world()
    agree("reduce_scatter_tensor", group, output=tensor_fact(output),
          input=tensor_fact(input), reduce_op=op_fact(op), async_op=async_op)
    stand, back = stand_in(output)
    source = dense(input)
    got = built.reduce_scatter_lowered(
        stand, op, group, async_op,
        stacked=lambda: source.reshape((size(group),) + tuple(output.shape)),
        native=lambda o: dist.reduce_scatter_single(stand, source, o, group=group,
                                                    async_op=async_op))
    return written(got, stand, output, back, async_op)


@guarded("all_gather_into_tensor")
def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op: bool = False):
    """torch style: every rank's ``input_tensor`` concatenated on dim 0 into ``output_tensor``."""
    ensure_world()
    agree("all_gather_into_tensor", group, output=tensor_fact(output_tensor),
          input=tensor_fact(input_tensor), async_op=async_op)
    stand, back = stand_in(output_tensor)
    work = dist.all_gather_single(stand, dense(input_tensor), group=group, async_op=async_op)
    return written(finish(stand, work, async_op), stand, output_tensor, back, async_op)


@guarded("all_to_all")
def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op: bool = False):
    """torch style: rank r's ``input_tensor_list[s]`` lands in rank s's ``output_tensor_list[r]``."""
    ensure_world()
    agree("all_to_all", group, tensors=len(input_tensor_list), async_op=async_op)
    stand, back = stand_in(output_tensor_list)
    work = dist.all_to_all(stand, dense(input_tensor_list), group=group, async_op=async_op)
    return written(finish(stand, work, async_op), stand, output_tensor_list, back, async_op)


@guarded("all_to_all_single")
def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op: bool = False):
    ensure_world()
    agree("all_to_all_single", group, dtype=str(input.dtype), async_op=async_op)
    stand, back = stand_in(output)
    work = dist.all_to_all_single(stand, dense(input), output_split_sizes, input_split_sizes,
                                  group=group, async_op=async_op)
    return written(finish(stand, work, async_op), stand, output, back, async_op)


@guarded("isend")
def isend(tensor, dst: int | None = None, group=None, tag: int = 0, group_dst: int | None = None):
    ensure_world()
    gdst = peer(group, dst, group_dst, "dst")
    return dist.isend(dense(tensor), group=group, tag=checked_tag(tag), group_dst=gdst)


@guarded("irecv")
def irecv(tensor, src: int | None = None, group=None, tag: int = 0, group_src: int | None = None):
    ensure_world()
    gsrc = None if src is None and group_src is None else peer(group, src, group_src, "src")
    stand, back = stand_in(tensor)
    work = dist.irecv(stand, group=group, tag=checked_tag(tag), group_src=gsrc)
    return work if back is None else written(work, stand, tensor, back, async_op=True)


