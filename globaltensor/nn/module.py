"""Modules with global parameters: ``module.to_global`` and ``gt.nn.to_global``.

A module's parameters and buffers are taken as *full* values (the first rank of the placement
wins) and laid out with the sbp chosen for each. Each parameter's ``.grad`` is brought to the
parameter's own layout after it is accumulated, so a broadcast weight's gradient is summed over
the ranks that share it: data parallel with no wrapper::

    mlp.to_global(placement, lambda name, t: gt.sbp.split(1) if name == "w1" else gt.sbp.broadcast)
    opt = torch.optim.AdamW(mlp.parameters())   # build the optimizer after the conversion
"""
from __future__ import annotations

import torch

from .. import comm, env
from .. import debug as _debug
from ..runtime.groups import group_along, groups_along
from ..errors import GlobalTensorError
from ..layout import Layout
from ..placement import Placement
from ..plan import plan
from ..steps import AllReduce
from ..sbp import SBP_TYPES, Broadcast, PartialSum, format_sbp, normalize
from ..convert import check_placement
from ..tensor import GlobalTensor, redistribute

__all__ = ["to_global"]


def to_global(module: torch.nn.Module, placement: Placement, sbp_fn=None) -> torch.nn.Module:
    """Turn ``module``'s parameters and buffers into global tensors, in place; returns it.

    ``sbp_fn(name, tensor) -> sbp`` picks each tensor's sbp by its qualified name (``"0.weight"``);
    an sbp value instead of a function applies to every tensor; None (or a function returning
    None) means broadcast. Shared parameters stay shared.
    """
    placement = check_placement(placement)
    choose = _sbp_chooser(sbp_fn, placement)
    converted: dict[int, torch.Tensor] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, value in list(sub._parameters.items()):
            if value is not None:
                sub._parameters[name] = _converted(value, _join(prefix, name), placement, choose,
                                                   converted, parameter=True)
        for name, value in list(sub._buffers.items()):
            if value is not None:
                sub._buffers[name] = _converted(value, _join(prefix, name), placement, choose,
                                                converted, parameter=False)
    return module


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _sbp_chooser(sbp_fn, placement: Placement):
    if sbp_fn is None:
        return lambda name, t: (Broadcast(),) * placement.ndim
    is_value = isinstance(sbp_fn, (list, tuple) + SBP_TYPES) or sbp_fn in (Broadcast, PartialSum)
    if not is_value and callable(sbp_fn):
        def choose(name, t):
            value = sbp_fn(name, t)
            if value is None:
                return (Broadcast(),) * placement.ndim
            return _normalized(value, name, placement)
        return choose
    fixed = _normalized(sbp_fn, "every tensor", placement)
    return lambda name, t: fixed


def _normalized(value, name, placement):
    try:
        return normalize(value, placement.ndim)
    except GlobalTensorError as e:
        raise GlobalTensorError(f"module.to_global: the sbp for {name}: {e}") from None


def _converted(value, name, placement, choose, converted, parameter):
    key = id(value)
    if key in converted:
        return converted[key]
    if isinstance(value, GlobalTensor):
        raise GlobalTensorError(
            f"module.to_global: {name} is already a global tensor (sbp {format_sbp(value.sbp)}); "
            f"convert a module once, or redistribute its tensors with t.to_global(...)")
    sbp = choose(name, value)
    g = _full_to_global(value.detach(), placement, sbp, name)
    if parameter:
        g = torch.nn.Parameter(g, requires_grad=value.requires_grad)
        if value.requires_grad:
            g.register_post_accumulate_grad_hook(_grad_to_own_layout)
    converted[key] = g
    return g


def _full_to_global(full: torch.Tensor, placement: Placement, sbp, name) -> GlobalTensor:
    """The full value on each rank -> global with ``sbp``; the first rank's values win."""
    try:
        replicated = full.to_global(placement=placement, sbp=(Broadcast(),) * placement.ndim)
        layout = Layout(placement, sbp, tuple(full.shape))
    except GlobalTensorError as e:
        raise GlobalTensorError(f"module.to_global: {name} of shape {list(full.shape)}: {e}") from None
    return redistribute(replicated, layout)


def _grad_to_own_layout(param: torch.Tensor) -> None:
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
    coord = placement.coord_of(env.get_rank())
    piece, work = None, None
    if coord is not None:
        group, _ = group_along(placement, step.axis, coord)
        piece = grad._local.clone(memory_format=torch.contiguous_format)
        work = comm.all_reduce(piece, group=group, async_op=True)
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
                piece = param._local.new_zeros(param._layout.local_shape_of_rank(env.get_rank()))
            param.grad = GlobalTensor._make(piece, param._layout)


def _module_to_global(self: torch.nn.Module, placement: Placement, sbp=None) -> torch.nn.Module:
    """``module.to_global(placement, sbp)``: see :func:`globaltensor.nn.to_global`."""
    return to_global(self, placement, sbp)


def install_module_methods():
    """``nn.Module.to_global`` (called once by globaltensor/__init__.py)."""
    torch.nn.Module.to_global = _module_to_global
