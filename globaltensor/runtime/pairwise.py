"""Gathers and reductions as batches of point-to-point messages (the executor's CPU path).

gloo's all_gather, reduce_scatter and all_reduce go round a ring in lockstep; one batch of
isend/irecv between the group's members sends the same bytes in one round (1.1-6x faster on 4
ranks here, docs/performance.md). Partial sums are added in axis order, so every member of a
P -> B ends with the same bits. Waits are bounded by the world's timeout.
"""
from __future__ import annotations

import torch

from .._cache import ById
from ..layout import box_shape
from ..plan import AllGather, AllReduce, ReduceScatter
from ..world.world import world_timeout
from .wire import point_to_point

# (id(step), coord) -> _Pairs: who a step exchanges with at one coordinate, and how it cuts
_PAIRS = ById(4096)


def member_coords(placement, axis: int, coord):
    """The coordinates of the group along ``axis`` through ``coord``, in axis order."""
    return [coord[:axis] + (k,) + coord[axis + 1:] for k in range(placement.shape[axis])]


def sizes_along(layout, axis: int, coord, dim: int) -> list[int]:
    return [hi - lo for lo, hi in (layout.box(c)[dim] for c in member_coords(layout.placement, axis, coord))]


def offsets(sizes) -> list[int]:
    out, at = [], 0
    for s in sizes:
        out.append(at)
        at += s
    return out


def send_recv(ops) -> None:
    """Post a batch of isend/irecv and wait for all of it, within the world's timeout: gloo's
    point-to-point waits otherwise use the timeout its connections were made with, so a peer
    that never sends would hang past gt.init(timeout=...)."""
    if ops:
        timeout = world_timeout()
        for work in post(ops):
            work.wait(timeout)


def post(ops) -> list:
    """Start a batch of ``(send, tensor, peer, tag)`` messages through the wire; their works
    (none for no ops)."""
    return point_to_point(ops)


def prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def gather_pairwise(step: AllGather, local, coord, tag: int = 0) -> torch.Tensor:
    """An all_gather without padding or a group: this rank sends its piece as it is to every
    other member and receives each member's piece, all posted as one batch. Along dim 0 each
    piece is received straight into its rows of the result; along another dim into a buffer,
    then placed."""
    m = _PAIRS.computed(step, coord, _Pairs)
    d = step.dim
    out = local.new_empty(m.out_shape)
    out.narrow(d, m.starts[m.me], m.sizes[m.me]).copy_(local)
    send = local.contiguous()
    ops, landing = [], []
    for k, peer in m.peers:
        if send.numel():
            ops.append((True, send, peer, tag))
        place = out.narrow(d, m.starts[k], m.sizes[k])
        if place.numel():  # (a member's piece with another dim of size 0 is not sent either)
            buf = place if d == 0 else local.new_empty(place.shape)
            ops.append((False, buf, peer, tag))
            landing.append((place, buf))
    send_recv(ops)
    for place, buf in landing:
        if buf is not place:
            place.copy_(buf)
    return out


class _Pairs:
    """Who a pairwise step at one coordinate exchanges with, and how its data is cut, worked out
    once per (step, coordinate): ``me`` (this member's axis index), ``peers`` ([(axis index, global
    rank)] of the others), and per member in axis order the ``sizes`` / ``starts`` of the cut:
    along the step's dim (a gather's pieces, a reduce_scatter's slices) or, for an all_reduce,
    of the flattened piece (the first numel % n runs one element longer)."""

    __slots__ = ("me", "peers", "sizes", "starts", "out_shape")

    def __init__(self, step, coord):
        placement = step.after.placement
        members = member_coords(placement, step.axis, coord)
        self.me = coord[step.axis]
        self.peers = [(k, placement.rank_at(c)) for k, c in enumerate(members) if k != self.me]
        if isinstance(step, AllReduce):
            n, numel = len(members), prod(box_shape(step.before.box(coord)))
            self.sizes = [numel // n + (1 if k < numel % n else 0) for k in range(n)]
        else:
            layout = step.before if isinstance(step, AllGather) else step.after
            self.sizes = sizes_along(layout, step.axis, coord, step.dim)
        self.starts = offsets(self.sizes)
        self.out_shape = box_shape(step.after.box(coord))


def reduce_scatter_pairwise(step: ReduceScatter, local, coord, tag: int = 0) -> torch.Tensor:
    """P -> S(dim) without a group: this rank sends each other member that member's slice of
    dim and receives its own slice from every member, all posted as one batch; the slices are
    then summed in axis order (so every layout of the same partial value sums alike)."""
    m = _PAIRS.computed(step, coord, _Pairs)
    d = step.dim
    mine = local.narrow(d, m.starts[m.me], m.sizes[m.me])
    ops, parts = [], {m.me: mine}
    for k, peer in m.peers:
        chunk = local.narrow(d, m.starts[k], m.sizes[k])
        if chunk.numel():  # every member's piece has the same shape: the peer expects it
            ops.append((True, chunk.contiguous(), peer, tag))
        parts[k] = local.new_empty(mine.shape)  # (empty, and nothing sent, if mine is)
        if mine.numel():
            ops.append((False, parts[k], peer, tag))
    send_recv(ops)
    return sum_in_order(parts, len(m.sizes))


def sum_in_order(parts: dict, n: int, out=None) -> torch.Tensor:
    """parts[0] + parts[1] + ... + parts[n-1] (n >= 2), left to right, in one new tensor (or
    into ``out``): the first add makes it, no copy of parts[0] first."""
    out = torch.add(parts[0], parts[1], out=out)
    for k in range(2, n):
        out += parts[k]
    return out


def all_reduce_pairwise(step: AllReduce, local, coord, tag: int = 0) -> torch.Tensor:
    """P -> B without a group: a pairwise reduce_scatter of the flattened piece in n runs (the
    first numel % n one element longer), then a pairwise gather of the summed runs; every
    member ends with the same bits. The gather's receives are posted with the reduce_scatter's
    messages (on their own tag, ``tag + 1``), so a peer's summed run can arrive as soon as it
    is ready."""
    m = _PAIRS.computed(step, coord, _Pairs)
    flat = local.contiguous().view(-1)
    n = len(m.sizes)
    runs = flat.split(m.sizes)
    out = flat.new_empty(flat.shape)
    places = out.split(m.sizes)
    first, gather, parts = [], [], {m.me: runs[m.me]}
    for k, peer in m.peers:
        if m.sizes[k]:
            first.append((True, runs[k], peer, tag))
            gather.append((False, places[k], peer, tag + 1))
        parts[k] = flat.new_empty(m.sizes[m.me])
        if m.sizes[m.me]:
            first.append((False, parts[k], peer, tag))
    timeout = world_timeout()
    scattering = post(first)
    gathering = post(gather)
    for work in scattering:
        work.wait(timeout)
    sum_in_order(parts, n, out=places[m.me])
    sends = [(True, places[m.me], peer, tag + 1)
             for _, peer in m.peers if m.sizes[m.me]]
    for work in gathering + post(sends):
        work.wait(timeout)
    return out.view(local.shape)

