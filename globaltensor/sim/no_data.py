"""Storages that hold no data in the run being measured, so ``gt.memory`` counts them as
nothing: in a real run every meta tensor; in a simulation (where every tensor is meta) only
those the user made on the meta device (``with torch.device("meta")``: the model of the
"build on meta" flow) and what operators make from such tensors alone (their layouts' meta
pieces), as the real run would. ``origin`` is set by the simulation's factories while one runs:
"no data" (the user's meta) or "data" (``Module.to_empty``'s ``empty_like`` among them);
None: an operator's inputs decide."""
from __future__ import annotations

import weakref

import torch
import torch.utils._pytree as pytree


def storage_of(t: torch.Tensor):
    """The storage ``t``'s bytes live in: a global tensor's piece's (any wrapper subclass's
    inner tensor: DTensor's local tensor too)."""
    while hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        t = getattr(t, names[0])
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a functional one)
        return None


class NoData:
    def __init__(self, simulated: bool):
        self.simulated = simulated
        self.ids: dict[int, bool] = {}  # id(storage) of the simulation's storages without data
        self.origin: str | None = None

    def holds(self, storage) -> bool:
        """Whether ``storage`` holds no data (costs nothing)."""
        if not self.simulated:
            return storage.device.type == "meta"
        return id(storage) in self.ids

    def mark(self, t: torch.Tensor) -> None:
        """In a simulation: ``t``'s storage holds no data in the real run."""
        storage = storage_of(t)
        if storage is None or id(storage) in self.ids:
            return
        key = id(storage)
        self.ids[key] = True
        weakref.finalize(storage, self.ids.pop, key, None)

    def made(self, args, kwargs, live) -> bool:
        """Whether an operator's outputs hold no data: the factory running says so, else every
        tensor input holds none (and there is one). ``live``: the storages counted already."""
        if self.origin is not None:
            return self.origin == "no data"
        if not self.ids:
            return False
        storages = [storage_of(t) for t in pytree.tree_leaves((args, kwargs))
                    if isinstance(t, torch.Tensor)]
        return bool(storages) and all(s is not None and id(s) in self.ids and id(s) not in live
                                      for s in storages)
