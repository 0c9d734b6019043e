"""``gt.nn.load_pretrained(model, folder)``: HF safetensors weights read by pieces.

The model is laid out first (built on meta, or materialized; docs/big_models.md). Each rank
opens the folder's files (``model.safetensors``, or the shards ``model.safetensors.index.json``
names) and reads, for each of the model's tensors, only the slice of its own piece, cast to
the tensor's dtype: the file's header (safetensors: a length, a JSON of each tensor's dtype,
shape and byte range, then the bytes) says where each tensor lies, and the rows of the piece's
box are read straight into a tensor of the piece's size, so only those bytes are read and
nothing else is allocated. (safetensors' own ``get_slice`` gives a view into a torch storage
over the whole mapped file: a piece would keep a whole shard's mapping alive, counted by the
allocator as the shard's size.)
Before anything is written every rank checks the same things from the files' headers, with no
data read: every key of the model is there (a tensor tied to another one, met under its first
name, needs one), no key is extra (with ``strict``), every shape matches; and that every rank
found the folder (one all-gather of a short answer). Any of these is one GlobalTensorError on
every rank, naming the keys and shapes. A meta piece is replaced by the piece read (the same
parameter object: fully_shard's units keep holding it); a materialized one is written in place.
"""
from __future__ import annotations

import json
import math
import os
import struct

import torch

from ..comm import all_gather
from ..convert import device_for
from ..errors import GlobalTensorError
from ..tensor import GlobalTensor
from ..world import world

__all__ = ["load_pretrained"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def _files(folder: str) -> dict[str, str]:
    """key -> the file holding it; raises a plain error text (checked on every rank after)."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder!r} is not a directory")
    index = os.path.join(folder, _INDEX)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(folder, v) for k, v in weight_map.items()}
    single = os.path.join(folder, _SINGLE)
    if not os.path.exists(single):
        raise FileNotFoundError(f"{folder!r} holds neither {_SINGLE} nor {_INDEX}")
    return {k: single for k in _header(single)[0]}


def _shapes(files: dict[str, str]) -> dict[str, tuple]:
    out = {}
    for path in sorted(set(files.values())):
        for key, entry in _header(path)[0].items():
            out[key] = tuple(entry["shape"])
    return out


def _header(path: str) -> tuple[dict, int]:
    """A safetensors file's entries (key -> dtype, shape, data_offsets) and where its data
    starts; raises ValueError on a file that is not one."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path!r} is not a safetensors file (shorter than its header)")
        length = struct.unpack("<Q", head)[0]
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


_TORCH = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
class _File:
    """One safetensors file: ``box(key, slices)`` reads that box of one tensor. The rows the
    box spans (its range of dim 0) are one byte range of the file, read straight into the
    result (one ``readinto``: no mapping, no page faults); a box that also cuts later dims (a
    tensor-parallel split of dim 1) reads its rows' range, then keeps its columns (a temporary
    of those rows: at most the tensor)."""

    def __init__(self, path: str):
        self.entries, self.start = _header(path)
        self.file = open(path, "rb", buffering=0)

    def close(self) -> None:
        self.file.close()

    def box(self, key: str, box: tuple) -> torch.Tensor:
        entry = self.entries[key]
        dtype, shape = _TORCH[entry["dtype"]], tuple(entry["shape"])
        begin = self.start + entry["data_offsets"][0]
        if not shape:
            return self._read(torch.empty((), dtype=dtype), begin)
        box = tuple(box) + (slice(None),) * (len(shape) - len(box))
        first, last, _ = box[0].indices(shape[0])
        row = math.prod(shape[1:]) * dtype.itemsize
        rows = self._read(torch.empty((max(last - first, 0),) + shape[1:], dtype=dtype),
                          begin + first * row)
        rest = box[1:]
        if all(b.indices(n)[:2] == (0, n) for b, n in zip(rest, shape[1:])):
            return rows
        return rows[(slice(None),) + rest].clone()

    def _read(self, out: torch.Tensor, offset: int) -> torch.Tensor:
        view = memoryview(out.view(-1).view(torch.uint8).numpy())  # (a 0-dim one too)
        self.file.seek(offset)
        done = 0
        while done < len(view):
            n = self.file.readinto(view[done:])
            if not n:
                raise GlobalTensorError(f"load_pretrained: {self.file.name!r} ends before its "
                                        f"header says (a truncated file?)")
            done += n
        return out


