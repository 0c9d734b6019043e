"""Run a plan on this rank's piece with real collectives (gloo on CPU, NCCL on CUDA).

SPMD: every rank of the world calls ``run`` with the same plan, in the same order. Every rank
makes the same process-group calls for every step (torch.distributed needs all ranks of the
world to create each group, in one order); a rank outside a step's group then skips its data
part. On CPU (gloo) gathers (AllGather, AllGatherV), reduce_scatters and all_reduces run as
batches of isend/irecv between the members (``_pairwise``), with exact sizes; on CUDA they are
NCCL's collectives, which pad uneven pieces to the largest of the group and trim after (an
AllGatherV is point to point there too). all_to_all sends exact split sizes everywhere.

The result is a fresh, contiguous tensor: the caller's tensor is never modified or aliased.
"""
from __future__ import annotations

import contextvars
import os

import torch

from .._cache import MISSING, ById
from ..errors import GlobalTensorError
from ..layout import box_shape, relative
from ..plan import (AllGather, AllGatherV, AllReduce, AllToAll, Exchange, LocalSlice, Plan,
                     ReduceScatter, Reorder, ZeroFill, reorder_piece)
from ..sbp import Broadcast
from ..world.simulated import simulated
from .emit import EAGER, emitter_for
from .groups import group_along, groups_along
from .guard import step_guard
from .pairwise import (all_reduce_pairwise, gather_pairwise, member_coords, offsets, prod,
                       reduce_scatter_pairwise, sizes_along)


