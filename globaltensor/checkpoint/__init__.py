"""Sharded checkpoints: global tensors in ``torch.distributed.checkpoint`` (DCP).

A global tensor tells DCP's planners which piece of the logical tensor this rank holds, through
the hooks DTensor implements (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``): its box from the ``Layout`` (global offsets and sizes). DCP does the
rest: each rank writes the pieces it owns, a piece several ranks hold (a broadcast axis) is
written once (DCP drops equal write items but one), and loading reads, for the box each rank of
the *destination* layout holds, the parts of the saved pieces that overlap it. So a checkpoint
saved on a 2x2 grid as (S(0), S(1)) loads on 2 ranks as S(1), as B, or in one process into plain
tensors, and no rank ever holds more than its own piece::

    import torch.distributed.checkpoint as dcp
    dcp.save({"model": model.state_dict()}, checkpoint_id="ckpt")       # every rank
    dcp.load({"model": other.state_dict()}, checkpoint_id="ckpt")       # any layout, any world

``save`` / ``load`` below wrap this for a model, its optimizer and extra values, with checks
that turn a bad directory, a shape or a key that differs into a ``GlobalTensorError`` on every
rank before anything is read or written.

Partial sums are reduced when saved: a tensor with a ``partial_sum`` axis is summed over it
while DCP plans the save (a reduce_scatter where a dim is free to split), so the checkpoint
holds the logical value. Loading into a ``partial_sum`` tensor gives the value to coordinate 0 of each partial
axis and zeros elsewhere (the factories' convention).

One audience per file: ``hooks.py`` (what DCP asks of a GlobalTensor), ``save_load.py`` (the
user's ``gt.checkpoint.save`` / ``load``), ``storage.py`` (DCP's writer, reader and planner,
extended with the directory checks). This module only re-exports.
"""
from .hooks import install_checkpoint_methods
from .save_load import load, save
from .storage import EXTRA, MODEL, OPTIMIZER

__all__ = ["load", "save", "install_checkpoint_methods"]
