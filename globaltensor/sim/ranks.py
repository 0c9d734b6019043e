"""Per-rank figures from layouts alone: what a global tensor's piece weighs on every rank of the
world, which ranks a plan's step involves, and rank classes (ranks whose figures are equal)."""
from __future__ import annotations

import numpy as np
import torch

from .._cache import memo
from ..layout import Layout
from ..sbp import Split


@memo(8192)
def piece_bytes(layout: Layout, itemsize: int, world: int) -> np.ndarray:
    """Bytes of ``layout``'s piece on each rank of a world of ``world`` (0 outside it), for the
    whole grid at once: along each dim, the axes that split it (outermost first) cut every
    coordinate's length by the uneven rule (the first ``length % n`` pieces one longer)."""
    placement = layout.placement
    coords = np.indices(placement.shape, dtype=np.int64)
    numel = np.ones(placement.shape, dtype=np.int64)
    for dim, size in enumerate(layout.shape):
        length = np.full(placement.shape, size, dtype=np.int64)
        for axis, value in enumerate(layout.sbp):
            n = placement.shape[axis]
            if isinstance(value, Split) and value.dim == dim and n > 1:
                length = length // n + (coords[axis] < length % n)
        numel *= length
    out = np.zeros(world, dtype=np.int64)
    out[np.asarray(placement.flat_ranks)] = numel.reshape(-1) * itemsize
    return out


@memo(4096)
def placement_members(placement, world: int) -> np.ndarray:
    """1 on each rank of ``placement``, 0 elsewhere."""
    out = np.zeros(world, dtype=np.int64)
    out[np.asarray(placement.flat_ranks)] = 1
    return out


def bytes_of(world: int):
    """``gt.memory``'s measure in a simulation: a global tensor costs each rank its piece; any
    other tensor is the same on every rank."""
    def measure(t: torch.Tensor, storage) -> np.ndarray:
        layout = getattr(t, "_layout", None)
        local = getattr(t, "_local", None)
        # a piece that is its storage: its bytes on each rank; a view into a buffer (a bucket's,
        # a unit's) counts the buffer, alike on every rank
        if isinstance(layout, Layout) and (storage is None or
                                           local.numel() * local.element_size() == storage.nbytes()):
            return piece_bytes(layout, t.element_size(), world)
        return np.full(world, storage.nbytes(), dtype=np.int64)
    return measure


def classes(rows: np.ndarray) -> list[np.ndarray]:
    """Ranks grouped by equal columns of ``rows`` (features x ranks), in order of first rank."""
    _, first, inverse = np.unique(rows.T, axis=0, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    order = np.argsort(first)
    return [np.flatnonzero(inverse == label) for label in order]


def ranges(ranks: np.ndarray) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"`` (long lists shortened)."""
    parts, start, prev = [], None, None
    for r in ranks.tolist():
        if start is None:
            start = prev = r
        elif r == prev + 1:
            prev = r
        else:
            parts.append(f"{start}-{prev}" if prev > start else str(start))
            start = prev = r
    if start is not None:
        parts.append(f"{start}-{prev}" if prev > start else str(start))
    text = ", ".join(parts)
    return text if len(parts) <= 8 else ", ".join(parts[:8]) + f", ... ({len(ranks)} ranks)"
