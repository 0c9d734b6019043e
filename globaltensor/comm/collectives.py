"""User collectives, ``gt.comm``: torch.distributed's calls, plus value-style calls.

Two call styles, told apart by the arguments (the full table is in docs/collectives.md):

* torch style -- a tensor (or output arguments) first, exactly as ``torch.distributed``: the call
  works in place, accepts any ``group``, ``async_op`` and every ``ReduceOp``, and returns what torch
  returns, except that where torch returns ``None`` it returns the output argument it wrote into::

      gt.comm.all_reduce(t)                         # t summed in place; returns t
      gt.comm.all_reduce(t, op=gt.comm.ReduceOp.MAX)
      gt.comm.all_gather(out_list, t)               # fills out_list; returns out_list

* value style -- only the data: the call returns the result and never modifies the caller's data::

      gt.comm.all_reduce(t, reduce_op="mean")       # a new tensor; t untouched
      gt.comm.all_reduce({"loss": t, "n": 3})       # the same nested structure, summed
      gt.comm.all_gather(t)                         # tensors stacked on a new dim 0 (a list if shapes differ)
      gt.comm.all_gather(3.0)                       # [3.0, ...], one entry per rank
      gt.comm.broadcast("hello", src=0)             # rank 0's string on every rank

Where a backend lacks an operation it is built from ones it has (see ``_LACKS``).
"""
from __future__ import annotations

import contextlib
import datetime
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .. import debug
from ..errors import CollectiveTimeoutError, GlobalTensorError

ReduceOp = dist.ReduceOp
_Red = dist.ReduceOp.RedOpType

__all__ = [
    "ReduceOp", "all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "broadcast", "gather", "irecv", "isend",
    "monitored_barrier", "rank_zero_first", "recv", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "send",
]

# ---------------------------------------------------------------------------------------------
# the world, groups and backends
# ---------------------------------------------------------------------------------------------


def _ensure_world() -> None:
    """Collectives before gt.init(): join the job (a world of 1 when nothing is set)."""
    if not (dist.is_available() and dist.is_initialized()):
        from .. import env  # imported here: env imports comm.backend

        env.init()


def _size(group) -> int:
    return dist.get_world_size(group)


def group_size(group=None) -> int:
    """How many ranks ``group`` (default: the world) has; for layers above comm (e.g. DDP)."""
    _ensure_world()
    return dist.get_world_size(group)


def group_rank(group=None) -> int:
    """This rank's index within ``group`` (default: the world)."""
    _ensure_world()
    return dist.get_group_rank(group or dist.group.WORLD, dist.get_rank())


def _group_rank(group, rank: int | None, group_rank: int | None, role: str) -> int:
    """The group-relative rank of ``rank`` (global) or ``group_rank``; 0 when neither is given."""
    if rank is not None and group_rank is not None:
        raise GlobalTensorError(f"expected one of {role} and group_{role}, found both "
                                f"({role}={rank}, group_{role}={group_rank}); pass only one")
    if rank is None:
        return 0 if group_rank is None else group_rank
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_group_rank(group, rank)


def _backend_for(tensor: torch.Tensor, group) -> str:
    """The backend that moves ``tensor`` on ``group`` ("gloo", "nccl", ...)."""
    name = str(dist.get_backend(group))
    if ":" not in name:
        return name
    table = dict(part.split(":", 1) for part in name.split(","))
    return table.get(tensor.device.type, name)


def _object_device(group) -> torch.device:
    """Where small bookkeeping tensors (numbers, shapes) live for ``group``: cpu for gloo."""
    return torch.device(c10d._get_object_coll_device(group))


def _agree(name: str, group, **facts) -> None:
    """With GT_DEBUG on: every rank of ``group`` must be making this call with these facts
    (otherwise every rank raises, naming the ranks that differ, instead of hanging)."""
    if debug.is_debug():
        ranks = None if group is None else dist.get_process_group_ranks(group)
        debug.check("gt.comm." + name, ranks=ranks, **facts)


def _tensor_fact(t: torch.Tensor, shape: bool = True) -> str:
    return f"tensor({list(t.shape)}, {t.dtype})" if shape else f"tensor({t.dtype})"


def _structure_fact(data, shapes: bool) -> str:
    """A rank-independent text of nested data: containers, keys, tensor dtypes (and shapes)."""
    leaves: list = []
    spec = _flatten(data, leaves, [])
    it = iter(_tensor_fact(v, shapes) if isinstance(v, torch.Tensor) else type(v).__name__
              for v in leaves)
    return _spec_text(spec, it)


