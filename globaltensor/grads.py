"""A global leaf's gradient in the leaf's own layout (SPEC: "a leaf global tensor that requires
grad gets its ``.grad`` in its own placement and sbp").

Gradients arrive in whatever layout backward produces: a broadcast leaf's as partial sums (each
rank's part), a split weight's perhaps as P too. After accumulation, a hook brings ``.grad`` to
the leaf's layout: P -> B is an all-reduce on a data-parallel axis (the sum over the ranks that
share the leaf), P -> S a reduce-scatter. A move that is one all-reduce is launched
asynchronously and waited for at the end of backward, as DDP does, so it overlaps the rest of
backward; gradients sharing an all-reduce group and dtype go in buckets of ``bucket_cap_mb``
(DDP's semantics, 25 MB by default): one all-reduce of a flat buffer per full bucket, launched
as it fills, the last ones at the end of backward. Until then ``.grad`` is the partial gradient
(the same logical value). Any other move
(and any move under GT_DEBUG, whose checks name each redistribution) runs in the hook.

``GlobalTensor.requires_grad_`` and the ``requires_grad`` setter (installed by
``install_grad_methods``) register the hook once per leaf, module parameters included.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import weakref

import torch

from . import debug as _debug
from . import observe
from .world import world
from .world.simulated import simulated
from .materialize import meta_message
from .compile_support import never_compiled
from .errors import GlobalTensorError
from .plan import plan
from .runtime.groups import group_across, groups_across
from .runtime.buckets import Bucket
from .runtime.wire import axis_name
from .plan import AllReduce
from .tensor import GlobalTensor, redistribute

_HOOK = "_gt_grad_hook"  # in a leaf's __dict__: its post-accumulate hook's handle
_REQUIRES_GRAD = torch.Tensor.requires_grad  # torch's own descriptor
_REQUIRES_GRAD_ = torch.Tensor.requires_grad_


def keep_own_layout(t: GlobalTensor) -> None:
    """Register the hook that brings ``t.grad`` to ``t``'s layout (once; leaves only)."""
    if t.is_leaf and t.requires_grad and _HOOK not in t.__dict__:
        t.__dict__[_HOOK] = t.register_post_accumulate_grad_hook(grad_to_own_layout)


def _requires_grad_(self, requires_grad: bool = True):
    _REQUIRES_GRAD_(self, requires_grad)
    keep_own_layout(self)
    return self


def _set_requires_grad(self, value: bool) -> None:
    _REQUIRES_GRAD.__set__(self, value)
    keep_own_layout(self)


def install_grad_methods() -> None:
    """``GlobalTensor.requires_grad_`` and the ``requires_grad`` setter register the hook; every
    optimizer's step first puts global gradients in their parameters' strides."""
    GlobalTensor.requires_grad_ = _requires_grad_
    GlobalTensor.requires_grad = property(_REQUIRES_GRAD.__get__, _set_requires_grad)
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(refuse_unusable_parameters)
    register_optimizer_step_pre_hook(gradients_in_parameter_strides)


def grad_to_own_layout(param: torch.Tensor) -> None:
    """After accumulation: bring ``param.grad`` to the parameter's layout (P -> B all-reduce on a
    data-parallel axis, P -> S reduce-scatter for a split weight).

    A move that is one all-reduce (the data-parallel case) is launched asynchronously and
    waited for at the end of backward, as DDP does, so it overlaps the rest of backward; until
    then ``.grad`` is the partial gradient. Any other move (and any move under GT_DEBUG, whose
    checks name each redistribution) runs here and now."""
    grad = param.grad
    if grad is not None:  # gt.memory / gt.simulate count it as a gradient
        observe.storage_kind(grad, "gradients")
    if type(grad) is torch.Tensor and isinstance(param, GlobalTensor):
        param.grad = _adopted(param, grad)
        return
    if not isinstance(grad, GlobalTensor):
        return
    if grad._layout == param._layout:
        return
    if id(param) in _DEFERRED.get():  # summed over backwards, reduced by reduce_gradients
        return
    if not _debug.is_debug() and torch._C._current_graph_task_id() >= 0:
        if _bucketed(param, grad, _this_backwards):
            return
    with torch.no_grad():
        param.grad = redistribute(grad, param._layout)
    observe.storage_kind(param.grad, "gradients")


