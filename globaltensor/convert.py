"""``Tensor.to_global`` and ``to_local``: making global tensors and redistributing them.

From a local tensor, ``to_global(placement, sbp)`` wraps this rank's piece (checking the pieces'
shapes across ranks with ``check_meta``, syncing broadcast pieces with ``sync_data``). From a
global tensor it redistributes: plan, then execute, as an autograd Function whose backward runs
the plan of the dual layout. A repeated sbp-only call on one layout takes a warm path.
"""
from __future__ import annotations

import itertools

import torch

from . import debug as _debug
from . import env
from .world import world
from .world.simulated import knowable, simulated
from ._cache import ById, memo
from .compile_support import nonstrict
from .errors import GlobalTensorError, SbpError, ShapeMismatchError
from .layout import Layout, trusted
from .placement import Placement
from .plan import plan as _plan
from .runtime.agreement import check
from .runtime.execute import run as _execute
from . import observe
from .observe import watching
from .runtime.meta import MAX_NDIM, broadcast_along, exchange_meta
from .sbp import (Broadcast, SbpSpec, Split, format_sbp, from_codes, normalize, resolve,
                  to_codes)
from .tensor import (GlobalTensor, FromLocal, Redistribute, coerce_plain_tangent, records_graph,
                     redistributed, rewrapped)


def device_for(placement: Placement) -> torch.device:
    """Where this rank's pieces of tensors on ``placement`` live (meta in gt.simulate: no data,
    and no device needed, so a "cuda" job simulates on a machine without one)."""
    if simulated():
        return torch.device("meta")
    if placement.type == "cuda":
        if not torch.cuda.is_available():
            raise GlobalTensorError(
                f"{placement!r} needs CUDA, found none on this machine (torch.cuda.is_available() "
                f"is False); use gt.placement('cpu', ...) or run where GPUs are visible"
            )
        return torch.device("cuda", env.get_local_rank())
    return torch.device("cpu")


def _check_grad_sbp(grad_sbp, placement: Placement, ndim: int):
    """Reject a bad grad_sbp now, not at backward time. It is the sbp of the input's gradient,
    so it is checked against the placement where backward applies it: the input's. Returns
    its resolved values (None for None)."""
    if grad_sbp is None:
        return None
    try:
        return resolve(normalize(grad_sbp, placement.ndim, placement.axes), ndim)
    except SbpError as e:
        raise SbpError(f"grad_sbp is the sbp of the input's gradient, on the input's "
                       f"placement {placement!r}: {e}") from None


def _even_shape(piece_shape, placement: Placement, values) -> tuple:
    """The global shape of equal pieces: each split dim times the ranks along its axis."""
    shape = list(piece_shape)
    for axis, v in enumerate(values):
        if isinstance(v, Split):
            shape[v.dim] *= placement.shape[axis]
    return tuple(shape)


def check_placement(placement) -> Placement:
    if not isinstance(placement, Placement):
        raise GlobalTensorError(
            f"expected placement=gt.placement(type, ranks), found {placement!r} "
            f"({type(placement).__name__})"
        )
    placement.check_world(world.get_world_size())
    return placement


def _global_shape_from_pieces(placement: Placement, sbp, metas, ndim):
    """Global shape implied by the piece shapes: a split dim sums the pieces along its axes
    (other axes at coordinate 0); any other dim is the piece's size at coordinate 0."""
    shape = []
    for dim in range(ndim):
        axes = [a for a, v in enumerate(sbp) if isinstance(v, Split) and v.dim == dim]
        along = itertools.product(*[range(n) if a in axes else (0,)  # row-major, as coords()
                                    for a, n in enumerate(placement.shape)])
        shape.append(sum(metas[placement.rank_at(c)][0][dim] for c in along))
    return tuple(shape)


