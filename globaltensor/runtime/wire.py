"""The one wire: every byte the tensor side sends goes through here (DESIGN "One wire").

Each call says why it is made (a :class:`Why`: a label, what a trace row says, a placement
axis) and which ranks run it (every rank of the collective's groups: a placement, or listed
ranks), and announces one event, :class:`Sent` (observe.py ``sent``): the collective, its
ranks and the bytes each member sends, from the formulas of plan/cost.py. ``gt.comm_trace``
(tools/trace.py) and ``gt.simulate``'s recorder (sim/simulate.py, then ``step_time``) listen to
that one event; no other file of the tensor side calls torch.distributed's data calls (a purity
test; process groups are made in groups.py, the world in world/).

The executor's three emitters (runtime/emit.py) take their data calls from here:
:class:`EagerWire` (torch.distributed's in-place collectives on real pieces), :class:`TracedWire`
(the functional collectives of ``torch.ops._c10d_functional`` under ``torch.compile``, each
followed by its ``wait_tensor``: the graph holds them as values) and :class:`SimulatedWire`
(``gt.simulate``'s meta pieces: nothing sent, empty results of the shapes they would have; in a
real world a meta piece holds no data and announces nothing either: :class:`NoDataWire`). Each
announces a plan's step as one event. Outside plans (buckets, units, stages, metadata, the
probe) a call on a simulated group announces and sends nothing: the other simulated ranks are
taken to hold what this one holds (SPMD), which is what a metadata exchange then returns.
A flat gather or reduce-scatter also tells gt.memory of gloo's own buffer beside it
(:class:`Workspace`), in a real run and a simulation alike.
"""
from __future__ import annotations

import functools
import math
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .. import observe
from ..placement import Placement
from ..plan import cost
from ..world import world
from ..world.simulated import simulated
from .groups import SimulatedGroup, byte_view, group_name, sends


# torch 2.13 renames the flat collectives; older versions only have the old names
_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True, slots=True)
class Why:
    """Why a call is made: ``label`` (``"redistribution"``, ``"gradient bucket"``,
    ``"fully_shard"``, ``"pipeline"``, ``"metadata"``, ``"layout check"``, ``"cost probe"``),
    ``op`` (what a trace row says) and the placement ``axis`` it runs along (a name; None where
    it runs on no one axis: the world, a move between placements)."""

    label: str
    op: str = ""
    axis: str | None = None


@dataclass(frozen=True, slots=True)
class Sent:
    """The one event: ``collective`` ran for ``why`` on every rank of ``ranks`` (a tuple of
    ranks, or a Placement: each of its groups ran one), each member sending ``nbytes`` (the
    busiest; ``by_rank`` where members send different amounts)."""

    collective: str
    why: Why
    ranks: object  # tuple[int, ...] | Placement | tuple[Placement, ...]; None: the world
    nbytes: int
    dtype: torch.dtype | None = None
    by_rank: dict | None = None

    def involves(self, rank: int) -> bool:
        if self.ranks is None:
            return True
        if isinstance(self.ranks, Placement):
            return rank in self.ranks
        return any(rank in r if isinstance(r, Placement) else rank == r for r in self.ranks)

    def sent_by(self, rank: int) -> int:
        return self.nbytes if self.by_rank is None else self.by_rank.get(rank, 0)


def announce(collective: str, why: Why, ranks, nbytes: int, dtype=None, by_rank=None) -> None:
    """Tell the listeners (nothing is made where nobody listens: one ContextVar read)."""
    if observe.watching() and observe.current() is not None:
        observe.sent(Sent(collective, why, ranks, int(nbytes), dtype, by_rank))


def axis_name(placement: Placement, axes) -> str | None:
    """A placement axis's name (``"axis i"`` for an unnamed one); axes joined by ``+``."""
    if isinstance(axes, int):
        axes = (axes,)
    names = [placement.axes[a] if placement.axes else f"axis {a}" for a in axes]
    return "+".join(names) if names else None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _members(group) -> int:
    return group.size() if isinstance(group, SimulatedGroup) else dist.get_world_size(group)


def _live(group) -> bool:
    """Whether a call on ``group`` (None: the world) sends anything: not in gt.simulate."""
    return sends(group) and not (group is None and simulated())


class Workspace:
    """gloo's own buffer while a flat gather or reduce-scatter runs on CPU pieces (a copy of the
    gathered output, of the reduced input; NCCL's run in place): gt.memory counts it as
    communication from the call until its work is waited for (gloo's worker thread frees it when
    done: at most that long), in a real run and a simulation alike. What gloo runs meanwhile on
    this thread (its copies at the wait) is this buffer's, not counted again. ``wait()`` is the
    collective's work's (a simulated one has none)."""

    __slots__ = ("work", "done")

    def __init__(self, work, done):
        self.work, self.done = work, done

    def wait(self, *timeout):
        try:
            if self.work is not None:
                with observe.backend_running():
                    self.work.wait(*timeout)
        finally:
            self.done()
        return True


