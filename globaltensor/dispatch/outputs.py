"""Outputs: their layouts (from a run of the op on meta tensors), the wrappers, and the empty
pieces of ranks outside the placement."""
from __future__ import annotations

import math

import torch
from torch.utils._pytree import tree_leaves, tree_map

from .._cache import Bounded
from ..errors import GlobalTensorError
from ..layout import Layout
from ..tensor import GlobalTensor
from ..world.simulated import wrapper_device


def _to_meta(value):
    if isinstance(value, GlobalTensor):
        return torch.empty(value._layout.shape, dtype=value.dtype, device="meta")
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    return value


def _batch_norm_eval(result, args, kwargs):
    """native_batch_norm in eval: torch's CPU (and CUDA) kernels give empty save_mean /
    save_invstd, its meta kernel (C,)-shaped ones; the layouts follow the real kernels."""
    training = args[5] if len(args) > 5 else kwargs.get("training")
    if training:
        return result
    out, mean, invstd = result
    return out, mean.new_empty((0,)), invstd.new_empty((0,))


# ops whose meta kernel gives other output shapes than the kernels that run on the pieces
_META_FIXES = {torch.ops.aten.native_batch_norm.default: _batch_norm_eval}


# (op, the arguments' shapes, dtypes and values) -> its meta result: a model runs an op on the
# same shapes many times (each layer, forward and backward), and a meta kernel written in
# Python (layer_norm, gelu, most pointwise ops) costs 0.1-0.6 ms
_RESULTS = Bounded(4096)

# argument values a key holds as they are (with their type: 1, 1.0 and True are equal keys
# but promote differently)
_PLAIN = frozenset({int, float, bool, complex, str, type(None), torch.dtype, torch.device,
                    torch.layout, torch.memory_format})


def _key_of(value):
    """``value`` as far as a meta kernel can see it (a tensor: its shape and dtype; the meta
    tensors made of it are contiguous), or None when it holds something else."""
    kind = type(value)
    if kind in _PLAIN:
        return kind, value
    if isinstance(value, GlobalTensor):
        return value._layout.shape, value.dtype
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    if kind is tuple or kind is list:
        parts = tuple(_key_of(v) for v in value)
        return None if None in parts else (kind, parts)
    return None


def meta_result(func, args, kwargs, name):
    """The op's result on meta tensors of the global shapes: output shapes and dtypes. Kept
    per (op, arguments' shapes, dtypes and values) where every argument is one of those; the
    result is only read (the outputs' structure, shapes and dtypes)."""
    parts = (_key_of(tuple(args)), _key_of(tuple(kwargs.values())))
    key = None if None in parts else (func, tuple(kwargs), parts)
    found = _RESULTS.get(key) if key is not None else None
    if found is None:
        found = _meta_result(func, args, kwargs, name)
        if key is not None:
            _RESULTS.put(key, found)
    return found


