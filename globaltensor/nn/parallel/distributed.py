"""DistributedDataParallel on gt.comm: torch's DDP semantics, gradients averaged in buckets.

At wrap: every rank checks it wraps the same parameters, then rank 0's parameters (and buffers,
with ``broadcast_buffers``) are broadcast. In backward, each parameter's gradient is written (scaled by 1/world) into its slot of
a flat bucket as soon as it is accumulated; a full bucket is all-reduced asynchronously while
backward goes on, buckets launching in index order on every rank. When backward ends, the
averaged buckets are copied back into ``.grad``. See docs/ddp.md.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ...comm import collectives as comm
from ...errors import GlobalTensorError

_FIRST_BUCKET_BYTES = 1024 * 1024  # a small first bucket starts communication early, as torch does


@dataclass(frozen=True, slots=True)
class Bucket:
    """Parameters whose gradients travel in one all_reduce.

    ``params`` index the wrapper's parameter list; parameter ``params[k]`` occupies
    ``[offsets[k], offsets[k] + numel of that parameter)`` of the bucket's flat buffer.
    """

    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int


def plan_buckets(params: list[torch.Tensor], cap_bytes: int,
                 first_cap_bytes: int = _FIRST_BUCKET_BYTES) -> tuple[Bucket, ...]:
    """Group parameters into buckets of about ``cap_bytes``, walking them back to front (the order
    gradients tend to become ready). A bucket holds one dtype on one device. Bucket 0 is capped at
    ``min(first_cap_bytes, cap_bytes)`` so communication starts early. Same answer on every rank.
    """
    open_: dict = {}   # (device, dtype) -> [indices, bytes]
    closed: list[list[int]] = []
    for i in reversed(range(len(params))):
        p = params[i]
        entry = open_.setdefault((p.device, p.dtype), [[], 0])
        entry[0].append(i)
        entry[1] += p.numel() * p.element_size()
        if entry[1] >= (min(first_cap_bytes, cap_bytes) if not closed else cap_bytes):
            closed.append(entry[0])
            del open_[(p.device, p.dtype)]
    closed.extend(indices for indices, _ in open_.values())
    return tuple(_bucket(indices, params) for indices in closed)


def _bucket(indices: list[int], params: list[torch.Tensor]) -> Bucket:
    offsets, total = [], 0
    for i in indices:
        offsets.append(total)
        total += params[i].numel()
    return Bucket(tuple(indices), tuple(offsets), total)


class _Reducer:
    """Per-backward state: which gradients arrived, which buckets are launched, their works."""

    def __init__(self, params, names, buckets, group, find_unused: bool, as_view: bool):
        self.params, self.names, self.buckets, self.group = params, names, buckets, group
        self.find_unused, self.as_view = find_unused, as_view
        self.scale = 1.0 / comm.group_size(group)
        self.buffers = [torch.zeros(b.numel, dtype=params[b.params[0]].dtype,
                                    device=params[b.params[0]].device) for b in buckets]
        self.bucket_of, self.views = {}, {}
        for k, b in enumerate(buckets):
            for i, off in zip(b.params, b.offsets):
                p = params[i]
                self.bucket_of[i] = k
                self.views[i] = self.buffers[k][off: off + p.numel()].view(p.shape)
        self.active = False

    def prepare(self) -> None:
        """A forward that will be followed by a synchronised backward."""
        self.active, self.queued = True, False
        self.got = [False] * len(self.params)
        self.pending = [len(b.params) for b in self.buckets]
        self.next, self.works = 0, []

    def on_grad(self, i: int) -> None:
        """Parameter ``i``'s gradient is accumulated: put it in its bucket; launch what is ready."""
        if not self.active:
            return
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        if self.got[i]:
            raise GlobalTensorError(
                f"expected parameter {self.names[i]!r} to get its gradient once per backward, "
                f"found it twice; DistributedDataParallel cannot reduce a parameter twice in one "
                f"backward (reentrant checkpointing?): use non-reentrant checkpointing")
        self.got[i] = True
        self._write(i)
        self.pending[self.bucket_of[i]] -= 1
        self._launch_ready()

    def _write(self, i: int) -> None:
        grad, view = self.params[i].grad, self.views[i]
        with torch.no_grad():
            if grad.data_ptr() == view.data_ptr():  # the gradient already lives in the bucket
                view.mul_(self.scale)
            else:
                torch.mul(grad, self.scale, out=view)

    def _launch_ready(self) -> None:
        """Launch buckets in index order -- the same order on every rank -- while they are full."""
        while self.next < len(self.buckets) and self.pending[self.next] == 0:
            self.works.append(comm.all_reduce(self.buffers[self.next], comm.ReduceOp.SUM,
                                              self.group, async_op=True))
            self.next += 1

    def finish(self) -> None:
        """End of backward: launch what is left (or fail naming the parameters), wait, copy back."""
        self.active = False
        used = None
        if self.next < len(self.buckets):
            missing = [i for i, got in enumerate(self.got) if not got]
            if not self.find_unused:
                self._wait()
                raise GlobalTensorError(_unused_message([self.names[i] for i in missing]))
            for i in missing:
                self.views[i].zero_()
                self.pending[self.bucket_of[i]] -= 1
            self._launch_ready()
        if self.find_unused:
            used = torch.tensor(self.got, dtype=torch.int32, device=self.buffers[0].device)
            comm.all_reduce(used, comm.ReduceOp.MAX, self.group)
            used = used.tolist()
        self._wait()
        self._copy_back(used)

    def _wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []

    def _copy_back(self, used) -> None:
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if not self.got[i] and (used is None or not used[i]):
                    continue  # no rank computed a gradient for it: leave .grad as it is
                view = self.views[i]
                if self.as_view:
                    p.grad = view
                elif p.grad is None:
                    p.grad = view.clone()
                elif p.grad.data_ptr() != view.data_ptr():
                    p.grad.copy_(view)


