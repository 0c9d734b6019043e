"""The state of one ``gt.nn.fully_shard`` unit on this rank and its schedule (nn/fully_shard.py
makes units; docs/fully_shard.md).

Forward: ``Unit.pre_forward`` waits for the unit's gather, issues the next unit's (prefetch) and
puts the gathered parameters (made by :class:`Unshard`, whose backward is the reduce-scatter) in
the module tree; ``post_forward`` puts the pieces back, frees the storage and hooks the outputs'
gradients (``pre_backward``: gather again, prefetch the unit before). A root (the first unit to
run with none running) keeps its parameters after forward and shares its :class:`Schedule` (the
last forward's order) with the units below it.
"""
from __future__ import annotations

import contextvars
import enum
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from .. import observe
from ..layout import Layout
from ..placement import Placement
from ..redistribute import redistribute_local
from ..runtime.unshard import UnitComm
from ..sbp import PartialSum
from ..tensor import GlobalTensor, as_global_grad

__all__ = ["MixedPrecision", "ShardedParam", "Schedule", "Unit", "UnitRole", "ShardedState",
           "Unshard", "UNIT", "cast_floating", "in_backward"]

UNIT = "_gt_fsdp_unit"  # a sharded module's attribute: its Unit


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


class UnitRole(enum.Enum):
    """What this rank does for a unit (fixed when the unit is made)."""

    MEMBER = "member"            # on the unit's placement: it gathers and reduce-scatters
    OUTSIDE = "outside"          # off the placement: it runs the program and holds nothing
    NOTHING_SPLIT = "nothing split"  # no parameter is split on the axis: nothing to gather


class ShardedState(enum.Enum):
    """Where a unit's parameters are on this rank now (FSDP2's ShardedState, with the gather
    in flight named)."""

    SHARDED = "sharded"          # only the pieces (the unsharded storage freed, or never made)
    GATHERING = "gathering"      # the all-gather posted, not yet waited for
    UNSHARDED = "unsharded"      # the gathered values in the unsharded storage


# the units whose forward is running in this context (a thread-rank has its own)
RUNNING: contextvars.ContextVar[tuple] = contextvars.ContextVar("gt_fsdp_running", default=())


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@dataclass
class ShardedParam:
    """One parameter of a unit: the sharded leaf, where the module tree holds it, and the
    layout its gathered value takes (the unit's axis broadcast)."""

    sharded: torch.nn.Parameter
    places: list  # [(module, name)]
    gathered: Layout
    spec_index: int | None  # its place in the unit's flat buffer; None: not split (kept as is)


class Schedule:
    """What the units under one root share: the order their forwards ran in last step."""

    def __init__(self):
        self.order: list[Unit] = []
        self.recording: list[Unit] = []

    def next_after(self, unit: "Unit", step: int) -> "Unit | None":
        """The unit ``step`` places after ``unit`` in the last forward's order; backward
        (``step`` -1) goes from the root, whose backward starts first, to the last unit."""
        if unit not in self.order:
            return None
        i = self.order.index(unit) + step
        if i < 0 and unit.is_root and len(self.order) > 1:
            return self.order[-1]
        return self.order[i] if 0 <= i < len(self.order) else None


