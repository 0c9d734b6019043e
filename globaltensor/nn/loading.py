"""``gt.nn.load_pretrained(model, folder)``: HF safetensors weights read by pieces.

The model is laid out first (built on meta, or materialized; docs/big_models.md). Each rank
opens the folder's files (``model.safetensors``, or the shards ``model.safetensors.index.json``
names) and reads, for each of the model's tensors, only the slice of its own piece
(safetensors' ``get_slice``: the bytes of that box, nothing else), cast to the tensor's dtype.
Before anything is written every rank checks the same things from the files' headers, with no
data read: every key of the model is there (a tensor tied to another one, met under its first
name, needs one), no key is extra (with ``strict``), every shape matches; and that every rank
found the folder (one all-gather of a short answer). Any of these is one GlobalTensorError on
every rank, naming the keys and shapes. A meta piece is replaced by the piece read (the same
parameter object: fully_shard's units keep holding it); a materialized one is written in place.
"""
from __future__ import annotations

import json
import os

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
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return {k: single for k in f.keys()}


def _shapes(files: dict[str, str]) -> dict[str, tuple]:
    from safetensors import safe_open

    out = {}
    for path in sorted(set(files.values())):
        with safe_open(path, "pt") as f:
            for key in f.keys():
                out[key] = tuple(f.get_slice(key).get_shape())
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
    from safetensors import safe_open

    by_file: dict[str, list] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(path, "pt") as f:
                for name in names:
                    _load_one(wanted[name], f.get_slice(name))
    return model


def _load_one(t: torch.Tensor, source) -> None:
    """This rank's piece of ``t`` from the file's slice ``source`` (only its box is read)."""
    if not isinstance(t, GlobalTensor):
        value = source[tuple(slice(0, n) for n in t.shape)] if t.dim() else source[()]
        _write(t, value.to(t.dtype))
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
        box = layout.slices(coord)
        piece = (source[box] if box else source[()]).to(device=device, dtype=t.dtype)
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
