"""Placement: a device type and an n-D grid of distinct global ranks.

Pure: holds no process group and never asks which rank is running.
"""
from __future__ import annotations

import itertools
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from .errors import PlacementError

DEVICE_TYPES = ("cpu", "cuda")


def _nested_shape(ranks) -> tuple[int, ...]:
    """Shape of a nested list of ints, raising on ragged or non-int entries."""
    if isinstance(ranks, (list, tuple)):
        if not ranks:
            raise PlacementError("expected a non-empty list of ranks, found []")
        shapes = {_nested_shape(r) for r in ranks}
        if len(shapes) != 1:
            raise PlacementError(
                f"expected a rectangular (not ragged) rank grid, found rows of shapes "
                f"{sorted(shapes)} in {ranks!r}; give every row the same length"
            )
        return (len(ranks),) + shapes.pop()
    return ()


def _to_array(ranks) -> np.ndarray:
    if isinstance(ranks, range):
        ranks = list(ranks)
    if isinstance(ranks, np.ndarray):
        arr = ranks
    else:
        if isinstance(ranks, (list, tuple)):
            _nested_shape(ranks)
        arr = np.array(ranks, dtype=object)
    if arr.size == 0:
        raise PlacementError(f"expected at least one rank, found an empty rank array {ranks!r}")
    flat = arr.reshape(-1).tolist()
    for r in flat:
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)):
            raise PlacementError(
                f"expected integer ranks, found {r!r} ({type(r).__name__}) in {ranks!r}"
            )
        if not -2 ** 63 <= int(r) < 2 ** 63:
            raise PlacementError(f"expected ranks below the world size, found {int(r)}; pass "
                                 f"ranks in [0, world size)")
    return np.array([int(r) for r in flat], dtype=np.int64).reshape(arr.shape if arr.ndim else (1,))