def _this_backwards() -> "_Reductions":
    """The reductions of the running backward (finished when it ends)."""
    task = torch._C._current_graph_task_id()
    pending = _PENDING.get(task)
    if pending is None:
        pending = _PENDING[task] = _Reductions()
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _finish(task, pending))
    return pending


def _bucketed(param, grad: GlobalTensor, pending_of) -> bool:
    """If the move of ``grad`` to ``param``'s layout ends in all-reduces, run what comes before
    them now and put the rest in a bucket of ``pending_of()``: True. Otherwise False (nothing
    done). Not for a head-tail layout at either end: the steps' layouts are then of the
    permuted tensor (plan/reorder.py), not ones to redistribute to."""
    if grad._layout.order or param._layout.order:
        return False
    steps = plan(grad._layout, param._layout).steps
    k = len(steps)
    while k > 0 and isinstance(steps[k - 1], AllReduce):
        k -= 1
    if k == len(steps):
        return False
    if k > 0:  # what comes before (a reduce-scatter on a tensor axis) runs now
        with torch.no_grad():
            grad = redistribute(grad, steps[k].before)
    _launch_all_reduce(param, grad, steps[k:], pending_of())
    return True


# ids of the leaves whose gradients stay partial, summed over several backwards, until
# reduce_gradients (a pipeline's micro-batches: one data-parallel reduction per step)
_DEFERRED: contextvars.ContextVar[frozenset] = contextvars.ContextVar(
    "globaltensor_deferred_grads", default=frozenset())


@contextlib.contextmanager
def deferred_reduction(params):
    """Inside: the gradients of ``params`` are not brought to their layouts after each
    backward; they accumulate as backward makes them (partial sums add locally)."""
    token = _DEFERRED.set(_DEFERRED.get() | frozenset(id(p) for p in params))
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def reduce_gradients(params) -> None:
    """Bring each parameter's accumulated gradient to its layout now: the all-reduces in
    buckets (as backward would), the other moves one by one. Every rank of the parameters'
    placements passes the same list, in the same order."""
    pending = _Reductions()
    for param in params:
        grad = param.grad
        if (isinstance(param, GlobalTensor) and isinstance(grad, GlobalTensor)
                and grad._layout != param._layout and not _bucketed(param, grad, lambda: pending)):
            with torch.no_grad():
                param.grad = redistribute(grad, param._layout)
            observe.storage_kind(param.grad, "gradients")
    pending.finish()


def _adopted(param: GlobalTensor, grad: torch.Tensor) -> GlobalTensor:
    """A plain gradient of a global leaf as a global one in the leaf's layout. torch's backward
    formulas build some gradients from no input (``cat``'s for a skipped empty input is
    ``zeros({0})``): computed alike on every rank, the full value of the gradient."""
    from .factories import tensor

    if tuple(grad.shape) != tuple(param.shape):
        raise GlobalTensorError(
            f"internal: a global leaf of shape {list(param.shape)} got a plain gradient of shape "
            f"{list(grad.shape)} from backward; please report this")
    return tensor(grad, placement=param.placement, sbp=param.sbp)


_PENDING: dict = {}  # graph task id -> _Reductions of that backward
# DDP's default bucket_cap_mb; gt.nn.set_bucket_cap_mb sets it for the current context (a
# thread-rank sets its own), read where the gradient hooks run
BUCKET_CAP_MB: contextvars.ContextVar[float] = contextvars.ContextVar(
    "globaltensor_bucket_cap_mb", default=25.0)
# DDP's first_bucket_bytes_cap: a backward's first bucket of each group is this small, so its
# all-reduce starts while the rest of backward runs (the last layers' gradients come first)
FIRST_BUCKET_MB = 1.0


