"""``save_pretrained`` (HF transformers) on a global model: every rank takes part, the full
values are written once.

HF's ``save_pretrained`` reads each tensor's storage pointer (to find tied weights), which a
global tensor, a wrapper without storage of its own, does not have. The converted module's
``save_pretrained`` therefore gathers the full value of every tensor of ``state_dict()`` on every
rank (a collective, in the state dict's order; tied tensors stay one tensor), then calls HF's own
with ``state_dict=`` those values and ``is_main_process`` true on rank 0 only, outside global
mode. Peak memory: the whole model on every rank, as HF's own saving holds it in one process; for
models that do not fit, ``gt.checkpoint.save`` writes each rank's pieces.
"""
from __future__ import annotations

import functools

import torch

from ..world import world
from ..tensor import GlobalTensor

__all__ = ["full_state_dict", "save_pretrained"]


def full_state_dict(module: torch.nn.Module, state_dict: dict | None = None) -> dict:
    """``state_dict`` (default ``module.state_dict()``) with each global tensor replaced by its
    full value (collective: every rank gets them); a tensor met twice (tied) gives one value."""
    if state_dict is None:
        state_dict = module.state_dict()
    full: dict[int, torch.Tensor] = {}
    out = {}
    for name, value in state_dict.items():
        if isinstance(value, GlobalTensor):
            if id(value) not in full:
                full[id(value)] = value.detach().full_tensor()
            value = full[id(value)]
        out[name] = value
    return out


def save_pretrained(method):
    """The converted class's ``save_pretrained``: HF's ``method`` given the full values."""
    @functools.wraps(method)
    def save_full_values(self, save_directory, *args, is_main_process: bool = True,
                         state_dict: dict | None = None, **kwargs):
        values = full_state_dict(self, state_dict)
        main = bool(is_main_process) and world.get_rank() == 0
        return method(self, save_directory, *args, is_main_process=main, state_dict=values,
                      **kwargs)
    return save_full_values