def _local_to_global(local: torch.Tensor, placement, sbp, grad_sbp, check_meta, sync_data, copy):
    if placement is None or sbp is None:
        raise GlobalTensorError(
            "to_global on a local tensor needs both placement and sbp, e.g. "
            "x.to_global(placement=gt.placement('cpu', [0, 1]), sbp=gt.sbp.split(0)); "
            f"found placement={placement!r}, sbp={sbp!r}"
        )
    placement = check_placement(placement)
    if local.layout != torch.strided:
        raise GlobalTensorError(
            f"to_global expects a dense (strided) tensor, found layout {local.layout}; convert "
            f"it first with .to_dense()")
    sbp = normalize(sbp, placement.ndim, placement.axes)
    if _debug.is_debug():
        own = {} if check_meta else {"dtype": local.dtype, "ndim": local.dim()}  # else exchanged
        check("to_global", source="local tensor", placement=placement, sbp=sbp, grad_sbp=grad_sbp,
              check_meta=check_meta, sync_data=sync_data, **own)
    rank = world.get_rank()
    coord = placement.coord_of(rank)
    device = device_for(placement)
    # built on meta (every rank alike): a meta piece, nothing synced; in gt.simulate every piece
    # is meta, and only the user's meta tensors hold no data in the real run
    meta = local.is_meta and (not simulated() or observe.holds_no_data(local))
    if simulated() and not knowable(local):  # gt.simulate: no data, but known positions
        local = local.to("meta")
    elif local.device != device and not meta:
        local = local.to(device)
    sync_data = sync_data and not meta
    if check_meta:  # a rank outside the placement passes an ignored tensor: take the members'
        metas = [per_rank[0] for per_rank in exchange_meta([local], sbp=sbp)]  # by rank
        first_shape, dtype, _ = metas[placement.flat_ranks[0]]
        ndim = len(first_shape)
        _check_same_sbp(metas, ndim)
    else:
        ndim, dtype = local.dim(), local.dtype
    values = resolve(sbp, ndim)
    _check_grad_sbp(grad_sbp, placement, ndim)
    if check_meta:
        shape = _checked_global_shape(metas, placement, values)
    else:
        shape = _even_shape(local.shape, placement, values)
    layout = trusted(placement, values, shape)  # the sbp was normalised once, above
    if coord is None:
        piece = torch.empty((0,) * ndim, dtype=dtype, device="meta" if meta else device)
    else:
        piece = local.clone() if copy else local
        if sync_data and any(isinstance(v, Broadcast) for v in values):
            piece = _sync_broadcast(piece, layout, rank, already_copied=copy)
    if coord is None and sync_data:
        _sync_broadcast(piece, layout, rank, already_copied=True)  # take part in group creation
    out = FromLocal.apply(piece, layout, grad_sbp)
    if simulated():  # counted on every rank by its piece (the meta piece was this rank's only)
        observe.storage_kind(out, "activations")
    return out


def _sync_broadcast(piece, layout: Layout, rank: int, already_copied: bool):
    if not already_copied:
        piece = piece.clone()
    piece = piece.contiguous()
    nbytes = layout.max_local_numel() * piece.element_size()
    for axis, v in enumerate(layout.sbp):
        if isinstance(v, Broadcast):
            broadcast_along(layout.placement, axis, piece, rank, nbytes)
    return piece


def _shown(values) -> str:
    """An exchanged sbp as format_sbp writes it; a split dim past MAX_NDIM arrived saturated
    (the exchange's int64 records carry no larger dim), so it is written as the range it stands
    for, not as the dim at the edge."""
    def one(v):
        if isinstance(v, Split) and v.dim >= MAX_NDIM:
            return f"S({MAX_NDIM} or more)"
        if isinstance(v, Split) and v.dim < -MAX_NDIM:
            return f"S({-MAX_NDIM - 1} or less)"
        return str(v)
    values = tuple(values)
    return "(" + ", ".join(map(one, values)) + (",)" if len(values) == 1 else ")")


def _check_same_sbp(metas, ndim: int) -> None:
    """Every rank must pass the same sbp (negative split dims resolved against the members'
    ``ndim``): else each builds another layout, and their global shapes differ. Every rank
    holds every rank's sbp (``metas``), so all raise the same message."""
    def key(values):
        try:
            return resolve(values, ndim)
        except SbpError:  # a dim the tensor lacks: resolve (below) raises it, on every rank
            return values
    if metas.count(metas[0]) == len(metas):  # one record (a simulation's ranks share one)
        return
    ranks_of: dict = {}
    for rank, meta in enumerate(metas):
        ranks_of.setdefault(key(meta.sbp), []).append(rank)
    if len(ranks_of) > 1:
        found = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: "
                          f"{_shown(v)}" for v, r in ranks_of.items())
        raise SbpError(
            f"to_global: expected every rank to pass the same sbp (one layout of one global "
            f"tensor), found {found}; the ranks would disagree on its global shape. Compute "
            f"the sbp from what every rank shares, not from the rank (gt.get_rank()); pieces "
            f"that differ per rank still go with one sbp")