def set_bucket_cap_mb(mb: float) -> None:
    """The size at which a bucket of gradients is all-reduced during backward (DDP's
    ``bucket_cap_mb``, default 25), in the current context; a backward's first bucket of each
    group is at most 1 MB (DDP's first bucket), so its all-reduce overlaps the rest of
    backward. 0 reduces each gradient on its own as soon as it is ready."""
    if isinstance(mb, bool) or not isinstance(mb, (int, float)) or mb < 0:
        raise GlobalTensorError(f"set_bucket_cap_mb expects a number of megabytes >= 0, found {mb!r}")
    BUCKET_CAP_MB.set(float(mb))


class _Bucket:
    """Gradients reduced together: same placement axis group and dtype, filled in the order
    their hooks fire (the same on every rank), all-reduced as one flat buffer
    (runtime/buckets.py); its size counts each gradient's largest piece (the same on every
    rank)."""

    __slots__ = ("params", "flat")

    def __init__(self, group, size: int, placement, axis):
        self.params, self.flat = [], Bucket(group, size, placement, axis)

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes

    def add(self, param, piece, nbytes: int) -> None:
        self.params.append(param)
        self.flat.add(piece, nbytes)

    def launch(self) -> None:
        self.flat.launch()
        if self.flat.flat is not None:  # gt.memory: a collective's buffer, the params' pieces
            observe.storage_kind(self.flat.flat, "communication", parts=self.params)

    def finish(self) -> None:
        for param, local in zip(self.params, self.flat.reduced()):
            if local is None:  # outside the placement: an empty piece, as the executor gives
                local = param._local.new_zeros(param._layout.local_shape_of_rank(world.get_rank()))
            param.grad = GlobalTensor._make(local, param._layout)
            observe.storage_kind(param.grad, "gradients")


class _Reductions:
    """The gradient all-reduces of one backward: open buckets by (group, dtype), and those
    launched, in launch order."""

    __slots__ = ("open", "launched", "started")

    def __init__(self):
        self.open: dict = {}
        self.launched: list = []
        self.started: set = set()  # the keys whose first bucket is launched

    def add(self, key, group, param, piece, nbytes: int) -> None:
        bucket = self.open.get(key)
        if bucket is None:
            placement, axes = key[0], key[1]
            size = math.prod(placement.shape[a] for a in axes)
            bucket = self.open[key] = _Bucket(group, size, placement, axis_name(placement, axes))
        bucket.add(param, piece, nbytes)
        cap = BUCKET_CAP_MB.get()
        if key not in self.started:
            cap = min(cap, FIRST_BUCKET_MB)
        if bucket.nbytes >= cap * 2**20:
            self.started.add(key)
            del self.open[key]
            bucket.launch()
            self.launched.append(bucket)

    def finish(self) -> None:
        for bucket in self.open.values():  # the last, partly filled buckets
            bucket.launch()
            self.launched.append(bucket)
        self.open.clear()
        with torch.no_grad():
            for bucket in self.launched:
                bucket.finish()


def _launch_all_reduce(param, grad: GlobalTensor, steps, pending: "_Reductions") -> None:
    """Add ``grad``'s piece to the bucket of its all-reduce group (the ranks that differ along
    the axes of ``steps``, all-reduces on distinct axes: one all-reduce over that group sums
    over all of them); a full bucket is all-reduced at once, asynchronously, the rest at the
    end of this backward, which waits for them all and sets each ``param.grad``. Every rank
    takes this path (the plan is the same everywhere); ranks outside the placement only take
    part in creating the groups, as the executor does."""
    placement = steps[-1].after.placement
    axes = tuple(sorted(s.axis for s in steps))
    groups_across(placement, axes)  # created by every rank of the world together
    rank = world.get_rank()
    group, piece = None, None
    if placement.coord_of(rank) is not None:
        group = group_across(placement, axes, rank)
        piece = grad._local
    # a bucket's size counts each gradient's largest piece, the same on every rank: it fills,
    # and is all-reduced, at the same hook on every rank whatever this rank's piece (uneven
    # pieces), so the all-reduces keep one order with the other collectives of the backward
    # (a compiled backward's, between graph breaks)
    nbytes = grad._layout.max_local_numel() * grad.element_size()
    pending.add((placement, axes, grad.dtype), group, param, piece, nbytes)


