"""``save_pretrained`` (HF transformers) on a global model, one tensor at a time.

HF's ``save_pretrained`` wants every tensor's full value at once (it reads storage pointers to
find tied weights, and writes each safetensors file from a dict). A rank that held the whole
model to save it would defeat sharding, so the converted module's ``save_pretrained`` writes the
files itself, in HF's layout: ``model.safetensors``, or shards ``model-0000k-of-0000n.safetensors``
of at most ``max_shard_size`` bytes (a tensor larger than that gets a file of its own, as HF
does) with ``model.safetensors.index.json``, beside ``config.json`` (and
``generation_config.json`` where the model has one). A safetensors file is a header (each
tensor's dtype, shape and byte range) and the bytes: every shape and dtype is known on every
rank without communication, so rank 0 writes the header first, then for each tensor in the
state dict's order every rank takes part in moving its full value to rank 0 (a redistribution
to ``placement([0])``; nothing reaches the other ranks), rank 0 appends its bytes and drops it.
Peak on any rank: its pieces plus the largest tensor. A tensor met twice (tied weights) is
written once, under its first name (``from_pretrained`` ties it again). Each file is written
beside its name and renamed over it when complete: a save that fails leaves the files before
it, and a model loaded from the folder by mapping (``gt.nn.load_pretrained``) keeps the old
bytes it maps. Weight files of an earlier save that this one did not write (other shard counts,
the index) are removed, as HF does.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
import struct

import torch

from ..errors import GlobalTensorError
from ..placement import Placement
from ..tensor import GlobalTensor
from ..sbp import Broadcast
from ..world import world

_B = Broadcast()

__all__ = ["full_state_dict", "save_pretrained", "save_by_pieces"]

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
           torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
           torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_INDEX = "model.safetensors.index.json"
_WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
_UNITS = {"B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20,
          "GIB": 2 ** 30}


def full_state_dict(module: torch.nn.Module, state_dict: dict | None = None) -> dict:
    """``state_dict`` (default ``module.state_dict()``) with each global tensor replaced by its
    full value (collective: every rank gets them); a tensor met twice (tied) gives one value."""
    if state_dict is None:
        state_dict = module.state_dict()
    full: dict[int, torch.Tensor] = {}
    out = {}
    for name, value in state_dict.items():
        if isinstance(value, GlobalTensor):
            if id(value) not in full:
                full[id(value)] = value.detach().full_tensor()
            value = full[id(value)]
        out[name] = value
    return out


def shard_bytes(size) -> int:
    """HF's ``max_shard_size``: an int of bytes or a text like "5GB", "200MB", "20KiB"."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMG]I?B|B)\s*", str(size).upper())
    if m is None or float(m.group(1)) <= 0:
        raise GlobalTensorError(f"save_pretrained: expected max_shard_size as bytes (an int) or a "
                                f"size like '5GB' / '200MB', found {size!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _tensors(state_dict: dict) -> list:
    """(name, tensor) to write: each tensor once (tied weights under their first name)."""
    seen, out = set(), []
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor) or id(value) in seen:
            continue
        seen.add(id(value))
        if value.dtype not in _DTYPES:
            raise GlobalTensorError(f"save_pretrained: {name} has dtype {value.dtype}, which "
                                    f"safetensors does not store; cast it first")
        out.append((name, value))
    return out


def _groups(tensors: list, limit: int) -> list:
    """The tensors cut into files of at most ``limit`` bytes (in order; a larger one alone)."""
    files, current, size = [], [], 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > limit:
            files.append(current)
            current, size = [], 0
        current.append((name, t))
        size += nbytes
    if current or not files:
        files.append(current)
    return files


def _header(group: list) -> bytes:
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in group:
        nbytes = t.numel() * t.element_size()
        entries[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                         "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the bytes start 8-aligned
    return struct.pack("<Q", len(text)) + text


def _full_on_writer(t: torch.Tensor, writer: Placement) -> torch.Tensor | None:
    """``t``'s full value on the writing rank (None elsewhere); every rank calls it."""
    if not isinstance(t, GlobalTensor):
        return t.detach() if world.get_rank() == 0 else None
    moved = t.detach().to_global(placement=writer, sbp=_B)
    return moved.to_local() if world.get_rank() == 0 else None


def save_by_pieces(state_dict: dict, directory: str, max_shard_size="50GB") -> list[str]:
    """Write ``state_dict`` (global tensors and plain ones) as HF's safetensors files in
    ``directory``, one tensor at a time through rank 0 (see the module docstring); returns the
    files written. Every rank calls it."""
    tensors = _tensors(state_dict)
    groups = _groups(tensors, shard_bytes(max_shard_size))
    n = len(groups)
    names = (["model.safetensors"] if n == 1 else
             [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)])
    writing = world.get_rank() == 0
    device = next((t.placement.type for _, t in tensors if isinstance(t, GlobalTensor)), "cpu")
    writer = Placement(device, [0])
    if writing:
        os.makedirs(directory, exist_ok=True)
    for group, file in zip(groups, names):
        path = os.path.join(directory, file)
        out = open(path + ".partial", "wb") if writing else None
        try:
            if out is not None:
                out.write(_header(group))
            for _, t in group:
                full = _full_on_writer(t, writer)
                if out is not None:
                    out.write(full.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
                del full
        finally:
            if out is not None:
                out.close()
        if out is not None:
            os.replace(path + ".partial", path)
    if writing:
        _replace_index(directory, names, groups, tensors)
    return names


def _replace_index(directory: str, names: list, groups: list, tensors: list) -> None:
    """The index of a sharded save (none for one file), and the weight files an earlier save
    left that this one did not write (HF's ``save_pretrained`` removes them too: a stale index
    or shard would be read by the next load)."""
    index_path = os.path.join(directory, _INDEX)
    if len(names) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for _, t in tensors)},
                 "weight_map": {name: file for group, file in zip(groups, names)
                                for name, _ in group}}
        with open(index_path + ".partial", "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
        os.replace(index_path + ".partial", index_path)
    elif os.path.exists(index_path):
        os.remove(index_path)
    for old in os.listdir(directory):
        if old not in names and _WEIGHTS.fullmatch(old):
            os.remove(os.path.join(directory, old))


def save_pretrained(method):
    """The converted class's ``save_pretrained``: the weights by pieces (:func:`save_by_pieces`),
    the configuration by HF (``config.save_pretrained`` on rank 0). ``state_dict=`` replaces the
    model's own; HF's other arguments that change what is written (``safe_serialization=False``,
    ``push_to_hub``) are refused rather than ignored."""
    @functools.wraps(method)
    def save_by_tensor(self, save_directory, *args, is_main_process: bool = True,
                       state_dict: dict | None = None, max_shard_size="50GB",
                       safe_serialization: bool = True, push_to_hub: bool = False, **kwargs):
        if args or not safe_serialization or push_to_hub:
            raise GlobalTensorError(
                "save_pretrained of a global model writes safetensors files by pieces; "
                "positional options, safe_serialization=False and push_to_hub are not "
                "supported (save, then push the folder)")
        save_by_pieces(self.state_dict() if state_dict is None else state_dict, save_directory,
                       max_shard_size)
        if bool(is_main_process) and world.get_rank() == 0:
            self.config.save_pretrained(save_directory)
            generation = getattr(self, "generation_config", None)
            if generation is not None and getattr(self, "can_generate", lambda: False)():
                generation.save_pretrained(save_directory)
    return save_by_tensor
