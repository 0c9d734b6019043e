"""Operations a backend lacks, built from ones it has (the table is ``LACKS``; docs/collectives.md).

The lowering is chosen per call from the tensor's device (``cpu:gloo,cuda:nccl`` groups use gloo
for CPU tensors and NCCL for CUDA ones):

* PREMUL_SUM on gloo: scale the input, then SUM;
* integer AVG on gloo: SUM, then divide by the group size (truncating, as NCCL's integer AVG does);
* BAND / BOR / BXOR on NCCL: all_gather, then combine locally;
* gather / scatter on a backend without them: send/recv to and from the root;
* all_gather of differently sized tensors: zero-pad, one all_gather, trim.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .common import (BITWISE, Red, ReduceOp, backend_for, done, finish, kind, my_group_rank, size,
                     to_reduce_op)

# (backend, need) pairs a backend cannot do natively; each is built from operations it has
LACKS = frozenset({("gloo", "premul_sum"), ("gloo", "avg_integer"), ("nccl", "bitwise")})
# backends known to have gather and scatter; any other one gets them built from send/recv
NATIVE_GATHER_SCATTER = frozenset({"gloo", "nccl", "mpi", "ucc", "xccl"})

# element-wise functions that combine two ranks' values, for ops reduced locally
COMBINE = {
    Red.SUM: torch.add, Red.PRODUCT: torch.mul, Red.MIN: torch.minimum,
    Red.MAX: torch.maximum, Red.BAND: torch.bitwise_and, Red.BOR: torch.bitwise_or,
    Red.BXOR: torch.bitwise_xor,
}

# ---------------------------------------------------------------------------------------------
# reductions: which ones need building, and how this rank runs them
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Lowered:
    """How this rank runs a reduction: the backend's op, plus the steps around it."""

    op: object                  # what the backend runs
    scale: object = None        # multiply the input by this first (PREMUL_SUM built as scale + SUM)
    divide: bool = False        # divide the result by the group size, truncating (integer AVG)
    by_gather: bool = False     # all_gather and combine locally (an op the backend lacks)


def need(op, dtype: torch.dtype) -> str | None:
    """What ``op`` on ``dtype`` asks of a backend beyond the plain reductions, if anything."""
    k = kind(op)
    if k == Red.PREMUL_SUM:
        return "premul_sum"
    if k == Red.AVG and not (dtype.is_floating_point or dtype.is_complex):
        return "avg_integer"
    if k in BITWISE:
        return "bitwise"
    return None


def lower(op, tensor: torch.Tensor, group) -> Lowered:
    op = to_reduce_op(op)
    what = need(op, tensor.dtype)
    if what is None or (backend_for(tensor, group), what) not in LACKS:
        return Lowered(op)
    if what == "premul_sum":
        return Lowered(ReduceOp.SUM, scale=op.factor)
    if what == "avg_integer":
        return Lowered(ReduceOp.SUM, divide=True)
    return Lowered(kind(op), by_gather=True)