def _finish(task: int, pending: _Reductions) -> None:
    """End of backward: launch the last buckets, wait for every all-reduce (in launch order)
    and install the gradients."""
    _PENDING.pop(task, None)
    pending.finish()


# parameters that module.to_global / to_local / fully_shard replaced with new ones, by id:
# (a weak reference to the old one, its qualified name, what replaced it). An optimizer built
# before the replacement holds the old ones and would silently train nothing (FSDP2 documents
# the same trap); its first step refuses (:func:`refuse_unusable_parameters`).
_REPLACED: dict[int, tuple] = {}


def parameter_replaced(old, name: str, by: str) -> None:
    """``old`` (a module's parameter) was replaced by ``by`` (``"fully_shard"``...)."""
    if not isinstance(old, torch.nn.Parameter):
        return
    key = id(old)

    def forget(ref, key=key):
        if _REPLACED.get(key, (None,))[0] is ref:
            del _REPLACED[key]
    _REPLACED[key] = (weakref.ref(old, forget), name, by)


def refuse_unusable_parameters(optimizer, args, kwargs) -> None:
    """Before an optimizer's step: a clear error if it holds a parameter that was replaced (it
    was built before the layout) or whose piece is still meta (a model built on meta, not
    materialized)."""
    found = []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if (p._local if isinstance(p, GlobalTensor) else p).is_meta and not simulated():
                raise GlobalTensorError(meta_message(
                    f"{type(optimizer).__name__}.step()", f"parameter {i} of param group {g}", p))
            entry = _REPLACED.get(id(p)) if _REPLACED else None
            if entry is not None and entry[0]() is p:
                found.append(entry)
    if found:
        names = ", ".join(repr(name) for _, name, _ in found[:3]) + (
            f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise GlobalTensorError(
            f"{type(optimizer).__name__}.step(): the optimizer holds {len(found)} parameter(s) "
            f"that {found[0][2]} replaced ({names}): it was built before {found[0][2]}, so it "
            f"would update the old tensors and train nothing. Build the optimizer after laying "
            f"the model out: model.to_global(...) / gt.nn.fully_shard(...), then "
            f"opt = torch.optim.AdamW(model.parameters())")


def gradients_in_parameter_strides(optimizer, args, kwargs) -> None:
    """Before an optimizer's step (a global hook on every optimizer): a global gradient whose
    piece backward left transposed (a Linear weight's) is made contiguous like its parameter's.

    torch's layout contract has the gradient's strides follow the parameter's, and autograd
    enforces it from the tensors' strides; a global tensor's wrapper shows the strides of its
    global shape whatever its piece's (every rank must see the same metadata, and pieces differ:
    a piece with a dim of one is contiguous on one rank and not on another), so a transposed
    piece is kept, and the optimizer's element-wise updates against contiguous state run
    several times slower (benchmarks/pipeline.py). Accumulating micro-batches into it stays
    fast (their gradients are transposed alike); here, once per step, one copy per weight."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            grad = p.grad
            if (type(grad) is GlobalTensor and isinstance(p, GlobalTensor)
                    and not grad._local.is_contiguous() and p._local.is_contiguous()):
                p.grad = GlobalTensor._make(grad._local.contiguous(), grad._layout)


def _frames_torch_calls_into():
    """The hooks autograd's engine calls (docs/compile.md: never compiled as frames)."""
    return grad_to_own_layout, _finish, gradients_in_parameter_strides, refuse_unusable_parameters


never_compiled(*_frames_torch_calls_into())
