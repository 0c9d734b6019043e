"""``gt.memory()``: the peak of live tensor bytes on this rank during a block, by kind.

::

    with gt.memory() as m:
        loss = model(x).sum(); loss.backward(); opt.step()
    m.peak_bytes()                  # everything live at the peak
    m.peak_bytes("communication")   # the highest that kind reached
    m.start_bytes()                 # what was live when the block began
    print(m.report())

It counts what this rank allocates while the block runs plus what this rank held when it began,
as storages (a view costs nothing more; a global tensor costs its piece on this rank), each
storage once (by its identity: two tensors, views or references of one storage are one entry),
from the moment it exists, or the block's start, until it is freed or resized:

- allocated in the block: every tensor an operator makes (a dispatch mode sees each
  operator's outputs) and every buffer the runtime announces (``observe.storage_kind``:
  gathered units, reduce-scatter buffers, gradient buckets);
- alive at the start (counted from the start, whenever it is found):

  - the global tensors (and torch's DTensors) reachable from the calling frames' local
    variables through containers, modules (parameters, buffers, ``.grad``, sharded units'
    pieces and buffers) and optimizers (their state): such a tensor's piece is this rank's by
    construction;
  - what the block uses: the parameters, buffers and ``.grad`` of each module whose forward
    runs in it, and the parameters, ``.grad`` and state of each optimizer whose step runs;
  - what is passed, ``gt.memory(model, opt, x)``: modules, optimizers and tensors (or
    containers of them), global or not (``MemTracker.track_external``'s way).

A meta tensor costs nothing (a model built on meta, until ``to_empty``; sim/no_data.py). A
plain (not global) tensor only reachable from a frame is not counted: a one-process reference
model in ``main()``'s locals is not this rank's parameters unless the block runs it or it is
passed. Like torch's ``MemTracker``, nothing else made before the block is seen: a plain
model's tensors freed before the block runs or steps it (``zero_grad()`` first) are not.

Kinds: ``parameters`` (and buffers), ``gradients`` (a leaf's ``.grad``: a hook on the leaves
found; gradients held back by ``set_requires_gradient_sync(False)``), ``optimizer`` (the state
an optimizer holds after its step, and the state found at the start; the step's temporaries
are activations), ``communication`` (buffers of collectives and gathered units, gloo's own
while it gathers or reduce-scatters, and what an operator's moves make while they run) and ``activations`` (anything else: what
forward saves, temporaries, inputs, and what a global operator's kernel makes on its pieces
before it returns). A storage counted as ``activations`` then found as a module's parameter
or buffer (a model built in the block) becomes ``parameters``; other kinds stay as first
counted or announced. Simulations, which start from nothing, count the same way.
"""
from __future__ import annotations

import contextlib
import sys
import weakref

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as _mode_stack
import torch.utils._pytree as pytree

from ..observe import current, reset, set_watchers
from . import reach
from .no_data import NoData, storage_of as _storage