def _spec_text(spec, leaves) -> str:
    if spec is None:
        return next(leaves)
    kind, keys, children = spec
    inner = [_spec_text(c, leaves) for c in children]
    if keys is not None:
        inner = [f"{k!r}: {v}" for k, v in zip(keys, inner)]
    return f"{kind.__name__}({', '.join(inner)})"


# ---------------------------------------------------------------------------------------------
# reduce ops: names, capabilities, and how a missing one is built
# ---------------------------------------------------------------------------------------------

_OP_NAMES = {
    "sum": ReduceOp.SUM, "mean": ReduceOp.AVG, "avg": ReduceOp.AVG, "max": ReduceOp.MAX,
    "min": ReduceOp.MIN, "prod": ReduceOp.PRODUCT, "product": ReduceOp.PRODUCT,
    "band": ReduceOp.BAND, "and": ReduceOp.BAND, "bor": ReduceOp.BOR, "or": ReduceOp.BOR,
    "bxor": ReduceOp.BXOR, "xor": ReduceOp.BXOR,
}

# element-wise functions that combine two ranks' values, for ops reduced locally
_COMBINE = {
    _Red.SUM: torch.add, _Red.PRODUCT: torch.mul, _Red.MIN: torch.minimum,
    _Red.MAX: torch.maximum, _Red.BAND: torch.bitwise_and, _Red.BOR: torch.bitwise_or,
    _Red.BXOR: torch.bitwise_xor,
}

# (backend, need) pairs a backend cannot do natively; each is built from operations it has:
#   premul_sum  -> scale the input, then SUM
#   avg_integer -> SUM, then divide by the group size (truncating, as NCCL's integer AVG does)
#   bitwise     -> all_gather, then combine locally
_LACKS = frozenset({("gloo", "premul_sum"), ("gloo", "avg_integer"), ("nccl", "bitwise")})
# backends known to have gather and scatter; any other one gets them built from send/recv
_NATIVE_GATHER_SCATTER = frozenset({"gloo", "nccl", "mpi", "ucc", "xccl"})


def to_reduce_op(op):
    """A ReduceOp from a ReduceOp, its enum value, or a name ("sum", "mean", "MAX", ...)."""
    if isinstance(op, (ReduceOp, _Red)):
        return op
    if isinstance(op, str) and op.lower() in _OP_NAMES:
        return _OP_NAMES[op.lower()]
    raise GlobalTensorError(
        f"expected a reduce op (a torch.distributed.ReduceOp or one of "
        f"{sorted(_OP_NAMES)}), found {op!r}; use reduce_op=\"sum\" or op=ReduceOp.SUM")


def _kind(op) -> _Red:
    return op if isinstance(op, _Red) else op.op


def _op_fact(op) -> str:
    return _kind(to_reduce_op(op)).name


@dataclass(frozen=True, slots=True)
class _Lowered:
    """How this rank runs a reduction: the backend's op, plus the steps around it."""

    op: object                  # what the backend runs
    scale: object = None        # multiply the input by this first (PREMUL_SUM built as scale + SUM)
    divide: bool = False        # divide the result by the group size, truncating (integer AVG)
    by_gather: bool = False     # all_gather and combine locally (an op the backend lacks)


def _need(op, dtype: torch.dtype) -> str | None:
    kind = _kind(op)
    if kind == _Red.PREMUL_SUM:
        return "premul_sum"
    if kind == _Red.AVG and not (dtype.is_floating_point or dtype.is_complex):
        return "avg_integer"
    if kind in (_Red.BAND, _Red.BOR, _Red.BXOR):
        return "bitwise"
    return None


def _lower(op, tensor: torch.Tensor, group) -> _Lowered:
    op = to_reduce_op(op)
    need = _need(op, tensor.dtype)
    if need is None or (_backend_for(tensor, group), need) not in _LACKS:
        return _Lowered(op)
    if need == "premul_sum":
        return _Lowered(ReduceOp.SUM, scale=op.factor)
    if need == "avg_integer":
        return _Lowered(ReduceOp.SUM, divide=True)
    return _Lowered(_kind(op), by_gather=True)


class _PendingWork:
    """A torch Work plus the step this rank runs once it completes (the tail of a built op)."""

    __slots__ = ("_work", "_then", "_done")

    def __init__(self, work, then):
        self._work, self._then, self._done = work, then, False

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self._work is not None:
            self._work.wait() if timeout is None else self._work.wait(timeout)
        if not self._done:
            self._done = True
            if self._then is not None:
                self._then()
        return True

    def is_completed(self) -> bool:
        return self._done or self._work is None or self._work.is_completed()

    def is_success(self) -> bool:
        return self.is_completed()


