"""Process groups per (placement, axis), created once per world and cached.

torch.distributed requires every rank of the world to create every group, in the same order.
Global operations are SPMD, so each rank asks for the same (placement, axis) at the same point
and we create all groups along that axis together; the first request for any group of a
placement creates the groups of every set of its axes (so a compiled graph loaded from a warm
cache, whose collectives were not traced in this process, finds the groups of the placements
the program used: docs/compile.md).

Each group is also registered under a name made of its ranks (``gt/0_2``; the world too), which
compiled graphs hold (``group_name``): torch's own names count groups in creation order, so a
graph cached by an earlier process would name another process's group, or none.
"""
from __future__ import annotations

import contextlib
import contextvars
import itertools
import math
import weakref

import torch
import torch.distributed as dist

from ..errors import GlobalTensorError
from ..placement import Placement
from ..world.simulated import simulated
from ..world.world import world_timeout

def byte_view(t: "torch.Tensor") -> "torch.Tensor":
    """A contiguous tensor's bytes as one flat uint8 view (no copy). Collectives that only move
    data (gathers, all_to_all, broadcast) send these: gloo's typed collectives reject int16,
    uint16, uint32, uint64 and float8 ("Invalid scalar type"), bytes of any dtype they take.
    (A contiguous tensor of one element may keep any stride, which a dtype view refuses: it is
    restrided first, a view still.)"""
    flat = t.reshape(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


# default process group -> {key: ProcessGroup, or None for the world's own group}. Weakly
# keyed, and never holding the world's group itself: after dist.destroy_process_group() nothing
# here keeps a group alive (a gloo group destroyed at interpreter exit instead can abort the
# process with "terminate called without an active exception").
_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _world_cache() -> dict:
    world = dist.distributed_c10d._get_default_group()
    cache = _CACHE.get(world)
    if cache is None:
        cache = {}
        _CACHE[world] = cache
    return cache


def group_of_ranks(ranks: tuple[int, ...]):
    """A process group over the set ``ranks``, created on every rank if new.

    torch numbers a group's members by ascending global rank, whatever order ``ranks`` lists
    them in: group rank i is ``sorted(ranks)[i]``. Pass global ranks (``src=``/``dst=``) or map
    through the sorted order. Every rank of the world must call this with the same set at the
    same point.
    """
    return _resolve(_cached_group(tuple(sorted(ranks))))


def _cached_group(members: tuple[int, ...]):
    """The cache's entry for ``members``: a group, or None for the whole world."""
    cache = _world_cache()
    key = ("ranks", members)
    if key not in cache:
        why = _FROZEN.get()
        if why is not None:
            raise GlobalTensorError(
                f"{why} needs a process group over ranks {list(members)}, which was not made "
                f"up front (making one needs every rank of the world, and the other ranks are "
                f"busy elsewhere); keep each stage's tensors on its own placement")
        if simulated():  # gt.simulate: nothing is sent, so no group is made
            cache[key] = SimulatedGroup(members)
            return cache[key]
        if members == tuple(range(dist.get_world_size())):
            cache[key] = None
        else:
            # new groups do not inherit the world's timeout (gt.init(timeout=...)) by themselves
            cache[key] = dist.new_group(list(members), timeout=world_timeout())
        _register_name(cache, members, cache[key])
    return cache[key]


# while set (to what is running), no new group may be made: gt.nn.Pipeline's ranks run different
# stages, so a group only some ranks ask for would wait forever
_FROZEN: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "globaltensor_no_new_groups", default=None)


@contextlib.contextmanager
def no_new_groups(why: str):
    """Inside: asking for a group that does not exist yet raises (naming ``why``), and an
    exchange sends its broadcasts as point-to-point messages."""
    token = _FROZEN.set(why)
    try:
        yield
    finally:
        _FROZEN.reset(token)


def groups_frozen() -> bool:
    return _FROZEN.get() is not None