class Placement:
    """``gt.placement(type, ranks, axes=None)``: where a global tensor lives; ``axes`` names
    the placement axes (``p["tp"]``, ``sbp={"tp": S(0)}``).

    >>> p = placement("cpu", ranks=[[0, 1], [2, 3]], axes=("dp", "tp"))
    >>> p.shape, p.ndim, p.coord_of(2), p.along("tp", 2)
    ((2, 2), 2, (1, 0), placement('cpu', ranks=[2, 3], axes=('tp',)))
    """

    __slots__ = ("type", "shape", "flat_ranks", "axes", "_hash", "__dict__")
    type: str  # "cpu" or "cuda"
    shape: tuple[int, ...]  # the grid's
    flat_ranks: tuple[int, ...]  # the grid's ranks, row-major
    axes: tuple[str, ...] | None  # the axis names, if given

    if TYPE_CHECKING:  # set by gt's import to env.sub_placement (which asks which rank runs)
        def __getitem__(self, axis: str | int) -> Placement:
            """``p["tp"]``: this rank's 1-D sub-placement along ``axis`` (a name or a number)."""

    def __init__(self, type: str = "cpu", ranks=None, axes=None):
        if ranks is None:
            raise PlacementError(
                "expected ranks, e.g. gt.placement('cpu', ranks=[0, 1]); found none "
                "(use gt.placement.all('cpu') for every rank)"
            )
        if not isinstance(type, str) or type.split(":")[0] not in DEVICE_TYPES:
            raise PlacementError(
                f"expected a device type in {DEVICE_TYPES}, found {type!r}; "
                f"'cpu' runs on gloo, 'cuda' on NCCL"
            )
        arr = _to_array(ranks)
        flat = tuple(int(r) for r in arr.reshape(-1))
        negative = [r for r in flat if r < 0]
        if negative:
            raise PlacementError(f"expected ranks >= 0, found {negative} in {arr.tolist()}")
        if len(set(flat)) != len(flat):
            dups = sorted({r for r in flat if flat.count(r) > 1})
            raise PlacementError(
                f"expected distinct ranks, found {dups} more than once in {arr.tolist()}; "
                f"each rank may hold one grid cell"
            )
        object.__setattr__(self, "type", type.split(":")[0])
        object.__setattr__(self, "shape", tuple(int(s) for s in arr.shape))
        object.__setattr__(self, "flat_ranks", flat)
        object.__setattr__(self, "axes", _checked_axes(axes, len(self.shape)))
        object.__setattr__(self, "_hash", hash(self._key()))  # hashed on every plan lookup

    def __setattr__(self, name, value):
        raise AttributeError("Placement is immutable")

    @classmethod
    def all(cls, type: str = "cpu", world_size: int | None = None) -> "Placement":
        """Every rank of the world, 1-D."""
        if world_size is None:
            from .world import world  # not env, which builds placements (all_device_placement)

            world_size = world.get_world_size()
        return cls(type, list(range(world_size)))

    # --- value semantics ---
    def _key(self):
        return (self.type, self.shape, self.flat_ranks, self.axes)

    def __eq__(self, other):
        if self is other:
            return True
        return (isinstance(other, Placement) and self._hash == other._hash
                and self._key() == other._key())

    def __hash__(self):
        return self._hash

    def __repr__(self):
        named = "" if self.axes is None else f", axes={self.axes!r}"
        return f"placement({self.type!r}, ranks={self.ranks.tolist()!r}{named})"

    __str__ = __repr__

    def __reduce__(self):
        return (Placement, (self.type, self.ranks.tolist(), self.axes))

    # --- the grid ---
    @property
    def ranks(self) -> np.ndarray:
        return np.array(self.flat_ranks, dtype=np.int64).reshape(self.shape)

    @property
    def hierarchy(self) -> tuple[int, ...]:
        """The grid's shape, by OneFlow's name (``placement.hierarchy``): ``shape``."""
        return self.shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return len(self.flat_ranks)

    @cached_property
    def _coord_map(self) -> dict:
        return {r: c for r, c in zip(self.flat_ranks, self.coords())}

    def coords(self):
        """Every grid coordinate, in row-major order (the order of ``flat_ranks``)."""
        return list(itertools.product(*(range(s) for s in self.shape)))

    def coord_of(self, rank: int):
        """Grid coordinate of ``rank``, or None if the rank is not in this placement."""
        return self._coord_map.get(rank)

    def __contains__(self, rank) -> bool:
        return rank in self._coord_map

    def rank_at(self, coord) -> int:
        """The rank at grid ``coord`` (row-major into ``flat_ranks``: no array is built, a
        grid of thousands of ranks is asked one coordinate at a time)."""
        if len(coord) != len(self.shape):
            return int(self.ranks[tuple(coord)])  # a partial coordinate: numpy's answer
        index = 0
        for i, n in zip(coord, self.shape):
            if not -n <= i < n:
                raise IndexError(f"coordinate {tuple(coord)} is outside the grid {self.shape}")
            index = index * n + (i % n)
        return self.flat_ranks[index]

    def group_along(self, axis: int, coord) -> tuple[int, ...]:
        """The ranks that share every coordinate with ``coord`` except along ``axis``, in axis order."""
        base = list(coord)
        out = []
        for i in range(self.shape[axis]):
            base[axis] = i
            out.append(self.rank_at(base))
        return tuple(out)

    def groups_along(self, axis: int) -> list[tuple[int, ...]]:
        """Every group of ranks along ``axis``, in a deterministic order (row-major over other axes)."""
        self.check_axis(axis)
        others = [range(s) if a != axis else range(1) for a, s in enumerate(self.shape)]
        return [self.group_along(axis, c) for c in itertools.product(*others)]

    def axis_index(self, axis) -> int:
        """The number of placement ``axis``, given by number or by name."""
        if isinstance(axis, str):
            if self.axes is None or axis not in self.axes:
                named = (f"named {list(self.axes)}" if self.axes else
                         "unnamed; name them with gt.placement(type, ranks, axes=(...))")
                raise PlacementError(f"expected a placement axis name, found {axis!r}; the axes "
                                     f"of {self!r} are {named}")
            return self.axes.index(axis)
        self.check_axis(axis)
        return axis

    def along(self, axis, rank: int) -> "Placement":
        """The 1-D placement of the ranks that share ``rank``'s grid coordinate except along
        ``axis`` (a number or a name): ``rank``'s row of that axis."""
        axis = self.axis_index(axis)
        coord = self.coord_of(rank)
        if coord is None:
            raise PlacementError(f"expected a rank of {self!r}, found rank {rank}, which holds "
                                 f"no cell; ask a rank of the placement for its sub-placement")
        names = None if self.axes is None else (self.axes[axis],)
        return Placement(self.type, list(self.group_along(axis, coord)), axes=names)

    def check_axis(self, axis: int) -> None:
        if not 0 <= axis < self.ndim:
            raise PlacementError(
                f"expected a placement axis in [0, {self.ndim}), found {axis} for {self!r}"
            )

    def check_world(self, world_size: int) -> None:
        """Raise if a rank lies beyond a world of ``world_size``."""
        beyond = [r for r in self.flat_ranks if r >= world_size]
        if beyond:
            raise PlacementError(
                f"expected ranks < world size {world_size}, found {beyond} in {self!r}; "
                f"launch more processes or use ranks 0..{world_size - 1}"
            )


def _checked_axes(axes, ndim: int):
    if axes is None:
        return None
    if isinstance(axes, str) or not isinstance(axes, (list, tuple)):
        raise PlacementError(f"expected axes=(name, ...), one str per placement axis, found "
                             f"{axes!r}; e.g. axes=('dp', 'tp')")
    axes = tuple(axes)
    if len(axes) != ndim or not all(isinstance(a, str) and a for a in axes):
        raise PlacementError(f"expected axes with {ndim} non-empty names (the grid has {ndim} "
                             f"axes), found {axes!r}")
    if len(set(axes)) != len(axes):
        raise PlacementError(f"expected distinct axis names, found axes={axes!r}; name each "
                             f"axis once")
    return axes


placement = Placement

__all__ = ["Placement", "placement", "PlacementError", "DEVICE_TYPES"]
