"""GlobalTensor: one logical tensor spread over the ranks of a placement.

A ``torch.Tensor`` wrapper subclass: it has the *global* shape, dtype and device, and holds this
rank's piece (``_local``) and its ``Layout`` (``_layout``). Torch operators on it reach
``dispatch.dispatch`` at the aten level, below autograd. ``to_global`` / ``to_local`` are autograd
Functions whose backward uses the dual sbp (S<->S, B<->P) unless ``grad_sbp`` fixes it.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy
import torch
from torch.types import Number

from .world import world
from .world.simulated import no_value_in_simulation, wrapper_device
from .compile_support import never_compiled
from .errors import GlobalTensorError
from .layout import Layout
from .materialize import meta_message
from .placement import Placement
from .redistribute import redistribute_local, whole_on_every_rank
from .runtime.groups import create_placement_groups
from .sbp import Broadcast, PartialSum, SbpSpec, SbpValue, format_sbp, replicated

broadcast, partial_sum = Broadcast(), PartialSum()
_GRAPH_FORMAT = "groups named by ranks"  # in the cache key of a compiled graph's global inputs
_TENSOR_DATA = torch.Tensor.data  # torch's own descriptor: shallow copy out, set_data in


class GlobalTensor(torch.Tensor):
    """A global tensor. Create one with ``Tensor.to_global`` or the ``gt.*`` factories."""

    _local: torch.Tensor
    _layout: Layout
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local: torch.Tensor, layout: Layout, requires_grad: bool = False):
        # torch's default strides are the contiguous ones of the global shape; every keyword
        # left out is parsed less on this warm path (a redistribution makes one wrapper per call)
        device = local.device if not local.is_meta else wrapper_device(local, layout.placement)
        if requires_grad:
            out = torch.Tensor._make_wrapper_subclass(cls, layout.shape, dtype=local.dtype,
                                                      device=device, requires_grad=True)
        else:
            out = torch.Tensor._make_wrapper_subclass(cls, layout.shape, dtype=local.dtype,
                                                      device=device)
        out._local = local
        out._layout = layout
        return out

    @classmethod
    def _make(cls, local: torch.Tensor, layout: Layout, requires_grad: bool = False) -> "GlobalTensor":
        """Wrap ``local`` as this rank's piece of ``layout`` (no communication, no checks)."""
        return cls(local, layout, requires_grad)

    # __torch_dispatch__ is dispatch.dispatch itself, bound as a classmethod at the end of this
    # module (no Python frame between torch and dispatch on every operator call)

    # --- torch.compile (docs/compile.md): the piece is the inner tensor, the layout the
    # context (dynamo guards on it, so another layout recompiles) ---
    def __tensor_flatten__(self):
        return ["_local"], self._layout

    @staticmethod
    def __tensor_unflatten__(inner, layout, outer_size, outer_stride):
        return GlobalTensor(inner["_local"], layout, False)

    def _stable_hash_for_caching(self) -> str:
        """The key inductor's and AOTAutograd's caches file a graph input under (torch asks a
        traceable subclass for it; its default pickles the flatten context, and fails). A graph
        is this rank's (its collectives name this rank's groups): the rank is in the key, the
        ranks share one cache. Graphs name groups by their ranks (runtime/groups.py, the same
        in every process; ``_GRAPH_FORMAT`` keeps graphs cached by earlier versions out); a
        graph found in the cache is not traced, so the groups of the input's placement are made
        here, on every rank, before it can run."""
        rank = world.cached_rank()
        if rank is not None:
            create_placement_groups(self._layout.placement)
        local = self._local
        key = (f"{_GRAPH_FORMAT}|{rank}|{self._layout!r}|{local.dtype}|{tuple(local.shape)}|"
               f"{tuple(local.stride())}|{self.requires_grad}")
        return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()

    def __coerce_tangent_metadata__(self):
        """The layout a compiled backward expects for this output's gradient: P becomes B (the
        gradient of a partial sum is the same on every rank; ``loss.backward()`` seeds a P loss
        with a B one). Without it the trace guesses P and all-reduces the seed in the graph."""
        if not any(isinstance(v, PartialSum) for v in self._layout.sbp):
            return self
        sbp = tuple(broadcast if isinstance(v, PartialSum) else v for v in self._layout.sbp)
        return GlobalTensor(self._local, self._layout.with_sbp(sbp), False)  # same piece shape

    def __coerce_same_metadata_as_tangent__(self, layout, expected_type=None):
        """A gradient that reaches a compiled backward laid out otherwise than the graph traced
        (e.g. P where the trace guessed the forward output's S): redistributed to that layout."""
        if expected_type is not None:
            return None
        return redistribute(self, layout)

    # --- what it is ---
    @property
    def placement(self) -> Placement:
        return self._layout.placement

    @property
    def sbp(self) -> tuple[SbpValue, ...]:
        return self._layout.sbp

    @property
    def is_global(self) -> bool:
        return True

    @property
    def is_local(self) -> bool:
        return False

    @property
    def data(self) -> "GlobalTensor":
        """The same global tensor outside autograd (its pieces are shared)."""
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, value) -> None:
        """``p.data = value``: ``p`` takes ``value``'s pieces and layout (shape and sbp too)."""
        if not isinstance(value, GlobalTensor):
            raise GlobalTensorError(
                f"x.data = value on a global tensor expects a global tensor, found "
                f"{type(value).__name__}; make it global first, e.g. "
                f"value.to_global(placement=x.placement, sbp=x.sbp)")
        _TENSOR_DATA.__set__(self, value)  # the wrapper's sizes, strides and dtype
        self._local, self._layout = value._local, value._layout
        self.__dict__.pop("_gt_moves", None)  # pieces moved from the old value

    if TYPE_CHECKING:  # what type checkers read; at runtime this is convert.to_global, which
        # gt's import installs on torch.Tensor and here (tests/core/test_ide.py checks the two
        # signatures agree). self is any tensor: gt.GlobalTensor.to_global(x, ...) is the typed
        # spelling of x.to_global(...) for a local x (torch's stubs do not know Tensor.to_global)
        def to_global(self: torch.Tensor, placement: Placement | None = None,
                      sbp: SbpSpec | None = None, *, grad_sbp: SbpSpec | None = None,
                      check_meta: bool = True, sync_data: bool = True,
                      copy: bool = False) -> GlobalTensor:
            """Make a global tensor (from a local piece) or redistribute one to ``placement``
            and ``sbp`` (either left out is kept); ``grad_sbp`` fixes the gradient's sbp."""

    def to_local(self) -> torch.Tensor:
        """This rank's piece (differentiable; the gradient flows back with the dual sbp)."""
        if records_graph(self):
            return _ToLocal.apply(self)
        return self._local.view_as(self._local)

    # --- collective views of the whole value ---
    def full_tensor(self) -> torch.Tensor:
        """The whole logical value on every rank of the world (collective). Differentiable as
        the identity on the logical value: every rank's gradient for it is taken as the
        gradient of the whole value (a loss computed on every rank gives the single-device
        gradient), not as a part of it. Never an alias: where the piece already is the whole
        value (broadcast on every rank of the world), a copy; ``to_local()`` is the alias."""
        if self._local.is_meta:
            no_value_in_simulation(self)
            raise GlobalTensorError(meta_message("full_tensor()", "this global tensor", self))
        full = Redistribute.apply(self, whole_on_every_rank(self._layout), None, True)
        return _ToLocal.apply(full, True)

    def numpy(self, *, force: bool = False) -> numpy.ndarray:
        return self.full_tensor().detach().cpu().numpy()

    def tolist(self) -> list:
        return self.full_tensor().tolist()

    def item(self) -> Number:
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
            f"a GlobalTensor (shape {list(self.shape)}, placement {self.placement!r}, sbp "
            f"{format_sbp(self.sbp)}) cannot be pickled, so torch.save / pickle of it or of a "
            "state_dict holding it fails. Save a checkpoint with gt.checkpoint.save(path, "
            "model=model, optimizer=opt) or torch.distributed.checkpoint's dcp.save(state_dict, "
            "checkpoint_id=path) (every rank writes its own pieces; docs/checkpoint.md). For "
            "one plain file: convert a DCP checkpoint with torch.distributed.checkpoint."
            "format_utils.dcp_to_torch_save(dcp_dir, file), or gather the values into a plain "
            "state dict on every rank, {k: v.full_tensor() if v.is_global else v for k, v in "
            "state_dict.items()}, and torch.save that on one rank")