def _finish(result, work, async_op: bool, then=None):
    """torch style: the work when async, else run ``then`` and return the output argument."""
    if async_op:
        return work if then is None else _PendingWork(work, then)
    if then is not None:
        then()
    return result


def _done(result, async_op: bool):
    """An op this rank ran synchronously: a completed work when async was asked for."""
    return _PendingWork(None, None) if async_op else result


def _combine_gathered(tensor: torch.Tensor, kind, group) -> torch.Tensor:
    """Reduce ``tensor`` over ``group`` in place by gathering every rank's value."""
    parts = [torch.empty_like(tensor) for _ in range(_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    tensor.copy_(functools.reduce(_COMBINE[kind], parts))
    return tensor


def _reduce_in_place(tensor, op, group, async_op, run):
    """Run reduction ``run(tensor, op)`` (all_reduce or reduce) with the backend's lowering."""
    low = _lower(op, tensor, group)
    if low.by_gather:
        return _done(_combine_gathered(tensor, low.op, group), async_op)
    if low.scale is not None:
        tensor.mul_(low.scale)
    work = run(tensor, low.op, async_op)
    then = (lambda: tensor.div_(_size(group), rounding_mode="trunc")) if low.divide else None
    return _finish(tensor, work, async_op, then)


# ---------------------------------------------------------------------------------------------
# nested data: flatten to leaves with paths, rebuild the same structure
# ---------------------------------------------------------------------------------------------


def _flatten(x, leaves: list, paths: list, path: str = ""):
    """Append the leaves of nested dict/list/tuple ``x`` to ``leaves``; return a spec to rebuild."""
    if isinstance(x, dict):
        keys = list(x)
        return (type(x), keys, [_flatten(x[k], leaves, paths, f"{path}[{k!r}]") for k in keys])
    if isinstance(x, (list, tuple)):
        return (type(x), None, [_flatten(v, leaves, paths, f"{path}[{i}]") for i, v in enumerate(x)])
    leaves.append(x)
    paths.append(path or "the value")
    return None


def _unflatten(spec, it):
    if spec is None:
        return next(it)
    kind, keys, children = spec
    values = [_unflatten(c, it) for c in children]
    if keys is not None:
        try:
            return kind(zip(keys, values))
        except TypeError:  # e.g. defaultdict wants its factory first
            return dict(zip(keys, values))
    if hasattr(kind, "_fields"):  # namedtuple
        return kind(*values)
    return kind(values)


def _has_tensor(x) -> bool:
    leaves: list = []
    _flatten(x, leaves, [])
    return any(isinstance(v, torch.Tensor) for v in leaves)


# ---------------------------------------------------------------------------------------------
# all_reduce
# ---------------------------------------------------------------------------------------------


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, *, reduce_op=None):
    """Reduce over the ranks of ``group``.

    torch style (a tensor, no ``reduce_op``): in place; returns the tensor (a work if async_op)::

        gt.comm.all_reduce(t, op=gt.comm.ReduceOp.MAX)

    value style (``reduce_op=`` given, or data that is not one tensor): returns a new value of the
    same structure -- a tensor, a nested dict/list/tuple of tensors and numbers, or a number::

        gt.comm.all_reduce({"loss": loss, "n": 4}, reduce_op="mean")
    """
    _ensure_world()
    if reduce_op is None and isinstance(tensor, torch.Tensor):
        _agree("all_reduce", group, tensor=_tensor_fact(tensor), reduce_op=_op_fact(op), async_op=async_op)
        return _reduce_in_place(tensor, op, group, async_op,
                                lambda t, o, a: dist.all_reduce(t, o, group=group, async_op=a))
    if reduce_op is not None and _kind(to_reduce_op(op)) != _Red.SUM:
        raise GlobalTensorError(f"expected either op= or reduce_op=, found both (op={op!r}, "
                                f"reduce_op={reduce_op!r}); pass one of them")
    _no_async(async_op, "all_reduce")
    _agree("all_reduce", group, value=_structure_fact(tensor, shapes=True),
           reduce_op=_op_fact(reduce_op if reduce_op is not None else op))
    return _all_reduce_value(tensor, to_reduce_op(reduce_op if reduce_op is not None else op), group)


def _no_async(async_op: bool, name: str) -> None:
    if async_op:
        raise GlobalTensorError(
            f"expected async_op=False for value-style {name} (it returns the result), found "
            f"async_op=True; pass a tensor torch-style (in place) to get a work handle")


def _all_reduce_value(data, op, group):
    leaves, paths = [], []
    spec = _flatten(data, leaves, paths)
    kind = _kind(op)
    buffers = [_reduce_buffer(leaf, path, kind, group) for leaf, path in zip(leaves, paths)]
    with torch.no_grad():
        reduced = _reduce_grouped(buffers, op, group)
    return _unflatten(spec, iter(_back_to_leaf(v, r, kind) for v, r in zip(leaves, reduced)))


def _reduce_buffer(leaf, path: str, kind, group) -> torch.Tensor:
    """The tensor that carries ``leaf`` through the reduction (never the caller's own tensor)."""
    if isinstance(leaf, torch.Tensor):
        t = leaf.detach()
        if kind == _Red.AVG and not (t.dtype.is_floating_point or t.dtype.is_complex):
            t = t.to(torch.get_default_dtype())  # the mean of integers is not an integer
        return t
    if isinstance(leaf, (bool, int, float, complex)):
        bitwise = kind in (_Red.BAND, _Red.BOR, _Red.BXOR)
        dtype = torch.int64 if bitwise else (torch.complex128 if isinstance(leaf, complex) else torch.float64)
        return torch.tensor(leaf, dtype=dtype, device=_object_device(group))
    raise GlobalTensorError(
        f"expected tensors or Python numbers to all_reduce, found {type(leaf).__name__} at "
        f"{path}; all_gather or broadcast it instead, or leave it out of the collection")


def _reduce_grouped(tensors: list[torch.Tensor], op, group) -> list[torch.Tensor]:
    """Reduce many tensors with one collective per (device, dtype): flatten, concatenate, split."""
    out: list = [None] * len(tensors)
    buckets: dict = {}
    for i, t in enumerate(tensors):
        buckets.setdefault((t.device, t.dtype), []).append(i)
    for idx in buckets.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])  # a copy: the caller's data stays
        _reduce_in_place(flat, op, group, False,
                         lambda t, o, a: dist.all_reduce(t, o, group=group, async_op=a))
        for i, piece in zip(idx, flat.split([tensors[i].numel() for i in idx])):
            out[i] = piece.view(tensors[i].shape)
    return out