KINDS = ("parameters", "gradients", "optimizer", "activations", "communication")


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
        self.quiet = 0
        self.before = True  # count what was alive at the start (a simulation: False)
        self.track: tuple = ()  # what gt.memory(...) was passed: alive at the start
        self._handles: list = []
        self._used = weakref.WeakSet()  # the modules whose forward ran in the block
        self.no_data = NoData(simulated=bytes_of is not None)  # what costs nothing

    # ---- the accounting --------------------------------------------------------------------
    def add(self, t: torch.Tensor, kind: str) -> None:
        """Count ``t``'s storage as ``kind`` unless it is counted already."""
        storage = _storage(t)
        if storage is None or id(storage) in self.live or self.no_data.holds(storage):
            return
        self._set(t, storage, kind)

    def found(self, t: torch.Tensor, kind: str) -> None:
        """``t`` was alive when the block began (found at its start, or when the block uses
        it): a storage not counted yet is counted as ``kind`` from the start, as if it had been
        seen then (it was live all along: every figure since the start grows by its bytes); one
        counted as ``activations`` becomes ``kind``; any other stays as it is."""
        storage = _storage(t)
        if storage is None or self.no_data.holds(storage):
            return
        entry = self.live.get(id(storage))
        if entry is not None:
            if entry[0] == "activations" and kind != "activations":
                self._rekind(entry, kind)
            return
        if not self.before:
            return
        nbytes = self.bytes_of(t, storage) if self.bytes_of is not None else storage.nbytes()
        key = id(storage)
        self.live[key] = [kind, nbytes]
        weakref.finalize(storage, self._freed, key)
        self.totals[kind] += nbytes
        if self.open:
            for figures in (self.at_start, self.kind_peaks, self.at_peak):
                figures[kind] += nbytes
            self.peak += nbytes

    def _rekind(self, entry: list, kind: str) -> None:
        self.totals[entry[0]] -= entry[1]
        entry[0] = kind
        self.totals[kind] += entry[1]
        self._update(kind)

    def holds_no_data(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage holds no data in the run measured (observe.holds_no_data)."""
        storage = _storage(t)
        return storage is not None and self.no_data.holds(storage)

    def classify(self, t: torch.Tensor, kind: str, parts=None) -> None:
        """``t``'s storage holds ``kind``, at its current size (counted anew if resized);
        ``parts``: the tensors whose pieces it concatenates (their bytes, rank by rank)."""
        storage = _storage(t)
        if storage is None or self.no_data.holds(storage):
            return
        nbytes, piece = None, getattr(t, "_local", t)
        if parts is not None and self.bytes_of is not None:
            nbytes = sum(self.bytes_of(p, None) for p in parts)
        elif self.bytes_of is not None and id(storage) in self.live and \
                piece.numel() * piece.element_size() < storage.nbytes():
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
        """A redistribution made ``piece``, this rank's of ``layout``; in a simulation its
        storage weighs each rank's piece. The executor makes it where no operator's output shows
        it (an operator's moved input, kept by redistribute.moved's memo while its source
        lives): counted here, as activations, unless an operator made it. A view of ``source``
        (a local slice) or of a larger buffer is left as it is counted."""
        storage = _storage(piece)
        if storage is None or storage is _storage(source) or self.no_data.holds(storage):
            return
        exact = piece.numel() * piece.element_size() == storage.nbytes()
        entry = self.live.get(id(storage))
        kind = "activations" if entry is None or entry[0] == "communication" else entry[0]
        if self.ranks == 1 or not exact:
            if entry is None or entry[0] != kind:  # (counted inside the move: its buffer)
                self._set(piece, storage, kind)
            return
        from .ranks import piece_bytes
        self._set(piece, storage, kind, piece_bytes(layout, piece.element_size(), self.ranks))

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

    def workspace(self, nbytes: int):
        """A collective's backend's own buffer (observe.workspace): counted until the call."""
        self.totals["communication"] += nbytes
        self._update("communication")
        return lambda: self.totals["communication"].__isub__(nbytes)

    @contextlib.contextmanager
    def backend(self):
        self.quiet += 1  # what the mode sees now is the backend's (observe.backend_running)
        try:
            yield
        finally:
            self.quiet -= 1

    def counting(self, kind: str):
        """A block inside an operator: what its torch calls make counts as ``kind``."""
        seen = not self.open or any(isinstance(m, _Mode) for m in _mode_stack())
        return contextlib.nullcontext() if seen else _Mode(self, kind)

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
        """Begin counting; the global tensors ``frame`` and its callers reach, and what
        ``gt.memory(...)`` was passed, are alive already (``frame`` None: a simulation, which
        starts from nothing and counts only what the block makes)."""
        self.before = frame is not None
        if self.before:
            reach.scan(self, frame)
            seen: set[int] = set()
            for obj in self.track:
                reach.visit(self, obj, seen, "activations", 0, plain=True)
        self.open = True
        self.at_start = {k: v.copy() for k, v in self.totals.items()}
        self.kind_peaks = {k: v.copy() for k, v in self.totals.items()}
        self.at_peak = {k: v.copy() for k, v in self.totals.items()}
        self.peak = sum(self.totals.values()).copy()
        self._token = set_watchers(memory=self)
        self._mode = _Mode(self)
        self._mode.__enter__()
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim import optimizer as opt
        self._handles += [opt.register_optimizer_step_pre_hook(self._optimizer_enter),
                          opt.register_optimizer_step_post_hook(self._optimizer_leave),
                          register_module_forward_pre_hook(self._module_used)]
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
                    self._used_tensor(p, "parameters")
                    if p.grad is not None:
                        self._used_tensor(p.grad, "gradients")
            for state in optimizer.state.values():  # an earlier step's: alive at the start
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        self.found(v, "optimizer")

    def _used_tensor(self, t: torch.Tensor, kind: str) -> None:
        """The step reads ``t`` as ``kind``: made before the block, it was alive at the start;
        counted already, it is ``kind`` now."""
        if self.before and id(_storage(t)) not in self.live:
            self.found(t, kind)
        else:
            self.classify(t, kind)

    def _optimizer_leave(self, optimizer, args, kwargs):
        if self._mine():
            self.in_optimizer -= 1
            for state in optimizer.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        self.classify(v, "optimizer")

    def _module_used(self, module, args):
        """A module's forward runs in the block: its parameters, buffers and gradients (and
        its submodules', its sharded units' pieces and buffers) are this rank's."""
        if module in self._used or not self._mine():
            return
        reach.visit_module(self, module, set(), 0, plain=True)

    def _gradient_ready(self, param: torch.Tensor) -> None:
        if self.open and param.grad is not None and self._mine():
            self.classify(param.grad, "gradients")


