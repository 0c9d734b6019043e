"""Gradient buckets: pieces all-reduced together as one flat buffer, asynchronously (the
data-parallel reduction grads.py schedules; DDP's reducer). A bucket is filled in the order
the gradient hooks fire, launched when full (or at the end of backward), and waited for once."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import observe
from .groups import sends
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

    __slots__ = ("group", "pieces", "nbytes", "flat", "work", "size", "ranks")

    def __init__(self, group, size: int, ranks: tuple[int, ...]):
        """``size``: the all-reduce group's size; ``ranks``: every rank that takes part in one
        of the bucket's all-reduces (the placement's), what a simulation counts."""
        self.group, self.pieces, self.nbytes = group, [], 0
        self.flat = self.work = None
        self.size, self.ranks = size, ranks

    def add(self, piece, nbytes: int) -> None:
        self.pieces.append(piece)
        self.nbytes += nbytes

    def launch(self) -> None:
        """Start the all-reduce of the flat buffer (nothing where this rank holds no piece)."""
        pieces = [p for p in self.pieces if p is not None]
        member = bool(pieces) and self.group is not None
        if member:
            self.flat = _packed(pieces)
            if sends(self.group):  # not in gt.simulate's world
                self.work = dist.all_reduce(self.flat, group=self.group, async_op=True)
        n = self.size  # what a ring all-reduce sends from each member
        observe.bucket_reduced(len(self.pieces), -(-2 * (n - 1) * self.nbytes // n), self.ranks,
                               member)

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
