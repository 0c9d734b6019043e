"""A sharded unit's communication (``gt.nn.fully_shard``): one all-gather of its parameters'
pieces as a flat buffer, one reduce-scatter of its gradients.

Every parameter of a unit is split on one dim (``ShardSpec.dim``) over the unit's axis, the
innermost axis that splits that dim, so the pieces of the members of this rank's group along
the axis, put together along the dim, make this rank's piece of the *gathered* layout (the axis
broadcast). Pieces may be uneven: each takes a segment of ``ceil(rows / n)`` rows in the flat
buffer (FSDP2's padding), so every member sends the same number of elements.

Memory: the received buffer (this rank's block of it is what it sends) lives until it is
copied out into the unit's *unsharded storage* (one flat tensor, parameters are views of it),
which :meth:`UnitComm.free` gives back (its storage resized to 0: views of it stay valid and
are filled again by the next gather, FSDP2's storage resize).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .. import observe
from ..layout import split_sizes
from . import wire
from .guard import guard


@dataclass(frozen=True)
class ShardSpec:
    """One parameter of a unit, on this rank: its gathered piece's shape, the dim it is split
    on over the axis, and the n pieces' row counts along that dim (uneven rule)."""

    shape: tuple[int, ...]   # this rank's piece of the gathered layout
    dim: int
    rows: tuple[int, ...]    # rows of each member's piece along ``dim``, in axis order

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[:self.dim] + self.shape[self.dim + 1:])

    @property
    def segment(self) -> int:
        """Elements each member sends for this parameter (its piece, padded)."""
        return max(self.rows) * self.row_numel

    def piece_shape(self, i: int) -> tuple[int, ...]:
        return self.shape[:self.dim] + (self.rows[i],) + self.shape[self.dim + 1:]

    @property
    def even(self) -> bool:
        return len(set(self.rows)) == 1

    def by_member(self, blocks: torch.Tensor, offset: int) -> torch.Tensor:
        """Even pieces: the segments of every member's block, as (member, before, rows,
        after) (``blocks`` is (members, block))."""
        return blocks[:, offset:offset + self.segment].view(len(self.rows), *self._around())

    def as_members(self, full: torch.Tensor) -> torch.Tensor:
        """Even pieces: ``full`` (this shape) as (member, before, rows, after), a view."""
        pre, rows, post = self._around()
        return full.reshape(pre, len(self.rows), rows, post).transpose(0, 1)

    def _around(self) -> tuple[int, int, int]:
        """(elements before the dim, rows of a piece, elements after it)."""
        return (math.prod(self.shape[:self.dim]), self.rows[0],
                math.prod(self.shape[self.dim + 1:]))

    def pieces_of(self, full: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(full, list(self.rows), dim=self.dim))

    def segments(self, blocks: torch.Tensor, offset: int) -> list[torch.Tensor]:
        """Uneven pieces: each member's piece in its block, shaped as the piece."""
        return [blocks[i, offset:offset + self.rows[i] * self.row_numel].view(self.piece_shape(i))
                for i in range(len(self.rows))]


def _plain(method):
    """Runs with torch-function modes off: the buffers are this rank's own tensors even where
    the caller runs in ``gt.global_mode`` (whose check of the calling frame cannot see through
    torch.compile's frames)."""
    @functools.wraps(method)
    def plain(*args, **kwargs):
        with torch._C.DisableTorchFunction():
            return method(*args, **kwargs)
    return plain


def shard_spec(shape: tuple[int, ...], dim: int, n: int) -> ShardSpec:
    return ShardSpec(tuple(shape), dim, split_sizes(shape[dim], n))


