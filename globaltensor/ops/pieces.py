"""Which pieces of a row's inputs belong together, and which results a rank may fill with zeros.

A row that splits several inputs on one placement axis runs the op on the i-th piece of each:
that is right only if those pieces correspond. Pieces of dims of equal size do (the uneven rule
cuts them alike). Pieces of dims of *different* sizes correspond only proportionally: the
grouped heads of attention (4 query heads over 2 key/value heads: query heads 2j and 2j+1 read
key head j) are cut into matching groups when each size divides evenly by the ranks that split
it; cut unevenly (2 key heads over 4 ranks: ranks 2 and 3 get none) they do not, and the op
would run on pieces that do not belong together. :func:`unequal_splits_even` is the check
:func:`~globaltensor.ops.registry.rows_for` adds to every rule whose rows split unequal dims
(a rule whose kernel matches such pieces itself says ``ragged=True``). A split dim of size 1
beside a longer one is never right (:func:`splits_size_one`): it broadcasts.

Zeros stand in for a result only where they are its exact value (:func:`nothing_held`): an
empty piece, or a partial sum of nothing.

Pure: no torch.distributed, no rank.
"""
from __future__ import annotations

import math

import torch

from ..sbp import Split, format_sbp


def split_sizes(row_ins, shapes) -> set:
    """The global sizes of the dims that ``row_ins`` (one value per input) split."""
    sizes = set()
    for v, shape in zip(row_ins, shapes):
        if isinstance(v, Split) and -len(shape) <= v.dim < len(shape):
            sizes.add(shape[v.dim])
    return sizes


def splits_size_one(row, shapes) -> bool:
    """Whether ``row`` splits a dim of global size 1 of one input while it splits a longer dim
    of another: the size-1 dim broadcasts, and the ranks past the first would get an empty
    piece of it (torch's CPU attention reads an empty mask as no mask). Such a row is a rule
    bug; ``rows_for`` drops it, it never runs."""
    sizes = split_sizes(row.ins, shapes)
    return 1 in sizes and max(sizes) > 1


def splits_unequal(row, shapes) -> bool:
    """Whether ``row`` splits dims of different sizes (all above 1) of its inputs."""
    return len(split_sizes(row.ins, shapes)) > 1


def unequal_splits_even(call, grid, ins) -> bool:
    """On every placement axis whose splits cut dims of different sizes, each such dim is cut
    into equal pieces by the ranks splitting it so far (nested: axes 0..axis that split the
    same dim), so the i-th pieces are the same fraction of each dim. ``ins``: one sbp tuple
    (one entry per axis) per input."""
    shapes = call.shapes
    for axis in range(len(grid)):
        split = [(i, v[axis].dim % len(shapes[i])) for i, v in enumerate(ins)
                 if isinstance(v[axis], Split) and shapes[i]]
        if len({shapes[i][d] for i, d in split}) < 2:
            continue
        for i, d in split:
            ranks = math.prod(grid[a] for a in range(axis + 1)
                              if isinstance(ins[i][a], Split) and ins[i][a].dim % len(shapes[i]) == d)
            if shapes[i][d] % ranks:
                return False
    return True


def nothing_held(outs, coord) -> bool:
    """Whether every result (an output spec with ``.layout``, or a nest of them) is, on the
    rank at ``coord``, an empty piece or a partial sum: zeros are then its exact value when the
    inputs there are empty."""
    if hasattr(outs, "layout"):
        layout = outs.layout
        return (coord is None or bool(layout.partial_axes)
                or math.prod(layout.local_shape(coord)) == 0)
    return outs is None or all(nothing_held(o, coord) for o in outs)


def zero_pieces(outs, coord, device):
    """Zeros shaped as the pieces of ``outs`` at ``coord`` (nested as ``outs``)."""
    if hasattr(outs, "layout"):
        return torch.zeros(outs.layout.local_shape(coord), dtype=outs.dtype, device=device)
    if outs is None:
        return None
    return type(outs)(zero_pieces(o, coord, device) for o in outs)


def layouts_of(outs) -> str:
    """Output specs as their sbp and global shape, ``(S(1),)[8, 4, 16]``."""
    if hasattr(outs, "layout"):
        return f"{format_sbp(outs.layout.sbp)}{list(outs.layout.shape)}"
    return ", ".join(layouts_of(o) for o in outs if o is not None)
