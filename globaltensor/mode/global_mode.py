"""Global mode: single-device model code runs unchanged on global tensors.

``with gt.global_mode(placement, sbp=gt.sbp.broadcast):``

- torch's factories (``torch.arange``, ``zeros``, ``ones``, ``full``, ``empty``, ``eye``,
  ``tensor``, ``rand*``, ...) called by the code inside return global tensors on ``placement``
  with ``sbp``. Deterministic factories compute the full value and keep this rank's piece;
  ``rand``/``randn``/``randint`` (and their ``_like`` forms on local tensors) draw from
  ``gt.manual_seed``'s stream, so every rank agrees whatever the layout; other random factories
  (``randperm``, ``normal``...) of local inputs take the first rank's draw; given a global
  input (``multinomial(probs)``) they are dispatch's, with rules (ops/random_ops.py, sampling.py).
- a non-scalar local tensor meeting a global one in an operator is taken as a broadcast value on
  that operator's placement (dispatch asks :func:`active`); with ``GT_DEBUG=1`` the ranks' values
  are compared and a difference names the ranks.
- a torch function given a global tensor that still returns a plain local tensor (e.g.
  ``matrix_power(x, 0)`` builds an identity with no input) returns it as a broadcast value.

``module.to_global`` enters the mode around the module's forward on the module's placement
(nn/module.py), so HF models that build positions, masks and rotary tables in ``forward`` run.

The mode is a ``TorchFunctionMode`` and is thread-local (thread-ranks each have their own).
globaltensor's own code (redistributions, collectives, ``full_tensor``...) makes plain local
tensors on purpose: a torch call made from a frame of the ``globaltensor`` package passes through
untouched.
"""
from __future__ import annotations

import contextlib
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from .. import debug as _debug
from .. import env
from .._cache import Bounded
from ..compile_support import nonstrict
from ..convert import check_placement, device_for
from ..errors import GlobalTensorError
from ..layout import Layout
from ..pieces import piece_of
from ..ops import factory_roles
from ..placement import Placement
from ..sbp import from_codes, normalize, replicated, to_codes
from ..dispatch.adopt import active, agree_on_value, modes
from . import packed, rnn
from ..runtime.emit import is_traced
from ..tensor import GlobalTensor
from ..world.simulated import knowable, simulated

@contextlib.contextmanager
def global_mode(placement, sbp=None):
    """Run single-device code on global tensors (see the module's docstring)."""
    mode = GlobalMode(placement, sbp)
    with mode:
        yield mode


# torch factory -> how its value is made: "same" (computed alike on every rank), "uniform" /
# "normal" (gt's random stream), "first" (the first rank's draw); registered in ops/creation.py
_FACTORIES = {getattr(torch, name): role for name, role in factory_roles().items()}

_OURS = "globaltensor"

__all__ = ["GlobalMode", "active", "global_mode"]


# torch functions global mode hands to globaltensor when an argument is global
HANDLERS = {**packed.HANDLERS, **rnn.HANDLERS}
# the torch functions the mode does anything but run: one lookup for every other call
_SPECIAL = frozenset(_FACTORIES) | frozenset(HANDLERS)
# (placement, sbp, shape) -> the layout of a factory's value: the same object every step (one
# layout less to build, and dispatch's decisions keyed by its id are found again)
_LAYOUTS = Bounded(4096)