def _workspace(t: torch.Tensor, ranks, nbytes: int):
    """gt.memory's release call for gloo's buffer of ``nbytes`` beside ``t`` (None where nobody
    counts memory or no gloo runs: pieces off the CPU; a simulation's, by the placement)."""
    if t.is_meta:
        on_cpu = simulated() and (not isinstance(ranks, Placement) or ranks.type == "cpu")
    else:
        on_cpu = t.device.type == "cpu"
    return observe.workspace(nbytes) if on_cpu else None


def _run(call, done, async_op: bool):
    """``call()`` with gloo's buffer counted while it runs (``done``: its release): a sync
    call's goes when it returns, an async one's at its work's wait (a :class:`Workspace`)."""
    if done is None:
        return call()
    try:
        with observe.backend_running():
            work = call()
    except BaseException:
        done()
        raise
    if not async_op:
        done()
        return work
    return Workspace(work, done)


# --------------------------------------------------------------------------- calls outside plans
# Each announces its event, then (unless its group is simulated) runs the collective; async_op
# gives the work to wait for (None when nothing was sent).

def all_gather(out: torch.Tensor, send: torch.Tensor, group, why: Why, ranks, async_op=False):
    """``out`` (flat) = every member's ``send`` in group rank order (their bytes: any dtype)."""
    n = _members(group)
    announce("all_gather", why, ranks, cost.gather_sent(n, _nbytes(send)), send.dtype)
    done = _workspace(out, ranks, _nbytes(out))
    if not _live(group):
        if not out.is_meta:  # the other simulated ranks hold what this one holds
            out.view(n, -1).copy_(send.reshape(1, -1))
        return _run(lambda: None, done, async_op)
    if not out.numel():
        return None
    return _run(lambda: _GATHER(byte_view(out), byte_view(send), group=group, async_op=async_op),
                done, async_op)


def reduce_scatter(out: torch.Tensor, send: torch.Tensor, group, why: Why, ranks, async_op=False):
    """``out`` = the sum over members of block ``g`` of ``send`` (flat) on group rank g."""
    n = _members(group)
    announce("reduce_scatter", why, ranks, cost.reduce_scatter_sent(n, _nbytes(out)), send.dtype)
    done = _workspace(send, ranks, _nbytes(send)) if out.numel() else None
    if not _live(group) or not out.numel():
        return _run(lambda: None, done, async_op)
    return _run(lambda: _SCATTER(out, send, group=group, async_op=async_op), done, async_op)


def all_reduce(t, group, why: Why, ranks, async_op=False, op=None, n=None, nbytes=None):
    """``t`` summed (or ``op``) over ``group`` in place. ``t`` None: this rank is outside
    ``group`` and only announces (as every rank does: a simulation plays one rank for all);
    ``n`` and ``nbytes`` then give the group's size and the largest member's buffer."""
    n = n or _members(group)
    size = _nbytes(t) if nbytes is None else nbytes
    announce("all_reduce", why, ranks, cost.all_reduce_sent(n, size),
             None if t is None else t.dtype)
    if t is None or not _live(group) or not t.numel():
        return None
    return dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group, async_op=async_op)


def broadcast(t: torch.Tensor, src: int, group, why: Why, ranks, nbytes=None) -> None:
    """``t`` as global rank ``src`` holds it, in place on every member (its bytes; ``nbytes``:
    the largest member's, where pieces differ). A pipelined broadcast: each forwards it once."""
    announce("broadcast", why, ranks, _nbytes(t) if nbytes is None else nbytes, t.dtype)
    if _live(group) and t.numel():
        dist.broadcast(byte_view(t), src=src, group=group)


def all_gather_rows(mine: torch.Tensor, group, why: Why) -> torch.Tensor:
    """``(members,) + mine.shape``: every member's ``mine`` (small int64 records, on the CPU),
    gathered on the device torch's object collectives use for ``group`` (None: the world)."""
    if _live(group):
        mine = mine.to(c10d._get_object_coll_device(group))
    ranks = (None if group is None else group.members if isinstance(group, SimulatedGroup)
             else tuple(dist.get_process_group_ranks(group)))
    n = _members(group)
    if not _live(group):  # every simulated rank holds these rows: one copy, seen n times
        announce("all_gather", why, ranks, cost.gather_sent(n, _nbytes(mine)), mine.dtype)
        # the real run's table and gloo's copy beside it, counted and gone (meta: no bytes
        # here, where a world of 16,384 ranks makes tables of gigabytes)
        table = mine.new_empty((n,) + tuple(mine.shape), device="meta")
        _run(lambda: None, _workspace(table, None, _nbytes(table)), False)
        del table
        return mine.unsqueeze(0).expand((n,) + tuple(mine.shape))
    table = mine.new_empty((n,) + tuple(mine.shape))
    if mine.numel():
        all_gather(table.view(-1), mine.reshape(-1), group, why, ranks)
    return table


