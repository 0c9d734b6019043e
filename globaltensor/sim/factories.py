"""Inside ``gt.simulate`` torch's factories make meta tensors: a model's parameters, the
activations and the optimizer's state hold no data. Real, because code reads them: a result of
one element (an optimizer's step count, a scale), an integer ``arange`` (rank grids for
``gt.placement``, positions), and a tensor made from data (``torch.tensor([...])``). Whatever
becomes a global tensor is a meta piece either way (convert.py)."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_FACTORIES = {
    torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.randint,
    torch.arange, torch.linspace, torch.logspace, torch.eye, torch.randperm, torch.empty_strided,
    torch.tril_indices, torch.triu_indices,
    torch.empty_like,  # what Module.to_empty calls: a model built on meta stays without data
}


class MetaFactories(TorchFunctionMode):
    """Factories give meta tensors unless the result has at most one element."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _FACTORIES:
            return func(*args, **kwargs)
        meta = func(*args, **{**kwargs, "device": "meta"})
        if meta.numel() <= 1 or (func is torch.arange and not meta.is_floating_point()):
            return func(*args, **kwargs)
        return meta
