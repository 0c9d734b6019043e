"""``gt.nn.load_pretrained(model, folder)``: HF weights read by pieces.

The model is laid out first (built on meta, or materialized; docs/big_models.md). Each rank
opens the folder's files (``model.safetensors``, or the shards ``model.safetensors.index.json``
names; else HF's older ``pytorch_model.bin`` and its index; or one file given as ``folder``),
renames their keys as ``from_pretrained`` does (``key_mapping``, the base model's prefix), and
reads, for each of the model's tensors, only the slice of its own piece, cast to
the tensor's dtype: the file's header (safetensors: a length, a JSON of each tensor's dtype,
shape and byte range, then the bytes) says where each tensor lies. A piece that is one run of
the file's bytes (a whole tensor, or rows of it: a split of dim 0), in the file's dtype, on the
CPU, is by default (``mmap=True``) a view of a private, copy-on-write mapping of the file, as
``from_pretrained`` in one process holds its weights: nothing is read or copied until a page is
touched, and the first write to a page (the optimizer's first step) copies that page. The
mapping is not the allocator's memory; gt.memory counts the piece as the parameter it is. Any
other piece (a split of a later dim, a cast, a GPU, or ``mmap=False``) has its rows read
straight into a tensor of the piece's size (one ``readinto``), so only those bytes are read.
(safetensors' own ``get_slice`` gives a view into a torch storage over the whole mapped file,
counted by the allocator as the shard's size.) A ``torch.save``d file is mapped by
``torch.load(mmap=True)`` and each piece copied out of it. A file replaced while the model maps it (gt's
``save_pretrained`` writes a new file and renames it over the old one) leaves the mapping on
the old bytes; a file rewritten in place by another program changes what an untouched page
holds, as it does under ``from_pretrained``: load with ``mmap=False`` there.
Before anything is written every rank checks the same things from the files' headers, with no
data read: every key of the model is there (a tensor tied to another one, met under its first
name, needs one), no key is extra (with ``strict``), every shape matches; and that every rank
found the folder (one all-gather of a short answer). Any of these is one GlobalTensorError on
every rank, naming the keys and shapes. A meta piece is replaced by the piece read (the same
parameter object: fully_shard's units keep holding it); a materialized one is written in place.
"""
from __future__ import annotations

import functools
import json
import math
import mmap
import os
import re
import struct

import torch

from ..comm import all_gather
from ..convert import device_for
from ..errors import GlobalTensorError
from ..tensor import GlobalTensor
from ..world import world

__all__ = ["load_pretrained"]

_NAMES = {  # HF's file names: the one-file name and the index of the shards
    "safetensors": ("model.safetensors", "model.safetensors.index.json"),
    "torch": ("pytorch_model.bin", "pytorch_model.bin.index.json")}


def _files(folder: str) -> dict[str, str]:
    """key (the file's name for it) -> the file holding it; ``folder`` may also be one file.
    Raises a plain error text (checked on every rank after)."""
    if os.path.isfile(folder):
        return {k: folder for k in _source(folder).shapes}
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder!r} does not exist (neither a directory nor a file)")
    for single, index in _NAMES.values():  # safetensors first, as HF prefers them
        if os.path.exists(os.path.join(folder, index)):
            with open(os.path.join(folder, index)) as f:
                weight_map = json.load(f)["weight_map"]
            return {k: os.path.join(folder, v) for k, v in weight_map.items()}
        if os.path.exists(os.path.join(folder, single)):
            path = os.path.join(folder, single)
            return {k: path for k in _source(path).shapes}
    names = ", ".join(n for pair in _NAMES.values() for n in pair)
    raise FileNotFoundError(f"{folder!r} holds none of {names}")


def _shapes(files: dict[str, str]) -> dict[str, tuple]:
    out = {}
    for path in sorted(set(files.values())):
        out.update(_source(path).shapes)
    return out


