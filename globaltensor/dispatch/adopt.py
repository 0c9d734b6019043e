"""Local tensors among a global op's inputs, and the thread's global mode (mode/global_mode.py).

A non-scalar local tensor meeting a global one is an error, except where it is known to hold
the same value on every rank: inside backward (autograd's own zeros) and in global mode, where
it is taken as a broadcast value on the op's placement, and as the value ``copy_`` writes into
a global tensor.
"""
from __future__ import annotations

import hashlib
import threading

import torch
from torch.utils._pytree import tree_leaves, tree_map

from .. import debug as _debug
from ..errors import GlobalTensorError
from ..layout import Layout
from ..runtime.agreement import check
from ..sbp import replicated
from ..tensor import GlobalTensor
from .args import local_tensor_error
from .decide import op_name
from .decisions import my_coord


class _ModeStack(threading.local):
    """Each thread's stack of global modes, there from the thread's first look (so code that
    torch.compile traces sees the same attribute on every call: no recompile after the first)."""

    def __init__(self):
        self.stack = []


_state = _ModeStack()


def modes() -> list:
    """This thread's stack of global modes (innermost last)."""
    return _state.stack


def active():
    """The innermost global mode of this thread, or None."""
    stack = _state.stack
    return stack[-1] if stack else None


def agree_on_value(what: str, value: torch.Tensor) -> None:
    """GT_DEBUG: every rank holds the same ``value`` (compared by a digest), else a clear error
    naming the ranks that differ."""
    data = value.detach().contiguous().cpu().reshape(-1)
    digest = hashlib.blake2b(data.view(torch.uint8).numpy().tobytes(), digest_size=8).hexdigest()
    check(what + " taken as broadcast", value_digest=digest, shape=list(value.shape),
          dtype=value.dtype)


def _a_write_of_a_value(func, args) -> bool:
    """``g.copy_(t)``, a global tensor set from a local one: the local tensor is the value to
    write, the same on every rank (SPMD code computes it alike: HF's ``_init_weights`` copies a
    rotary ``inv_freq`` it computed into the buffer, laid out by then). With GT_DEBUG the ranks'
    values are compared."""
    return func is torch.ops.aten.copy_.default and isinstance(args[0], GlobalTensor)


def adopt_locals(func, args, kwargs, found):
    """A non-scalar local tensor among a global op's inputs is taken as a broadcast value on the
    placement of the global inputs where it is known to be one: inside backward (autograd makes
    full-size local zeros for the gradients of unused outputs), in global mode
    (mode/global_mode.py; with GT_DEBUG the ranks' values are compared) and as the source of
    ``copy_`` into a global tensor. Elsewhere it is a clear error."""
    in_mode = active() is not None
    in_backward = torch._C._current_graph_task_id() >= 0
    if not in_mode and not in_backward and not _a_write_of_a_value(func, args):
        raise local_tensor_error(found, op_name(func))
    tensors = [v for v in tree_leaves((args, kwargs)) if isinstance(v, GlobalTensor)]
    if not tensors:
        raise GlobalTensorError("internal: no global tensor among the arguments; please report this")
    placement = tensors[0]._layout.placement
    inside = my_coord(placement) is not None
    meta = tensors[0]._local.is_meta  # gt.simulate: a real local value joins as a meta piece

    def adopt(v):
        if isinstance(v, torch.Tensor) and not isinstance(v, GlobalTensor) and v.dim() != 0:
            if _debug.is_debug() and (in_mode or _a_write_of_a_value(func, args)):
                agree_on_value(f"aten.{op_name(func)}: a local input", v)
            layout = Layout(placement, replicated(placement.ndim), tuple(v.shape))
            if meta and not v.is_meta:
                v = v.to("meta")
            return GlobalTensor._make(v if inside else v.new_empty((0,) * v.dim()), layout)
        return v
    return tree_map(adopt, (list(args), kwargs))

