"""GlobalTensor: one logical tensor spread over the ranks of a placement.

A ``torch.Tensor`` wrapper subclass: it has the *global* shape, dtype and device, and holds this
rank's piece (``_local``) and its ``Layout`` (``_layout``). Torch operators on it reach
``dispatch.dispatch`` at the aten level, below autograd. ``to_global`` / ``to_local`` are autograd
Functions whose backward uses the dual sbp (S<->S, B<->P) unless ``grad_sbp`` fixes it.
"""
from __future__ import annotations

import functools

import torch

from . import debug as _debug
from . import env
from .errors import GlobalTensorError, ShapeMismatchError
from .layout import Layout
from .placement import Placement
from .comm import backend as _backend
from .comm.execute import run as _execute
from .plan import plan as _plan
from .sbp import Broadcast, PartialSum, Split, format_sbp, normalize, resolve

broadcast, partial_sum = Broadcast(), PartialSum()


def _device_for(placement: Placement) -> torch.device:
    if placement.type == "cuda":
        if not torch.cuda.is_available():
            raise GlobalTensorError(
                f"{placement!r} needs CUDA, found none on this machine (torch.cuda.is_available() "
                f"is False); use gt.placement('cpu', ...) or run where GPUs are visible"
            )
        return torch.device("cuda", env.get_local_rank())
    return torch.device("cpu")


class GlobalTensor(torch.Tensor):
    """A global tensor. Create one with ``Tensor.to_global`` or the ``gt.*`` factories."""

    _local: torch.Tensor
    _layout: Layout
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local: torch.Tensor, layout: Layout, requires_grad: bool = False):
        # torch's default strides are the contiguous ones of the global shape; every keyword
        # left out is parsed less on this warm path (a redistribution makes one wrapper per call)
        if requires_grad:
            out = torch.Tensor._make_wrapper_subclass(cls, layout.shape, dtype=local.dtype,
                                                      device=local.device, requires_grad=True)
        else:
            out = torch.Tensor._make_wrapper_subclass(cls, layout.shape, dtype=local.dtype,
                                                      device=local.device)
        out._local = local
        out._layout = layout
        return out

    @classmethod
    def _make(cls, local: torch.Tensor, layout: Layout, requires_grad: bool = False) -> "GlobalTensor":
        """Wrap ``local`` as this rank's piece of ``layout`` (no communication, no checks)."""
        return cls(local, layout, requires_grad)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, types, args, kwargs or {})

    def __tensor_flatten__(self):
        return ["_local"], self._layout

    @staticmethod
    def __tensor_unflatten__(inner, layout, outer_size, outer_stride):
        return GlobalTensor(inner["_local"], layout, False)

    # --- what it is ---
    @property
    def placement(self) -> Placement:
        return self._layout.placement

    @property
    def sbp(self) -> tuple:
        return self._layout.sbp

    @property
    def is_global(self) -> bool:
        return True

    @property
    def is_local(self) -> bool:
        return False

    def to_local(self) -> torch.Tensor:
        """This rank's piece (differentiable; the gradient flows back with the dual sbp)."""
        if self.requires_grad and torch.is_grad_enabled():  # _records_graph, inlined: a warm path
            return _ToLocal.apply(self)
        return self._local.view_as(self._local)

    # --- collective views of the whole value ---
    def full_tensor(self) -> torch.Tensor:
        """The whole logical value on every rank of the world (collective)."""
        return _ToLocal.apply(_Redistribute.apply(self, _full_layout(self._layout), None, False))

    def numpy(self, *, force: bool = False):
        return self.full_tensor().detach().cpu().numpy()

    def tolist(self):
        return self.full_tensor().tolist()

    def item(self):
        if self._layout.numel() != 1:
            raise GlobalTensorError(
                f"item() expects a global tensor of one element, found shape {list(self.shape)}"
            )
        return self.full_tensor().item()

    def __repr__(self, *, tensor_contents=None):
        with torch.no_grad():
            full = self.full_tensor()
        body = repr(full)
        if body.startswith("tensor("):
            body = body[len("tensor("):-1]
        return (f"GlobalTensor({body}, placement={self.placement!r}, "
                f"sbp={format_sbp(self.sbp)})")

    def __str__(self):
        return self.__repr__()

    def __format__(self, spec):
        if self._layout.numel() == 1 and spec:
            return format(self.item(), spec)
        return self.__repr__()

    def __reduce_ex__(self, protocol):
        raise GlobalTensorError(
            "a GlobalTensor cannot be pickled directly; save x.full_tensor() or x.to_local() "
            "with its placement and sbp"
        )