def run(plan: Plan, local: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's piece of ``plan.dst`` from its piece ``local`` of ``plan.src``."""
    if not plan.steps:
        return local
    if local.is_conj() or local.is_neg():  # a lazy view's bits (a _conj piece): no collective
        local = local.resolve_conj().resolve_neg()  # sends them, so move the values they mean
    _check_summable(plan, local.dtype)
    if not local.is_meta and simulated() and not _STATIC.computed(plan, "local", _local_only):
        local = local.to("meta")  # a simulation's known value, sent: no longer known (knowable.py)
    emit = emitter_for(local)  # under torch.compile: functional collectives (emit.py)
    tag = emit.first_use_tag(plan, local, rank)  # ranks that disagree: an error, not a crash
    cuts = _STATIC.computed(plan, rank, _cuts)
    if cuts is not None:  # no communication: narrow, then one copy (never the caller's storage)
        for dim, start, length in cuts:
            local = local.narrow(dim, start, length)
        # a contiguous view clones contiguous by default (and the keyword costs ~10 us cold)
        return local.clone() if local.is_contiguous() else local.clone(memory_format=torch.contiguous_format)
    out = local
    for index, step in enumerate(plan.steps):
        emit.announce(step, out)  # the wire's one event of a step that communicates
        try:
            with step_guard(plan, index):  # a timeout names the step and its ranks
                out = _run_step(step, out, rank, tag, emit)
        except GlobalTensorError:  # ours: raised alike everywhere, or already a peer's failure
            raise
        except Exception as error:  # noqa: BLE001 - this rank alone may have raised
            raise emit.failure(plan, index, error) from error
    return emit.fresh(out, local, plan)


def _check_summable(plan: Plan, dtype: torch.dtype) -> None:
    """A plan that adds partial sums, for a dtype torch cannot add (uint16, uint32, uint64,
    float8): the same clear error on every rank, before anything moves."""
    message = _STATIC.get((id(plan), ("sums", dtype)), MISSING)  # the warm path: one lookup
    if message is MISSING:
        message = _STATIC.computed(plan, ("sums", dtype), _sum_message)
    if message is not None:
        raise GlobalTensorError(message)


def _sum_message(plan: Plan, where) -> str | None:
    dtype = where[1]
    if not any(isinstance(s, (AllReduce, ReduceScatter)) or (isinstance(s, Exchange)
               and s.before.is_partial) for s in plan.steps):
        return None
    try:
        torch.zeros(1, dtype=dtype).add_(torch.zeros(1, dtype=dtype))
        return None
    except (RuntimeError, NotImplementedError) as e:
        return (f"redistributing {plan.src!r} -> {plan.dst!r} adds the partial sums, and torch "
                f"cannot add {dtype} ({str(e).splitlines()[0][:120]}); expected a dtype torch "
                f"adds: cast first (x.to(torch.float32) or a wider integer type), or keep the "
                f"tensor split or broadcast")


# (id(obj), where) -> what obj needs there: a plan's local-slice cuts per rank (None when the
# plan communicates), a step's shapes, splits, orders and peers per coordinate. These depend
# only on the plan or step and the rank or coordinate, never on the world, so thread-ranks
# share them. An entry pins obj, so its id is not reused while the entry lives.
_STATIC = ById(4096)


def _local_only(plan: Plan, where) -> bool:
    return all(isinstance(s, (LocalSlice, ZeroFill, Reorder)) for s in plan.steps)


def _cuts(plan: Plan, rank: int):
    """For a plan of local slices only (B -> S, on any axes): this rank's (dim, start, length)
    narrows; None for any other plan."""
    if not all(isinstance(s, LocalSlice) for s in plan.steps):
        return None
    coord = plan.src.placement.coord_of(rank)
    if coord is None:
        return None  # outside the placement: the general path makes the empty piece
    cuts = []
    for step in plan.steps:
        (lo, hi), (base, _) = step.after.box(coord)[step.dim], step.before.box(coord)[step.dim]
        cuts.append((step.dim, lo - base, hi - lo))
    return tuple(cuts)


def _run_step(step, local: torch.Tensor, rank: int, tag: int, emit=EAGER) -> torch.Tensor:
    """One step; point-to-point messages travel on the plan's ``tag`` (layoutcheck.data_tag)."""
    after = step.after
    if isinstance(step, Exchange):
        return emit.exchange(step, local, rank, tag)
    if isinstance(step, Reorder):  # local, no axis
        return reorder_piece(step, local) if rank in after.placement else local
    # every rank of the world creates the axis's groups together, members or not
    n = after.placement.shape[step.axis]
    pairwise = emit.point_to_point and (
        _pairwise(step) or (local.dtype in _GLOO_CANNOT_REDUCE  # int16: p2p sums it
                            and after.placement.type == "cpu"
                            and isinstance(step, (ReduceScatter, AllReduce))))
    if n > 1 and not pairwise and not isinstance(step, (LocalSlice, ZeroFill, Reorder)):
        groups_along(after.placement, step.axis)
    coord = after.placement.coord_of(rank)
    if coord is None:
        return local.new_zeros(after.local_shape_of_rank(rank))  # empty (a 0 for a scalar)
    match step:
        case LocalSlice():
            return local[relative(after.box(coord), step.before.box(coord))]
        case ZeroFill():
            return _zero_fill(step, local, coord)
    if n == 1:  # a group of one: the collective changes nothing
        return local
    if pairwise:  # point-to-point: no group needed
        match step:
            case AllGather():
                return gather_pairwise(step, local, coord, tag)
            case ReduceScatter():
                return reduce_scatter_pairwise(step, local, coord, tag)
            case AllReduce():
                return all_reduce_pairwise(step, local, coord, tag)
    group, ranks = group_along(after.placement, step.axis, coord)
    match step:
        case AllGather():
            return _all_gather(step, local, coord, group, ranks, emit)
        case ReduceScatter():
            return _reduce_scatter(step, local, coord, group, ranks, emit)
        case AllReduce():
            return emit.all_reduce(local, group)
        case AllToAll():
            return _all_to_all(step, local, coord, group, ranks, emit)
    raise TypeError(f"the executor does not know the step {step!r}")


# GT_CPU_COLLECTIVES, read once per context (a thread-rank has its own): ``p2p`` (the default)
# runs a plan's gathers and reductions on CPU as batches of isend/irecv; ``gloo`` keeps gloo's
# own collectives (the code path NCCL takes).
_CPU_POINT_TO_POINT: contextvars.ContextVar = contextvars.ContextVar(
    "globaltensor_cpu_point_to_point", default=None)


def cpu_point_to_point() -> bool:
    """Whether a plan's gathers and reductions on CPU run point to point (GT_CPU_COLLECTIVES)."""
    flag = _CPU_POINT_TO_POINT.get()
    if flag is None:
        raw = os.environ.get("GT_CPU_COLLECTIVES", "p2p").strip().lower()
        if raw not in ("p2p", "gloo"):
            raise GlobalTensorError(
                f"expected GT_CPU_COLLECTIVES to be 'p2p' or 'gloo', found {raw!r}; unset it for "
                f"point-to-point gathers and reductions on CPU, or set it to 'gloo' for gloo's "
                f"collectives")
        flag = raw == "p2p"
        _CPU_POINT_TO_POINT.set(flag)
    return flag


def _pairwise(step) -> bool:
    """Whether a step runs as batches of point-to-point messages instead of a collective: on
    CPU (gloo) every gather, reduce_scatter and all_reduce (AllGatherV everywhere). gloo's
    collectives go round a ring in lockstep, n-1 rounds (2(n-1) for all_reduce), each waiting
    on the slowest member; the pairwise messages send the same bytes per rank, all in flight at
    once, and land in place. On 4 ranks: all_gather 1.5-3.7x and reduce_scatter 2.6-6x faster,
    all_reduce (a pairwise reduce_scatter, then a pairwise gather) 1.1-1.2x at 32 MiB and 2-3x
    at 4 KiB (docs/performance.md). NCCL keeps its collectives, pipelined rings. (The sums are
    ``+=``, as gloo's: for bool that is a logical or, as gloo's sum of bools.)"""
    return isinstance(step, AllGatherV) or (
        cpu_point_to_point() and step.after.placement.type == "cpu"
        and isinstance(step, (AllGather, ReduceScatter, AllReduce)))


# dtypes torch adds but gloo's reductions reject ("Invalid scalar type"): summed point to point
_GLOO_CANNOT_REDUCE = frozenset({torch.int16})


def _group_order(ranks) -> list[int]:
    """Axis indices in the order of the group's ranks: torch numbers the members of a group
    by their global rank, not by their place on the placement axis."""
    return sorted(range(len(ranks)), key=lambda k: ranks[k])


def _all_gather(step: AllGather, local, coord, group, ranks, emit) -> torch.Tensor:
    """Pieces (padded along dim to the largest) gather into one buffer, one block per member;
    along dim 0, in axis order and even, that buffer is the result (no copy)."""
    d = step.dim
    sizes = sizes_along(step.before, step.axis, coord, d)
    n, big, order = len(sizes), max(sizes), _group_order(ranks)
    padded = list(local.shape)
    padded[d] = big
    if min(sizes) == big:
        send = local.contiguous()
    else:
        send = local.new_zeros(padded)
        send.narrow(d, 0, local.shape[d]).copy_(local)
    buf = emit.all_gather(send, n, group)  # any dtype: the eager emitter moves its bytes
    if d == 0 and order == sorted(order) and min(sizes[:-1], default=big) == big:
        return buf[: sum(sizes)]  # even, or only the last piece short: its padding is the tail
    blocks = buf.view([n] + padded)
    at = {k: g for g, k in enumerate(order)}  # the block axis index k landed in
    return torch.cat([blocks[at[k]].narrow(d, 0, s) for k, s in enumerate(sizes)], dim=d)


def _reduce_scatter(step: ReduceScatter, local, coord, group, ranks, emit) -> torch.Tensor:
    """Chunks along dim (padded to the largest) are packed in the group's rank order; along
    dim 0, in axis order and even, the piece itself is that buffer (no copy)."""
    d, axis = step.dim, step.axis
    sizes = sizes_along(step.after, axis, coord, d)
    n, big, mine, order = len(sizes), max(sizes), sizes[coord[axis]], _group_order(ranks)
    chunk = list(local.shape)
    chunk[d] = big
    even = min(sizes) == big
    if d == 0 and even and order == sorted(order):
        send = local.contiguous()
    else:
        send = (local.new_empty if even else local.new_zeros)([n * chunk[0]] + chunk[1:])
        blocks, starts = send.view([n] + chunk), offsets(sizes)
        for g, k in enumerate(order):
            blocks[g].narrow(d, 0, sizes[k]).copy_(local.narrow(d, starts[k], sizes[k]))
    out = emit.reduce_scatter(send, n, group)
    return out if even else out.narrow(d, 0, mine).contiguous()


def _all_to_all(step: AllToAll, local, coord, group, ranks, emit) -> torch.Tensor:
    """Member k sends member m its slice of dst_dim; received pieces concatenate along src_dim.

    Each slice travels as one flat run (exact sizes, no padding), packed in the group's rank
    order; along src_dim 0 in axis order the received buffer is the result (no copy), and even
    slices in axis order pack (and unpack) with one strided copy."""
    m = _STATIC.computed(step, coord, _AllToAllStatic)
    i, j, n = step.src_dim, step.dst_dim, len(ranks)
    if j == 0 and m.in_order:
        send = local.contiguous().view(-1)
    elif m.in_order and m.even_j:  # one copy: (.., n, len, ..) with the n blocks outermost
        send = local.unflatten(j, (n, m.lengths[0])).movedim(j, 0).contiguous().view(-1)
    else:
        send = local.new_empty(sum(m.send_splits))
        for run, k in zip(send.split(m.send_splits), m.order):
            run.view(m.chunk_shapes[k]).copy_(local.narrow(j, m.starts[k], m.lengths[k]))
    # communicate or not is decided by the plan, so every member agrees
    recv = emit.all_to_all(send, m.recv_splits, m.send_splits, group, step.before.numel() > 0)
    if i == 0 and m.in_order:
        return recv.view(m.mine)
    if m.in_order and m.even_i:
        return recv.view([n] + m.shapes[0]).movedim(0, i).reshape(m.mine)
    received = dict(zip(m.order, recv.split(m.recv_splits)))
    return torch.cat([received[k].view(m.shapes[k]) for k in range(n)], dim=i)


class _AllToAllStatic:
    """What an all_to_all step needs at one coordinate, worked out once per (step, coordinate)."""

    __slots__ = ("order", "in_order", "lengths", "starts", "even_j", "chunk_shapes",
                 "send_splits", "mine", "shapes", "even_i", "recv_splits")

    def __init__(self, step: AllToAll, coord):
        i, j = step.src_dim, step.dst_dim
        before, after = step.before, step.after
        members = member_coords(after.placement, step.axis, coord)
        self.order = _group_order(after.placement.group_along(step.axis, coord))
        self.in_order = self.order == sorted(self.order)
        self.lengths = [after.box(c)[j][1] - after.box(c)[j][0] for c in members]
        self.starts = offsets(self.lengths)
        self.even_j = min(self.lengths) == max(self.lengths)
        have = list(box_shape(before.box(coord)))
        self.chunk_shapes = [have[:j] + [n] + have[j + 1:] for n in self.lengths]
        self.send_splits = [prod(self.chunk_shapes[k]) for k in self.order]
        self.mine = list(box_shape(after.box(coord)))
        self.shapes = [self.mine[:i] + [before.box(c)[i][1] - before.box(c)[i][0]] + self.mine[i + 1:]
                       for c in members]
        self.even_i = min(s[i] for s in self.shapes) == max(s[i] for s in self.shapes)
        self.recv_splits = [prod(self.shapes[k]) for k in self.order]


def _zero_fill(step: ZeroFill, local, coord) -> torch.Tensor:
    if isinstance(step.before.sbp[step.axis], Broadcast):
        return local if coord[step.axis] == 0 else torch.zeros_like(local)
    have, want = step.before.box(coord), step.after.box(coord)
    out = local.new_zeros(box_shape(want))
    out[relative(have, want)] = local
    return out