class Unit:
    """One ``fully_shard`` call's state on this rank."""

    def __init__(self, module, placement: Placement, axis: int, params: list[ShardedParam],
                 comm: UnitComm | None, reshard_after_forward: bool, mp: MixedPrecision,
                 role: UnitRole = UnitRole.MEMBER):
        self.module, self.placement, self.axis = module, placement, axis
        self.params, self.comm = params, comm  # comm: a MEMBER's collectives (else None)
        self.role = role
        self.reshard_after_forward = reshard_after_forward
        self.mp = mp
        self.schedule = Schedule()
        self.is_root: bool | None = None
        self.forward_prefetch: list | None = None
        self.backward_prefetch: list | None = None
        self.sync = True
        self.pending: torch.Tensor | None = None  # gradients held back (no sync), unreduced
        self.gathered_versions = None
        self.current: list | None = None  # the gathered parameters of the last forward
        self.swapped_for_backward = False  # the module tree holds them while backward runs
        self.replicate_axes: tuple[int, ...] = ()  # HSDP: summed after the reduce-scatter
        # laid out from meta tensors: the forward checks they hold data (nn/module.py)
        self.maybe_meta = any(p.sharded._local.is_meta for p in params)

    # ---- the parameters' values ----------------------------------------------------------
    @property
    def split_params(self) -> list[ShardedParam]:
        return [p for p in self.params if p.spec_index is not None]

    def _versions(self):
        return tuple((p.sharded._version, p.sharded._local._version) for p in self.split_params)

    @property
    def state(self) -> ShardedState:
        comm = self.comm
        if comm is None:
            return ShardedState.SHARDED
        if comm.gathering:
            return ShardedState.GATHERING
        return ShardedState.UNSHARDED if comm.unsharded else ShardedState.SHARDED

    def start_unshard(self) -> None:
        """Launch this unit's gather unless it is gathered (and current) or on its way."""
        if self.role is not UnitRole.MEMBER:
            return
        state, comm = self.state, self.comm
        if state is ShardedState.GATHERING:
            return
        if state is ShardedState.UNSHARDED and self.gathered_versions == self._versions():
            return
        dtype = self.mp.param_dtype or self.split_params[0].sharded.dtype
        with torch.no_grad():
            comm.start_gather([p.sharded._local for p in self.split_params], dtype)
        self.gathered_versions = self._versions()

    def wait_unshard(self) -> None:
        self.start_unshard()
        if self.state is ShardedState.GATHERING:
            with torch.no_grad():
                self.comm.finish_gather()

    def reshard(self) -> None:
        if self.state is ShardedState.UNSHARDED:
            self.comm.free()

    def gathered_values(self) -> list[torch.Tensor]:
        """New global tensors over the unsharded storage's views (those of this forward); on a
        rank outside the unit's placement (it runs the program, holds nothing), empty pieces
        of the gathered layouts."""
        if self.role is not UnitRole.MEMBER:
            return [GlobalTensor._make(_empty_piece(p.sharded), p.gathered)
                    for p in self.split_params]
        views = self.comm.views
        return [GlobalTensor._make(views[p.spec_index], p.gathered) for p in self.split_params]

    # ---- forward -------------------------------------------------------------------------
    def pre_forward(self, module, args, kwargs):
        if self.maybe_meta:  # built on meta: no gather of pieces that hold no data
            from .module import check_materialized
            check_materialized(self.module, f"{type(self.module).__name__}.forward")
            self.maybe_meta = False  # (it raised otherwise)
        if in_backward():  # activation checkpointing recomputes the unit: as it was
            self.wait_unshard()
            self._swap_in(self.current)
            return None
        if self.is_root is None:
            self._lazy_init()
        if self.is_root:
            self.schedule.recording = []
        self.schedule.recording.append(self)
        RUNNING.set(RUNNING.get() + (self,))
        self.wait_unshard()
        for other in self._forward_prefetch():
            other.start_unshard()
        self.current = self._gathered_for_forward()
        self._swap_in(self.current)
        if self.mp.param_dtype is not None and self.mp.cast_forward_inputs:
            args, kwargs = cast_floating((args, kwargs), self.mp.param_dtype)
            return args, kwargs
        return None

    def _gathered_for_forward(self) -> list:
        """The values the module computes with: gathered ones through :class:`_Unshard` (its
        backward is the reduce-scatter), the unsplit ones cast to ``param_dtype``."""
        split = [p.sharded for p in self.split_params]
        if split and torch.is_grad_enabled() and any(t.requires_grad for t in split):
            gathered = list(Unshard.apply(self, *split))
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
        if in_backward():
            self._swap_in(self.current if self.swapped_for_backward else None)
            return None
        RUNNING.set(tuple(u for u in RUNNING.get() if u is not self))
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
            return cast_floating(output, self.mp.output_dtype)
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
        if self.current is not None and not self.swapped_for_backward:
            # a recomputation inside the unit (activation checkpointing of any spelling: the
            # unit's module, a part of its forward) reads the module's parameters: the
            # gathered ones until the unit's gradients are reduced or the backward ends
            self._swap_in(self.current)
            self.swapped_for_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if self.backward_prefetch is not None:
            others = self.backward_prefetch
        else:
            prev = self.schedule.next_after(self, -1)
            others = [prev] if prev is not None else []
        for other in others:
            other.start_unshard()

    def _end_backward(self) -> None:
        if self.swapped_for_backward:
            self._swap_in(None)
            self.swapped_for_backward = False

    def post_backward(self, grads) -> tuple:
        """The gathered parameters' gradients -> the pieces' (one reduce-scatter); the storage
        is given back first, so the flat gradient buffer takes its place."""
        self._end_backward()
        with torch.no_grad():
            grads = [None if g is None else as_global_grad(g, p.gathered)
                     for p, g in zip(self.split_params, grads)]
            if self.pending is None:
                self.replicate_axes = self._replicate_axes(grads)
            partial = [self._partial_piece(p, g) for p, g in zip(self.split_params, grads)]
            del grads
            if self.role is not UnitRole.MEMBER:  # outside: empty gradients of the pieces
                return tuple(GlobalTensor._make(_empty_piece(p.sharded), p.sharded._layout)
                             for p in self.split_params)
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
            pieces = self.comm.reduce_scatter(flat, replicate=bool(self.replicate_axes))
            grads = tuple(GlobalTensor._make(piece.to(p.sharded.dtype), p.sharded._layout)
                          for p, piece in zip(self.split_params, pieces))
            for g in grads[:1]:  # one buffer holds them all (a view each)
                observe.storage_kind(g, "gradients")
            return grads

    def _replicate_axes(self, grads) -> tuple[int, ...]:
        """HSDP's replicate axes (FSDP2's ``fully_shard(m, mesh=2-D)``) for this backward: the
        unit's candidates (axes besides its own, each split parameter broadcast there) when some
        gradient is a partial sum on one of them (the batch split there too). Their sum waits
        until after the reduce-scatter, which leaves 1/n of each gradient to all-reduce over
        them (FSDP2's order), instead of all-reducing whole gradients first. A gradient that is
        not partial there becomes one for free (its value on one rank of the group, zeros on
        the others)."""
        candidates = self.comm.replicate if self.role is UnitRole.MEMBER else ()
        if any(g is not None and isinstance(g._layout.sbp[a], PartialSum)
               for g in grads for a in candidates):
            return candidates
        return ()

    def _partial_piece(self, p: ShardedParam, grad):
        """This rank's piece of ``grad`` as a partial sum over the unit's axis and its replicate
        axes (other axes as the gathered parameter)."""
        if grad is None:
            return None
        target = p.gathered.with_axis(self.axis, PartialSum())
        for a in self.replicate_axes:
            target = target.with_axis(a, PartialSum())
        return redistribute_local(grad._local, grad._layout, target)

    # ---- the root ------------------------------------------------------------------------
    def _lazy_init(self) -> None:
        """The first unit to run with no other unit running is a root: it and the units below
        it share one schedule; a root keeps its parameters gathered after forward (backward
        needs them next), as FSDP2's root."""
        if RUNNING.get():
            self.is_root = False
            return
        schedule = Schedule()
        for sub in self.module.modules():
            unit = sub.__dict__.get(UNIT)
            if unit is not None:
                unit.schedule = schedule
                if unit is not self:
                    unit.is_root = False
        self.is_root = True


def _empty_piece(t: GlobalTensor) -> torch.Tensor:
    """What a rank outside ``t``'s placement holds: an empty piece of its ndim and dtype."""
    return torch.empty((0,) * t.dim(), dtype=t.dtype, device=t._local.device)


class Unshard(torch.autograd.Function):
    """The pieces -> the gathered parameters (forward: the gather the unit waited for); backward:
    the reduce-scatter of their gradients into the pieces."""

    @staticmethod
    def forward(ctx, unit: Unit, *pieces):
        ctx.unit = unit
        return tuple(unit.gathered_values())

    @staticmethod
    def backward(ctx, *grads):
        return (None,) + ctx.unit.post_backward(grads)


def cast_floating(tree, dtype):
    def cast(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
            return t.to(dtype)
        return t
    return pytree.tree_map(cast, tree)