def _meta_result(func, args, kwargs, name):
    margs, mkwargs = tree_map(_to_meta, (tuple(args), kwargs))
    if mkwargs.get("device") is not None:  # a copy to a device (_to_copy): stay on meta
        mkwargs["device"] = torch.device("meta")
    try:
        result = func(*margs, **mkwargs)
        fix = _META_FIXES.get(func)
        return result if fix is None else fix(result, args, kwargs)
    except (NotImplementedError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and "meta" not in str(e).lower():
            return _real_result(func, args, kwargs, name, e)
        raise DataDependent(
            f"{name}: cannot work out the output shape without running the op (no meta "
            f"kernel: {e}); gather the inputs with x.full_tensor() and run it locally") from e


# the most bytes of stand-ins a real run may allocate to learn an output (see _real_result)
STAND_IN_BYTES = 1 << 30


def _stand_in(value):
    """A zero-filled tensor of ``value``'s global shape and dtype on its device, its dims laid
    out in the order of the piece's strides (a transposed piece stands in as a transposed
    tensor: kernels that ask for strides, such as _grouped_mm's, see what the pieces give)."""
    if not isinstance(value, torch.Tensor):
        return value
    piece = value._local if isinstance(value, GlobalTensor) else value
    shape = value._layout.shape if isinstance(value, GlobalTensor) else value.shape
    order = sorted(range(len(shape)), key=lambda d: -piece.stride(d)) if piece.dim() else []
    if order == sorted(order) or piece.dim() != len(shape):
        return torch.zeros(shape, dtype=value.dtype, device=value.device)
    laid = torch.zeros([shape[d] for d in order], dtype=value.dtype, device=value.device)
    return laid.permute([order.index(d) for d in range(len(shape))])


def _stand_in_bytes(args, kwargs) -> int:
    tensors = [v for v in tree_leaves((tuple(args), kwargs)) if isinstance(v, torch.Tensor)]
    return sum(math.prod(v.shape) * v.dtype.itemsize for v in tensors)


def _real_result(func, args, kwargs, name, meta_error):
    """The meta kernel refused the call (``meta_error``), but some meta kernels are stricter
    than the kernels that run (``_grouped_mm``'s demands bf16, its CPU kernel runs float32):
    the op runs once on zero-filled stand-ins of the global shapes and dtypes on the inputs'
    device, and its result (shapes and dtypes, kept as meta tensors) is the meta result. If
    the real kernel refuses the stand-ins too, the call is refused with torch's message: the
    same call on the full tensors fails alike."""
    size = _stand_in_bytes(args, kwargs)
    if size > STAND_IN_BYTES:
        raise GlobalTensorError(
            f"{name} on global tensors: {meta_error}{_hint(meta_error)} (torch's meta kernel "
            f"refused the global shapes and dtypes; its real kernel was not tried on stand-ins "
            f"of {size} bytes, over globaltensor.dispatch.outputs.STAND_IN_BYTES)") from meta_error
    sargs, skwargs = tree_map(_stand_in, (tuple(args), kwargs))
    try:
        result = func(*sargs, **skwargs)
    except Exception as error:  # noqa: BLE001 - the real kernel agrees with the meta one
        raise GlobalTensorError(f"{name} on global tensors: {error}{_hint(error)}") from error
    return tree_map(_as_meta, result)


def _as_meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    return value


def _hint(error) -> str:
    """How to fix a call torch's own check rejected on tensors of the global shapes."""
    text = str(error).lower()
    if any(w in text for w in ("stride", "major", "contiguous")):
        return ("; a global tensor is laid out contiguously in its global shape whatever view "
                "made it, so an op that asks for other strides cannot take it: run the op on "
                "local tensors (x.full_tensor() or x.to_local())")
    return ("; torch's own check of the op on the global shapes and dtypes: the same call on "
            "the full tensors fails alike, so fix the arguments")


class DataDependent(GlobalTensorError):
    """The op's output shape depends on its data (nonzero, unique, masked_select...): meta
    tensors cannot tell it. Dispatch runs such ops on broadcast inputs (decisions.RunToLearn)."""


# equal layouts -> one of them: the targets and output layouts of decisions (kept while the
# decisions are; forgetting one only costs a field-by-field comparison)
_CANONICAL = Bounded(50_000)


def canonical(layout: Layout) -> Layout:
    """The one object kept for layouts equal to ``layout`` (decisions are made on a cache miss,
    so this never runs on the warm path)."""
    found = _CANONICAL.get(layout)
    return found if found is not None else _CANONICAL.put(layout, layout)


class OutSpec:
    """An output's layout and dtype (its wrapper has the contiguous strides of the global
    shape: torch's default, so the wrapper is made without a strides keyword)."""

    __slots__ = ("layout", "dtype", "shape", "complex")

    def __init__(self, layout, dtype):
        self.layout, self.dtype = layout, dtype
        self.complex = dtype.is_complex  # a piece may carry the conjugate or negative bit
        self.shape = layout.shape


def out_specs(meta, outs, placement, name):
    """The output specs of a decision: the meta result's structure, each tensor an OutSpec
    with the signature's sbp (one sbp tuple per output, or one for all)."""
    count = iter(range(1 << 30))  # the output's position: a None output holds its place

    def build(m):
        if isinstance(m, torch.Tensor):
            k = next(count)
            sbp = outs[k] if len(outs) > 1 else outs[0]
            return OutSpec(canonical(Layout(placement, sbp, tuple(m.shape))), m.dtype)
        if isinstance(m, (list, tuple)):
            return type(m)(build(x) for x in m)
        if m is None:
            next(count)
            return None
        raise GlobalTensorError(
            f"{name} returns a {type(m).__name__}, not a tensor; read global values with "
            f"x.full_tensor() / x.item() and compute locally")

    return build(meta)


new_wrapper = torch.Tensor._make_wrapper_subclass


def wrap(result, outs):
    """The local result(s) wrapped as global tensors of the specs ``outs``."""
    if type(outs) is OutSpec:
        # GlobalTensor._make inline: keywords left out are parsed less (requires_grad=False
        # and the contiguous strides are the defaults)
        device = result.device if not result.is_meta else \
            wrapper_device(result, outs.layout.placement)  # gt.simulate: the job's
        out = new_wrapper(GlobalTensor, outs.shape, dtype=result.dtype, device=device)
        out._local = result
        out._layout = outs.layout
        if outs.complex:
            lazy_bits(out, result)
        return out
    if outs is None:
        return None
    return type(outs)(wrap(r, o) for r, o in zip(result, outs))


def lazy_bits(out, piece) -> None:
    """The wrapper carries its piece's conjugate and negative bits, so that torch resolves them
    (through dispatch, on the pieces) before any op that does not keep them: the bits of a
    piece alone are not seen by the ops that run on it below the wrapper."""
    if piece.is_conj():
        torch._C._set_conj(out, True)
    if piece.is_neg():
        torch._C._set_neg(out, True)


def empties(outs, pieces, kwargs=None):
    """What a rank outside the placement holds for outputs ``outs``: empty pieces of their
    ndim and dtype, on the device the op was asked for (``empty_like(x, device="cpu")`` of a
    meta-built parameter: ``Module.to_empty``), else its first input's."""
    device = (kwargs or {}).get("device")
    if device is None:
        device = pieces[0].device if pieces else torch.device("cpu")
    return _empties(outs, device)


def _empties(outs, device):
    if type(outs) is OutSpec:
        return torch.empty((0,) * len(outs.layout.shape), dtype=outs.dtype, device=device)
    if outs is None:
        return None
    return type(outs)(_empties(o, device) for o in outs)