def _back_to_leaf(leaf, reduced: torch.Tensor, kind):
    """A Python number comes back as the caller's type where the op keeps it (int sum -> int)."""
    if isinstance(leaf, torch.Tensor):
        return reduced
    value = reduced.item()
    if isinstance(leaf, bool) and kind in (_Red.MAX, _Red.MIN, _Red.BAND, _Red.BOR, _Red.BXOR):
        return bool(value)
    if isinstance(leaf, int) and kind != _Red.AVG:
        return int(round(value))
    return value


# ---------------------------------------------------------------------------------------------
# all_gather
# ---------------------------------------------------------------------------------------------

_DTYPES = tuple(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))
_CODE = {d: i for i, d in enumerate(_DTYPES)}
_MAX_NDIM = 64  # fixed-size shape records, so ranks exchange them in one collective


def all_gather(tensor_list, tensor=None, group=None, async_op: bool = False):
    """Gather from every rank of ``group``.

    torch style ``all_gather(out_list, t)``: fills ``out_list`` (its tensors may differ in size,
    one per rank's ``t``); returns ``out_list`` (a work if async_op).

    value style ``all_gather(x)``: a tensor -> every rank's tensor stacked on a new dim 0 (a list
    when shapes differ); a nested dict/list/tuple holding tensors -> the same structure, gathered
    leaf by leaf; anything else (numbers, strings, objects) -> a list with one entry per rank.
    """
    _ensure_world()
    if tensor is None:
        _no_async(async_op, "all_gather")
        _agree("all_gather", group, value=_structure_fact(tensor_list, shapes=False))
        return _all_gather_value(tensor_list, group)
    _agree("all_gather", group, outputs=[_tensor_fact(t) for t in tensor_list],
           tensor=_tensor_fact(tensor, shape=False), async_op=async_op)
    shapes = {tuple(t.shape) for t in tensor_list}
    if len(shapes) <= 1:
        return _finish(tensor_list, dist.all_gather(tensor_list, tensor, group, async_op), async_op)
    _gather_uneven_into(tensor_list, tensor, group)
    return _done(tensor_list, async_op)