def coerce_plain_tangent(self: torch.Tensor, layout, expected_type=None):
    """``torch.Tensor.__coerce_same_metadata_as_tangent__`` (installed by
    ``convert.install_tensor_methods``): a plain gradient that reaches a compiled backward
    expecting a global one. Autograd gives one for an output that the loss does not use (zeros
    of the global shape: the logits beside an HF model's loss, the outputs of a region before a
    graph break); it is taken as the full logical value and laid out as the trace expects (a
    local slice or zero fill, no communication). Anything else keeps torch's error (None)."""
    if (isinstance(self, GlobalTensor) or not isinstance(expected_type, type)
            or not issubclass(expected_type, GlobalTensor) or not isinstance(layout, Layout)
            or tuple(self.shape) != tuple(layout.shape)):
        return None
    with torch.no_grad():
        return as_global_grad(self, layout)


# ---------------------------------------------------------------------------------------------
# redistribution of global tensors, and its autograd Functions


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


def _grad_layout(layout: Layout, grad_sbp) -> Layout:
    if grad_sbp is None:
        return Layout(layout.placement, dual_sbp(layout.sbp), layout.shape)
    return Layout(layout.placement, grad_sbp, layout.shape)


def as_global_grad(grad, like: Layout) -> GlobalTensor:
    """A gradient for a global output: a plain tensor is taken as the full logical value."""
    if isinstance(grad, GlobalTensor):
        return grad
    full = Layout(like.placement, replicated(like.placement.ndim), like.shape)
    coord = like.placement.coord_of(world.get_rank())
    local = grad if coord is not None else grad.new_empty((0,) * grad.dim())
    return redistribute(GlobalTensor._make(local, full), like)