def _agree(found: str | None, what: str) -> None:
    """Every rank's answer (None: fine), one all-gather; any rank's problem raises everywhere."""
    answers = all_gather(found) if world.get_world_size() > 1 else [found]
    bad = [(r, a) for r, a in enumerate(answers) if a is not None]
    if bad:
        raise GlobalTensorError(f"load_pretrained({what!r}): " + "; ".join(
            f"rank {r}: {a}" for r, a in bad))


def load_pretrained(model: torch.nn.Module, folder: str, *, strict: bool = True) -> torch.nn.Module:
    """Load the HF safetensors folder ``folder`` into ``model`` (laid out already) by pieces;
    returns ``model``. Every rank calls it. See the module docstring."""
    try:
        files = _files(str(folder))
        shapes = _shapes(files)
        problem = None
    except (OSError, ValueError, KeyError) as e:
        files, shapes, problem = {}, {}, f"{type(e).__name__}: {e}"
    _agree(problem, str(folder))
    state = model.state_dict(keep_vars=True)
    wanted, seen = {}, set()
    for name, t in state.items():
        if id(t) in seen:
            continue  # tied: loaded under its first name
        seen.add(id(t))
        wanted[name] = t
    missing = [k for k in wanted if k not in shapes]
    unexpected = [k for k in shapes if k not in state] if strict else []
    wrong = [f"{k}: the model's {list(t.shape)}, the file's {list(shapes[k])}"
             for k, t in wanted.items() if k in shapes and tuple(t.shape) != shapes[k]]
    if missing or unexpected or wrong:
        parts = ([f"missing keys {missing}"] if missing else []) + \
            ([f"unexpected keys {unexpected} (strict=False ignores them)"] if unexpected else []) + \
            ([f"shape mismatches: {'; '.join(wrong)}"] if wrong else [])
        raise GlobalTensorError(f"load_pretrained({str(folder)!r}): expected the model's keys and "
                                f"shapes, found " + "; ".join(parts) + ". Nothing was loaded.")
    by_file: dict[str, list] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    with torch.no_grad():
        for path, names in by_file.items():
            source = _File(path)
            try:
                for name in names:
                    _load_one(wanted[name], lambda box, name=name: source.box(name, box))
            finally:
                source.close()
    return model


def _load_one(t: torch.Tensor, read) -> None:
    """This rank's piece of ``t``: ``read(box)`` gives that box of the file's tensor."""
    if not isinstance(t, GlobalTensor):
        _write(t, read(()).to(t.dtype))
        return
    layout = t._layout
    if layout.is_partial:
        raise GlobalTensorError(f"load_pretrained: a tensor of shape {list(t.shape)} is a partial "
                                f"sum {layout.sbp}; lay parameters out as splits or broadcast")
    coord = layout.placement.coord_of(world.get_rank())
    device = device_for(layout.placement)
    if coord is None:  # a rank outside the tensor's placement holds nothing of it
        piece = torch.empty((0,) * t.dim(), dtype=t.dtype, device=device)
    else:
        piece = read(tuple(layout.slices(coord))).to(device=device, dtype=t.dtype)
    if t._local.is_meta:
        _materialize(t, GlobalTensor._make(piece.contiguous(), layout))
    else:
        t._local.copy_(piece)


def _write(t: torch.Tensor, value: torch.Tensor) -> None:
    if t.is_meta:
        _materialize(t, value.contiguous())
    else:
        t.copy_(value)


def _materialize(t: torch.Tensor, value: torch.Tensor) -> None:
    """``t`` (meta) takes ``value``'s data, the same Python object (a unit, an optimizer or a
    tied module holding it keeps it): torch's own ``to_empty`` way for tensor subclasses,
    ``swap_tensors`` (``.data =`` cannot move a tensor off the meta device)."""
    if isinstance(t, torch.nn.Parameter):
        value = torch.nn.Parameter(value, requires_grad=t.requires_grad)
    torch.utils.swap_tensors(t, value)