def _alike(metas, members) -> bool:
    """Whether every member passed one record (as a simulation's ranks do): a C-level count
    where the members are the whole world."""
    first = metas[members[0]]
    if len(members) == len(metas):
        return metas.count(first) == len(metas)
    return all(metas[r] == first for r in members)


def _coords_to_check(layout: Layout, alike: bool):
    """The coordinates whose pieces :func:`_checked_global_shape` compares with the rule: every
    one, unless every member passed one record (``alike``) and the rule cuts one piece shape
    for every coordinate: then the first coordinate stands for all."""
    placement = layout.placement
    if not alike or not _one_piece_shape(layout):
        return placement.coords()
    return [(0,) * placement.ndim]


def _one_piece_shape(layout: Layout) -> bool:
    """Whether every coordinate's piece has one shape (each split cuts even pieces, at every
    level of a nested split: the longest piece, ceil, equals the shortest, floor)."""
    lengths = list(layout.shape)
    for value, n in zip(layout.sbp, layout.placement.shape):
        if isinstance(value, Split) and n > 1:
            if lengths[value.dim] % n:
                return False
            lengths[value.dim] //= n
    return True


def _checked_global_shape(metas, placement: Placement, values):
    """The global shape the members' pieces (``metas``: (shape, dtype) by rank) make, after
    checking they agree in ndim and dtype and follow the uneven split rule."""
    members = placement.flat_ranks  # row-major, as coords()
    first = members[0]
    alike = _alike(metas, members)
    for r in (first,) if alike else members:
        if len(metas[r][0]) != len(metas[first][0]):
            raise ShapeMismatchError(
                f"to_global: expected every rank of {placement!r} to pass a piece with "
                f"{len(metas[first][0])} dims (rank {first}: {list(metas[first][0])}), found rank "
                f"{r} with {list(metas[r][0])}"
            )
        if metas[r][1] != metas[first][1]:
            raise ShapeMismatchError(
                f"to_global: expected one dtype on every rank, found {metas[first][1]} "
                f"on rank {first} and {metas[r][1]} on rank {r}; cast the pieces first"
            )
    shape = _global_shape_from_pieces(placement, values, metas, len(metas[first][0]))
    layout = trusted(placement, values, shape)  # values: normalised and resolved by the caller
    for c in _coords_to_check(layout, alike):
        r = placement.rank_at(c)
        if metas[r][0] != layout.local_shape(c):
            expected = {placement.rank_at(k): list(layout.local_shape(k)) for k in placement.coords()}
            found = {placement.rank_at(k): list(metas[placement.rank_at(k)][0])
                     for k in placement.coords()}
            raise ShapeMismatchError(
                f"to_global with sbp {format_sbp(values)}: rank {r} passed a piece of shape "
                f"{list(metas[r][0])}, expected {list(layout.local_shape(c))} for a global shape "
                f"{list(shape)} (uneven split: the first N % k ranks hold one more). Pieces by "
                f"rank, found: {found}; expected: {expected}. Pass pieces that follow the rule, "
                f"or build the tensor from full data with gt.tensor(...)"
            )
    return shape


def target_layout(src: Layout, placement, sbp, what: str) -> Layout:
    """The layout a redistribution of ``src`` aims at: a missing placement or sbp is kept."""
    if placement is None:
        placement = src.placement
    else:
        placement = check_placement(placement)
    if placement.type != src.placement.type:
        raise GlobalTensorError(
            f"{what} cannot move between device types ({src.placement.type} -> "
            f"{placement.type}) yet; move the local piece with .to_local().to(device) first"
        )
    if sbp is None:
        if placement.ndim != src.placement.ndim:
            raise GlobalTensorError(
                f"{what} to {placement!r} ({placement.ndim}-D) from a {src.placement.ndim}-D "
                f"placement needs an sbp for each of its {placement.ndim} axes; pass sbp=..."
            )
        return Layout(placement, src.sbp, src.shape)
    return Layout(placement, sbp, src.shape)  # the Layout normalises the sbp


