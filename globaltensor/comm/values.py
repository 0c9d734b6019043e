"""Value-style calls: nested structures, Python numbers, picklable objects, ``reduce_op`` names.

They never write into what the caller passed; they return the result. Tensors of one device and
dtype travel together in one collective (docs/collectives.md, "Which style a call is").
"""
from __future__ import annotations

import hashlib
import math

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from ..debug import Verbatim
from ..errors import GlobalTensorError
from ..runtime.meta import exchange_meta
from .built import all_reduce_in_place, gather_padded, gather_stacked
from .common import (BITWISE, Red, agree, kind, no_async, object_device, op_fact, peer, root, size,
                     tensor_fact, to_reduce_op)


def _is_leaf(x) -> bool:
    return x is None  # a None in the data is a value to gather, not an empty container


def _flatten(data):
    """``(leaves, paths, spec)`` of nested ``data`` (torch's pytree: dict, list, tuple,
    namedtuple, OrderedDict, defaultdict), each leaf with its path text for messages."""
    with_paths, spec = pytree.tree_flatten_with_path(data, is_leaf=_is_leaf)
    paths = [pytree.keystr(p) or "the value" for p, _ in with_paths]
    return [leaf for _, leaf in with_paths], paths, spec


def _has_tensor(data) -> bool:
    return any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(data, is_leaf=_is_leaf))


def _structure_fact(data, shapes: bool, numbers_alike: bool = False) -> str:
    """A rank-independent text of nested data: containers, keys, tensor dtypes (and shapes).
    ``numbers_alike``: a Python int and float are one kind ("number"), as the collectives see
    them (``_number_pair``: an int64 and a float64 whatever the type)."""
    def fact(v):
        if numbers_alike and isinstance(v, (int, float)) and not isinstance(v, bool):
            return Verbatim("number")
        return Verbatim(tensor_fact(v, shapes) if isinstance(v, torch.Tensor) else type(v).__name__)
    return str(pytree.tree_map(fact, data, is_leaf=_is_leaf))


def _same_structure(name: str, fact: str, group) -> None:
    """Every rank of ``group`` passes data of one structure (``fact``: containers, keys, leaf
    types; for all_reduce tensor shapes too), checked with one all-gather of 8 bytes before the
    collectives whose sizes follow from it: data that differ by rank (a dict with a key one
    rank lacks) would otherwise make collectives of different sizes, which gloo answers by
    aborting the process (SIGABRT). Every rank raises the same error, naming each rank's
    structure. Without GT_DEBUG too: the default path must not be unsafe."""
    digest = hashlib.blake2b(fact.encode(), digest_size=8).digest()
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64,
                        device=object_device(group))
    table = mine.new_empty((size(group), 1))
    gather_stacked(table, mine, group)
    if len(set(table.view(-1).tolist())) == 1:
        return
    facts = _gather_objects(fact, group)
    found = "; ".join(f"rank {r}: {f}" for r, f in enumerate(facts))
    raise GlobalTensorError(
        f"gt.comm.{name}: expected every rank to pass data of the same structure (the same keys, "
        f"containers{' and tensor shapes' if name == 'all_reduce' else ''}), found {found}. "
        f"Give every rank the same keys (e.g. fill a missing one with a zero) or gather the "
        f"differing part as an object (gt.comm.all_gather of a dict of Python values)")