def _register_name(cache: dict, members: tuple[int, ...], pg) -> None:
    """Register a member's group under its ranks' name in torch's registry (what functional
    collectives resolve); destroying the world unregisters it with the rest."""
    pg = _resolve(pg)
    if dist.get_rank() not in members:  # dist.GroupMember.NON_GROUP_MEMBER
        return
    name = "gt/" + "_".join(map(str, members))
    c10d = torch._C._distributed_c10d
    c10d._unregister_process_group(name)  # an earlier world's group of these ranks
    c10d._register_process_group(name, pg)
    cache[("name", members)] = name  # by ranks: the world's cache must never hold its own group


class SimulatedGroup:
    """A group of a simulated world (``gt.simulate``): its members, and nothing to send with."""

    __slots__ = ("members",)

    def __init__(self, members: tuple[int, ...]):
        self.members = members

    def size(self) -> int:  # what dist.get_world_size(group) asks
        return len(self.members)


def sends(group) -> bool:
    """Whether a collective on ``group`` sends anything (not in ``gt.simulate``'s world)."""
    return not isinstance(group, SimulatedGroup)


def group_name(group) -> str:
    """The name compiled graphs hold for ``group`` (None: the world): the same in every process
    of the same world size; torch's own name for a group made elsewhere."""
    pg = _resolve(group)
    members = tuple(sorted(dist.get_process_group_ranks(pg)))
    return _world_cache().get(("name", members)) or pg.group_name


def create_placement_groups(placement: Placement) -> None:
    """Every group of ``placement`` exists in this world (created now, on every rank, if new)."""
    _placement_groups(_world_cache(), placement)


def _placement_groups(cache: dict, placement: Placement) -> None:
    """The first request for a group of ``placement``: create the groups of every set of its
    axes, in one order on every rank."""
    key = ("placement", placement)
    if key in cache:
        return
    cache[key] = True
    for n in range(1, placement.ndim + 1):
        for axes in itertools.combinations(range(placement.ndim), n):
            groups_across(placement, axes)


def _resolve(pg):
    return dist.group.WORLD if pg is None else pg


def groups_along(placement: Placement, axis: int) -> dict[tuple[int, ...], object]:
    """Every group along ``axis`` of ``placement``, created together, on every rank, once:
    {ranks in axis order: the cache's entry (None for the whole world)}."""
    cache = _world_cache()
    key = ("axis", placement, axis)
    groups = cache.get(key)
    if groups is None:
        _placement_groups(cache, placement)
        groups = {ranks: _cached_group(tuple(sorted(ranks))) for ranks in placement.groups_along(axis)}
        cache[key] = groups
    return groups


def groups_across(placement: Placement, axes: tuple[int, ...]) -> dict[tuple[int, ...], object]:
    """Every group of ranks that differ only along ``axes`` (one all-reduce over them sums
    over all those axes at once), created together, on every rank, once: {ranks: the cache's
    entry}. One axis: :func:`groups_along`."""
    if len(axes) == 1:
        return groups_along(placement, axes[0])
    cache = _world_cache()
    key = ("axes", placement, axes)
    groups = cache.get(key)
    if groups is None:
        _placement_groups(cache, placement)
        others = [a for a in range(placement.ndim) if a not in axes]
        rows = placement.ranks.transpose(others + list(axes)).reshape(
            -1, math.prod(placement.shape[a] for a in axes))
        groups = {}
        for row in rows:
            ranks = tuple(int(r) for r in row)
            groups[ranks] = _cached_group(tuple(sorted(ranks)))
        cache[key] = groups
    return groups


def group_across(placement: Placement, axes: tuple[int, ...], rank: int):
    """``rank``'s group of :func:`groups_across` (it must be in the placement)."""
    return ranks_across(placement, axes, rank)[0]


def ranks_across(placement: Placement, axes: tuple[int, ...], rank: int):
    """``(group, ranks)``: ``rank``'s group of :func:`groups_across` and its ranks."""
    for ranks, pg in groups_across(placement, axes).items():
        if rank in ranks:
            return _resolve(pg), ranks
    raise ValueError(f"rank {rank} is not in {placement!r}")


def group_along(placement: Placement, axis: int, coord) -> tuple[object, tuple[int, ...]]:
    """This coordinate's group along ``axis`` and its ranks in axis order (the group's own
    numbering is by ascending global rank: see ``group_of_ranks``)."""
    ranks = placement.group_along(axis, coord)
    return _resolve(groups_along(placement, axis)[ranks]), ranks