def _gather_uneven_into(outputs: list[torch.Tensor], tensor: torch.Tensor, group) -> None:
    """Rank r's ``tensor`` lands in ``outputs[r]``: pad to the largest, gather, trim."""
    sizes = [o.numel() for o in outputs]
    gathered = _gather_padded(tensor.detach().reshape(-1), max(sizes), group)
    for out, row, n in zip(outputs, gathered, sizes):
        out.copy_(row[:n].view(out.shape))


def _gather_padded(flat: torch.Tensor, width: int, group) -> torch.Tensor:
    """(group size, width): every rank's 1-D ``flat``, zero-padded to ``width``."""
    buf = flat.new_zeros(width)
    buf[: flat.numel()] = flat
    out = flat.new_empty((_size(group), width))
    _gather_stacked(out, buf, group)
    return out


def _gather_stacked(out: torch.Tensor, tensor: torch.Tensor, group) -> None:
    """Every rank's ``tensor`` into ``out[r]`` (``out`` has shape (group size, *tensor.shape))."""
    if tensor.numel():
        dist.all_gather_single(out.view(-1), tensor.reshape(-1), group=group)


def _all_gather_value(data, group):
    if isinstance(data, torch.Tensor):
        return _gather_tensors([data], group)[0]
    if not _has_tensor(data):
        return _gather_objects(data, group)
    leaves, paths = [], []
    spec = _flatten(data, leaves, paths)
    tensor_at = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    other_at = [i for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor)]
    out = list(leaves)
    if other_at:
        per_rank = _gather_objects([leaves[i] for i in other_at], group)
        for j, i in enumerate(other_at):
            out[i] = [values[j] for values in per_rank]
    for i, gathered in zip(tensor_at, _gather_tensors([leaves[i] for i in tensor_at], group)):
        out[i] = gathered
    return _unflatten(spec, iter(out))


def _gather_objects(obj, group) -> list:
    out = [None] * _size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _shape_records(tensors: list[torch.Tensor], group) -> torch.Tensor:
    """(group size, len(tensors), 2 + _MAX_NDIM) int64: every rank's dtype code, ndim and shape."""
    rows = []
    for t in tensors:
        if t.ndim > _MAX_NDIM:
            raise GlobalTensorError(f"expected tensors of at most {_MAX_NDIM} dims to all_gather, "
                                    f"found {t.ndim}; reshape it first")
        rows.append([_CODE[t.dtype], t.ndim, *t.shape] + [0] * (_MAX_NDIM - t.ndim))
    mine = torch.tensor(rows, dtype=torch.int64, device=_object_device(group))
    out = mine.new_empty((_size(group),) + tuple(mine.shape))
    _gather_stacked(out, mine, group)
    return out.cpu()


def _gather_tensors(tensors: list[torch.Tensor], group) -> list:
    """Value-style all_gather of tensors: stacked per tensor, or a list where shapes differ."""
    records = _shape_records(tensors, group).tolist()
    shapes = [[tuple(rec[i][2: 2 + rec[i][1]]) for rec in records] for i in range(len(tensors))]
    for i, t in enumerate(tensors):
        codes = [rec[i][0] for rec in records]
        if len(set(codes)) > 1:
            found = {r: str(_DTYPES[c]) for r, c in enumerate(codes)}
            raise GlobalTensorError(f"expected every rank to all_gather the same dtype, found "
                                    f"{found}; cast with .to(dtype) before gathering")
    out: list = [None] * len(tensors)
    buckets: dict = {}
    for i, t in enumerate(tensors):
        buckets.setdefault((t.device, t.dtype), []).append(i)
    with torch.no_grad():
        for idx in buckets.values():
            _gather_bucket(tensors, shapes, idx, group, out)
    return out


def _gather_bucket(tensors, shapes, idx: list[int], group, out: list) -> None:
    """Gather tensors ``idx`` (one device and dtype) in one collective; fill ``out``."""
    first = shapes[idx[0]]
    if len(idx) == 1 and len(set(first)) == 1:  # the common case: one tensor, same shape everywhere
        t = tensors[idx[0]].detach().contiguous()
        out[idx[0]] = t.new_empty((_size(group),) + tuple(t.shape))
        _gather_stacked(out[idx[0]], t, group)
        return
    numels = [[_numel(shapes[i][r]) for i in idx] for r in range(_size(group))]
    flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
    rows = _gather_padded(flat, max(sum(n) for n in numels), group)
    for r, row in enumerate(rows):
        for i, piece in zip(idx, row[: sum(numels[r])].split(numels[r])):
            shapes_i = shapes[i]
            out[i] = out[i] if out[i] is not None else []
            out[i].append(piece.view(shapes_i[r]))
    for i in idx:
        if len(set(shapes[i])) == 1:
            out[i] = torch.stack(out[i])


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op: bool = False):
    """torch style: every rank's ``input_tensor`` concatenated on dim 0 into ``output_tensor``."""
    _ensure_world()
    _agree("all_gather_into_tensor", group, output=_tensor_fact(output_tensor),
           input=_tensor_fact(input_tensor), async_op=async_op)
    work = dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
    return _finish(output_tensor, work, async_op)


