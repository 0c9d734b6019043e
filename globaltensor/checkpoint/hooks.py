"""What DCP asks of a GlobalTensor: the hooks its planners call (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``, as DTensor implements them), each rank's
box read from the ``Layout``; a partial sum is reduced while the save is planned."""
from __future__ import annotations

import contextvars

import torch

from ..world import world
from ..errors import GlobalTensorError
from ..layout import Box, Layout, box_numel
from ..sbp import Broadcast, PartialSum, Split, plain
from ..tensor import GlobalTensor, redistribute


_REDUCED = "_gt_reduced"  # a partial tensor's summed piece, from planning to writing
# pieces of partial tensors to zero once every rank's load plan is made (gt.checkpoint.load:
# a load that fails in planning leaves the destination as it was); None: zero them at once
ZERO_LATER: contextvars.ContextVar[list | None] = contextvars.ContextVar("gt_zero_later",
                                                                         default=None)




def _create_write_items(self: GlobalTensor, fqn: str, obj=None) -> list:
    """The piece this rank writes (none outside the placement or for an empty piece).

    Collective for a partial tensor (every rank of the world plans every tensor of a save, in
    the same order, so the sum runs here): the summed piece waits on the tensor for
    ``__get_tensor_shard__``."""
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                       TensorProperties)
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    layout, local = _savable(self)
    box = _written_box(layout)
    if box is None:
        return []
    if local is not self._local:
        self.__dict__[_REDUCED] = local
    offsets, sizes = _chunk(box)
    return [WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                    properties=TensorProperties(dtype=self.dtype),
                                    size=torch.Size(layout.shape)))]


def _create_chunk_list(self: GlobalTensor) -> list:
    """The box this rank's piece must be filled with when loading (none outside the placement,
    for an empty piece, or off coordinate 0 of a partial axis: that piece is zeroed)."""
    self.__dict__.pop(_REDUCED, None)  # a save's leftover (its write went to another rank)
    layout = self._layout
    if layout.order:
        raise GlobalTensorError(
            f"loading a checkpoint into a tensor laid out as {layout!r}: expected plain splits "
            f"(a head-tail piece is two ranges, which a checkpoint's chunk of it is not); load "
            f"into the plain split, then x.to_global(sbp=...) to the head-tail one")
    coord = _coord(layout)
    if coord is None:
        return []
    if any(coord[a] for a in layout.partial_axes):
        deferred = ZERO_LATER.get()
        if deferred is None:
            self._local.zero_()
        else:
            deferred.append(self._local)
        return []
    box = layout.box(coord)
    if box_numel(box) == 0:
        return []
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    offsets, sizes = _chunk(box)
    return [ChunkStorageMetadata(offsets=offsets, sizes=sizes)]


def _get_tensor_shard(self: GlobalTensor, index) -> torch.Tensor:
    """This rank's piece: the one DCP writes when saving, the one it fills when loading."""
    reduced = self.__dict__.pop(_REDUCED, None)
    if reduced is not None:
        return reduced
    if self._layout.numel() == 0:
        return self._local.new_empty(self._layout.shape)
    return self._local


def install_checkpoint_methods() -> None:
    """Give GlobalTensor DTensor's checkpoint hooks (called once by globaltensor/__init__.py)."""
    GlobalTensor.__create_write_items__ = _create_write_items
    GlobalTensor.__create_chunk_list__ = _create_chunk_list
    GlobalTensor.__get_tensor_shard__ = _get_tensor_shard


def _savable(x: GlobalTensor) -> tuple[Layout, torch.Tensor]:
    """``x``'s layout and piece with every partial axis summed, and head-tail splits put in
    order (a checkpoint's chunk is one box)."""
    layout = x._layout
    if layout.order:
        layout = Layout(layout.placement, plain(layout.sbp), layout.shape)
    if not layout.is_partial:
        return layout, x._local if layout == x._layout else redistribute(x, layout)._local
    summed = _summed(layout)
    return summed, redistribute(x, summed)._local


def _summed(layout: Layout) -> Layout:
    """``layout`` with each partial axis split along the largest dim no later axis splits (a
    reduce_scatter: each rank keeps a part of the sum, and writes it), or broadcast where no
    such dim is left (an all_reduce)."""
    sbp = list(layout.sbp)
    for axis, v in enumerate(sbp):
        if isinstance(v, PartialSum):
            later = {w.dim for w in layout.sbp[axis + 1:] if isinstance(w, Split)}
            free = [d for d in range(layout.ndim) if d not in later and layout.shape[d] > 1]
            sbp[axis] = Split(max(free, key=lambda d: layout.shape[d])) if free else Broadcast()
    return Layout(layout.placement, tuple(sbp), layout.shape)


def _written_box(layout: Layout) -> Box | None:
    """The box this rank describes to the save planner: its own when not empty; the whole
    (empty) tensor at coordinate 0 when the tensor has no element."""
    coord = _coord(layout)
    if coord is None:
        return None
    if layout.numel() == 0:
        return tuple((0, s) for s in layout.shape) if not any(coord) else None
    box = layout.box(coord)
    return box if box_numel(box) else None


def _coord(layout: Layout):
    """This rank's grid coordinate in ``layout`` (None outside the placement). A hook that runs
    in a thread with no world (``dcp.async_save`` inside ``gt.testing.run_ranks``, whose worlds
    are per thread) cannot know its rank: refuse rather than describe another rank's piece."""
    if layout.placement.size > 1 and not world.is_initialized():
        raise GlobalTensorError(
            f"a global tensor on {layout.placement.size} ranks reached torch.distributed."
            f"checkpoint in a thread with no torch.distributed world, so its rank is unknown "
            f"(e.g. dcp.async_save inside gt.testing.run_ranks, whose worlds are per thread); "
            f"save from the rank's own thread (dcp.save), or in real processes")
    return layout.placement.coord_of(world.get_rank())


def _chunk(box: Box) -> tuple[torch.Size, torch.Size]:
    return torch.Size(lo for lo, _ in box), torch.Size(hi - lo for lo, hi in box)