class GlobalMode(TorchFunctionMode):
    """The torch-function mode behind :func:`global_mode`."""

    def __init__(self, placement, sbp=None):
        super().__init__()
        self.placement = check_placement(placement)
        sbp = replicated(self.placement.ndim) if sbp is None else sbp
        self.sbp = normalize(sbp, self.placement.ndim, self.placement.axes)

    def __enter__(self):
        stack = modes()
        stack.append(self)
        try:
            return super().__enter__()
        except BaseException:
            stack.pop()
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            modes().pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SPECIAL:  # one lookup; any other torch call is run as it is
            kind = _FACTORIES.get(func)
            if kind is not None:
                return self._factory(func, kind, args, kwargs)
            if _any_global(args, kwargs):  # packed sequences, recurrent layers
                return HANDLERS[func](*args, **kwargs)
        result = func(*args, **kwargs)
        if (type(result) is torch.Tensor and result.dim() > 0 and _any_global(args, kwargs)
                and not _called_by_us()):
            # a torch function built its result from no input (matrix_power(x, 0): an eye)
            return self._wrap(result, sync=False, placement=_placement_of(args, kwargs))
        return result

    def _factory(self, func, kind, args, kwargs):
        if _any_global(args, kwargs) or (not torch.compiler.is_compiling() and _called_by_us(1)):
            # zeros_like(global) is dispatch's; our own code makes local tensors on purpose
            # (under torch.compile only the user's code is traced: dynamo cannot read frames)
            return func(*args, **kwargs)
        full = func(*args, **_local_kwargs(kwargs))
        if isinstance(full, GlobalTensor):
            # an enclosing global mode made it (a module in global mode inside another, e.g.
            # each fully_shard unit: eagerly _called_by_us keeps the outer one out, under
            # torch.compile frames cannot be read); wrapping it again would nest global tensors
            return full if full._layout.placement == self.placement else \
                full.to_global(placement=self.placement, sbp=self.sbp)
        if kind == "same" and torch.compiler.is_compiling():
            return traced_factory_value(full, self.placement, self.sbp)
        if kind == "same":
            return self._wrap(full, sync=False)
        if kind == "first":
            return self._wrap(full, sync=True)
        return self._random(full, kind)

    # ---- making global tensors
    def _layout(self, full: torch.Tensor, placement=None) -> Layout:
        placement = placement or self.placement
        sbp = self.sbp if placement is self.placement else replicated(placement.ndim)
        key = (placement, sbp, tuple(full.shape))
        if torch.compiler.is_compiling():
            return Layout(*key)
        layout = _LAYOUTS.get(key)
        return layout if layout is not None else _LAYOUTS.put(key, Layout(*key))

    def _wrap(self, full: torch.Tensor, *, sync: bool, placement=None) -> GlobalTensor:
        if simulated() and not knowable(full):  # gt.simulate: no data but known positions
            full = full.to("meta")
        layout = self._layout(full, placement)
        if sync:  # the first rank's draw, sent to the others (to_global's broadcast)
            every = replicated(layout.placement.ndim)
            out = full.detach().to_global(placement=layout.placement, sbp=every)
            return out if layout.sbp == every else out.to_global(sbp=layout.sbp)
        if _debug.is_debug():
            agree_on_value("global_mode: a factory's value", full)
        return _piece_of(full, layout)

    def _random(self, full: torch.Tensor, kind: str) -> GlobalTensor:
        from .. import random as gt_random

        layout = self._layout(full)
        coord = layout.placement.coord_of(env.get_rank())
        dtype, device = full.dtype, device_for(layout.placement)
        if simulated():
            device = torch.device("meta")
        if coord is None:
            local = full.new_empty((0,) * full.dim())
        elif kind == "uniform":
            local = gt_random.uniform_piece(layout, coord, dtype, device)
        else:
            local = gt_random.normal_piece(layout, coord, dtype, device)
        return GlobalTensor._make(local, layout, full.requires_grad)


def _called_by_us(extra: int = 0) -> bool:
    """Whether the torch call comes from globaltensor's code (torch's own Python frames, such
    as ``torch.overrides`` or ``torch.nn.functional``, are looked through); ``extra``: frames of
    the mode's own between ``__torch_function__`` and the caller."""
    frame = sys._getframe(2 + extra)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not name.startswith("torch"):
            return name.startswith(_OURS)
        frame = frame.f_back
    return False


def _local_kwargs(kwargs):
    """A factory's keywords without a device other than the placement's (HF passes
    ``device=x.device``, which for a global tensor is the placement's device anyway)."""
    if "device" in kwargs:
        kwargs = dict(kwargs)
        kwargs.pop("device")
    return kwargs


def _any_global(args, kwargs) -> bool:
    for v in args:
        if isinstance(v, GlobalTensor):
            return True
        if isinstance(v, (list, tuple)) and any(isinstance(u, GlobalTensor) for u in v):
            return True
    return any(isinstance(v, GlobalTensor) for v in kwargs.values())


def _placement_of(args, kwargs):
    for v in tree_leaves((args, kwargs)):
        if isinstance(v, GlobalTensor):
            return v._layout.placement
    raise GlobalTensorError("internal: no global tensor among the arguments; please report this")


def traced_factory_value(full: torch.Tensor, placement: Placement, sbp) -> GlobalTensor:
    """A deterministic factory's value ``full`` laid out as (placement, sbp) under
    torch.compile: one opaque call in dynamo's graph that AOTAutograd traces (its arguments
    constants dynamo can pass: the placement, a registered pytree constant, and the sbp as
    ints)."""
    return _factory_value(full, placement, to_codes(sbp))


@nonstrict
def _factory_value(full, placement, codes) -> GlobalTensor:
    return _piece_of(full, Layout(placement, from_codes(codes), tuple(full.shape)))


def _piece_of(full: torch.Tensor, layout: Layout) -> GlobalTensor:
    coord = layout.placement.coord_of(env.get_rank())
    device = device_for(layout.placement)
    requires_grad = full.requires_grad
    full = full.detach()
    if coord is None:
        local = full.new_empty((0,) * full.dim())
    else:
        local = piece_of(full, layout, coord)
        if layout.partial_axes and not all(coord[a] == 0 for a in layout.partial_axes):
            local = torch.zeros_like(local)
        if local.shape == full.shape and (is_traced(full) or local.data_ptr() == full.data_ptr()):
            local = full
        else:
            local = local.contiguous()
    keep = local.is_meta or (simulated() and knowable(local))  # a simulation's known positions
    out = GlobalTensor._make(local if keep else local.to(device), layout)
    return out.requires_grad_() if requires_grad else out