def all_to_all_rows(send: torch.Tensor, send_counts, recv_counts, group, why: Why, ranks,
                    nbytes=None) -> torch.Tensor:
    """Rows of ``send`` (dim 0) in blocks of ``send_counts[g]`` to group rank ``g`` (ascending
    global rank); the rows received, ``sum(recv_counts)`` of them, in group rank order (an
    all_to_all_v: the counts are data, exchanged before). Announced with the rows this rank
    sends to others (``nbytes``: a simulation's expected figure, for every member)."""
    row = math.prod(send.shape[1:]) * send.element_size()
    me = _group_rank(group)
    mine = (sum(send_counts) - send_counts[me]) * row
    by_rank = None if nbytes is not None else {world.get_rank(): mine}
    announce("all_to_all", why, ranks, mine if nbytes is None else nbytes, send.dtype, by_rank)
    recv = send.new_empty((sum(recv_counts),) + tuple(send.shape[1:]))
    if _live(group) and (recv.numel() or send.numel()):
        dist.all_to_all_single(byte_view(recv), byte_view(send.contiguous()),
                               [c * row for c in recv_counts], [c * row for c in send_counts],
                               group=group)
    return recv


def _group_rank(group) -> int:
    """This rank's number in ``group`` (ascending global rank; None: the world)."""
    if isinstance(group, SimulatedGroup):
        members = sorted(group.members)
        return members.index(world.get_rank()) if world.get_rank() in members else 0
    return dist.get_rank(group)


def all_gather_object(value, why: Why) -> list:
    """``[rank] = value`` of every rank of the world (picklable values)."""
    n = world.get_world_size()
    announce("all_gather_object", why, None, cost.gather_sent(n, len(pickle.dumps(value))))
    if simulated():
        return [value] * n
    out = [None] * n
    dist.all_gather_object(out, value)
    return out