class _Mode(TorchDispatchMode):
    """Counts every operator's outputs as ``kind`` (activations: the optimizer's state is
    classified when its step ends); also inside operators (observe.counted_inside)."""

    def __init__(self, tracker: MemoryTracker, kind: str = "activations"):
        super().__init__()
        self.tracker, self.kind = tracker, kind

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            out = func(*args, **(kwargs or {}))
        except RuntimeError:
            out = _stricter_meta(func, args, kwargs or {})
        tracker, kind = self.tracker, self.kind
        if tracker.quiet:
            return out
        count = tracker.no_data.mark if tracker.no_data.made(args, kwargs, tracker.live) else \
            (lambda t: tracker.add(t, kind))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                count(t)
        if tracker.on_op is not None:
            tracker.on_op(func, args, kwargs, out)
        return out


def _stricter_meta(func, args, kwargs):
    """A meta kernel stricter than the CPU one (``_grouped_mm``'s demands bf16; its CPU kernel
    runs float32 too, which is how HF's experts run on CPU): the meta kernel on bf16 twins of
    the float inputs, its outputs in the dtype the CPU kernel gives (``out_dtype`` or the
    inputs'). Any other failure is raised again."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if (func is not torch.ops.aten._grouped_mm.default or not tensors
            or not all(t.is_meta for t in tensors)):
        raise  # noqa: PLE0704 - the caller's RuntimeError, as it was
    dtype = kwargs.get("out_dtype") or args[0].dtype
    twin = lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t  # noqa: E731
    out = func(*pytree.tree_map_only(torch.Tensor, twin, args),
               **pytree.tree_map_only(torch.Tensor, twin, kwargs))
    return out.to(dtype)


def _mb(n) -> str:
    n = int(n)
    unit, size = next(((u, b) for u, b in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10))
                       if abs(n) >= b), ("B", 1))
    return f"{n} B" if size == 1 else f"{n / size:.2f} {unit}"


def memory(*track) -> MemoryTracker:
    """``with gt.memory() as m:``: see the module docstring (SPEC: "Sharded parameters").
    ``track``: modules, optimizers and tensors (or containers of them) made before the block
    that this rank holds, global or not, counted as alive at its start (a plain one the block
    does not run or step is otherwise not counted)."""
    tracker = MemoryTracker()
    tracker.track = track
    return tracker


__all__ = ["memory", "MemoryTracker", "KINDS"]
