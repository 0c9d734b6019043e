"""Pieces of a model built on the meta device, before ``to_empty`` gives them data
(docs/big_models.md): the meta piece of a layout, and the error for using one.

Pure: no communication.
"""
from __future__ import annotations

import torch

from .layout import Layout
from .world import world


def meta_piece(layout: Layout, like: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``layout`` on the meta device (an empty one outside the placement),
    of ``like``'s dtype and made from it (``new_empty``: in gt.simulate a piece made from a
    tensor without data holds none either, sim/no_data.py)."""
    coord = layout.placement.coord_of(world.get_rank())
    shape = layout.local_shape(coord) if coord is not None else (0,) * len(layout.shape)
    return like.new_empty(shape, device="meta")


def meta_message(what: str, name: str, t: torch.Tensor) -> str:
    """The error for ``what`` (a forward, an optimizer step) on tensor ``name`` still on meta."""
    return (f"{what}: {name} (shape {list(t.shape)}) is still on the meta device: the model was "
            f"built under torch.device('meta') and laid out, and holds no data yet. Materialize "
            f"it first: model.to_empty(device=...) (each rank allocates its pieces), then "
            f"initialise it (gt.manual_seed(s); model.reset_parameters() / init_weights()) or "
            f"load weights into it (docs/big_models.md)")
