"""Point-to-point messages between pipeline stages (gt.nn.Pipeline), posted without waiting.

A stage's activation (or its gradient, the other way) moves between two disjoint placements by
the moves of a planned point-to-point exchange (``plan.exchange``): the sending ranks post one
isend per region and go on computing; the receiving ranks post their irecvs when they need the
tensor and wait there. A region that several ranks need is sent to each of them (no broadcast:
that would need a process group made by every rank, and the other stages are busy). A small
object (the layouts of a stage's outputs, sent once per input shape) travels as two messages:
its length, then its pickled bytes.
"""
from __future__ import annotations

import pickle

import torch

from ..layout import box_shape, relative
from ..world.world import world_timeout
from . import wire
from .guard import guard


def _wait(work, timeout, what: str, peer: int) -> None:
    """Wait for one posted send or receive with ``peer``. Where the peer's stage raised, it
    published its error and closed its connections (runtime/failure.py): the wait ends at once,
    and the guard raises that error here too (instead of a closed connection, or a wait until
    the world's timeout)."""
    with guard(lambda: f"gt.nn.Pipeline's {what} rank {peer}", ranks=(peer,)):
        work.wait(timeout)


class Outgoing:
    """Posted sends; the tensors they read stay referenced here until :meth:`wait`."""

    __slots__ = ("works", "buffers", "nbytes")

    def __init__(self):
        self.works, self.buffers, self.nbytes = [], [], 0

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self.buffers.append(tensor)
        self.works.append((wire.isend(tensor, dst, tag), dst))
        self.nbytes += tensor.numel() * tensor.element_size()

    def wait(self) -> None:
        timeout = world_timeout()
        for work, dst in self.works:
            _wait(work, timeout, "send to", dst)
        self.works.clear()
        self.buffers.clear()


def send_piece(out: Outgoing, exchange, piece: torch.Tensor, rank: int, tag: int) -> None:
    """Post this rank's sends of ``exchange`` (``piece`` is its piece of ``exchange.before``)."""
    before = exchange.before
    have = before.box(before.placement.coord_of(rank))
    for move in exchange.moves:
        if move.src != rank:
            continue
        region = piece[relative(move.region, have)].contiguous()
        for dst in move.dsts:
            if dst != rank and region.numel():
                out.send(region, dst, tag)


class Incoming:
    """Posted receives of one piece of ``exchange.after``; :meth:`wait` assembles it."""

    __slots__ = ("works", "landing", "piece", "want")

    def __init__(self, exchange, rank: int, dtype: torch.dtype, device, tag: int):
        after = exchange.after
        coord = after.placement.coord_of(rank)
        self.want = after.box(coord)
        self.piece = torch.empty(after.local_shape(coord), dtype=dtype, device=device)
        self.works, self.landing = [], []
        mine = [m for m in exchange.moves if rank in m.dsts and m.src != rank]
        if len(mine) == 1 and mine[0].region == self.want:  # the whole piece from one rank
            if self.piece.numel():
                self.works.append((wire.irecv(self.piece, mine[0].src, tag), mine[0].src))
            return
        for move in mine:
            buf = torch.empty(box_shape(move.region), dtype=dtype, device=device)
            if buf.numel():
                self.works.append((wire.irecv(buf, move.src, tag), move.src))
            self.landing.append((move.region, buf))

    def wait(self) -> torch.Tensor:
        timeout = world_timeout()
        for work, src in self.works:
            _wait(work, timeout, "receive from", src)
        for region, buf in self.landing:
            self.piece[relative(region, self.want)] = buf
        return self.piece


def object_bytes(value, peers: int) -> int:
    """What :func:`send_object` sends of ``value`` to ``peers`` ranks: its length, its bytes."""
    return peers * (8 + len(pickle.dumps(value)))


def send_object(out: Outgoing, value, dsts, tag: int) -> None:
    """Post ``value`` (picklable) to every rank of ``dsts``: its length, then its bytes."""
    data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    for dst in dsts:
        out.send(size, dst, tag)
        out.send(data, dst, tag)


def recv_object(src: int, tag: int):
    """What :func:`send_object` sent this rank from ``src``."""
    timeout = world_timeout()
    size = torch.empty(1, dtype=torch.int64)
    _wait(wire.irecv(size, src, tag), timeout, "receive from", src)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    _wait(wire.irecv(data, src, tag), timeout, "receive from", src)
    return pickle.loads(data.numpy().tobytes())