# ---------------------------------------------------------------------------------------------
# broadcast, send, recv
# ---------------------------------------------------------------------------------------------


def broadcast(tensor, src: int | None = None, group=None, async_op: bool = False,
              group_src: int | None = None):
    """Rank ``src``'s value on every rank of ``group`` (``src`` defaults to 0).

    A tensor is broadcast in place, torch style (same shape and dtype on every rank), and also
    returned. Anything else -- numbers, strings, picklable objects, collections -- comes back as
    src's value (value style), whatever the other ranks passed.
    """
    _ensure_world()
    gsrc = _group_rank(group, src, group_src, "src")
    if isinstance(tensor, torch.Tensor):
        _agree("broadcast", group, tensor=_tensor_fact(tensor), group_src=gsrc, async_op=async_op)
        work = dist.broadcast(tensor, group=group, async_op=async_op, group_src=gsrc)
        return _finish(tensor, work, async_op)
    _no_async(async_op, "broadcast")
    _agree("broadcast", group, value="object", group_src=gsrc)
    box = [tensor]
    dist.broadcast_object_list(box, group=group, group_src=gsrc)
    return box[0]


def send(tensor, dst: int | None = None, group=None, tag: int = 0, group_dst: int | None = None):
    """torch style for a tensor; any other value is pickled and sent (``recv(src=...)`` gets it)."""
    _ensure_world()
    gdst = _group_rank(group, dst, group_dst, "dst")
    if isinstance(tensor, torch.Tensor):
        return dist.send(tensor, group=group, tag=tag, group_dst=gdst)
    return dist.send_object_list([tensor], group=group, group_dst=gdst)


def recv(tensor=None, src: int | None = None, group=None, tag: int = 0, group_src: int | None = None):
    """torch style with a tensor (returns the sender's rank); without one, returns the object
    that rank ``src`` sent with ``send(obj, dst)``."""
    _ensure_world()
    if tensor is not None:
        return dist.recv(tensor, src=src, group=group, tag=tag, group_src=group_src)
    if src is None and group_src is None:
        raise GlobalTensorError("expected src= (or group_src=) to receive an object, found neither; "
                                "say which rank sent it")
    box = [None]
    dist.recv_object_list(box, group=group, group_src=_group_rank(group, src, group_src, "src"))
    return box[0]


def isend(tensor, dst: int | None = None, group=None, tag: int = 0, group_dst: int | None = None):
    _ensure_world()
    return dist.isend(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)


def irecv(tensor, src: int | None = None, group=None, tag: int = 0, group_src: int | None = None):
    _ensure_world()
    return dist.irecv(tensor, src=src, group=group, tag=tag, group_src=group_src)


# ---------------------------------------------------------------------------------------------
# rooted collectives: reduce, gather, scatter
# ---------------------------------------------------------------------------------------------


def reduce(tensor, dst: int | None = None, op=ReduceOp.SUM, group=None, async_op: bool = False,
           group_dst: int | None = None):
    """torch style: the reduction lands in ``tensor`` on ``dst`` (default 0); returns ``tensor``."""
    _ensure_world()
    gdst = _group_rank(group, dst, group_dst, "dst")
    _agree("reduce", group, tensor=_tensor_fact(tensor), reduce_op=_op_fact(op), group_dst=gdst,
           async_op=async_op)
    return _reduce_in_place(tensor, op, group, async_op, lambda t, o, a: dist.reduce(
        t, op=o, group=group, async_op=a, group_dst=gdst))


def gather(tensor, gather_list=None, dst: int | None = None, group=None, async_op: bool = False,
           group_dst: int | None = None):
    """torch style: every rank's ``tensor`` into ``gather_list`` on ``dst`` (default 0)."""
    _ensure_world()
    gdst = _group_rank(group, dst, group_dst, "dst")
    _agree("gather", group, tensor=_tensor_fact(tensor), group_dst=gdst, async_op=async_op)
    if _backend_for(tensor, group) not in _NATIVE_GATHER_SCATTER:
        return _done(_gather_by_p2p(tensor, gather_list, gdst, group), async_op)
    work = dist.gather(tensor, gather_list, group=group, async_op=async_op, group_dst=gdst)
    return _finish(gather_list, work, async_op)


