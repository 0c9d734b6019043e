"""Values a simulation knows without data: small integer and boolean tensors made by
deterministic factories (``torch.arange`` of positions, ``cache_position``, masks built from
them) keep real values inside ``gt.simulate``, so code that reads them (HF's
``find_packed_sequence_indices`` with ``use_cache=False``: ``if (mask[:, -1] == 0).all():``)
runs as in the real job, where every other tensor is meta (no data).

Which tensors: :func:`knowable` (world/simulated.py, where the factories and ``to_global``
ask). A global tensor may then hold a real piece in a simulation. :class:`Unify` keeps the pieces'
operators consistent: where one meets a meta tensor, the real one becomes meta too (its value
is no longer known), so a value read of anything computed from data is still the clear
``GlobalTensorError`` (world/simulated.py ``no_value_in_simulation``), and a plan that moves a
real piece between ranks runs on its meta copy (runtime/execute.py): only local slices keep
values (each simulated rank is taken to hold what this one holds).
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..world.simulated import KNOWABLE_NUMEL, knowable

def _with_data(t) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_meta and t.dim() > 0


class Unify(TorchDispatchMode):
    """Inside a simulation: an operator on plain pieces that mixes meta tensors with real ones
    (not 0-dim: those are scalars either way) runs on meta copies of the real ones."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is not torch.Tensor for t in types):
            return NotImplemented  # a global operator: its kernel runs with this mode on
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in leaves) and any(
                _with_data(t) for t in leaves):
            args, kwargs = pytree.tree_map_only(
                torch.Tensor, lambda t: t.to("meta") if _with_data(t) else t, (args, kwargs))
        return func(*args, **kwargs)


__all__ = ["KNOWABLE_NUMEL", "knowable", "Unify"]