def _renamed(files: dict[str, str], shapes: dict, model: torch.nn.Module, state: dict,
             key_mapping: dict | None) -> tuple[dict, dict, dict]:
    """The files' keys in the model's names: ``key_mapping`` (HF's ``from_pretrained``
    argument: regex -> replacement, applied in order to each file key), then HF's base-model
    prefix (a head model's ``model.`` added to a base model's checkpoint, or dropped the other
    way), as ``from_pretrained`` does. Returns key -> file, key -> shape, key -> the file's
    key."""
    def mapped(key: str) -> str:
        for pattern, replacement in (key_mapping or {}).items():
            key = re.sub(pattern, replacement, key)
        return key
    names = {mapped(k): k for k in shapes}
    prefix = getattr(model, "base_model_prefix", "") or ""
    if prefix and names:
        model_has = any(k.startswith(prefix + ".") for k in state)
        file_has = any(k.startswith(prefix + ".") for k in names)
        if model_has and not file_has:  # a base model's checkpoint into a model with a head
            names = {(f"{prefix}.{k}" if f"{prefix}.{k}" in state else k): v
                     for k, v in names.items()}
        elif file_has and not model_has:  # a head model's checkpoint into its base model
            names = {(k[len(prefix) + 1:] if k.startswith(prefix + ".") else k): v
                     for k, v in names.items()}
    return ({k: files[v] for k, v in names.items()}, {k: shapes[v] for k, v in names.items()},
            names)


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

    def __init__(self, path: str, mapped: bool = False):
        self.entries, self.start = _header(path)
        self.shapes = {k: tuple(e["shape"]) for k, e in self.entries.items()}
        self.path, self.mapped, self.map, self.file = path, mapped, None, None

    def close(self) -> None:
        if self.file is not None:  # a mapping lives on while a piece views it (its own fd)
            self.file.close()
        self.file = self.map = None

    def box(self, key: str, box: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The box, as a mapped view where it can be one (see the module docstring) and the
        caller wants ``dtype`` on ``device``; read into fresh memory otherwise."""
        entry = self.entries[key]
        stored, shape = _TORCH[entry["dtype"]], tuple(entry["shape"])
        begin = self.start + entry["data_offsets"][0]
        box = tuple(box) + (slice(None),) * (len(shape) - len(box))
        first, last = box[0].indices(shape[0])[:2] if shape else (0, 1)
        count = max(last - first, 0)
        row = math.prod(shape[1:]) * stored.itemsize
        whole_rows = all(b.indices(n)[:2] == (0, n) for b, n in zip(box[1:], shape[1:]))
        offset = begin + first * row
        if self.file is None:
            self.file = open(self.path, "rb", buffering=0)
        if (self.mapped and whole_rows and stored == dtype and device.type == "cpu"
                and count * row > 0 and offset % stored.itemsize == 0):
            if self.map is None:
                self.map = mmap.mmap(self.file.fileno(), 0, access=mmap.ACCESS_COPY)
            return torch.frombuffer(self.map, dtype=stored, count=count * row // stored.itemsize,
                                    offset=offset).view(((count,) + shape[1:]) if shape else ())
        rows = self._read(torch.empty(((count,) + shape[1:]) if shape else (), dtype=stored),
                          offset)
        if not whole_rows:
            rows = rows[(slice(None),) + box[1:]].clone()
        return rows.to(device=device, dtype=dtype)

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


class _TorchFile:
    """A ``torch.save``d state dict (HF's ``pytorch_model.bin``): mapped by ``torch.load(...,
    mmap=True)`` (no data read until sliced); ``box`` copies the slice, so no piece keeps the
    file's mapping alive. A file of torch's old (not zip) format cannot be mapped: it is read
    whole, once per rank."""

    def __init__(self, path: str, mapped: bool = False):
        try:
            self.state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:
            self.state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(self.state, dict):
            raise ValueError(f"{path!r} holds a {type(self.state).__name__}, not a state dict")
        self.state = {k: v for k, v in self.state.items() if isinstance(v, torch.Tensor)}
        self.shapes = {k: tuple(v.shape) for k, v in self.state.items()}

    def close(self) -> None:
        self.state = {}

    def box(self, key: str, box: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.state[key][tuple(box)].to(device=device, dtype=dtype, copy=True)


def _source(path: str, mapped: bool = False):
    """The reader of one weights file, by its kind (safetensors, or a torch.save'd dict)."""
    with open(path, "rb") as f:
        zipped = f.read(4) == b"PK\x03\x04"
    if zipped or path.endswith((".bin", ".pt", ".pth")):
        return _TorchFile(path, mapped)
    return _File(path, mapped)


def _agree(found: str | None, what: str) -> None:
    """Every rank's answer (None: fine), one all-gather; any rank's problem raises everywhere."""
    answers = all_gather(found) if world.get_world_size() > 1 else [found]
    bad = [(r, a) for r, a in enumerate(answers) if a is not None]
    if bad:
        raise GlobalTensorError(f"load_pretrained({what!r}): " + "; ".join(
            f"rank {r}: {a}" for r, a in bad))


def load_pretrained(model: torch.nn.Module, folder: str, *, strict: bool = True,
                    mmap: bool = True, key_mapping: dict | None = None) -> torch.nn.Module:
    """Load the HF folder ``folder`` (safetensors, or ``pytorch_model.bin`` files; or one such
    file) into ``model`` (laid out already) by pieces; returns ``model``. Every rank calls it.
    ``mmap=False`` reads every piece into fresh memory rather than mapping the ones it can;
    ``key_mapping`` renames the files' keys (regex -> replacement, HF's argument). See the
    module docstring."""
    state = model.state_dict(keep_vars=True)
    try:
        files = _files(str(folder))
        files, shapes, file_keys = _renamed(files, _shapes(files), model, state, key_mapping)
        problem = None
    except (OSError, ValueError, KeyError, RuntimeError, re.error) as e:
        files, shapes, file_keys, problem = {}, {}, {}, f"{type(e).__name__}: {e}"
    _agree(problem, str(folder))
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
            source = _source(path, mmap)
            try:
                for name in names:
                    _load_one(wanted[name], functools.partial(source.box, file_keys[name]))
            finally:
                source.close()
    return model


def _load_one(t: torch.Tensor, read) -> None:
    """This rank's piece of ``t``: ``read(box, dtype, device)`` gives that box of the file's
    tensor."""
    if not isinstance(t, GlobalTensor):
        _write(t, read((), t.dtype, t.device if not t.is_meta else torch.device("cpu")))
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
        piece = read(tuple(layout.slices(coord)), t.dtype, torch.device(device))
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