def _buckets(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by (device, dtype), in order of first appearance."""
    buckets: dict = {}
    for i, t in enumerate(tensors):
        buckets.setdefault((t.device, t.dtype), []).append(i)
    return list(buckets.values())


# ---------------------------------------------------------------------------------------------
# all_reduce
# ---------------------------------------------------------------------------------------------


def all_reduce(data, op, group, async_op: bool):
    """The same structure as ``data`` (tensors and numbers as leaves), reduced with ``op``."""
    no_async(async_op, "all_reduce")
    fact = _structure_fact(data, shapes=True)
    agree("all_reduce", group, value=fact, reduce_op=op_fact(op))
    single = (isinstance(data, (bool, int, float, complex))
              or isinstance(data, torch.Tensor) and data.dim() == 0)
    if not single:  # (a number or a 0-dim tensor has one structure on every rank)
        _same_structure("all_reduce", _structure_fact(data, shapes=True, numbers_alike=True), group)
    op = to_reduce_op(op)
    leaves, paths, spec = _flatten(data)
    k = kind(op)
    buffers, ends = [], []
    for leaf, path in zip(leaves, paths):
        pair = _number_pair(leaf, k, group)
        buffers += pair if pair is not None else [_reduce_buffer(leaf, path, k, group)]
        ends.append(len(buffers))
    with torch.no_grad():
        reduced = _reduce_grouped(buffers, op, group)
    out = [_back_to_leaf(v, reduced[end - 1], k) if end - start == 1
           else _pair_back(v, reduced[start].item(), reduced[start + 1].item(), k)
           for v, start, end in zip(leaves, [0] + ends[:-1], ends)]
    return pytree.tree_unflatten(out, spec)


# the identity of each op in the int64 and float64 halves of a Python number (_number_pair)
_IDENTITY = {Red.SUM: (0, 0.0), Red.PRODUCT: (1, 1.0), Red.MIN: (2 ** 63 - 1, math.inf),
             Red.MAX: (-2 ** 63, -math.inf)}


def _number_pair(leaf, op_kind, group) -> list[torch.Tensor] | None:
    """A Python int or float travels as an int64 and a float64 value, on every rank whatever its
    type there (so the collectives match even where one rank has 3 and another 3.5): an int in
    the int64 half, reduced exactly (a float64 rounds above 2**53), a float in the other; the
    other half holds the op's identity. None for any other leaf or op."""
    if (isinstance(leaf, bool) or not isinstance(leaf, (int, float))
            or op_kind not in _IDENTITY):
        return None
    whole, frac = _IDENTITY[op_kind]
    if isinstance(leaf, int):
        if not -2 ** 63 <= leaf < 2 ** 63:
            raise GlobalTensorError(f"expected Python ints to all_reduce within int64, found "
                                    f"{leaf}; pass float({leaf}) to reduce it as a float")
        whole = leaf
    else:
        frac = leaf
    device = object_device(group)
    return [torch.tensor(whole, dtype=torch.int64, device=device),
            torch.tensor(frac, dtype=torch.float64, device=device)]


def _pair_back(leaf, whole: int, frac: float, op_kind):
    """The reduced halves of a Python number as one value of the caller's type."""
    no_whole, no_frac = _IDENTITY[op_kind]
    if frac == no_frac:
        value = whole  # only ints took part: exact
    elif whole == no_whole:
        value = frac
    else:
        combine = {Red.SUM: lambda a, b: a + b, Red.PRODUCT: lambda a, b: a * b,
                   Red.MIN: min, Red.MAX: max}[op_kind]
        value = combine(whole, frac)
    return int(round(value)) if isinstance(leaf, int) else float(value)


def _reduce_buffer(leaf, path: str, op_kind, group) -> torch.Tensor:
    """The tensor that carries ``leaf`` through the reduction (never the caller's own tensor)."""
    if isinstance(leaf, torch.Tensor):
        t = leaf.detach()
        if op_kind == Red.AVG and not (t.dtype.is_floating_point or t.dtype.is_complex):
            t = t.to(torch.get_default_dtype())  # the mean of integers is not an integer
        return t
    if isinstance(leaf, (bool, int, float, complex)):
        bitwise = op_kind in BITWISE
        wide = torch.complex128 if isinstance(leaf, complex) else torch.float64
        dtype = torch.int64 if bitwise else wide
        return torch.tensor(leaf, dtype=dtype, device=object_device(group))
    raise GlobalTensorError(
        f"expected tensors or Python numbers to all_reduce, found {type(leaf).__name__} at "
        f"{path}; all_gather or broadcast it instead, or leave it out of the collection")


def _reduce_grouped(tensors: list[torch.Tensor], op, group) -> list[torch.Tensor]:
    """Reduce many tensors with one collective per (device, dtype): flatten, concatenate, split."""
    out: list = [None] * len(tensors)
    for idx in _buckets(tensors):
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])  # a copy: the caller's data stays
        all_reduce_in_place(flat, op, group)
        for i, piece in zip(idx, flat.split([tensors[i].numel() for i in idx])):
            out[i] = piece.view(tensors[i].shape)
    return out


def _back_to_leaf(leaf, reduced: torch.Tensor, op_kind):
    """A Python number comes back as the caller's type where the op keeps it (int sum -> int)."""
    if isinstance(leaf, torch.Tensor):
        return reduced
    value = reduced.item()
    if isinstance(leaf, bool) and op_kind in (Red.MAX, Red.MIN, *BITWISE):
        return bool(value)
    if isinstance(leaf, int) and op_kind != Red.AVG:
        return int(round(value))
    return value