def _full_layout(layout: Layout) -> Layout:
    """Broadcast on every rank of the world (so full_tensor reaches ranks outside the placement)."""
    world = env.get_world_size()
    placement = layout.placement
    if placement.size != world or set(placement.flat_ranks) != set(range(world)):
        placement = Placement(placement.type, list(range(world)))
    return Layout(placement, (broadcast,) * placement.ndim, layout.shape)


# ---------------------------------------------------------------------------------------------
# redistribution below autograd


def redistribute_local(local: torch.Tensor, src: Layout, dst: Layout) -> torch.Tensor:
    """This rank's piece of ``dst`` from its piece of ``src``: plan, then execute (SPMD)."""
    if src == dst:
        return local
    if _debug.is_debug():
        _debug.check("redistribute", source=src, target=dst, dtype=local.dtype)
    return _execute(_plan(src, dst), local, env.get_rank())


def redistribute(x: GlobalTensor, layout: Layout) -> GlobalTensor:
    """``x`` laid out as ``layout`` (not differentiable; use ``to_global`` for that)."""
    if x._layout == layout:
        return x
    return GlobalTensor._make(redistribute_local(x._local, x._layout, layout), layout)


def dual_sbp(values) -> tuple:
    """The sbp a gradient takes by default: S stays S, B becomes P, P becomes B."""
    out = []
    for v in values:
        if isinstance(v, Broadcast):
            out.append(partial_sum)
        elif isinstance(v, PartialSum):
            out.append(broadcast)
        else:
            out.append(v)
    return tuple(out)


def _check_grad_sbp(grad_sbp, placement: Placement, ndim: int) -> None:
    """Reject a bad grad_sbp now, not at backward time."""
    if grad_sbp is not None:
        resolve(normalize(grad_sbp, placement.ndim), ndim)


def _grad_layout(layout: Layout, grad_sbp) -> Layout:
    if grad_sbp is None:
        return Layout(layout.placement, dual_sbp(layout.sbp), layout.shape)
    return Layout(layout.placement, normalize(grad_sbp, layout.placement.ndim), layout.shape)


def _as_global_grad(grad, like: Layout) -> GlobalTensor:
    """A gradient for a global output: a plain tensor is taken as the full logical value."""
    if isinstance(grad, GlobalTensor):
        return grad
    full = Layout(like.placement, (broadcast,) * like.placement.ndim, like.shape)
    coord = like.placement.coord_of(env.get_rank())
    local = grad if coord is not None else grad.new_empty((0,) * grad.dim())
    return redistribute(GlobalTensor._make(local, full), like)


def _redistributed(x: GlobalTensor, layout: Layout, copy: bool) -> GlobalTensor:
    """A new global tensor holding ``x`` laid out as ``layout`` (what to_global computes)."""
    return _rewrapped(x, redistribute_local(x._local, x._layout, layout), layout, copy)


def _rewrapped(x: GlobalTensor, local: torch.Tensor, layout: Layout, copy: bool = False) -> GlobalTensor:
    """``local`` (x's piece of ``layout``) as a new global tensor: if the move left x's own
    piece (the same layout, or nothing to do on this rank), a new tensor object; with copy,
    new storage too."""
    if local is x._local:
        local = local.clone() if copy else local.view_as(local)
    return GlobalTensor(local, layout)


def _records_graph(x: torch.Tensor) -> bool:
    return x.requires_grad and torch.is_grad_enabled()


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: GlobalTensor, layout: Layout, grad_sbp, copy=False):
        ctx.src = x._layout
        ctx.grad_sbp = grad_sbp
        return _redistributed(x, layout, copy)

    @staticmethod
    def backward(ctx, grad):
        grad = _as_global_grad(grad, ctx.src)
        return redistribute(grad, _grad_layout(ctx.src, ctx.grad_sbp)), None, None, None


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, layout: Layout, grad_sbp):
        ctx.layout = layout
        ctx.grad_sbp = grad_sbp
        return GlobalTensor._make(local, layout)

    @staticmethod
    def backward(ctx, grad):
        grad = _as_global_grad(grad, ctx.layout)
        return redistribute(grad, _grad_layout(ctx.layout, ctx.grad_sbp))._local, None, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: GlobalTensor):
        ctx.layout = x._layout
        return x._local.view_as(x._local)

    @staticmethod
    def backward(ctx, grad_local):
        # the local gradient is this rank's piece of the dual layout
        dual = Layout(ctx.layout.placement, dual_sbp(ctx.layout.sbp), ctx.layout.shape)
        return redistribute(GlobalTensor._make(grad_local.contiguous(), dual), ctx.layout)


