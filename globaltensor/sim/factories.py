"""Inside ``gt.simulate`` torch's factories make meta tensors: a model's parameters, the
activations and the optimizer's state hold no data. Real, because code reads them: a result of
one element (an optimizer's step count, a scale), an integer ``arange`` (rank grids for
``gt.placement``, positions), and a tensor made from data (``torch.tensor([...])``). Whatever
becomes a global tensor is a meta piece either way (convert.py).

A factory that runs under the user's ``with torch.device("meta")`` (and is given no device)
makes what the real run would make: a tensor without data. ``gt.memory``'s accounting is told
so (it costs nothing there, and so does what operators make from such tensors only), while
every other factory's result stands for data (``Module.to_empty``'s ``empty_like`` among them).
"""
from __future__ import annotations

import torch
import torch.utils._device as _device
from torch.overrides import TorchFunctionMode
from torch.overrides import _get_current_function_mode_stack as _function_modes

_FACTORIES = {
    torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.randint,
    torch.arange, torch.linspace, torch.logspace, torch.eye, torch.randperm, torch.empty_strided,
    torch.tril_indices, torch.triu_indices,
    torch.empty_like,  # what Module.to_empty calls: a model built on meta stays without data
}


def _users_meta(kwargs) -> bool:
    """The factory runs under the user's meta device and is given no device: a DeviceContext
    below this mode (``torch.set_default_device``) has not filled it in yet."""
    if kwargs.get("device") is not None:
        return False
    contexts = [m for m in _function_modes() if isinstance(m, _device.DeviceContext)]
    return bool(contexts) and contexts[-1].device.type == "meta"


class _MetaContextsSeen:
    """While a simulation runs: a factory to which ``with torch.device("meta")`` gives its
    device (torch's C++ ``__enter__`` pushes that DeviceContext above the simulation's mode, so
    the device arrives filled in) tells the tracker its result holds no data."""

    def __init__(self, tracker):
        self.tracker = tracker

    def __enter__(self):
        original = self.original = _device.DeviceContext.__torch_function__
        tracker = self.tracker

        def __torch_function__(mode, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if mode.device.type != "meta" or kwargs.get("device") is not None or \
                    func not in _device._device_constructors():
                return original(mode, func, types, args, kwargs)
            before, tracker.no_data.origin = tracker.no_data.origin, "no data"
            try:
                return original(mode, func, types, args, kwargs)
            finally:
                tracker.no_data.origin = before
        _device.DeviceContext.__torch_function__ = __torch_function__
        return self

    def __exit__(self, *exc):
        _device.DeviceContext.__torch_function__ = self.original
        return False


class MetaFactories(TorchFunctionMode):
    """Factories give meta tensors unless the result has at most one element; ``tracker``
    (the simulation's ``MemoryTracker``) learns which of them hold data in the real run."""

    def __init__(self, tracker=None):
        super().__init__()
        self.tracker = tracker
        self.seen = _MetaContextsSeen(tracker) if tracker is not None else None

    def __enter__(self):
        if self.seen is not None:
            self.seen.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self.seen is not None:
                self.seen.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _FACTORIES:
            return func(*args, **kwargs)
        tracker = self.tracker
        before = None if tracker is None else tracker.no_data.origin
        if tracker is not None and before != "no data":
            tracker.no_data.origin = "no data" if _users_meta(kwargs) else "data"
        try:
            meta = func(*args, **{**kwargs, "device": "meta"})
            if meta.numel() <= 1 or (func is torch.arange and not meta.is_floating_point()):
                return func(*args, **kwargs)
            return meta
        finally:
            if tracker is not None:
                tracker.no_data.origin = before
