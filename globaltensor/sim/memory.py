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
``optimizer`` (the state an optimizer holds after its step, and the state found at the start;
the step's temporaries are activations),
``communication`` (buffers of collectives and gathered units) and ``activations`` (anything
else: what forward saves, temporaries). The same accounting serves simulations.
"""
from __future__ import annotations

import sys
import weakref

import numpy as np
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
    """The running sums of one ``gt.memory()`` block (see the module docstring), for ``ranks``
    ranks at once: a real run counts its own (1); a simulation every rank of the world, a
    global tensor costing each rank its piece (``bytes_of``)."""

    def __init__(self, ranks: int = 1, bytes_of=None):
        self.ranks = ranks
        self.bytes_of = bytes_of  # (tensor, storage) -> bytes per rank, or None: the storage's
        self.live: dict[int, list] = {}  # id(storage) -> [kind, bytes per rank]
        self.totals = {k: np.zeros(ranks, dtype=np.int64) for k in KINDS}
        self.kind_peaks = {k: np.zeros(ranks, dtype=np.int64) for k in KINDS}
        self.peak = np.zeros(ranks, dtype=np.int64)
        self.at_peak = {k: np.zeros(ranks, dtype=np.int64) for k in KINDS}
        self.at_start = {k: np.zeros(ranks, dtype=np.int64) for k in KINDS}
        self.in_optimizer = 0
        self.open = False
        self.on_op = None  # called with (func, args, kwargs, out) after each operator
        self._handles: list = []

    # ---- the accounting --------------------------------------------------------------------
    def add(self, t: torch.Tensor, kind: str) -> None:
        """Count ``t``'s storage as ``kind`` unless it is counted already."""
        storage = _storage(t)
        if storage is None or id(storage) in self.live:
            return
        self._set(t, storage, kind)

    def classify(self, t: torch.Tensor, kind: str, parts=None) -> None:
        """``t``'s storage holds ``kind``, at its current size (counted anew if resized);
        ``parts``: the tensors whose pieces it concatenates (their bytes, rank by rank)."""
        storage = _storage(t)
        if storage is None:
            return
        nbytes = None
        if parts is not None and self.bytes_of is not None:
            nbytes = sum(self.bytes_of(p, None) for p in parts)
        elif self.bytes_of is not None and id(storage) in self.live and _is_view_into(t, storage):
            nbytes = self.live[id(storage)][1]  # a view of a buffer counted already: its weight
        self._set(t, storage, kind, nbytes)

    def _set(self, t, storage, kind: str, nbytes=None) -> None:
        key = id(storage)
        entry = self.live.get(key)
        if nbytes is None:
            nbytes = self.bytes_of(t, storage) if self.bytes_of is not None else storage.nbytes()
        if entry is None:
            entry = self.live[key] = [kind, 0]
            weakref.finalize(storage, self._freed, key)
        self.totals[entry[0]] -= entry[1]
        entry[0], entry[1] = kind, nbytes
        self.totals[kind] += nbytes
        self._update(kind)

    def weigh(self, piece: torch.Tensor, layout, source: torch.Tensor) -> None:
        """A redistribution made ``piece``, this rank's of ``layout``: in a simulation, its
        storage (counted when an operator made it, at this rank's size on every rank) weighs
        each rank's piece. A view of ``source`` (a local slice) or of a larger buffer is left
        as it is counted."""
        if self.ranks == 1:
            return
        storage = _storage(piece)
        if storage is None or id(storage) not in self.live or storage is _storage(source):
            return
        if piece.numel() * piece.element_size() != storage.nbytes():
            return
        from .ranks import piece_bytes

        self._set(piece, storage, self.live[id(storage)][0],
                  piece_bytes(layout, piece.element_size(), self.ranks))

    def _freed(self, key: int) -> None:
        if not self.open:  # the block is over: its figures stay as they were at its end
            return
        entry = self.live.pop(key, None)
        if entry is not None:
            self.totals[entry[0]] -= entry[1]

    def _update(self, kind: str) -> None:
        if not self.open:
            return
        np.maximum(self.kind_peaks[kind], self.totals[kind], out=self.kind_peaks[kind])
        total = sum(self.totals.values())
        higher = total > self.peak
        if higher.any():
            self.peak[higher] = total[higher]
            for k in KINDS:
                self.at_peak[k][higher] = self.totals[k][higher]

    # ---- the answers -----------------------------------------------------------------------
    def peak_bytes(self, kind: str | None = None, rank: int = 0) -> int:
        """The peak of all live bytes (``kind`` None), or the highest ``kind`` reached (of
        ``rank``: a simulation's; a real run has its own only)."""
        return int(self._kind(self.peak, self.kind_peaks, kind)[rank])

    def live_bytes(self, kind: str | None = None, rank: int = 0) -> int:
        """What is live now (at the block's end, once it is over)."""
        if kind is None:
            return int(sum(v[rank] for v in self.totals.values()))
        return int(self._kind(None, self.totals, kind)[rank])

    def start_bytes(self, kind: str | None = None, rank: int = 0) -> int:
        """What was live when the block began (all kinds, or ``kind``)."""
        if kind is None:
            return int(sum(v[rank] for v in self.at_start.values()))
        return int(self._kind(None, self.at_start, kind)[rank])

    @staticmethod
    def _kind(whole, by_kind: dict, kind):
        if kind is None:
            return whole
        if kind not in KINDS:
            from ..errors import GlobalTensorError
            raise GlobalTensorError(f"gt.memory: expected a kind, one of {', '.join(KINDS)}; "
                                    f"found {kind!r}")
        return by_kind[kind]

    def report(self, rank: int = 0) -> str:
        """A table: each kind's bytes at the start, at the peak, and the highest it reached."""
        lines = [f"{'kind':<15}{'at the start':>14}{'at the peak':>14}{'its own peak':>14}"]
        for kind in KINDS:
            lines.append(f"{kind:<15}{_mb(self.at_start[kind][rank]):>14}"
                         f"{_mb(self.at_peak[kind][rank]):>14}{_mb(self.kind_peaks[kind][rank]):>14}")
        lines.append(f"{'total':<15}{_mb(self.start_bytes(rank=rank)):>14}"
                     f"{_mb(self.peak[rank]):>14}")
        return "\n".join(lines)

    def __repr__(self):
        return f"<gt.memory: peak {_mb(int(self.peak.max()))}>"

    # ---- the block -------------------------------------------------------------------------
    def __enter__(self) -> "MemoryTracker":
        return self.start(sys._getframe(1))

    def start(self, frame=None) -> "MemoryTracker":
        """Begin counting; what ``frame`` and its callers reach is alive already (None: nothing)."""
        if frame is not None:
            self._scan(frame)
        self.open = True
        self.at_start = {k: v.copy() for k, v in self.totals.items()}
        self.kind_peaks = {k: v.copy() for k, v in self.totals.items()}
        self.at_peak = {k: v.copy() for k, v in self.totals.items()}
        self.peak = sum(self.totals.values()).copy()
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
            for group in optimizer.param_groups:  # what the step reads is known for sure now
                for p in group["params"]:
                    self.classify(p, "parameters")
                    if p.grad is not None:
                        self.classify(p.grad, "gradients")

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


def _is_view_into(t: torch.Tensor, storage) -> bool:
    """Whether ``t`` (a global tensor's piece) covers less than its storage."""
    local = getattr(t, "_local", t)
    return local.numel() * local.element_size() < storage.nbytes()


class _Mode(TorchDispatchMode):
    """Sees every operator's outputs (global tensors' at the global level) and counts them."""

    def __init__(self, tracker: MemoryTracker):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tracker = self.tracker
        kind = "activations"  # the optimizer's state is classified when its step ends
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                tracker.add(t, kind)
        if tracker.on_op is not None:
            tracker.on_op(func, args, kwargs, out)
        return out


def _mb(n) -> str:
    n = int(n)
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def memory() -> MemoryTracker:
    """``with gt.memory() as m:``: see the module docstring (SPEC: "Sharded parameters")."""
    return MemoryTracker()


__all__ = ["memory", "MemoryTracker", "KINDS"]
