"""A global leaf's gradient in the leaf's own layout (SPEC: "a leaf global tensor that requires
grad gets its ``.grad`` in its own placement and sbp").

Gradients arrive in whatever layout backward produces: a broadcast leaf's as partial sums (each
rank's part), a split weight's perhaps as P too. After accumulation, a hook brings ``.grad`` to
the leaf's layout: P -> B is an all-reduce on a data-parallel axis (the sum over the ranks that
share the leaf), P -> S a reduce-scatter. A move that is one all-reduce is launched
asynchronously and waited for at the end of backward, as DDP does, so it overlaps the rest of
backward; until then ``.grad`` is the partial gradient (the same logical value). Any other move
(and any move under GT_DEBUG, whose checks name each redistribution) runs in the hook.

``GlobalTensor.requires_grad_`` and the ``requires_grad`` setter (installed by
``install_grad_methods``) register the hook once per leaf, module parameters included.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import debug as _debug
from . import world
from .plan import plan
from .runtime.groups import group_along, groups_along
from .steps import AllReduce
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
    """``GlobalTensor.requires_grad_`` and the ``requires_grad`` setter register the hook."""
    GlobalTensor.requires_grad_ = _requires_grad_
    GlobalTensor.requires_grad = property(_REQUIRES_GRAD.__get__, _set_requires_grad)


def grad_to_own_layout(param: torch.Tensor) -> None:
    """After accumulation: bring ``param.grad`` to the parameter's layout (P -> B all-reduce on a
    data-parallel axis, P -> S reduce-scatter for a split weight).

    A move that is one all-reduce (the data-parallel case) is launched asynchronously and
    waited for at the end of backward, as DDP does, so it overlaps the rest of backward; until
    then ``.grad`` is the partial gradient. Any other move (and any move under GT_DEBUG, whose
    checks name each redistribution) runs here and now."""
    grad = param.grad
    if not isinstance(grad, GlobalTensor) or grad._layout == param._layout:
        return
    if not _debug.is_debug() and torch._C._current_graph_task_id() >= 0:
        steps = plan(grad._layout, param._layout).steps
        if len(steps) == 1 and isinstance(steps[0], AllReduce):
            _launch_all_reduce(param, grad, steps[0])
            return
    with torch.no_grad():
        param.grad = redistribute(grad, param._layout)


_PENDING: dict = {}  # graph task id -> [(param, reduced piece or None, work or None)]


def _launch_all_reduce(param, grad: GlobalTensor, step: AllReduce) -> None:
    """Start the all-reduce of ``grad``'s piece along ``step.axis``; the end of this backward
    waits for it and sets ``param.grad``. Every rank takes this path (the plan is the same
    everywhere); ranks outside the placement only take part in creating the groups, as the
    executor does."""
    placement = step.after.placement
    groups_along(placement, step.axis)  # created by every rank of the world together
    coord = placement.coord_of(world.get_rank())
    piece, work = None, None
    if coord is not None:
        group, _ = group_along(placement, step.axis, coord)
        piece = grad._local.clone(memory_format=torch.contiguous_format)
        work = dist.all_reduce(piece, group=group, async_op=True)
    task = torch._C._current_graph_task_id()
    pending = _PENDING.get(task)
    if pending is None:
        pending = _PENDING[task] = []
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: _finish_all_reduces(task, pending))
    pending.append((param, piece, work))


def _finish_all_reduces(task: int, pending: list) -> None:
    """End of backward: wait for the gradients' all-reduces (in launch order) and install them."""
    _PENDING.pop(task, None)
    with torch.no_grad():
        for param, piece, work in pending:
            if work is not None:
                work.wait()
            else:  # outside the placement: an empty piece, as the executor gives
                piece = param._local.new_zeros(param._layout.local_shape_of_rank(world.get_rank()))
            param.grad = GlobalTensor._make(piece, param._layout)