def _unused_message(names: list[str]) -> str:
    return (f"expected every parameter to receive a gradient in backward, found none for "
            f"{names}; use them in forward's output, set requires_grad=False on them, or wrap "
            f"with DistributedDataParallel(..., find_unused_parameters=True)")


def _check_arguments(module, bucket_cap_mb) -> None:
    """Before any communication, on every rank alike."""
    if not isinstance(module, torch.nn.Module):
        raise GlobalTensorError(
            f"DistributedDataParallel expects a torch.nn.Module, found {repr(module)[:80]} "
            f"({type(module).__name__}); wrap the model itself: DistributedDataParallel(model)")
    ok = bucket_cap_mb is None or (isinstance(bucket_cap_mb, (int, float))
                                   and not isinstance(bucket_cap_mb, bool) and bucket_cap_mb > 0
                                   and bucket_cap_mb * 1024 * 1024 < 2 ** 62)
    if not ok:
        raise GlobalTensorError(
            f"expected bucket_cap_mb to be a number of MiB > 0 (or None for 25), found "
            f"{repr(bucket_cap_mb)[:80]} ({type(bucket_cap_mb).__name__}); e.g. bucket_cap_mb=25")


class DistributedDataParallel(torch.nn.Module):
    """Data parallel training: the same model on every rank, gradients averaged over ranks.

    ``module`` is wrapped as ``self.module`` (so parameter names gain a ``module.`` prefix, as
    with torch); attributes the wrapper lacks are looked up on the module (``ddp(m).lr``)::

        model = gt.nn.parallel.DistributedDataParallel(Net())
        loss_fn(model(x), y).backward()       # .grad is the average over ranks
        with model.no_sync():                 # accumulate locally, no communication
            loss_fn(model(x2), y2).backward()

    Arguments follow torch's: ``bucket_cap_mb`` (25), ``broadcast_buffers`` (rank 0's buffers
    broadcast at every forward), ``find_unused_parameters``, ``gradient_as_bucket_view``,
    ``process_group``, ``init_sync``, ``device_ids`` (inputs are moved to ``device_ids[0]``).
    """

    def __init__(self, module: torch.nn.Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers: bool = True, init_sync: bool = True, process_group=None,
                 bucket_cap_mb: float | None = 25, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False):
        super().__init__()
        _check_arguments(module, bucket_cap_mb)
        self.module = module
        self.device = torch.device(device_ids[0]) if device_ids else None
        self.broadcast_buffers = broadcast_buffers
        self.process_group = process_group
        self.require_backward_grad_sync = True
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if init_sync:
            _check_same_parameters(module, process_group)
            # as torch's DDP: rank 0's buffers too only with broadcast_buffers
            buffers = list(module.buffers()) if broadcast_buffers else []
            _broadcast_coalesced(list(module.parameters()) + buffers, process_group)
        cap = int((25 if bucket_cap_mb is None else bucket_cap_mb) * 1024 * 1024)
        params = [p for _, p in named]
        self._reducer = _Reducer(params, [n for n, _ in named], plan_buckets(params, cap),
                                 process_group, find_unused_parameters, gradient_as_bucket_view)
        self._hooks = [p.register_post_accumulate_grad_hook(_Hook(self._reducer, i))
                       for i, p in enumerate(params)]

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """The buckets, in launch order (indices into the parameters that require grad)."""
        return self._reducer.buckets

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers:
            buffers = list(self.module.buffers())
            if buffers:
                _broadcast_coalesced(buffers, self.process_group)
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self._reducer.prepare()
        else:
            self._reducer.active = False
        if self.device is not None:
            args, kwargs = _move(args, self.device), _move(kwargs, self.device)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Forward and backward inside this block accumulate gradients locally, without
        communication; the first synchronised backward after it averages the accumulated sum."""
        before = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None:
                raise
            return getattr(module, name)


class _Hook:
    """The post-accumulate-grad hook of one parameter (a class, so it has a readable repr)."""

    __slots__ = ("reducer", "index")

    def __init__(self, reducer: _Reducer, index: int):
        self.reducer, self.index = reducer, index

    def __call__(self, _param) -> None:
        self.reducer.on_grad(self.index)


def _move(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_move(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _move(v, device) for k, v in x.items()}
    return x


def _check_same_parameters(module: torch.nn.Module, group) -> None:
    """Every rank must wrap parameters of the same names, shapes and dtypes (all ranks raise)."""
    mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
    every = comm.all_gather(mine, group=group)
    for rank, theirs in enumerate(every):
        if theirs != every[0]:
            raise GlobalTensorError(
                f"expected every rank to wrap the same parameters, found rank {rank} differs from "
                f"rank 0: {_first_difference(every[0], theirs)}; build the same model on every "
                f"rank before wrapping it")


def _first_difference(ours: list, theirs: list) -> str:
    for a, b in zip(ours, theirs):
        if a != b:
            return f"{a[0]!r} {a[1]} {a[2]} on rank 0 vs {b[0]!r} {b[1]} {b[2]}"
    return f"{len(ours)} parameters on rank 0 vs {len(theirs)}"


def _broadcast_coalesced(tensors: list[torch.Tensor], group) -> None:
    """Rank 0's values (of ``group``) into ``tensors`` on every rank: one broadcast per dtype."""
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    with torch.no_grad():
        for same in groups.values():
            flat = torch.cat([t.reshape(-1) for t in same])
            comm.broadcast(flat, group=group)  # from the group's first rank
            for t, piece in zip(same, flat.split([t.numel() for t in same])):
                t.copy_(piece.view(t.shape))