def scatter(tensor, scatter_list=None, src: int | None = None, group=None, async_op: bool = False,
            group_src: int | None = None):
    """torch style: ``scatter_list[r]`` on ``src`` (default 0) lands in rank r's ``tensor``."""
    _ensure_world()
    gsrc = _group_rank(group, src, group_src, "src")
    _agree("scatter", group, tensor=_tensor_fact(tensor), group_src=gsrc, async_op=async_op)
    if _backend_for(tensor, group) not in _NATIVE_GATHER_SCATTER:
        return _done(_scatter_by_p2p(tensor, scatter_list, gsrc, group), async_op)
    work = dist.scatter(tensor, scatter_list, group=group, async_op=async_op, group_src=gsrc)
    return _finish(tensor, work, async_op)


def _gather_by_p2p(tensor, gather_list, group_dst: int, group):
    """gather built from send/recv: every rank sends to the root, which receives from each."""
    me = dist.get_group_rank(group or dist.group.WORLD, dist.get_rank())
    if me != group_dst:
        dist.send(tensor, group=group, group_dst=group_dst)
        return gather_list
    works = [dist.irecv(out, group=group, group_src=r)
             for r, out in enumerate(gather_list) if r != me]
    gather_list[me].copy_(tensor)
    for w in works:
        w.wait()
    return gather_list


def _scatter_by_p2p(tensor, scatter_list, group_src: int, group):
    """scatter built from send/recv: the root sends piece r to rank r."""
    me = dist.get_group_rank(group or dist.group.WORLD, dist.get_rank())
    if me != group_src:
        dist.recv(tensor, group=group, group_src=group_src)
        return tensor
    works = [dist.isend(piece, group=group, group_dst=r)
             for r, piece in enumerate(scatter_list) if r != me]
    tensor.copy_(scatter_list[me])
    for w in works:
        w.wait()
    return tensor


# ---------------------------------------------------------------------------------------------
# reduce_scatter, all_to_all
# ---------------------------------------------------------------------------------------------


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """torch style: ``output`` on rank r = reduction of every rank's ``input_list[r]``."""
    _ensure_world()
    _agree("reduce_scatter", group, output=_tensor_fact(output), reduce_op=_op_fact(op),
           async_op=async_op)
    low = _lower(op, output, group)
    if low.by_gather or low.scale is not None:
        return _reduce_scatter_built(output, torch.stack(list(input_list)), low, group, async_op)
    work = dist.reduce_scatter(output, list(input_list), low.op, group=group, async_op=async_op)
    return _finish(output, work, async_op, _then_divide(output, low, group))


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """torch style: ``input`` split on dim 0 into group-size pieces; piece r reduced into rank r's ``output``."""
    _ensure_world()
    _agree("reduce_scatter_tensor", group, output=_tensor_fact(output),
           input=_tensor_fact(input), reduce_op=_op_fact(op), async_op=async_op)
    low = _lower(op, output, group)
    if low.by_gather or low.scale is not None:
        return _reduce_scatter_built(output, input.reshape((_size(group),) + tuple(output.shape)),
                                     low, group, async_op)
    work = dist.reduce_scatter_single(output, input, low.op, group=group, async_op=async_op)
    return _finish(output, work, async_op, _then_divide(output, low, group))


def _then_divide(output, low: _Lowered, group):
    return (lambda: output.div_(_size(group), rounding_mode="trunc")) if low.divide else None


def _reduce_scatter_built(output, stacked: torch.Tensor, low: _Lowered, group, async_op):
    """reduce_scatter of an op the backend lacks: all_reduce (lowered) then keep this rank's row."""
    full = stacked.clone()
    if low.scale is not None:
        full.mul_(low.scale)
        all_reduce(full, ReduceOp.SUM, group)
    else:
        _combine_gathered(full, low.op, group)
    output.copy_(full[dist.get_group_rank(group or dist.group.WORLD, dist.get_rank())])
    return _done(output, async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op: bool = False):
    """torch style: rank r's ``input_tensor_list[s]`` lands in rank s's ``output_tensor_list[r]``."""
    _ensure_world()
    _agree("all_to_all", group, tensors=len(input_tensor_list), async_op=async_op)
    work = dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)
    return _finish(output_tensor_list, work, async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op: bool = False):
    _ensure_world()
    _agree("all_to_all_single", group, dtype=str(input.dtype), async_op=async_op)
    work = dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                  group=group, async_op=async_op)
    return _finish(output, work, async_op)


