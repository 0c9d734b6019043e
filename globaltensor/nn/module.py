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

from ..errors import GlobalTensorError
from ..layout import Layout
from ..placement import Placement
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
        # a global leaf that requires grad keeps its .grad in its own layout (grads.py)
        g = torch.nn.Parameter(g, requires_grad=value.requires_grad)
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


def _module_to_global(self: torch.nn.Module, placement: Placement, sbp=None) -> torch.nn.Module:
    """``module.to_global(placement, sbp)``: see :func:`globaltensor.nn.to_global`."""
    return to_global(self, placement, sbp)


def install_module_methods():
    """``nn.Module.to_global`` (called once by globaltensor/__init__.py)."""
    torch.nn.Module.to_global = _module_to_global
