"""Gradient buckets: pieces all-reduced together as one flat buffer, asynchronously (the
data-parallel reduction grads.py schedules; DDP's reducer). A bucket is filled in the order
the gradient hooks fire, launched when full (or at the end of backward), and waited for once."""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import wire
from .guard import guard


def _packed(pieces: list) -> "torch.Tensor":
    """One flat buffer holding ``pieces`` in order: one foreach copy into its views (a
    transposed piece, a Linear weight's gradient, is copied once, not reshaped then
    concatenated)."""
    if len(pieces) == 1 and pieces[0].is_contiguous():
        return pieces[0].reshape(-1).clone()
    first = pieces[0]
    flat = torch.empty(sum(p.numel() for p in pieces), dtype=first.dtype, device=first.device)
    views, offset = [], 0
    for p in pieces:
        views.append(flat[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    torch._foreach_copy_(views, pieces)
    return flat


class Bucket:
    """Pieces (None on a rank outside the placement) summed over ``group`` as one buffer;
    ``nbytes`` counts what the caller says each piece weighs (the same on every rank)."""

    __slots__ = ("group", "pieces", "nbytes", "flat", "work", "size", "placement", "axis")

    def __init__(self, group, size: int, placement, axis: str | None):
        """``size``: the all-reduce group's size; ``placement``: each of its groups runs one
        of the bucket's all-reduces, along ``axis`` (a name, ``+``-joined for several)."""
        self.group, self.pieces, self.nbytes = group, [], 0
        self.flat = self.work = None
        self.size, self.placement = size, placement
        self.axis = axis

    def add(self, piece, nbytes: int) -> None:
        self.pieces.append(piece)
        self.nbytes += nbytes

    def launch(self) -> None:
        """Start the all-reduce of the flat buffer (nothing where this rank holds no piece)."""
        pieces = [p for p in self.pieces if p is not None]
        member = bool(pieces) and self.group is not None
        if member:
            self.flat = _packed(pieces)
        count = len(self.pieces)
        why = wire.Why("gradient bucket", f"gradient bucket ({count} gradient{'s' * (count != 1)})",
                       self.axis)
        self.work = wire.all_reduce(self.flat if member else None, self.group, why,
                                    self.placement, async_op=True, n=self.size, nbytes=self.nbytes)

    def reduced(self) -> list:
        """Wait for the all-reduce; each piece's sum, a view of the flat buffer (None where the
        piece was None)."""
        if self.work is not None:
            with guard("a gradient bucket's all-reduce",
                       ranks=lambda: dist.get_process_group_ranks(self.group)):
                self.work.wait()
        out, offset = [], 0
        for piece in self.pieces:
            if piece is None:
                out.append(None)
                continue
            out.append(self.flat[offset:offset + piece.numel()].view(piece.shape))
            offset += piece.numel()
        return out