def combine_gathered(tensor: torch.Tensor, op_kind, group) -> torch.Tensor:
    """Reduce ``tensor`` over ``group`` in place by gathering every rank's value."""
    parts = [torch.empty_like(tensor) for _ in range(size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    tensor.copy_(functools.reduce(COMBINE[op_kind], parts))
    return tensor


def _then_divide(tensor: torch.Tensor, low: Lowered, group):
    """The step after the backend's SUM that makes it an integer AVG (None when not needed)."""
    return (lambda: tensor.div_(size(group), rounding_mode="trunc")) if low.divide else None


def run_lowered(tensor: torch.Tensor, low: Lowered, group, async_op: bool, run):
    """Reduce ``tensor`` in place as ``low`` says; ``run(tensor, op, async_op)`` starts the
    backend's reduction (all_reduce or reduce) and returns its work."""
    if low.by_gather:
        return done(combine_gathered(tensor, low.op, group), async_op)
    if low.scale is not None:
        tensor.mul_(low.scale)
    work = run(tensor, low.op, async_op)
    return finish(tensor, work, async_op, _then_divide(tensor, low, group))


def reduce_in_place(tensor: torch.Tensor, op, group, async_op: bool, run):
    """Run reduction ``run`` (see run_lowered) of ``op`` with the backend's lowering."""
    return run_lowered(tensor, lower(op, tensor, group), group, async_op, run)


def _all_reduce_on(group):
    return lambda t, o, a: dist.all_reduce(t, o, group=group, async_op=a)


def all_reduce_in_place(tensor: torch.Tensor, op, group, async_op: bool = False):
    """torch's all_reduce of ``op`` on ``tensor``, built where the backend lacks it."""
    return reduce_in_place(tensor, op, group, async_op, _all_reduce_on(group))


def reduce_scatter_lowered(output: torch.Tensor, op, group, async_op: bool, stacked, native):
    """reduce_scatter of ``op`` into ``output``: ``native(op)`` starts the backend's own and
    returns its work; an op built around a whole reduction reduces ``stacked()`` instead (every
    rank's input pieces, one row per destination rank)."""
    low = lower(op, output, group)
    if low.by_gather or low.scale is not None:
        return reduce_scatter_built(output, stacked(), low, group, async_op)
    return finish(output, native(low.op), async_op, _then_divide(output, low, group))


def reduce_scatter_built(output, stacked: torch.Tensor, low: Lowered, group, async_op):
    """reduce_scatter of an op the backend lacks: all_reduce (lowered) then keep this rank's row."""
    full = stacked.clone()
    run_lowered(full, low, group, False, _all_reduce_on(group))
    output.copy_(full[my_group_rank(group)])
    return done(output, async_op)


# ---------------------------------------------------------------------------------------------
# gather and scatter from send/recv
# ---------------------------------------------------------------------------------------------


def lacks_gather_scatter(tensor: torch.Tensor, group) -> bool:
    return backend_for(tensor, group) not in NATIVE_GATHER_SCATTER


def gather_by_p2p(tensor, gather_list, group_dst: int, group):
    """gather built from send/recv: every rank sends to the root, which receives from each."""
    me = my_group_rank(group)
    if me != group_dst:
        dist.send(tensor, group=group, group_dst=group_dst)
    else:
        _at_root(gather_list, me, lambda out, r: dist.irecv(out, group=group, group_src=r),
                 lambda: gather_list[me].copy_(tensor))
    return gather_list


def scatter_by_p2p(tensor, scatter_list, group_src: int, group):
    """scatter built from send/recv: the root sends piece r to rank r."""
    me = my_group_rank(group)
    if me != group_src:
        dist.recv(tensor, group=group, group_src=group_src)
    else:
        _at_root(scatter_list, me, lambda piece, r: dist.isend(piece, group=group, group_dst=r),
                 lambda: tensor.copy_(scatter_list[me]))
    return tensor


def _at_root(pieces, me: int, start, own) -> None:
    """Start ``start(piece, r)`` for every other rank r's piece, do ``own()``, wait for them all."""
    works = [start(piece, r) for r, piece in enumerate(pieces) if r != me]
    own()
    for w in works:
        w.wait()


# ---------------------------------------------------------------------------------------------
# all_gather of differently sized tensors: zero-pad, gather once, trim
# ---------------------------------------------------------------------------------------------


def gather_stacked(out: torch.Tensor, tensor: torch.Tensor, group) -> None:
    """Every rank's ``tensor`` into ``out[r]`` (``out`` has shape (group size, *tensor.shape))."""
    if tensor.numel():
        dist.all_gather_single(out.view(-1), tensor.reshape(-1), group=group)


def gather_padded(flat: torch.Tensor, width: int, group) -> torch.Tensor:
    """(group size, width): every rank's 1-D ``flat``, zero-padded to ``width``."""
    buf = flat.new_zeros(width)
    buf[: flat.numel()] = flat
    out = flat.new_empty((size(group), width))
    gather_stacked(out, buf, group)
    return out


def gather_uneven_into(outputs: list[torch.Tensor], tensor: torch.Tensor, group) -> None:
    """Rank r's ``tensor`` lands in ``outputs[r]``: pad to the largest, gather, trim."""
    sizes = [o.numel() for o in outputs]
    gathered = gather_padded(tensor.detach().reshape(-1), max(sizes), group)
    for out, row, n in zip(outputs, gathered, sizes):
        out.copy_(row[:n].view(out.shape))