def broadcast_object(value, src: int, why: Why):
    """``value`` as rank ``src`` holds it, on every rank of the world."""
    if simulated():  # every simulated rank holds what this one holds
        announce("broadcast_object", why, None, len(pickle.dumps(value)))
        return value
    box = [value if world.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    announce("broadcast_object", why, None, len(pickle.dumps(box[0])))  # known once it came
    return box[0]


def point_to_point(ops) -> list:
    """Start a batch of ``(send: bool, tensor, peer, tag)`` messages; their works (none for no
    ops). The caller announced what they carry (a plan's step, a stage's micro-batch)."""
    if not ops:
        return []
    return list(dist.batch_isend_irecv(
        [dist.P2POp(dist.isend if out else dist.irecv, t, peer, tag=tag)
         for out, t, peer, tag in ops]))


def isend(t: torch.Tensor, dst: int, tag: int):
    return dist.isend(t, dst, tag=tag)


def irecv(t: torch.Tensor, src: int, tag: int):
    return dist.irecv(t, src, tag=tag)


# --------------------------------------------------------------------------- plan steps

def _step_event(step, local: torch.Tensor) -> None:
    """One event per step that communicates: its kind, axis, ranks (the placements on both
    sides) and the busiest rank's bytes (the plan's own formula, plan/cost.py)."""
    if not (observe.watching() and observe.current() is not None) or not step.communicates():
        return
    axis = getattr(step, "axis", None)
    after, before = step.after.placement, step.before.placement
    ranks = after if after == before else (before, after)
    why = Why("redistribution", axis=None if axis is None else axis_name(after, axis))
    announce(step.kind, why, ranks, step.bytes_sent(local.element_size()), local.dtype)


@functools.cache
def _ops():
    """torch's traceable collectives (importing funcol registers them), looked up once."""
    import torch.distributed._functional_collectives  # noqa: F401 - registers the ops
    return torch.ops._c10d_functional


class EagerWire:
    """Real collectives, in place into buffers made here (the eager emitter's data calls)."""

    @staticmethod
    def announce(step, local: torch.Tensor) -> None:
        _step_event(step, local)

    @staticmethod
    def all_gather(send: torch.Tensor, n: int, group) -> torch.Tensor:
        """The members' ``send`` buffers stacked along dim 0, in the group's rank order."""
        buf = send.new_empty([n * send.shape[0]] + list(send.shape[1:]))
        if buf.numel():  # any dtype: its bytes (gloo rejects some: int16, uint16, float8...)
            _GATHER(byte_view(buf), byte_view(send), group=group)
        return buf

    @staticmethod
    def reduce_scatter(send: torch.Tensor, n: int, group) -> torch.Tensor:
        """The sum over members of block ``g`` of ``send`` (dim 0 cut in ``n``) on group rank g."""
        out = send.new_empty([send.shape[0] // n] + list(send.shape[1:]))
        if out.numel():
            _SCATTER(out, send, group=group)
        return out

    @staticmethod
    def all_reduce(local: torch.Tensor, group) -> torch.Tensor:
        out = local.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def all_to_all(send, recv_splits, send_splits, group, communicate: bool) -> torch.Tensor:
        recv = send.new_empty(sum(recv_splits))
        if communicate:  # any dtype: its bytes
            size = send.element_size()
            dist.all_to_all_single(byte_view(recv), byte_view(send),
                                   [k * size for k in recv_splits],
                                   [k * size for k in send_splits], group=group)
        return recv

    @staticmethod
    def broadcast(t: torch.Tensor, src: int, group) -> None:
        """An Exchange step's broadcast of ``t`` (its bytes) from global rank ``src``."""
        dist.broadcast(byte_view(t), src=src, group=group)


class TracedWire:
    """Functional collectives: each returns a new tensor, recorded in the graph being traced."""

    @staticmethod
    def announce(step, local: torch.Tensor) -> None:
        _step_event(step, local)

    @staticmethod
    def all_gather(send: torch.Tensor, n: int, group) -> torch.Tensor:
        if send.numel() == 0:
            return send.new_empty([n * send.shape[0]] + list(send.shape[1:]))
        ops = _ops()
        return ops.wait_tensor(ops.all_gather_into_tensor(send.contiguous(), n, group_name(group)))

    @staticmethod
    def reduce_scatter(send: torch.Tensor, n: int, group) -> torch.Tensor:
        if send.numel() == 0:
            return send.new_empty([send.shape[0] // n] + list(send.shape[1:]))
        ops = _ops()
        return ops.wait_tensor(ops.reduce_scatter_tensor(send.contiguous(), "sum", n,
                                                         group_name(group)))

    @staticmethod
    def all_reduce(local: torch.Tensor, group) -> torch.Tensor:
        ops = _ops()
        return ops.wait_tensor(ops.all_reduce(local.contiguous(), "sum", group_name(group)))

    @staticmethod
    def all_to_all(send, recv_splits, send_splits, group, communicate: bool) -> torch.Tensor:
        if not communicate:
            return send.new_empty(sum(recv_splits))
        ops = _ops()
        return ops.wait_tensor(ops.all_to_all_single(send.contiguous(), list(recv_splits),
                                                     list(send_splits), group_name(group)))


class SimulatedWire:
    """``gt.simulate``: meta pieces, nothing sent; each collective's result is an empty (meta)
    tensor of the shape it would have. Each step is announced as the real run announces it."""

    @staticmethod
    def announce(step, local: torch.Tensor) -> None:
        if not observe.holds_no_data(local):  # the user's meta model: no data in the real run
            _step_event(step, local)

    @staticmethod
    def all_gather(send: torch.Tensor, n: int, group) -> torch.Tensor:
        return send.new_empty([n * send.shape[0]] + list(send.shape[1:]))

    @staticmethod
    def reduce_scatter(send: torch.Tensor, n: int, group) -> torch.Tensor:
        return send.new_empty([send.shape[0] // n] + list(send.shape[1:]))

    @staticmethod
    def all_reduce(local: torch.Tensor, group) -> torch.Tensor:
        return torch.empty_like(local, memory_format=torch.contiguous_format)

    @staticmethod
    def all_to_all(send, recv_splits, send_splits, group, communicate: bool) -> torch.Tensor:
        return send.new_empty(sum(recv_splits))


class NoDataWire(SimulatedWire):
    """A meta piece in a real world (a model built on meta): nothing moves, nothing is told."""

    @staticmethod
    def announce(step, local: torch.Tensor) -> None:
        return None


__all__ = ["Why", "Sent", "announce", "axis_name", "all_gather", "reduce_scatter", "all_reduce",
           "broadcast", "all_gather_rows", "all_to_all_rows", "Workspace", "all_gather_object", "broadcast_object",
           "point_to_point", "isend", "irecv", "EagerWire", "TracedWire", "SimulatedWire",
           "NoDataWire"]