# ---------------------------------------------------------------------------------------------
# Tensor.to_global


def _check_placement(placement) -> Placement:
    if not isinstance(placement, Placement):
        raise GlobalTensorError(
            f"expected placement=gt.placement(type, ranks), found {placement!r} "
            f"({type(placement).__name__})"
        )
    placement.check_world(env.get_world_size())
    return placement


def _global_shape_from_pieces(placement: Placement, sbp, metas, ndim):
    """Global shape implied by the piece shapes: a split dim sums the pieces along its axes
    (other axes at coordinate 0); any other dim is the piece's size at coordinate 0."""
    shape = []
    for dim in range(ndim):
        axes = [a for a, v in enumerate(sbp) if isinstance(v, Split) and v.dim == dim]
        along = [c for c in placement.coords()
                 if all(c[a] == 0 for a in range(placement.ndim) if a not in axes)]
        shape.append(sum(metas[placement.rank_at(c)][0][dim] for c in along))
    return tuple(shape)


def _local_to_global(local: torch.Tensor, placement, sbp, grad_sbp, check_meta, sync_data, copy):
    if placement is None or sbp is None:
        raise GlobalTensorError(
            "to_global on a local tensor needs both placement and sbp, e.g. "
            "x.to_global(placement=gt.placement('cpu', [0, 1]), sbp=gt.sbp.split(0)); "
            f"found placement={placement!r}, sbp={sbp!r}"
        )
    placement = _check_placement(placement)
    values = resolve(normalize(sbp, placement.ndim), local.dim())
    _check_grad_sbp(grad_sbp, placement, local.dim())
    if _debug.is_debug():
        _debug.check("to_global", source="local tensor", placement=placement, sbp=values,
                     dtype=local.dtype, ndim=local.dim(), grad_sbp=grad_sbp, check_meta=check_meta,
                     sync_data=sync_data)
    rank = env.get_rank()
    coord = placement.coord_of(rank)
    device = _device_for(placement)
    if local.device != device:
        local = local.to(device)
    if check_meta:
        shape = _checked_global_shape(local, placement, values, rank)
    else:
        shape = list(local.shape)
        for axis, v in enumerate(values):
            if isinstance(v, Split):
                shape[v.dim] *= placement.shape[axis]
        shape = tuple(shape)
    layout = Layout(placement, values, shape)
    if coord is None:
        piece = local.new_empty((0,) * local.dim())
    else:
        piece = local.clone() if copy else local
        if sync_data and any(isinstance(v, Broadcast) for v in values):
            piece = _sync_broadcast(piece, layout, rank, already_copied=copy)
    if coord is None and sync_data:
        _sync_broadcast(piece, layout, rank, already_copied=True)  # take part in group creation
    return _FromLocal.apply(piece, layout, grad_sbp)


def _sync_broadcast(piece, layout: Layout, rank: int, already_copied: bool):
    from .comm.meta import broadcast_along

    if not already_copied:
        piece = piece.clone()
    piece = piece.contiguous()
    for axis, v in enumerate(layout.sbp):
        if isinstance(v, Broadcast):
            broadcast_along(layout.placement, axis, piece, rank)
    return piece


def _checked_global_shape(local, placement: Placement, values, rank: int):
    from .comm.meta import dtype_of_code, exchange_meta

    metas = exchange_meta(tuple(local.shape), local.dtype)
    members = [placement.rank_at(c) for c in placement.coords()]
    first = members[0]
    for r in members:
        if len(metas[r][0]) != len(metas[first][0]):
            raise ShapeMismatchError(
                f"to_global: expected every rank of {placement!r} to pass a piece with "
                f"{len(metas[first][0])} dims (rank {first}: {list(metas[first][0])}), found rank "
                f"{r} with {list(metas[r][0])}"
            )
        if metas[r][1] != metas[first][1]:
            raise ShapeMismatchError(
                f"to_global: expected one dtype on every rank, found {dtype_of_code(metas[first][1])} "
                f"on rank {first} and {dtype_of_code(metas[r][1])} on rank {r}; cast the pieces first"
            )
    shape = _global_shape_from_pieces(placement, values, metas, len(metas[first][0]))
    layout = Layout(placement, values, shape)
    for c in placement.coords():
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
        placement = _check_placement(placement)
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
    return Layout(placement, normalize(sbp, placement.ndim), src.shape)