@memo(4096)
def _hashed_target(src: Layout, placement, sbp) -> Layout:
    return target_layout(src, placement, sbp, "to_global")


def _cached_target(src: Layout, placement, sbp) -> Layout:
    """``target_layout`` for to_global, cached on (src, placement, sbp) when they hash."""
    try:
        return _hashed_target(src, placement, sbp)
    except TypeError:  # an unhashable sbp (a list): compute it
        return target_layout(src, placement, sbp, "to_global")


# The warm path of ``x.to_global(sbp=...)`` on a global tensor: (id(src layout), sbp argument)
# -> (dst, plan or None for the same layout). Filled by the full path below and used only where
# that path does nothing but plan and execute: no placement argument (that one is checked
# against the current world every time), no grad_sbp, no copy, debug checks off and no autograd
# graph. A redistribution that is a 1 ms copy then costs one dict lookup, the executor and the
# wrapper, instead of some thirty Python calls that each touch memory the copy just evicted from
# the caches (docs/performance.md). An entry pins src, so its id is not reused while it lives.
_MOVES = ById(4096)


def to_global(self: torch.Tensor, placement: Placement | None = None, sbp: SbpSpec | None = None,
              *, grad_sbp: SbpSpec | None = None, check_meta: bool = True,
              sync_data: bool = True, copy: bool = False) -> GlobalTensor:
    """Make a global tensor (from a local piece) or redistribute one (from a global tensor).

    >>> x = torch.randn(2, 5).to_global(placement=gt.placement("cpu", [0, 1]), sbp=gt.sbp.split(0))
    >>> y = x.to_global(sbp=gt.sbp.broadcast)        # all_gather
    """
    if not isinstance(self, GlobalTensor):
        return _local_to_global(self, placement, sbp, grad_sbp, check_meta, sync_data, copy)
    src = self._layout
    plain = (placement is None and grad_sbp is None and not copy and _debug.FLAG.get() is False
             and not (self.requires_grad and torch.is_grad_enabled()))
    if plain:
        try:
            hit = _MOVES.get((id(src), sbp))
        except TypeError:  # an unhashable argument (an sbp list): the full path
            hit = None
        if hit is not None:
            if hit[1] is None:
                return self
            rank = world.cached_rank()
            if rank is not None and not watching():  # a trace or the profiler: the full path
                return rewrapped(self, _execute(hit[1], self._local, rank), hit[0])
    dst = _cached_target(src, placement, sbp)
    _check_grad_sbp(grad_sbp, src.placement, len(src.shape))  # where backward applies it
    if _debug.is_debug():
        check("to_global", source=src, target=dst, dtype=self.dtype, grad_sbp=grad_sbp,
                     copy=copy)
    elif plain:  # debug was off before this call too: the next such call may take the warm path
        _remember_move(src, sbp, dst)
    if dst == src and not copy and (grad_sbp is None or not records_graph(self)):
        return self
    if records_graph(self):  # also the same layout with grad_sbp: the gradient is moved
        return Redistribute.apply(self, dst, grad_sbp, copy)
    return redistributed(self, dst, copy)


def _remember_move(src: Layout, sbp, dst: Layout) -> None:
    try:
        key = (id(src), sbp)
        hash(key)
    except TypeError:
        return
    _MOVES.put(key, (dst, None if dst == src else _plan(src, dst)), pinned=src)


def to_local(self: torch.Tensor) -> torch.Tensor:
    """A local tensor is already local: returns itself."""
    if isinstance(self, GlobalTensor):
        return GlobalTensor.to_local(self)
    return self


def install_tensor_methods():
    """``Tensor.to_global``, ``to_local``, ``is_global`` and ``is_local`` (called once by
    globaltensor/__init__.py)."""
    torch.Tensor.to_global = to_global
    torch.Tensor.to_local = to_local
    # a plain gradient for a global output of a compiled graph (docs/compile.md)
    torch.Tensor.__coerce_same_metadata_as_tangent__ = coerce_plain_tangent
    torch.Tensor.is_global = property(lambda self: isinstance(self, GlobalTensor))
    torch.Tensor.is_local = property(lambda self: not isinstance(self, GlobalTensor))  # OneFlow's name
    GlobalTensor.to_global = to_global


