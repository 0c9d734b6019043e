"""Packed sequences (``torch.nn.utils.rnn``) on global tensors, in global mode.

torch's C++ reads a PackedSequence's ``batch_sizes`` (and a padded batch's ``lengths``) from
memory, so they must be plain CPU int64 tensors, never global ones. ``pack_padded_sequence`` and
``pad_packed_sequence`` call ``torch._VF._pack_padded_sequence`` / ``_pad_packed_sequence``;
global mode (``mode.py``) hands those calls with a global tensor to the functions below, which:

- take the lengths (or batch sizes) whole as a plain CPU tensor, equal on every rank (a global
  one is read with ``full_tensor()``), and let torch itself check them and compute the batch
  sizes (or lengths) on a zero-width stand-in of the data, so a bad length fails alike on every
  rank with torch's own words;
- pack by one ``index_select`` of the rows of the padded batch (pad: one ``index_copy`` into a
  tensor of the padding value), global ops with rules and gradients: ``data`` is the global
  packed tensor, the same rows as one process's ``PackedSequence.data``.

A batch split over the ranks is therefore gathered by the packing (the packed rows of a split
batch are not a split of the packed tensor); docs/global_mode.md says so.
"""
from __future__ import annotations

import torch

from ..errors import GlobalTensorError
from ..sbp import replicated
from ..tensor import GlobalTensor


def _plain(values) -> torch.Tensor:
    """A plain CPU int64 tensor of the whole value (a global tensor is read whole: collective)."""
    if isinstance(values, GlobalTensor):
        values = values.full_tensor()
    return torch.as_tensor(values, dtype=torch.int64, device="cpu").detach()


def _rows(batch_sizes: torch.Tensor, batch: int, steps: int, batch_first: bool) -> torch.Tensor:
    """The row of every packed element in the padded batch flattened over its first two dims:
    step ``t``, sequence ``b`` is row ``b * steps + t`` (batch first) or ``t * batch + b``."""
    rows = []
    for t, n in enumerate(batch_sizes.tolist()):
        b = torch.arange(n)
        rows.append(b * steps + t if batch_first else t * batch + b)
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)


def _index(rows: torch.Tensor, like: GlobalTensor) -> GlobalTensor:
    """``rows`` as a broadcast global index on ``like``'s placement (no communication)."""
    from ..factories import tensor

    return tensor(rows, placement=like.placement, sbp=replicated(like.placement.ndim))


def _torch_says(func, *args):
    """torch's own call on plain tensors; its error becomes a GlobalTensorError (every rank
    holds the same plain arguments, so every rank raises alike)."""
    try:
        return func(*args)
    except RuntimeError as e:
        raise GlobalTensorError(f"{func.__name__} on global tensors: {e}") from None


def pack_padded(input, lengths, batch_first: bool):
    """``_pack_padded_sequence(input, lengths, batch_first) -> (data, batch_sizes)``."""
    if not isinstance(input, GlobalTensor):
        raise GlobalTensorError(
            f"_pack_padded_sequence: expected the padded batch as a global tensor when its "
            f"lengths are global, found a local {type(input).__name__}; make the input global "
            f"(x.to_global(...)) or pass the lengths as a plain list or CPU tensor")
    lengths = _plain(lengths)
    shape = tuple(input.shape)
    stand_in = torch.empty(shape[:2], dtype=torch.float32)
    _, batch_sizes = _torch_says(torch._pack_padded_sequence, stand_in, lengths, batch_first)
    batch, steps = (shape[0], shape[1]) if batch_first else (shape[1], shape[0])
    rows = _rows(batch_sizes, batch, steps, batch_first)
    data = input.flatten(0, 1).index_select(0, _index(rows, input))
    return data, batch_sizes


def pad_packed(data, batch_sizes, batch_first: bool, padding_value, total_length: int):
    """``_pad_packed_sequence(data, batch_sizes, batch_first, padding_value, total_length)
    -> (padded, lengths)``."""
    if not isinstance(data, GlobalTensor):
        raise GlobalTensorError(
            "_pad_packed_sequence: expected the packed data as a global tensor when its batch "
            f"sizes are global, found a local {type(data).__name__}; pass batch_sizes as the "
            "plain CPU tensor pack_padded_sequence returned")
    batch_sizes = _plain(batch_sizes)
    stand_in = torch.empty((data.shape[0], 0), dtype=torch.float32)
    padded, lengths = _torch_says(torch._pad_packed_sequence, stand_in, batch_sizes, False,
                                  0.0, total_length)
    steps, batch = padded.shape[0], padded.shape[1]
    rows = _rows(batch_sizes, batch, steps, False)
    flat = data.new_full((steps * batch,) + tuple(data.shape[1:]), padding_value)
    out = flat.index_copy(0, _index(rows, data), data).view((steps, batch) + tuple(data.shape[1:]))
    return (out.transpose(0, 1) if batch_first else out), lengths


# the torch functions global mode hands here when an argument is a global tensor
HANDLERS = {torch._C._VariableFunctions._pack_padded_sequence: pack_padded,
            torch._C._VariableFunctions._pad_packed_sequence: pad_packed}