@functools.lru_cache(maxsize=4096)
def _hashed_target(src: Layout, placement, sbp) -> Layout:
    return target_layout(src, placement, sbp, "to_global")


def _cached_target(src: Layout, placement, sbp) -> Layout:
    """``target_layout`` for to_global, cached on (src, placement, sbp) when they hash."""
    try:
        return _hashed_target(src, placement, sbp)
    except TypeError:  # an unhashable sbp (a list): compute it
        return target_layout(src, placement, sbp, "to_global")


# The warm path of ``x.to_global(sbp=...)`` on a global tensor: (id(src layout), sbp argument)
# -> (src, dst, plan or None for the same layout). Filled by the full path below and used only
# where that path does nothing but plan and execute: no placement argument (that one is checked
# against the current world every time), no grad_sbp, no copy, debug checks off and no autograd
# graph. A redistribution that is a 1 ms copy then costs one dict lookup, the executor and the
# wrapper, instead of some thirty Python calls that each touch memory the copy just evicted from
# the caches (docs/performance.md). An entry holds src, so its id is not reused while it lives.
_MOVES: dict = {}
_MOVES_MAX = 4096


def to_global(self, placement=None, sbp=None, *, grad_sbp=None, check_meta=True,
              sync_data=True, copy=False):
    """Make a global tensor (from a local piece) or redistribute one (from a global tensor).

    >>> x = torch.randn(2, 5).to_global(placement=gt.placement("cpu", [0, 1]), sbp=gt.sbp.split(0))
    >>> y = x.to_global(sbp=gt.sbp.broadcast)        # all_gather
    """
    if not isinstance(self, GlobalTensor):
        return _local_to_global(self, placement, sbp, grad_sbp, check_meta, sync_data, copy)
    src = self._layout
    plain = (placement is None and grad_sbp is None and not copy and _debug._FLAG.get() is False
             and not (self.requires_grad and torch.is_grad_enabled()))
    if plain:
        try:
            hit = _MOVES.get((id(src), sbp))
        except TypeError:  # an unhashable argument (an sbp list): the full path
            hit = None
        if hit is not None:
            if hit[2] is None:
                return self
            rank = _backend.cached_rank()
            if rank is not None:
                return _rewrapped(self, _execute(hit[2], self._local, rank), hit[1])
    dst = _cached_target(src, placement, sbp)
    _check_grad_sbp(grad_sbp, dst.placement, len(src.shape))
    if _debug.is_debug():
        _debug.check("to_global", source=src, target=dst, dtype=self.dtype, grad_sbp=grad_sbp,
                     copy=copy)
    elif plain:  # debug was off before this call too: the next such call may take the warm path
        _remember_move(src, sbp, dst)
    if dst == src and not copy:
        return self
    if _records_graph(self):
        return _Redistribute.apply(self, dst, grad_sbp, copy)
    return _redistributed(self, dst, copy)


def _remember_move(src: Layout, sbp, dst: Layout) -> None:
    try:
        key = (id(src), sbp)
        hash(key)
    except TypeError:
        return
    if len(_MOVES) >= _MOVES_MAX:
        _MOVES.clear()
    _MOVES[key] = (src, dst, None if dst == src else _plan(src, dst))


def to_local(self):
    """A local tensor is already local: returns itself."""
    if isinstance(self, GlobalTensor):
        return GlobalTensor.to_local(self)
    return self


def _install_tensor_methods():
    torch.Tensor.to_global = to_global
    torch.Tensor.to_local = to_local
    torch.Tensor.is_global = property(lambda self: isinstance(self, GlobalTensor))
    torch.Tensor.is_local = property(lambda self: not isinstance(self, GlobalTensor))  # OneFlow's name
    GlobalTensor.to_global = to_global


_install_tensor_methods()

# bound once here (dispatch imports this module), not looked up on every operator call
from .dispatch import dispatch as _dispatch  # noqa: E402
