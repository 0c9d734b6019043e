"""``gt.nn.fully_shard``: FSDP2's surface on global tensors (docs/fully_shard.md).

A unit's parameters are global tensors split over the unit's axis. Just before the unit runs,
its pieces are all-gathered as one flat buffer (in ``param_dtype``) into the unit's unsharded
storage, and the module computes with global tensors laid out with that axis broadcast (views
of the storage); the next unit's gather is issued before this one computes (prefetch). After
the unit the storage is freed (``reshard_after_forward``) and gathered again before the unit's
backward. The gradients of the gathered parameters come back as partial sums over the axis and
are reduce-scattered, one flat buffer per unit in ``reduce_dtype``, into the pieces' ``.grad``.
This module converts the parameters and makes the unit; ``units.py`` runs it.

::

    policy = gt.nn.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        gt.nn.fully_shard(block, grid, axis="dp", mp_policy=policy)
    gt.nn.fully_shard(model, grid, axis="dp", mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters())      # the pieces
"""
from __future__ import annotations

import functools

import torch

from .. import observe
from ..grads import parameter_replaced
from ..errors import GlobalTensorError
from ..placement import Placement
from ..runtime.groups import group_along, groups_across, groups_along, ranks_across
from ..runtime.unshard import UnitComm, shard_spec
from ..runtime.wire import axis_name
from ..sbp import Broadcast, PartialSum, Split, replicated
from ..tensor import GlobalTensor
from ..world import world
from .module import PLACEMENT, full_to_global, join_name, relaid, run_forward_in_global_mode
from .units import UNIT, MixedPrecision, ShardedParam, Unit, UnitRole

__all__ = ["fully_shard", "MixedPrecision", "FSDPModule"]


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


def _unit_of(module) -> Unit:
    unit = module.__dict__.get(UNIT) if isinstance(module, torch.nn.Module) else None
    if unit is None:
        raise GlobalTensorError(
            f"expected a module that gt.nn.fully_shard sharded, found {type(module).__name__}; "
            f"call gt.nn.fully_shard(module, placement, axis=...) on it first")
    return unit


def _units(module, recurse: bool) -> list[Unit]:
    if not recurse:
        return [_unit_of(module)]
    return [m.__dict__[UNIT] for m in module.modules() if UNIT in m.__dict__]


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
    if UNIT in module.__dict__:
        raise GlobalTensorError(f"fully_shard: {type(module).__name__} is sharded already; "
                                f"call fully_shard once per module")
    params = _shard_parameters(module, placement, axis, shard_dim)
    _buffers_to_global(module, placement)
    comm = _unit_comm(module, placement, axis, params)
    role = (UnitRole.MEMBER if comm is not None else UnitRole.OUTSIDE
            if placement.coord_of(world.get_rank()) is None else UnitRole.NOTHING_SPLIT)
    unit = Unit(module, placement, axis, params, comm, reshard_after_forward, mp, role)
    if PLACEMENT not in module.__dict__:
        run_forward_in_global_mode(module, placement)
    module.__dict__[UNIT] = unit
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


def _own_parameters(module, placement: Placement, axis: int):
    """(module, name, qualified name, parameter) of ``module``'s tree, but not below a unit,
    and not those split on ``axis`` already (their layout is the user's: experts split on the
    axis that fully_shard shards the rest over, as torchtitan lays out expert parallelism; each
    rank keeps its piece, no gather)."""
    out = []

    def visit(sub, prefix):
        for name, value in sub._parameters.items():
            if value is not None and not _split_on(value, placement, axis):
                out.append((sub, name, join_name(prefix, name), value))
        for child_name, child in sub._modules.items():
            if child is not None and UNIT not in child.__dict__:
                visit(child, join_name(prefix, child_name))
    visit(module, "")
    return out


def _split_on(value, placement: Placement, axis: int) -> bool:
    return (isinstance(value, GlobalTensor) and value.placement == placement
            and isinstance(value.sbp[axis], Split))


def _shard_parameters(module, placement: Placement, axis: int, shard_dim) -> list[ShardedParam]:
    by_id: dict[int, ShardedParam] = {}
    order = []
    for sub, name, qualified, value in _own_parameters(module, placement, axis):
        if id(value) in by_id:  # a shared parameter: one gather, every place it appears
            by_id[id(value)].places.append((sub, name))
            continue
        sbp = _sharded_sbp(value, placement, axis, shard_dim, qualified)
        if isinstance(value, GlobalTensor):
            _check_ranks(value, placement, qualified)
            g = relaid(value.detach(), placement, sbp, qualified)
        else:
            g = full_to_global(value.detach(), placement, sbp, qualified)
        sharded = torch.nn.Parameter(g, requires_grad=value.requires_grad)
        parameter_replaced(value, qualified, "fully_shard")
        observe.storage_kind(sharded, "parameters")
        gathered = g._layout.with_axis(axis, Broadcast()) if isinstance(sbp[axis], Split) else None
        param = ShardedParam(sharded, [(sub, name)], gathered if gathered is not None else g._layout,
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
                sub._buffers[name] = full_to_global(value, placement, replicated(placement.ndim),
                                                     join_name(prefix, name))


def _unit_comm(module, placement: Placement, axis: int, params: list[ShardedParam]) -> UnitComm | None:
    rank = world.get_rank()
    coord = placement.coord_of(rank)
    split = [p for p in params if p.spec_index is not None]
    groups_along(placement, axis)  # every rank of the world makes the groups, in one order
    replicate = tuple(a for a in range(placement.ndim) if a != axis and placement.shape[a] > 1
                      and split and all(isinstance(p.sharded.sbp[a], Broadcast) for p in split))
    if replicate:
        groups_across(placement, replicate)  # made by every rank, in one order
    if coord is None or not split:
        return None
    replicate_group = ranks_across(placement, replicate, rank) if replicate else None
    group, members = group_along(placement, axis, coord)
    n = len(members)
    specs = []
    for p in split:
        dim = p.sharded.sbp[axis].dim
        specs.append(shard_spec(p.gathered.local_shape(coord), dim, n))
    name = type(module).__name__
    return UnitComm(specs, group, members, members.index(rank), name, replicate, replicate_group,
                    ranks=placement, axis=axis_name(placement, axis),
                    replicate_axis=axis_name(placement, replicate))

