"""``gt.nn.fully_shard``: FSDP2's surface on global tensors (docs/fully_shard.md).

A unit's parameters are global tensors split over the unit's axis. Just before the unit runs,
its pieces are all-gathered as one flat buffer (in ``param_dtype``) into the unit's unsharded
storage, and the module computes with global tensors laid out with that axis broadcast (views
of the storage); the next unit's gather is issued before this one computes (prefetch). After
the unit the storage is freed (``reshard_after_forward``) and gathered again before the unit's
backward. The gradients of the gathered parameters come back as partial sums over the axis and
are reduce-scattered, one flat buffer per unit in ``reduce_dtype``, into the pieces' ``.grad``:
the autograd node that gathered them (:class:`_Unshard`) runs its backward once every gradient
of the unit is ready, which is FSDP2's post-backward.

::

    policy = gt.nn.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        gt.nn.fully_shard(block, grid, axis="dp", mp_policy=policy)
    gt.nn.fully_shard(model, grid, axis="dp", mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters())      # the pieces
"""
from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from .. import observe
from ..errors import GlobalTensorError
from ..layout import Layout
from ..placement import Placement
from ..redistribute import redistribute_local
from ..runtime.groups import group_along, groups_along
from ..runtime.unshard import UnitComm, shard_spec
from ..sbp import Broadcast, PartialSum, Split, replicated
from ..tensor import GlobalTensor, _as_global_grad
from ..world import world
from .module import (_PLACEMENT, _full_to_global, _join, _relaid, _run_forward_in_global_mode)

__all__ = ["fully_shard", "MixedPrecision", "FSDPModule"]

_UNIT = "_gt_fsdp_unit"  # a sharded module's attribute: its _Unit