class UnitComm:
    """The flat buffers and collectives of one unit on this rank: ``group`` is this rank's group
    along the unit's axis (``members`` in axis order, ``index`` this rank's place in it)."""

    def __init__(self, specs: list[ShardSpec], group, members: tuple[int, ...], index: int,
                 name: str, replicate: tuple[int, ...] = (), replicate_group=None,
                 ranks=None, axis: str | None = None, replicate_axis: str | None = None):
        self.specs, self.group, self.members, self.index = specs, group, members, index
        # every rank of the unit's placement: each group of it runs the same collectives (a
        # simulation charges them to these ranks, not to the world)
        self.ranks = members if ranks is None else ranks
        # HSDP: the axes whose sum follows the reduce-scatter, and (group, ranks) across them
        self.replicate, self.replicate_group = replicate, replicate_group
        self.n = len(members)
        self.name = name
        self.axis, self.replicate_axis = axis, replicate_axis  # their names (wire.Why)
        self.offsets = []  # of each parameter's segment in a member's block
        offset = 0
        for spec in specs:
            self.offsets.append(offset)
            offset += spec.segment
        self.block = offset  # elements each member sends
        self.numel = sum(s.numel for s in specs)  # of the unsharded storage
        self.flat: torch.Tensor | None = None  # the unsharded storage (kept; resized to 0)
        self.views: list[torch.Tensor] = []
        self.received = self.work = None

    # ---- all-gather -------------------------------------------------------------------------
    @_plain
    def start_gather(self, pieces: list[torch.Tensor], dtype: torch.dtype) -> None:
        """Launch the all-gather of this rank's ``pieces`` (cast to ``dtype``), asynchronously.
        In place, as FSDP2's: this rank's block of the received buffer is what it sends."""
        device = pieces[0].device if pieces else "cpu"
        self.received = torch.empty(self.n * self.block, dtype=dtype, device=device)
        observe.storage_kind(self.received, "communication")
        send = self.received[self.index * self.block:(self.index + 1) * self.block]
        dsts, srcs = [], []
        for offset, piece in zip(self.offsets, pieces):
            if piece.numel():
                dsts.append(send[offset:offset + piece.numel()].view(piece.shape))
                srcs.append(piece)
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        self.work = wire.all_gather(self.received, send, self.group,
                                    self._why("all_gather"), self.ranks, async_op=True)

    @property
    def gathering(self) -> bool:
        return self.received is not None

    @_plain
    def finish_gather(self) -> list[torch.Tensor]:
        """Wait for the gather and copy it out into the unsharded storage; the parameters'
        gathered pieces (views of that storage)."""
        if self.work is not None:
            with guard(lambda: f"fully_shard's all-gather of {self.name}", ranks=self.members):
                self.work.wait()
        received, self.received, self.work = self.received, None, None
        views = self._unsharded(received.dtype, received.device)
        blocks = received.view(self.n, self.block)
        dsts, srcs = [], []
        for spec, offset, view in zip(self.specs, self.offsets, views):
            if spec.even:
                dsts.append(spec.as_members(view))
                srcs.append(spec.by_member(blocks, offset))
            else:
                dsts += spec.pieces_of(view)
                srcs += spec.segments(blocks, offset)
        # the same values as the gather before: autograd's saved copies stay valid (FSDP2
        # writes its unsharded parameters the same way)
        with torch.autograd._unsafe_preserve_version_counter(self.flat):
            torch._foreach_copy_(dsts, srcs)
        # the received buffer goes now, even if the finished collective's record still holds
        # a reference to it for a while (gloo's work)
        del blocks, srcs
        received.untyped_storage().resize_(0)
        observe.storage_kind(received, "communication")
        return views

    def _unsharded(self, dtype, device) -> list[torch.Tensor]:
        """The unsharded storage's views, (re)allocated in ``dtype``."""
        if self.flat is None or self.flat.dtype != dtype:
            self.flat = torch.empty(self.numel, dtype=dtype, device=device)
            self.views, offset = [], 0
            for spec in self.specs:
                self.views.append(self.flat[offset:offset + spec.numel].view(spec.shape))
                offset += spec.numel
        else:
            storage = self.flat.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(self.numel * self.flat.element_size())
        observe.storage_kind(self.flat, "communication")
        return self.views

    @_plain
    def free(self) -> None:
        """Give back the unsharded storage's memory (the views stay, holding nothing)."""
        if self.flat is not None and self.flat.untyped_storage().nbytes():
            self.flat.untyped_storage().resize_(0)
            observe.storage_kind(self.flat, "communication")

    @property
    def unsharded(self) -> bool:
        return self.flat is not None and self.flat.untyped_storage().nbytes() > 0

    # ---- reduce-scatter ---------------------------------------------------------------------
    @_plain
    def pack_gradients(self, grads: list[torch.Tensor | None], dtype: torch.dtype) -> torch.Tensor:
        """The flat buffer a reduce-scatter takes: member i's block holds piece i of every
        gradient (None: zeros), cast to ``dtype``."""
        device = next((g.device for g in grads if g is not None), torch.device("cpu"))
        flat = torch.empty(self.n * self.block, dtype=dtype, device=device)
        blocks = flat.view(self.n, self.block)
        dsts, srcs = [], []
        for spec, offset, grad in zip(self.specs, self.offsets, grads):
            if grad is None:
                blocks[:, offset:offset + spec.segment].zero_()
            elif spec.even:
                dsts.append(spec.by_member(blocks, offset))
                srcs.append(spec.as_members(grad))
            else:
                for i, (dst, src) in enumerate(zip(spec.segments(blocks, offset), spec.pieces_of(grad))):
                    dsts.append(dst)
                    srcs.append(src)
                    blocks[i, offset + dst.numel():offset + spec.segment].zero_()  # the padding
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return flat

    @_plain
    def reduce_scatter(self, flat: torch.Tensor, replicate: bool = False) -> list[torch.Tensor]:
        """Sum ``flat`` over the group; this rank's pieces of the gradients (views of one
        buffer of ``block`` elements). ``replicate``: that buffer is then summed over the
        replicate axes too (:meth:`all_reduce_shard`)."""
        observe.storage_kind(flat, "communication")
        out = flat.new_empty(self.block)
        with guard(lambda: f"fully_shard's reduce-scatter of {self.name}", ranks=self.members):
            wire.reduce_scatter(out, flat, self.group, self._why("reduce_scatter"), self.ranks)
        if replicate:
            self.all_reduce_shard(out)
        pieces = []
        for spec, offset in zip(self.specs, self.offsets):
            rows = spec.rows[self.index]
            pieces.append(out[offset:offset + rows * spec.row_numel].view(spec.piece_shape(self.index)))
        return pieces

    def all_reduce_shard(self, out: torch.Tensor) -> None:
        """Sum the reduce-scattered buffer ``out`` over the replicate group (HSDP's replicate
        axes: FSDP2's order, reduce-scatter over the shard axis first, then all-reduce the 1/n
        shard), in place."""
        group, members = self.replicate_group
        why = wire.Why("fully_shard", f"fully_shard all_reduce ({self.name})", self.replicate_axis)
        with guard(lambda: f"fully_shard's all-reduce of {self.name} over its replicate axes",
                   ranks=members):
            wire.all_reduce(out, group, why, self.ranks, n=len(members))

    def _why(self, collective: str) -> "wire.Why":
        return wire.Why("fully_shard", f"fully_shard {collective} ({self.name})", self.axis)
