"""``gt.memory()``: the peak of live tensor bytes on this rank during a block, by kind.

::

    with gt.memory() as m:
        loss = model(x).sum(); loss.backward(); opt.step()
    m.peak_bytes()                  # everything live at the peak
    m.peak_bytes("communication")   # the highest that kind reached
    m.start_bytes()                 # what was live when the block began
    print(m.report())

What it counts is storages (a view costs nothing more; a global tensor costs its piece on this
rank), each once, from the moment it exists until it is freed:

- at the start, the tensors reachable from the calling frames' local variables through
  containers, modules (parameters, buffers, ``.grad``, sharded units' buffers) and optimizers
  (their state): what was already alive;
- then every tensor an operator makes (a dispatch mode sees each operator's outputs) and every
  buffer the runtime announces (``observe.storage_kind``: gathered units, reduce-scatter
  buffers), until its storage is freed (a weak reference's callback) or resized.

Kinds: ``parameters`` (and buffers), ``gradients`` (a leaf's ``.grad``: a hook on the leaves
found at the start; gradients held back by ``set_requires_gradient_sync(False)``),
``optimizer`` (what ``optimizer.step()`` makes, and the state found at the start),
``communication`` (buffers of collectives and gathered units) and ``activations`` (anything
else: what forward saves, temporaries). The same accounting serves simulations.
"""
from __future__ import annotations

import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
import torch.utils._pytree as pytree

from ..observe import current, reset, set_watchers

KINDS = ("parameters", "gradients", "optimizer", "activations", "communication")


def _storage(t: torch.Tensor):
    """The storage ``t``'s bytes live in: a global tensor's piece's (any wrapper subclass's
    inner tensor: DTensor's local tensor too)."""
    while hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        t = getattr(t, names[0])
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a functional one)
        return None