def from_local(local: torch.Tensor, placement: Placement, sbp: SbpSpec, *,
               shape: tuple[int, ...] | None = None,
               grad_sbp: SbpSpec | None = None) -> GlobalTensor:
    """This rank's piece ``local`` as its piece of a global tensor, with no communication (as
    DTensor's ``from_local``); unlike ``Tensor.to_global`` it traces inside ``torch.compile``.

    The global shape is ``shape`` (nothing is sent). Without it, where an axis splits, every
    rank must learn the others' pieces to know the global shape (the pieces may be uneven, and
    ranks that assumed even pieces would build different shapes): eagerly the pieces' shapes
    are exchanged, one small all-gather as ``to_global``'s ``check_meta``, and pieces that do
    not follow the uneven-split rule are an error on every rank; inside ``torch.compile``
    (no exchange in a graph) ``shape`` is required. Broadcast and partial pieces need no shape
    and send nothing; broadcast pieces are taken as equal, not synced. Each piece's shape is
    checked against the shape its rank must hold (a ``ShapeMismatchError``, on that rank).

    >>> x = gt.from_local(torch.randn(2, 5), gt.placement("cpu", [0, 1]), gt.sbp.split(0),
    ...                   shape=(4, 5))
    """
    placement = check_placement(placement)
    values = resolve(normalize(sbp, placement.ndim, placement.axes), local.dim())
    grad = _check_grad_sbp(grad_sbp, placement, local.dim())
    if shape is None and any(isinstance(v, Split) for v in values):
        shape = _exchanged_shape(local, placement, values)
    # () and (-1,) stand for None: dynamo passes no None to a nonstrict_trace call
    return _piece_as_global(local, placement, to_codes(values),
                            (-1,) if shape is None else tuple(shape), to_codes(grad or ()))


def _exchanged_shape(local: torch.Tensor, placement: Placement, values) -> tuple:
    """gt.from_local of split pieces without ``shape``: the global shape from every rank's
    piece (one all-gather of their shapes over the world; ranks outside take the members')."""
    if torch.compiler.is_compiling():
        raise GlobalTensorError(
            f"gt.from_local with sbp {format_sbp(values)} inside torch.compile needs the global "
            f"shape: pass shape=(...) (the ranks' pieces may be uneven, and a graph cannot "
            f"exchange their shapes); outside compiled code it is learnt from the pieces")
    metas = [per_rank[0] for per_rank in exchange_meta(
        [local], what="gt.from_local: exchanging piece shapes (no shape= given)")]
    return _checked_global_shape(metas, placement, values)


# a constant of a nonstrict_trace call (dynamo guards on it by __eq__), not a pytree leaf
torch.utils._pytree.register_constant(Placement)


@nonstrict  # one opaque call in dynamo's graph, traced by AOTAutograd
def _piece_as_global(local, placement, codes, shape, grad) -> GlobalTensor:
    values = from_codes(codes)  # ints: dynamo passes sbp values made in the region as no constant
    device = device_for(placement)
    coord = placement.coord_of(world.get_rank())
    if shape == (-1,):
        if coord is None:
            raise GlobalTensorError(
                f"gt.from_local on rank {world.get_rank()}, outside {placement!r}: its piece is "
                f"ignored, so the global shape must be given; pass shape=(...)")
        shape = _even_shape(local.shape, placement, values)
    layout = trusted(placement, values, tuple(shape))
    if coord is None:
        piece = torch.empty((0,) * len(shape), dtype=local.dtype, device=device)
    else:
        if tuple(local.shape) != layout.local_shape(coord):
            raise ShapeMismatchError(
                f"gt.from_local with sbp {format_sbp(values)} and global shape {list(shape)}: "
                f"rank {world.get_rank()} passed a piece of shape {list(local.shape)}, expected "
                f"{list(layout.local_shape(coord))} (uneven split: the first N % k ranks hold "
                f"one more); pass the global shape=(...) for uneven pieces")
        piece = local if local.device == device else local.to(device)
    return FromLocal.apply(piece, layout, from_codes(grad) if grad else None)
