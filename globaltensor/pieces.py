"""A rank's piece of a full tensor, and the global positions its piece holds, for any layout:
a plain split's one range per dim, a head-tail split's two (Layout.ranges). The factories, the
random generator and global mode cut pieces here, so a head-tail layout gets the values of its
own positions."""
from __future__ import annotations

import torch

from .layout import Layout


def positions(layout: Layout, coord, dim: int, dtype=torch.int64, device=None) -> torch.Tensor:
    """The global indices along ``dim`` of the piece at ``coord``, in the piece's order (none
    for a rank outside the placement: ``coord`` None)."""
    if coord is None:
        return torch.arange(0, dtype=dtype, device=device)
    ranges = layout.ranges(coord)[dim]
    if len(ranges) == 1:
        (a, b), = ranges
        return torch.arange(a, b, dtype=dtype, device=device)
    return torch.cat([torch.arange(a, b, dtype=dtype, device=device) for a, b in ranges])


def piece_of(full: torch.Tensor, layout: Layout, coord) -> torch.Tensor:
    """``full``'s piece at ``coord``: a view for a plain layout; where a dim is held as two
    ranges (head-tail), the other dims' slices, then those dims' positions picked (a copy)."""
    if not layout.order:
        return full[layout.slices(coord)]
    ordered = {d for d, _ in layout.order}
    box = layout.plain().slices(coord)
    out = full[tuple(slice(None) if d in ordered else s for d, s in enumerate(box))]
    for d in sorted(ordered):
        out = out.index_select(d, positions(layout, coord, d, device=full.device))
    return out


__all__ = ["piece_of", "positions"]
