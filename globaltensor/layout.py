"""Layout: a placement, one sbp per placement axis, and a global shape.

It answers, for every grid coordinate, which box of the global tensor that rank holds. The
uneven rule: a dim of size N over k ranks gives each N // k, and the first N % k one more; on an
n-D grid, placement axes split in order, axis 0 outermost (nested).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from ._cache import memo
from .errors import GlobalTensorError, PlacementError, SbpError
from .placement import Placement
from .sbp import Broadcast, PartialSum, Split, SbpValue, format_sbp, normalize, resolve

Box = tuple[tuple[int, int], ...]  # [start, stop) per tensor dim


def split_sizes(n: int, k: int) -> tuple[int, ...]:
    """Sizes of ``k`` pieces of a dim of size ``n`` (first ``n % k`` pieces one larger)."""
    q, r = divmod(n, k)
    return tuple(q + 1 if i < r else q for i in range(k))


def split_range(start: int, stop: int, k: int, i: int) -> tuple[int, int]:
    """The ``i``-th of ``k`` pieces of the index range [start, stop)."""
    sizes = split_sizes(stop - start, k)
    lo = start + sum(sizes[:i])
    return lo, lo + sizes[i]


@dataclass(frozen=True, slots=True)
class Layout:
    placement: Placement
    sbp: tuple[SbpValue, ...]
    shape: tuple[int, ...]
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.placement, Placement):
            raise PlacementError(
                f"Layout expects a placement made by gt.placement(type, ranks), found "
                f"{self.placement!r} ({type(self.placement).__name__})"
            )
        shape = _checked_shape(self.shape)
        object.__setattr__(self, "shape", shape)
        values = normalize(self.sbp, self.placement.ndim, self.placement.axes)
        try:
            values = resolve(values, len(shape))
        except SbpError as e:
            raise SbpError(f"{e} (tensor shape {list(shape)}, sbp {format_sbp(values)})") from None
        object.__setattr__(self, "sbp", values)
        # layouts key every plan and dispatch cache: hash once
        object.__setattr__(self, "_hash", hash((self.placement, values, shape)))

    def __hash__(self):
        return self._hash

    def __repr__(self):
        return f"Layout({self.placement!r}, {format_sbp(self.sbp)}, {list(self.shape)})"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def partial_axes(self) -> tuple[int, ...]:
        return tuple(a for a, s in enumerate(self.sbp) if isinstance(s, PartialSum))

    @property
    def is_partial(self) -> bool:
        return bool(self.partial_axes)

    def with_sbp(self, sbp) -> "Layout":
        return Layout(self.placement, sbp, self.shape)

    def with_axis(self, axis: int, value: SbpValue) -> "Layout":
        """This layout with ``value`` on placement ``axis`` (a resolved sbp value: no checks,
        the planner's inner loop)."""
        sbp = self.sbp[:axis] + (value,) + self.sbp[axis + 1:]
        return trusted(self.placement, sbp, self.shape)

    def max_local_numel(self) -> int:
        """Elements of the largest piece any rank holds (see :func:`_max_local`)."""
        return _max_local(self)

    def with_placement(self, placement: Placement, sbp) -> "Layout":
        return Layout(placement, sbp, self.shape)

    def box(self, coord) -> tuple[tuple[int, int], ...]:
        """The [start, stop) range of every tensor dim held at grid ``coord``."""
        return _box(self, tuple(coord))

    def slices(self, coord) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in self.box(coord))

    def local_shape(self, coord) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.box(coord))

    def local_shape_of_rank(self, rank: int) -> tuple[int, ...]:
        """This rank's piece shape; ranks outside the placement hold an empty piece."""
        coord = self.placement.coord_of(rank)
        if coord is None:
            return (0,) * self.ndim
        return self.local_shape(coord)

    def split_axes_of(self, dim: int) -> tuple[int, ...]:
        """Placement axes that split tensor ``dim``, outermost first."""
        return tuple(a for a, s in enumerate(self.sbp) if isinstance(s, Split) and s.dim == dim)