def redistributed(x: GlobalTensor, layout: Layout, copy: bool) -> GlobalTensor:
    """A new global tensor holding ``x`` laid out as ``layout`` (what to_global computes)."""
    return rewrapped(x, redistribute_local(x._local, x._layout, layout), layout, copy)


def rewrapped(x: GlobalTensor, local: torch.Tensor, layout: Layout, copy: bool = False) -> GlobalTensor:
    """``local`` (x's piece of ``layout``) as a new global tensor: if the move left x's own
    piece (the same layout, or nothing to do on this rank), a new tensor object; with copy,
    new storage too."""
    if local is x._local:
        local = local.clone() if copy else local.view_as(local)
    return GlobalTensor(local, layout)


def records_graph(x: torch.Tensor) -> bool:
    return x.requires_grad and torch.is_grad_enabled()


class Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: GlobalTensor, layout: Layout, grad_sbp, copy=False):
        ctx.src = x._layout
        ctx.grad_sbp = grad_sbp
        return redistributed(x, layout, copy)

    @staticmethod
    def backward(ctx, grad):
        grad = as_global_grad(grad, ctx.src)
        return redistribute(grad, _grad_layout(ctx.src, ctx.grad_sbp)), None, None, None


class FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, layout: Layout, grad_sbp):
        ctx.layout = layout
        ctx.grad_sbp = grad_sbp
        return GlobalTensor._make(local, layout)

    @staticmethod
    def backward(ctx, grad):
        grad = as_global_grad(grad, ctx.layout)
        return redistribute(grad, _grad_layout(ctx.layout, ctx.grad_sbp))._local, None, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: GlobalTensor, whole: bool = False):
        ctx.layout, ctx.whole = x._layout, whole
        return x._local.view_as(x._local)

    @staticmethod
    def backward(ctx, grad_local):
        # the local gradient is this rank's piece of the dual layout; for a whole value
        # (full_tensor), of the same layout: every rank holds the whole gradient
        layout = ctx.layout
        grad = grad_local.contiguous()
        if ctx.whole:
            return GlobalTensor._make(grad, layout), None
        dual = Layout(layout.placement, dual_sbp(layout.sbp), layout.shape)
        return redistribute(GlobalTensor._make(grad, dual), layout), None


# The one import cycle of the package: dispatch needs the GlobalTensor class, and the class needs
# dispatch for __torch_dispatch__ (DTensor has the same pair). One name each way; bound once here,
# after the class exists, not looked up on every operator call.
from .dispatch import dispatch as _dispatch  # noqa: E402

GlobalTensor.__torch_dispatch__ = classmethod(_dispatch)


def _frames_torch_calls_into():
    return (_dispatch, GlobalTensor.__tensor_flatten__, GlobalTensor.__tensor_unflatten__,
            GlobalTensor.__coerce_same_metadata_as_tangent__, coerce_plain_tangent,
            *(f for cls in (Redistribute, FromLocal, _ToLocal) for f in (cls.forward, cls.backward)))


never_compiled(*_frames_torch_calls_into())


def _register_foreach_support() -> None:
    """Global tensors take torch's multi-tensor paths as DTensor does: an optimizer's default
    ``foreach`` (on devices that have the kernels: CUDA, not CPU) and ``clip_grad_norm_``'s.
    Dispatch runs a ``_foreach_*`` call once on the pieces when its elements allow
    (dispatch/special.py), else element by element."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    for types in (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        if GlobalTensor not in types:
            types.append(GlobalTensor)


_register_foreach_support()
