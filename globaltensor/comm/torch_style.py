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
from .common import ReduceOp, agree, done, ensure_world, finish, op_fact, root, size, tensor_fact
from ..runtime.guard import guarded

# ---------------------------------------------------------------------------------------------
# the torch halves of the two-style calls (the world is already joined)
# ---------------------------------------------------------------------------------------------


def all_reduce_tensor(tensor: torch.Tensor, op, group, async_op: bool):
    agree("all_reduce", group, tensor=tensor_fact(tensor), reduce_op=op_fact(op), async_op=async_op)
    return built.all_reduce_in_place(tensor, op, group, async_op)


def all_gather_list(tensor_list, tensor: torch.Tensor, group, async_op: bool):
    """Fill ``tensor_list`` with every rank's ``tensor``; its entries may differ in size."""
    agree("all_gather", group, outputs=[tensor_fact(t) for t in tensor_list],
          tensor=tensor_fact(tensor, shape=False), async_op=async_op)
    if len({tuple(t.shape) for t in tensor_list}) <= 1:
        return finish(tensor_list, dist.all_gather(tensor_list, tensor, group, async_op), async_op)
    built.gather_uneven_into(tensor_list, tensor, group)
    return done(tensor_list, async_op)


def broadcast_tensor(tensor: torch.Tensor, group_src: int, group, async_op: bool):
    agree("broadcast", group, tensor=tensor_fact(tensor), group_src=group_src, async_op=async_op)
    work = dist.broadcast(tensor, group=group, async_op=async_op, group_src=group_src)
    return finish(tensor, work, async_op)


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
    return built.reduce_in_place(tensor, op, group, async_op, lambda t, o, a: dist.reduce(
        t, op=o, group=group, async_op=a, group_dst=gdst))


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
    if built.lacks_gather_scatter(tensor, group):
        return done(call.by_p2p(tensor, pieces, r, group), async_op)
    work = call.native(tensor, pieces, group=group, async_op=async_op, **{f"group_{call.role}": r})
    return finish(pieces if call.fills_list else tensor, work, async_op)


# ---------------------------------------------------------------------------------------------
# reduce_scatter, all_gather_into_tensor, all_to_all, isend / irecv
# ---------------------------------------------------------------------------------------------


@guarded("reduce_scatter")
def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """torch style: ``output`` on rank r = reduction of every rank's ``input_list[r]``."""
    ensure_world()
    agree("reduce_scatter", group, output=tensor_fact(output), reduce_op=op_fact(op),
          async_op=async_op)
    return built.reduce_scatter_lowered(
        output, op, group, async_op, stacked=lambda: torch.stack(list(input_list)),
        native=lambda o: dist.reduce_scatter(output, list(input_list), o, group=group,
                                             async_op=async_op))


@guarded("reduce_scatter_tensor")
def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """torch style: ``input`` split on dim 0 into group-size pieces; piece r reduced into rank r's ``output``."""
    ensure_world()
    agree("reduce_scatter_tensor", group, output=tensor_fact(output),
          input=tensor_fact(input), reduce_op=op_fact(op), async_op=async_op)
    return built.reduce_scatter_lowered(
        output, op, group, async_op,
        stacked=lambda: input.reshape((size(group),) + tuple(output.shape)),
        native=lambda o: dist.reduce_scatter_single(output, input, o, group=group,
                                                    async_op=async_op))


@guarded("all_gather_into_tensor")
def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op: bool = False):
    """torch style: every rank's ``input_tensor`` concatenated on dim 0 into ``output_tensor``."""
    ensure_world()
    agree("all_gather_into_tensor", group, output=tensor_fact(output_tensor),
          input=tensor_fact(input_tensor), async_op=async_op)
    work = dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
    return finish(output_tensor, work, async_op)


@guarded("all_to_all")
def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op: bool = False):
    """torch style: rank r's ``input_tensor_list[s]`` lands in rank s's ``output_tensor_list[r]``."""
    ensure_world()
    agree("all_to_all", group, tensors=len(input_tensor_list), async_op=async_op)
    work = dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)
    return finish(output_tensor_list, work, async_op)


@guarded("all_to_all_single")
def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op: bool = False):
    ensure_world()
    agree("all_to_all_single", group, dtype=str(input.dtype), async_op=async_op)
    work = dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                  group=group, async_op=async_op)
    return finish(output, work, async_op)


@guarded("isend")
def isend(tensor, dst: int | None = None, group=None, tag: int = 0, group_dst: int | None = None):
    ensure_world()
    return dist.isend(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)


@guarded("irecv")
def irecv(tensor, src: int | None = None, group=None, tag: int = 0, group_src: int | None = None):
    ensure_world()
    return dist.irecv(tensor, src=src, group=group, tag=tag, group_src=group_src)