def trusted(placement: Placement, sbp: tuple, shape: tuple) -> Layout:
    """A Layout from values already checked and resolved (no normalisation)."""
    layout = object.__new__(Layout)
    object.__setattr__(layout, "placement", placement)
    object.__setattr__(layout, "sbp", sbp)
    object.__setattr__(layout, "shape", shape)
    object.__setattr__(layout, "_hash", hash((placement, sbp, shape)))
    return layout


@memo(65536)
def _max_local(layout: Layout) -> int:
    """The largest piece's numel, without visiting the grid: each dim's ranges at a coordinate
    depend only on the axes that split that dim (disjoint sets of axes), so the largest piece is
    the product over dims of the longest range, and the longest of k nested pieces of a range of
    n is ceil(n / k) at every level (the first pieces are the long ones)."""
    lengths = list(layout.shape)
    for value, n in zip(layout.sbp, layout.placement.shape):
        if isinstance(value, Split):
            lengths[value.dim] = -(-lengths[value.dim] // n)
    numel = 1
    for length in lengths:
        numel *= length
    return numel


def _is_size(s) -> bool:
    if type(s) is int:  # the common case, fast
        return s >= 0
    return isinstance(s, numbers.Integral) and not isinstance(s, bool) and s >= 0


def _checked_shape(shape) -> tuple[int, ...]:
    """``shape`` as a tuple of ints >= 0 (numpy / torch ints accepted; floats and bools not)."""
    try:
        dims = tuple(shape)
    except TypeError:
        dims = None
    if dims is None or not all(_is_size(s) for s in dims):
        raise GlobalTensorError(
            f"expected a global shape of ints >= 0, found {shape!r}; e.g. (4, 5)"
        )
    return tuple(int(s) for s in dims)


@memo(65536)
def _box(layout: Layout, coord: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """One coordinate's box, axis by axis as :func:`boxes` cuts them (without visiting the
    rest of the grid: a simulated world of thousands of ranks asks for one)."""
    if len(coord) != layout.placement.ndim:
        raise KeyError(coord)
    box = [(0, s) for s in layout.shape]
    for value, n, i in zip(layout.sbp, layout.placement.shape, coord):
        if not 0 <= i < n:
            raise KeyError(coord)
        if isinstance(value, Split) and n > 1:
            box[value.dim] = _pieces(*box[value.dim], n)[i]
    return tuple(box)


@memo(16384)
def boxes(layout: Layout) -> dict:
    """Every grid coordinate's box, worked out once per layout, axis by axis (axis 0
    outermost): an axis that splits a dim cuts each box's range of that dim in its pieces."""
    entries = [((), tuple((0, s) for s in layout.shape))]
    for value, n in zip(layout.sbp, layout.placement.shape):
        if isinstance(value, Split) and n > 1:
            d = value.dim
            entries = [(coord + (i,), box[:d] + (piece,) + box[d + 1:])
                       for coord, box in entries for i, piece in enumerate(_pieces(*box[d], n))]
        else:
            entries = [(coord + (i,), box) for coord, box in entries for i in range(n)]
    return dict(entries)


@memo(4096)
def _pieces(start: int, stop: int, k: int) -> tuple[tuple[int, int], ...]:
    out = []
    for size in split_sizes(stop - start, k):
        out.append((start, start + size))
        start += size
    return tuple(out)


@memo(1024)
def grid_coords(placement: Placement) -> tuple[tuple[int, ...], ...]:
    """``placement.coords()``, worked out once per placement."""
    return tuple(placement.coords())


__all__ = ["Layout", "boxes", "grid_coords", "split_sizes", "split_range", "Broadcast", "PartialSum", "Split"]


# --------------------------------------------------------------------------- the box algebra


def box_numel(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None when they do not overlap."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def overlap_numel(a: Box, b: Box) -> int:
    """``box_numel(intersect(a, b))``, 0 when they do not overlap (no box is built)."""
    n = 1
    for (x0, x1), (y0, y1) in zip(a, b):
        lo = x0 if x0 > y0 else y0
        hi = x1 if x1 < y1 else y1
        if hi <= lo:
            return 0
        n *= hi - lo
    return n


def relative(region: Box, within: Box) -> tuple[slice, ...]:
    """Slices that pick ``region`` out of a local piece holding ``within``."""
    return tuple(slice(lo - base, hi - base) for (lo, hi), (base, _) in zip(region, within))