# ---------------------------------------------------------------------------------------------
# all_gather
# ---------------------------------------------------------------------------------------------


def all_gather(data, group, async_op: bool):
    """A tensor -> stacked on a new dim 0 (a list when shapes differ); a structure holding
    tensors -> gathered leaf by leaf; anything else -> a list with one entry per rank."""
    no_async(async_op, "all_gather")
    agree("all_gather", group, value=_structure_fact(data, shapes=False))
    if isinstance(data, torch.Tensor):
        return _gather_tensors([data], group)[0]
    if not _has_tensor(data):
        return _gather_objects(data, group)
    _same_structure("all_gather", _structure_fact(data, shapes=False, numbers_alike=True), group)
    return _gather_leaves(data, group)


def _gather_leaves(data, group):
    """Nested ``data`` holding tensors: each tensor stacked, each other leaf a per-rank list."""
    leaves, _, spec = _flatten(data)
    tensor_at = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    other_at = [i for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor)]
    out = list(leaves)
    if other_at:
        per_rank = _gather_objects([leaves[i] for i in other_at], group)
        for j, i in enumerate(other_at):
            out[i] = [values[j] for values in per_rank]
    for i, gathered in zip(tensor_at, _gather_tensors([leaves[i] for i in tensor_at], group)):
        out[i] = gathered
    return pytree.tree_unflatten(out, spec)


def _gather_objects(obj, group) -> list:
    out = [None] * size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _gather_tensors(tensors: list[torch.Tensor], group) -> list:
    """Value-style all_gather of tensors: stacked per tensor, or a list where shapes differ."""
    records = exchange_meta(tensors, group, "gt.comm.all_gather: exchanging shapes")
    shapes = [[rec[i][0] for rec in records] for i in range(len(tensors))]
    for i in range(len(tensors)):
        dtypes = [rec[i][1] for rec in records]
        if len(set(dtypes)) > 1:
            found = {r: str(d) for r, d in enumerate(dtypes)}
            raise GlobalTensorError(f"expected every rank to all_gather the same dtype, found "
                                    f"{found}; cast with .to(dtype) before gathering")
    out: list = [None] * len(tensors)
    with torch.no_grad():
        for idx in _buckets(tensors):
            _gather_bucket(tensors, shapes, idx, group, out)
    return out


def _gather_bucket(tensors, shapes, idx: list[int], group, out: list) -> None:
    """Gather tensors ``idx`` (one device and dtype) in one collective; fill ``out``."""
    if len(idx) == 1 and len(set(shapes[idx[0]])) == 1:  # the common case: one tensor, one shape
        t = tensors[idx[0]].detach().contiguous()
        out[idx[0]] = t.new_empty((size(group),) + tuple(t.shape))
        gather_stacked(out[idx[0]], t, group)
        return
    numels = [[math.prod(shapes[i][r]) for i in idx] for r in range(size(group))]
    flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
    rows = gather_padded(flat, max(sum(n) for n in numels), group)
    for i in idx:
        out[i] = []
    for r, row in enumerate(rows):
        for i, piece in zip(idx, row[: sum(numels[r])].split(numels[r])):
            out[i].append(piece.view(shapes[i][r]))
    for i in idx:
        if len(set(shapes[i])) == 1:
            out[i] = torch.stack(out[i])


# ---------------------------------------------------------------------------------------------
# objects: broadcast, send, recv
# ---------------------------------------------------------------------------------------------


def broadcast(obj, group_src: int, group, async_op: bool):
    """Rank ``group_src``'s ``obj`` (pickled) on every rank, whatever the others passed."""
    no_async(async_op, "broadcast")
    agree("broadcast", group, value="object", group_src=group_src)
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=group_src)
    return box[0]


def send(obj, group_dst: int, group):
    """Pickle ``obj`` and send it to ``group_dst`` (which gets it with ``recv(src=...)``)."""
    return dist.send_object_list([obj], group=group, group_dst=group_dst)


def recv(src: int | None, group_src: int | None, group):
    """The object that rank ``src`` (or ``group_src``) sent with ``send(obj, dst)``."""
    if src is None and group_src is None:
        raise GlobalTensorError("expected src= (or group_src=) to receive an object, found neither; "
                                "say which rank sent it")
    box = [None]
    dist.recv_object_list(box, group=group, group_src=peer(group, src, group_src, "src"))
    return box[0]
