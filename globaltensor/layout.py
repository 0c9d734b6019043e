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
from .sbp import (Broadcast, PartialSum, Split, SbpValue, balanced, format_sbp, normalize, plain,
                  resolve)

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
        if balanced(values):
            _check_balanced(self.placement, values)
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
        """The [start, stop) range of every tensor dim held at grid ``coord``. A balanced
        (head-tail) split's piece is two ranges: :meth:`ranges` gives them, and this raises
        (code that reads positions from a box would read the wrong ones)."""
        if self.order:
            raise GlobalTensorError(
                f"internal: {self!r} has a head-tail split, whose pieces hold two ranges of the "
                f"dim; expected a caller that reads Layout.ranges(coord) (or works on "
                f"Layout.plain(), the permuted order), found one reading Layout.box. Please "
                f"report this with the op or call that raised it.")
        return _box(self, tuple(coord))

    def ranges(self, coord) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per tensor dim, the [start, stop) ranges held at grid ``coord``, in the order the
        piece holds them: one range, or two for a dim with a head-tail split."""
        coord = tuple(coord)
        box = _box(self.plain(), coord)
        out = [((lo, hi),) for lo, hi in box]
        for value, n, i in zip(self.sbp, self.placement.shape, coord):
            if type(value) is Split and value.balance and n > 1:
                out[value.dim] = head_tail_ranges(self.shape[value.dim], n, i)
        return tuple(out)

    def range_of(self, coord, dim: int) -> tuple[int, int]:
        """The [start, stop) of tensor dim ``dim`` held at grid ``coord``; raises for a dim
        with a head-tail split (two ranges: :meth:`ranges`)."""
        if any(d == dim for d, _ in self.order):
            raise GlobalTensorError(
                f"internal: dim {dim} of {self!r} has a head-tail split (two ranges); expected a "
                f"caller reading Layout.ranges(coord). Please report this.")
        return _box(self.plain(), tuple(coord))[dim]

    @property
    def order(self) -> tuple[tuple[int, int], ...]:
        """(dim, ranks) of each head-tail split on an axis of more than one rank: the dims its
        pieces hold permuted; ``()`` for every plain layout."""
        return _order(self)

    def plain(self) -> "Layout":
        """This layout with its splits' balance dropped: the same piece sizes, and each piece
        is what the plain layout holds of the tensor permuted by :attr:`order`."""
        return _plain(self)

    def slices(self, coord) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in self.box(coord))

    def local_shape(self, coord) -> tuple[int, ...]:
        return tuple(b - a for a, b in _box(self.plain(), tuple(coord)))

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
def _order(layout: Layout) -> tuple:
    return tuple((v.dim, n) for v, n in zip(layout.sbp, layout.placement.shape)
                 if type(v) is Split and v.balance and n > 1)


@memo(65536)
def _plain(layout: Layout) -> Layout:
    if not balanced(layout.sbp):
        return layout
    return trusted(layout.placement, plain(layout.sbp), layout.shape)


def _check_balanced(placement: Placement, values) -> None:
    """A head-tail split's dim is split by no other axis of more than one rank (its chunks
    are of the whole dim)."""
    for a, v in enumerate(values):
        if type(v) is Split and v.balance:
            others = [b for b, w in enumerate(values) if b != a and isinstance(w, Split)
                      and w.dim == v.dim and placement.shape[b] > 1]
            if others and placement.shape[a] > 1:
                raise SbpError(
                    f"sbp {format_sbp(values)}: a head-tail split cuts the whole dim {v.dim} into "
                    f"2k chunks, so expected no other placement axis splitting dim {v.dim}, found "
                    f"axis {others[0]} too; split dim {v.dim} on one axis, or use plain splits")


@memo(4096)
def head_tail_ranges(n: int, k: int, i: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Rank ``i`` of ``k``'s two ranges of a dim of ``n`` under a head-tail split: its piece
    has the uneven rule's size; the first half (rounded up) is the head, chunk i in the dim's
    order, the rest the tail, chunk 2k-1-i (heads in rank order, then tails in reverse)."""
    sizes = split_sizes(n, k)
    heads = [(s + 1) // 2 for s in sizes]
    tails = [s - h for s, h in zip(sizes, heads)]
    start = sum(heads[:i])
    tail = sum(heads) + sum(tails[i + 1:])
    return (start, start + heads[i]), (tail, tail + tails[i])


@memo(1024)
def head_tail_order(n: int, k: int) -> tuple[int, ...]:
    """For each position of a dim of ``n`` as a head-tail split over ``k`` ranks holds it (rank
    0's piece, then rank 1's, ...), the position it stands for in the dim's own order."""
    out = []
    for i in range(k):
        for lo, hi in head_tail_ranges(n, k, i):
            out.extend(range(lo, hi))
    return tuple(out)


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


__all__ = ["Layout", "boxes", "grid_coords", "head_tail_order", "head_tail_ranges", "split_sizes",
           "split_range", "Broadcast", "PartialSum", "Split"]


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