# ---------------------------------------------------------------------------------------------
# synchronisation: barrier, rank_zero_first, monitored_barrier
# ---------------------------------------------------------------------------------------------


def barrier(group=None, async_op: bool = False, device_ids=None, timeout=None):
    """Wait until every rank of ``group`` has reached this point."""
    _ensure_world()
    _agree("barrier", group)
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids,
                        timeout=_as_timedelta(timeout))


@contextlib.contextmanager
def rank_zero_first(local: bool = False, group=None):
    """Rank 0 (with ``local=True``: local rank 0 of each node) runs the block before the others
    enter it -- e.g. to download a data set once::

        with gt.comm.rank_zero_first():
            data = load_or_download()
    """
    _ensure_world()
    from .. import env

    first = (env.get_local_rank() if local else dist.get_rank()) == 0
    if not first:
        barrier(group)
    yield
    if first:
        barrier(group)


def _as_timedelta(timeout) -> datetime.timedelta | None:
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


def monitored_barrier(timeout=None, group=None, wait_all_ranks: bool = True) -> None:
    """A barrier that fails after ``timeout`` (seconds or timedelta; default 30 min), naming the
    ranks that did not arrive. Works on any backend: it meets through the job's store.

    The group's first rank coordinates: it waits for everyone, then releases them or tells them
    who is missing. Every rank raises CollectiveTimeoutError when the barrier fails.
    """
    _ensure_world()
    timeout = _as_timedelta(timeout) or datetime.timedelta(minutes=30)
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    me, store = dist.get_rank(), c10d._get_default_store()
    if me not in ranks:
        return  # as torch: a rank outside the group has nothing to wait for
    base = "gt/monitored_barrier/" + ",".join(map(str, ranks))
    seq = store.add(f"{base}/seq/{me}", 1)
    key = f"{base}/{seq}"
    store.set(f"{key}/arrived/{me}", "1")
    if me == ranks[0]:
        _coordinate(store, key, ranks, timeout, seq)
    else:
        _await_release(store, key, ranks[0], timeout)


def _coordinate(store, key: str, ranks, timeout, seq: int) -> None:
    arrived = [f"{key}/arrived/{r}" for r in ranks]
    try:
        store.wait(arrived, timeout)
    except Exception:  # noqa: BLE001 - the store reports a timeout in its own way
        missing = [r for r, k in zip(ranks, arrived) if not store.check([k])]
        store.set(f"{key}/release", "missing " + ",".join(map(str, missing)))
        raise CollectiveTimeoutError(_missing_message(missing, ranks, timeout)) from None
    store.set(f"{key}/release", "ok")
    _forget_round(store, key.rsplit("/", 1)[0], seq - 1, ranks)


def _await_release(store, key: str, coordinator: int, timeout) -> None:
    grace = timeout + min(timeout, datetime.timedelta(seconds=1))
    try:
        store.wait([f"{key}/release"], grace)
    except Exception:  # noqa: BLE001
        raise CollectiveTimeoutError(
            f"expected rank {coordinator} (which coordinates monitored_barrier) to release this "
            f"rank within {grace.total_seconds():g}s, found no word from it; rank {coordinator} "
            f"did not arrive or failed") from None
    status = store.get(f"{key}/release").decode()
    if status != "ok":
        missing = [int(r) for r in status.split(" ", 1)[1].split(",")]
        raise CollectiveTimeoutError(_missing_message(missing, None, timeout))


def _missing_message(missing, ranks, timeout) -> str:
    group = f" of {list(ranks)}" if ranks is not None else ""
    return (f"expected every rank{group} at monitored_barrier within "
            f"{timeout.total_seconds():g}s, found ranks {missing} missing; they are stuck "
            f"earlier, skipped this barrier, or crashed")


def _forget_round(store, base: str, seq: int, ranks) -> None:
    """Delete the keys of round ``seq``: every rank is past it once round seq + 1 completes."""
    if seq < 1:
        return
    try:
        for r in ranks:
            store.delete_key(f"{base}/{seq}/arrived/{r}")
        store.delete_key(f"{base}/{seq}/release")
    except Exception:  # noqa: BLE001 - a store without delete_key keeps a few bytes per round
        pass


# a collective that times out says which one, and on which ranks (comm/guard.py)
from .guard import guard_collectives  # noqa: E402 - wraps the functions defined above

guard_collectives(globals(), [
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all", "all_to_all_single",
    "broadcast", "barrier", "gather", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "scatter", "send", "recv", "isend", "irecv",
])