class MemoryTracker:
    """The running sums of one ``gt.memory()`` block (see the module docstring)."""

    def __init__(self):
        self.live: dict[int, list] = {}  # id(storage) -> [kind, nbytes]
        self.totals = dict.fromkeys(KINDS, 0)
        self.kind_peaks = dict.fromkeys(KINDS, 0)
        self.peak = 0
        self.at_peak = dict.fromkeys(KINDS, 0)
        self.at_start = dict.fromkeys(KINDS, 0)
        self.in_optimizer = 0
        self.open = False
        self._handles: list = []

    # ---- the accounting --------------------------------------------------------------------
    def add(self, t: torch.Tensor, kind: str) -> None:
        """Count ``t``'s storage as ``kind`` unless it is counted already."""
        storage = _storage(t)
        if storage is None or id(storage) in self.live:
            return
        self._set(storage, kind)

    def classify(self, t: torch.Tensor, kind: str) -> None:
        """``t``'s storage holds ``kind``, at its current size (counted anew if resized)."""
        storage = _storage(t)
        if storage is not None:
            self._set(storage, kind)

    def _set(self, storage, kind: str) -> None:
        key = id(storage)
        entry = self.live.get(key)
        nbytes = storage.nbytes()
        if entry is None:
            entry = self.live[key] = [kind, 0]
            weakref.finalize(storage, self._freed, key)
        self.totals[entry[0]] -= entry[1]
        entry[0], entry[1] = kind, nbytes
        self.totals[kind] += nbytes
        self._update(kind)

    def _freed(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.totals[entry[0]] -= entry[1]

    def _update(self, kind: str) -> None:
        if not self.open:
            return
        if self.totals[kind] > self.kind_peaks[kind]:
            self.kind_peaks[kind] = self.totals[kind]
        total = sum(self.totals.values())
        if total > self.peak:
            self.peak = total
            self.at_peak = dict(self.totals)

    # ---- the answers -----------------------------------------------------------------------
    def peak_bytes(self, kind: str | None = None) -> int:
        """The peak of all live bytes (``kind`` None), or the highest ``kind`` reached."""
        if kind is None:
            return self.peak
        if kind not in KINDS:
            from ..errors import GlobalTensorError
            raise GlobalTensorError(f"gt.memory: expected a kind, one of {', '.join(KINDS)}; "
                                    f"found {kind!r}")
        return self.kind_peaks[kind]

    def start_bytes(self, kind: str | None = None) -> int:
        """What was live when the block began (all kinds, or ``kind``)."""
        if kind is None:
            return sum(self.at_start.values())
        self.peak_bytes(kind)  # checks the kind
        return self.at_start[kind]

    def report(self) -> str:
        """A table: each kind's bytes at the start, at the peak, and the highest it reached."""
        lines = [f"{'kind':<15}{'at the start':>14}{'at the peak':>14}{'its own peak':>14}"]
        for kind in KINDS:
            lines.append(f"{kind:<15}{_mb(self.at_start[kind]):>14}{_mb(self.at_peak[kind]):>14}"
                         f"{_mb(self.kind_peaks[kind]):>14}")
        lines.append(f"{'total':<15}{_mb(self.start_bytes()):>14}{_mb(self.peak):>14}")
        return "\n".join(lines)

    def __repr__(self):
        return f"<gt.memory: peak {_mb(self.peak)}>"

    # ---- the block -------------------------------------------------------------------------
    def __enter__(self) -> "MemoryTracker":
        self._scan(sys._getframe(1))
        self.open = True
        self.at_start = dict(self.totals)
        for kind in KINDS:
            self.kind_peaks[kind] = self.totals[kind]
        self.peak, self.at_peak = sum(self.totals.values()), dict(self.totals)
        self._token = set_watchers(memory=self)
        self._mode = _Mode(self)
        self._mode.__enter__()
        from torch.optim import optimizer as opt
        self._handles += [opt.register_optimizer_step_pre_hook(self._optimizer_enter),
                          opt.register_optimizer_step_post_hook(self._optimizer_leave)]
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        reset(self._token)
        for h in self._handles:
            h.remove()
        self._handles = []
        self.open = False
        return False

    def _mine(self) -> bool:
        watchers = current()
        return watchers is not None and watchers.memory is self

    def _optimizer_enter(self, optimizer, args, kwargs):
        if self._mine():
            self.in_optimizer += 1

    def _optimizer_leave(self, optimizer, args, kwargs):
        if self._mine():
            self.in_optimizer -= 1
            for state in optimizer.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        self.classify(v, "optimizer")

    def _gradient_ready(self, param: torch.Tensor) -> None:
        if self.open and param.grad is not None and self._mine():
            self.classify(param.grad, "gradients")

    # ---- what was alive at the start ---------------------------------------------------------
    def _scan(self, frame) -> None:
        seen: set[int] = set()
        while frame is not None:
            for value in list(frame.f_locals.values()):
                self._visit(value, seen, "activations", 0)
            frame = frame.f_back

    def _visit(self, obj, seen: set, kind: str, depth: int) -> None:
        if id(obj) in seen or depth > 8:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            self._visit_tensor(obj, kind)
        elif isinstance(obj, torch.nn.Module):
            self._visit_module(obj, seen, depth)
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                self._visit(state, seen, "optimizer", depth + 1)
            for group in obj.param_groups:
                self._visit(group.get("params", ()), seen, "parameters", depth + 1)
        elif isinstance(obj, dict):
            for v in list(obj.values()):
                self._visit(v, seen, kind, depth + 1)
        elif isinstance(obj, (list, tuple, set)):
            for v in list(obj):
                self._visit(v, seen, kind, depth + 1)

    def _visit_tensor(self, t: torch.Tensor, kind: str) -> None:
        if isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad):
            self.add(t, "parameters")
            self._handles.append(t.register_post_accumulate_grad_hook(self._gradient_ready))
            if t.grad is not None:
                self.add(t.grad, "gradients")
        else:
            self.add(t, kind)

    def _visit_module(self, module: torch.nn.Module, seen: set, depth: int) -> None:
        for sub in module.modules():
            seen.add(id(sub))
            for p in sub._parameters.values():
                if isinstance(p, torch.Tensor) and id(p) not in seen:
                    seen.add(id(p))
                    self._visit_tensor(p, "parameters")
            for b in sub._buffers.values():
                if isinstance(b, torch.Tensor):
                    self.add(b, "parameters")
            unit = sub.__dict__.get("_gt_fsdp_unit")
            if unit is not None:
                if unit.comm is not None and unit.comm.flat is not None:
                    self.add(unit.comm.flat, "communication")
                if unit.pending is not None:
                    self.add(unit.pending, "gradients")


class _Mode(TorchDispatchMode):
    """Sees every operator's outputs (global tensors' at the global level) and counts them."""

    def __init__(self, tracker: MemoryTracker):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tracker = self.tracker
        kind = "optimizer" if tracker.in_optimizer else "activations"
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                tracker.add(t, kind)
        return out


def _mb(n: int) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def memory() -> MemoryTracker:
    """``with gt.memory() as m:``: see the module docstring (SPEC: "Sharded parameters")."""
    return MemoryTracker()


__all__ = ["memory", "MemoryTracker", "KINDS"]