@dataclass(frozen=True)
class MixedPrecision:
    """FSDP2's ``MixedPrecisionPolicy``: parameters are gathered and computed in
    ``param_dtype``, gradients reduced in ``reduce_dtype`` (default: ``param_dtype``), the
    pieces and the optimizer stay in the parameters' own dtype. ``cast_forward_inputs``: a
    unit's floating inputs are cast to ``param_dtype``; ``output_dtype``: its outputs to that."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


# the units whose forward is running in this context (a thread-rank has its own)
_RUNNING: contextvars.ContextVar[tuple] = contextvars.ContextVar("gt_fsdp_running", default=())


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@dataclass
class _Param:
    """One parameter of a unit: the sharded leaf, where the module tree holds it, and the
    layout its gathered value takes (the unit's axis broadcast)."""

    sharded: torch.nn.Parameter
    places: list  # [(module, name)]
    gathered: Layout
    spec_index: int | None  # its place in the unit's flat buffer; None: not split (kept as is)


class _Schedule:
    """What the units under one root share: the order their forwards ran in last step."""

    def __init__(self):
        self.order: list[_Unit] = []
        self.recording: list[_Unit] = []

    def next_after(self, unit: "_Unit", step: int) -> "_Unit | None":
        if unit not in self.order:
            return None
        i = self.order.index(unit) + step
        return self.order[i] if 0 <= i < len(self.order) else None


class _Unit:
    """One ``fully_shard`` call's state on this rank."""

    def __init__(self, module, placement: Placement, axis: int, params: list[_Param],
                 comm: UnitComm | None, reshard_after_forward: bool, mp: MixedPrecision):
        self.module, self.placement, self.axis = module, placement, axis
        self.params, self.comm = params, comm
        self.reshard_after_forward = reshard_after_forward
        self.mp = mp
        self.schedule = _Schedule()
        self.is_root: bool | None = None
        self.forward_prefetch: list | None = None
        self.backward_prefetch: list | None = None
        self.sync = True
        self.pending: torch.Tensor | None = None  # gradients held back (no sync), unreduced
        self.gathered_versions = None
        self.current: list | None = None  # the gathered parameters of the last forward

    # ---- the parameters' values ----------------------------------------------------------
    @property
    def split_params(self) -> list[_Param]:
        return [p for p in self.params if p.spec_index is not None]

    def _versions(self):
        return tuple((p.sharded._version, p.sharded._local._version) for p in self.split_params)

    def start_unshard(self) -> None:
        """Launch this unit's gather unless it is gathered (and current) or on its way."""
        comm = self.comm
        if comm is None or comm.gathering:
            return
        if comm.unsharded and self.gathered_versions == self._versions():
            return
        dtype = self.mp.param_dtype or self.split_params[0].sharded.dtype
        with torch.no_grad():
            comm.start_gather([p.sharded._local for p in self.split_params], dtype)
        self.gathered_versions = self._versions()

    def wait_unshard(self) -> None:
        self.start_unshard()
        if self.comm is not None and self.comm.gathering:
            with torch.no_grad():
                self.comm.finish_gather()

    def reshard(self) -> None:
        if self.comm is not None and not self.comm.gathering:
            self.comm.free()

    def gathered_values(self) -> list[torch.Tensor]:
        """New global tensors over the unsharded storage's views (those of this forward)."""
        views = self.comm.views if self.comm is not None else []
        out = []
        for p in self.params:
            if p.spec_index is None:
                continue
            out.append(GlobalTensor._make(views[p.spec_index], p.gathered))
        return out

    # ---- forward -------------------------------------------------------------------------
    def pre_forward(self, module, args, kwargs):
        if _in_backward():  # activation checkpointing recomputes the unit: as it was
            self.wait_unshard()
            self._swap_in(self.current)
            return None
        if self.is_root is None:
            self._lazy_init()
        if self.is_root:
            self.schedule.recording = []
        self.schedule.recording.append(self)
        _RUNNING.set(_RUNNING.get() + (self,))
        self.wait_unshard()
        for other in self._forward_prefetch():
            other.start_unshard()
        self.current = self._gathered_for_forward()
        self._swap_in(self.current)
        if self.mp.param_dtype is not None and self.mp.cast_forward_inputs:
            args, kwargs = _cast_floating((args, kwargs), self.mp.param_dtype)
            return args, kwargs
        return None

    def _gathered_for_forward(self) -> list:
        """The values the module computes with: gathered ones through :class:`_Unshard` (its
        backward is the reduce-scatter), the unsplit ones cast to ``param_dtype``."""
        split = [p.sharded for p in self.split_params]
        if split and torch.is_grad_enabled() and any(t.requires_grad for t in split):
            gathered = list(_Unshard.apply(self, *split))
        else:
            gathered = self.gathered_values()
        values, it = [], iter(gathered)
        for p in self.params:
            if p.spec_index is not None:
                values.append(next(it))
            elif self.mp.param_dtype is not None and p.sharded.is_floating_point():
                values.append(p.sharded.to(self.mp.param_dtype))
            else:
                values.append(p.sharded)
        return values

    def post_forward(self, module, args, output):
        if _in_backward():
            self._swap_in(None)
            return None
        _RUNNING.set(tuple(u for u in _RUNNING.get() if u is not self))
        self._swap_in(None)
        if self.is_root:
            self.schedule.order = self.schedule.recording
        if self.reshard_after_forward and not self.is_root:
            self.reshard()
        if torch.is_grad_enabled():
            outputs = [t for t in pytree.tree_leaves(output)
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if outputs:
                torch.autograd.graph.register_multi_grad_hook(
                    outputs, lambda grads: self.pre_backward(), mode="any")
        if self.mp.output_dtype is not None:
            return _cast_floating(output, self.mp.output_dtype)
        return None

    def _swap_in(self, values) -> None:
        """The module tree holds ``values`` (the gathered ones) in place of the pieces; None:
        the pieces again."""
        for i, p in enumerate(self.params):
            value = p.sharded if values is None else values[i]
            for module, name in p.places:
                module._parameters[name] = value

    def _forward_prefetch(self) -> list:
        if self.forward_prefetch is not None:
            return self.forward_prefetch
        nxt = self.schedule.next_after(self, +1)
        return [nxt] if nxt is not None else []

    # ---- backward ------------------------------------------------------------------------
    def pre_backward(self) -> None:
        self.wait_unshard()
        if self.backward_prefetch is not None:
            others = self.backward_prefetch
        else:
            prev = self.schedule.next_after(self, -1)
            others = [prev] if prev is not None else []
        for other in others:
            other.start_unshard()

    def post_backward(self, grads) -> tuple:
        """The gathered parameters' gradients -> the pieces' (one reduce-scatter); the storage
        is given back first, so the flat gradient buffer takes its place."""
        with torch.no_grad():
            partial = [self._partial_piece(p, g) for p, g in zip(self.split_params, grads)]
            del grads
            self.reshard()
            reduce_dtype = self.mp.reduce_dtype or self.mp.param_dtype or self.split_params[0].sharded.dtype
            flat = self.comm.pack_gradients(partial, reduce_dtype)
            del partial
            if self.pending is not None:
                flat += self.pending
                self.pending = None
            if not self.sync:
                self.pending = flat
                observe.storage_kind(flat, "gradients")
                return (None,) * len(self.split_params)
            pieces = self.comm.reduce_scatter(flat)
            return tuple(GlobalTensor._make(piece.to(p.sharded.dtype), p.sharded._layout)
                         for p, piece in zip(self.split_params, pieces))

    def _partial_piece(self, p: _Param, grad):
        """This rank's piece of ``grad`` as a partial sum over the unit's axis (other axes as
        the gathered parameter)."""
        if grad is None:
            return None
        grad = _as_global_grad(grad, p.gathered)
        target = p.gathered.with_axis(self.axis, PartialSum())
        return redistribute_local(grad._local, grad._layout, target)

    # ---- the root ------------------------------------------------------------------------
    def _lazy_init(self) -> None:
        """The first unit to run with no other unit running is a root: it and the units below
        it share one schedule; a root keeps its parameters gathered after forward (backward
        needs them next), as FSDP2's root."""
        if _RUNNING.get():
            self.is_root = False
            return
        schedule = _Schedule()
        for sub in self.module.modules():
            unit = sub.__dict__.get(_UNIT)
            if unit is not None:
                unit.schedule = schedule
                if unit is not self:
                    unit.is_root = False
        self.is_root = True


class _Unshard(torch.autograd.Function):
    """The pieces -> the gathered parameters (forward: the gather the unit waited for); backward:
    the reduce-scatter of their gradients into the pieces."""

    @staticmethod
    def forward(ctx, unit: _Unit, *pieces):
        ctx.unit = unit
        return tuple(unit.gathered_values())

    @staticmethod
    def backward(ctx, *grads):
        return (None,) + ctx.unit.post_backward(grads)


def _cast_floating(tree, dtype):
    def cast(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
            return t.to(dtype)
        return t
    return pytree.tree_map(cast, tree)


# ------------------------------------------------------------------------------------ the API


class FSDPModule:
    """The methods a sharded module gains (FSDP2's ``FSDPModule``)."""

    def unshard(self, async_op: bool = False):
        """Gather this unit's parameters now; ``async_op=True`` returns a handle whose
        ``wait()`` finishes the gather (the next forward waits for it otherwise)."""
        unit = _unit_of(self)
        unit.start_unshard()
        if async_op:
            return _UnshardHandle(unit)
        unit.wait_unshard()
        return None

    def reshard(self) -> None:
        """Free this unit's gathered parameters (the pieces stay)."""
        _unit_of(self).reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward keeps the gradients unreduced, summed over the steps, and sends
        nothing (gradient accumulation); the next backward with True reduces them all."""
        for unit in _units(self, recurse):
            unit.sync = bool(requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        for unit in _units(self, recurse):
            unit.reshard_after_forward = bool(reshard_after_forward)

    def set_modules_to_forward_prefetch(self, modules) -> None:
        """The units whose gather starts when this one's forward starts (instead of the next
        one in the last step's order)."""
        _unit_of(self).forward_prefetch = [_unit_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules) -> None:
        """The units whose gather starts when this one's backward starts (instead of the one
        before it in the last step's forward order)."""
        _unit_of(self).backward_prefetch = [_unit_of(m) for m in modules]


class _UnshardHandle:
    def __init__(self, unit):
        self.unit = unit

    def wait(self) -> None:
        self.unit.wait_unshard()


def _unit_of(module) -> _Unit:
    unit = module.__dict__.get(_UNIT) if isinstance(module, torch.nn.Module) else None
    if unit is None:
        raise GlobalTensorError(
            f"expected a module that gt.nn.fully_shard sharded, found {type(module).__name__}; "
            f"call gt.nn.fully_shard(module, placement, axis=...) on it first")
    return unit


def _units(module, recurse: bool) -> list[_Unit]:
    if not recurse:
        return [_unit_of(module)]
    return [m.__dict__[_UNIT] for m in module.modules() if _UNIT in m.__dict__]


@functools.cache
def _fsdp_class(cls: type) -> type:
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"_gt_fsdp_of": cls,
                                                           "__module__": cls.__module__})


def fully_shard(module: torch.nn.Module, placement: Placement, axis=None, *, shard_dim=0,
                reshard_after_forward: bool = True, mp_policy: MixedPrecision | None = None):
    """Shard ``module``'s parameters (those no unit below it holds) over placement ``axis``
    (a name or number; None for a 1-D placement) as one unit; returns the module, now also an
    :class:`FSDPModule`. See the module docstring and docs/fully_shard.md."""
    from ..convert import check_placement

    placement = check_placement(placement)
    axis = _checked_axis(placement, axis)
    mp = mp_policy or MixedPrecision()
    if not isinstance(mp, MixedPrecision):
        raise GlobalTensorError(f"fully_shard: mp_policy expects gt.nn.MixedPrecision(...), "
                                f"found {mp_policy!r}")
    if _UNIT in module.__dict__:
        raise GlobalTensorError(f"fully_shard: {type(module).__name__} is sharded already; "
                                f"call fully_shard once per module")
    params = _shard_parameters(module, placement, axis, shard_dim)
    _buffers_to_global(module, placement)
    comm = _unit_comm(module, placement, axis, params)
    unit = _Unit(module, placement, axis, params, comm, reshard_after_forward, mp)
    if _PLACEMENT not in module.__dict__:
        _run_forward_in_global_mode(module, placement)
    module.__dict__[_UNIT] = unit
    hooks = (module.register_forward_pre_hook(_disabled(unit.pre_forward), with_kwargs=True),
             module.register_forward_hook(_disabled(unit.post_forward)))
    module.__dict__["_gt_fsdp_hooks"] = hooks
    module.__class__ = _fsdp_class(type(module))
    return module


def _disabled(fn):
    """Hooks run as Python under torch.compile (a graph ends before, another starts after), as
    FSDP2's do by default."""
    try:
        return torch.compiler.disable(fn, recursive=True)
    except Exception:  # noqa: BLE001 - no dynamo: nothing to disable
        return fn


def _checked_axis(placement: Placement, axis) -> int:
    if axis is None:
        if placement.ndim != 1:
            raise GlobalTensorError(
                f"fully_shard: the placement {placement!r} has {placement.ndim} axes; name the "
                f"one to shard over: fully_shard(module, placement, axis=...)")
        return 0
    try:
        return placement.axis_index(axis)
    except GlobalTensorError as e:
        raise GlobalTensorError(f"fully_shard: axis={axis!r}: {e}") from None


def _own_parameters(module):
    """(module, name, qualified name, parameter) of ``module``'s tree, but not below a unit."""
    out = []

    def visit(sub, prefix):
        for name, value in sub._parameters.items():
            if value is not None:
                out.append((sub, name, _join(prefix, name), value))
        for child_name, child in sub._modules.items():
            if child is not None and _UNIT not in child.__dict__:
                visit(child, _join(prefix, child_name))
    visit(module, "")
    return out


def _shard_parameters(module, placement: Placement, axis: int, shard_dim) -> list[_Param]:
    by_id: dict[int, _Param] = {}
    order = []
    for sub, name, qualified, value in _own_parameters(module):
        if id(value) in by_id:  # a shared parameter: one gather, every place it appears
            by_id[id(value)].places.append((sub, name))
            continue
        sbp = _sharded_sbp(value, placement, axis, shard_dim, qualified)
        if isinstance(value, GlobalTensor):
            _check_ranks(value, placement, qualified)
            g = _relaid(value.detach(), placement, sbp, qualified)
        else:
            g = _full_to_global(value.detach(), placement, sbp, qualified)
        sharded = torch.nn.Parameter(g, requires_grad=value.requires_grad)
        gathered = g._layout.with_axis(axis, Broadcast()) if isinstance(sbp[axis], Split) else None
        param = _Param(sharded, [(sub, name)], gathered if gathered is not None else g._layout,
                       None if gathered is None else -1)
        by_id[id(value)] = param
        order.append(param)
        sub._parameters[name] = sharded
    for p in order[:]:
        for extra in p.places[1:]:
            extra[0]._parameters[extra[1]] = p.sharded
    index = 0
    for p in order:
        if p.spec_index is not None:
            p.spec_index, index = index, index + 1
    return order


def _check_ranks(value: GlobalTensor, placement: Placement, name: str) -> None:
    held = set(value.placement.flat_ranks)
    if not held <= set(placement.flat_ranks):
        raise GlobalTensorError(
            f"fully_shard: {name} lives on {value.placement!r}, whose ranks "
            f"{sorted(held - set(placement.flat_ranks))} the placement {placement!r} does not "
            f"hold; shard it onto a placement holding all of its ranks")


def _sharded_sbp(value, placement: Placement, axis: int, shard_dim, name: str) -> tuple:
    """The parameter's sbp on ``placement``: its own on the other axes (a global tensor on
    this placement; else broadcast), S(dim) on ``axis``, dim being ``shard_dim`` unless an
    axis after ``axis`` splits it too (the gather would not be one all-gather: then the first
    dim no later axis splits), none if every dim is (then the axis stays broadcast)."""
    if isinstance(value, GlobalTensor) and value.placement == placement:
        sbp = list(value.sbp)
        if isinstance(sbp[axis], PartialSum):
            sbp[axis] = Broadcast()
    else:
        sbp = list(replicated(placement.ndim))
    ndim = value.dim()
    if ndim == 0:
        return tuple(sbp)
    dim = shard_dim(name, value) if callable(shard_dim) else shard_dim
    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise GlobalTensorError(
            f"fully_shard: shard_dim for {name} (shape {list(value.shape)}) must be a dim in "
            f"[{-ndim}, {ndim}), found {dim!r}")
    dim %= ndim
    inner = {s.dim for s in sbp[axis + 1:] if isinstance(s, Split)}
    if dim in inner:
        free = [d for d in range(ndim) if d not in inner]
        if not free:
            sbp[axis] = Broadcast()
            return tuple(sbp)
        dim = free[0]
    sbp[axis] = Split(dim)
    return tuple(sbp)


def _buffers_to_global(module, placement: Placement) -> None:
    """Plain buffers become broadcast global tensors (as ``module.to_global`` makes them)."""
    for prefix, sub in module.named_modules():
        for name, value in list(sub._buffers.items()):
            if value is not None and not isinstance(value, GlobalTensor):
                sub._buffers[name] = _full_to_global(value, placement, replicated(placement.ndim),
                                                     _join(prefix, name))


def _unit_comm(module, placement: Placement, axis: int, params: list[_Param]) -> UnitComm | None:
    rank = world.get_rank()
    coord = placement.coord_of(rank)
    split = [p for p in params if p.spec_index is not None]
    groups_along(placement, axis)  # every rank of the world makes the groups, in one order
    if coord is None or not split:
        return None
    group, members = group_along(placement, axis, coord)
    n = len(members)
    specs = []
    for p in split:
        dim = p.sharded.sbp[axis].dim
        specs.append(shard_spec(p.gathered.local_shape(coord), dim, n))
    name = type(module).__name__
    return UnitComm(specs, group, members, members.index(rank), name)

