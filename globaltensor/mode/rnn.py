"""Recurrent layers (``nn.RNN``, ``nn.GRU``, ``nn.LSTM``) on a split batch, in global mode.

torch's C++ runs ``_VF.gru`` / ``_VF.rnn_tanh`` / ``_VF.rnn_relu`` (and ``_VF.lstm`` in float64)
as a composite of matmuls and per-step cells above the dispatcher; no aten rule can keep a split
batch through it (flattening time and batch into one dim for the input projection gathers the
batch). Yet a recurrent layer computes each sequence on its own. So global mode hands these calls
here, and when the batch is split (and the weights whole) every rank runs the layer on its own
sequences: the layer on this rank's pieces (``to_local``, differentiable: the weights' gradients
come back as partial sums, summed as a broadcast leaf's are), its outputs laid out as the input
(the batch split on the same axes). Anything else (a packed sequence, dropout between layers in
training, weights split, a placement that leaves ranks out) runs as before.
"""
from __future__ import annotations

import torch

from ..world import world
from ..layout import Layout
from ..sbp import Broadcast, Split
from ..tensor import FromLocal, GlobalTensor

_VF = torch._C._VariableFunctions


def _batch_axes(x: GlobalTensor, batch: int):
    """The placement axes splitting dim ``batch`` of ``x``, or None when another axis is not B."""
    axes = []
    for a, v in enumerate(x.sbp):
        if v == Split(batch):
            axes.append(a)
        elif not isinstance(v, Broadcast):
            return None
    return tuple(axes)


def _whole(t, placement) -> bool:
    return (isinstance(t, GlobalTensor) and t.placement == placement
            and all(isinstance(v, Broadcast) for v in t.sbp))


def _split_like(t: GlobalTensor, axes, dim: int) -> GlobalTensor:
    """``t`` laid out with dim ``dim`` split on ``axes`` and whole elsewhere (differentiable)."""
    sbp = tuple(Split(dim) if a in axes else Broadcast() for a in range(t.placement.ndim))
    return t if t.sbp == sbp else t.to_global(sbp=sbp)


def _wrap(local: torch.Tensor, like: GlobalTensor, axes, dim: int, batch: int) -> GlobalTensor:
    """This rank's output piece as a global tensor: dim ``dim`` (the batch, of global size
    ``batch``) split on ``axes``."""
    shape = list(local.shape)
    shape[dim] = batch
    sbp = tuple(Split(dim) if a in axes else Broadcast() for a in range(like.placement.ndim))
    return FromLocal.apply(local, Layout(like.placement, sbp, tuple(shape)), None)


def _plan(input, hx, params, dropout, train, batch_first):
    """(axes splitting the batch, batch dim) when the call can run on pieces, else None. The
    answer depends on layouts and arguments only: the same on every rank."""
    if not isinstance(input, GlobalTensor) or input.dim() != 3 or (dropout and train):
        return None
    placement = input.placement
    if placement.ranks.size != world.get_world_size():
        return None
    batch = 0 if batch_first else 1
    axes = _batch_axes(input, batch)
    if not axes or not all(_whole(p, placement) for p in params):
        return None
    states = hx if isinstance(hx, (tuple, list)) else (hx,)
    if not all(h is None or isinstance(h, GlobalTensor) and h.placement == placement
               for h in states):
        return None
    return axes, batch


def _on_pieces(func):
    """The handler of ``func`` (``_VF.gru`` & co): the input overload ``(input, hx, params,
    has_biases, num_layers, dropout, train, bidirectional, batch_first)``."""
    def handler(*args, **kwargs):
        if len(args) != 9 or kwargs or not isinstance(args[2], (list, tuple)):
            return func(*args, **kwargs)  # the packed overload (data, batch_sizes, hx, ...)
        input, hx, params, has_biases, layers, dropout, train, bidirectional, batch_first = args
        plan = _plan(input, hx, params, dropout, train, batch_first)
        if plan is None:
            return func(*args)
        axes, batch = plan
        lstm = isinstance(hx, (tuple, list))
        states = tuple(_split_like(h, axes, 1).to_local() for h in (hx if lstm else (hx,)))
        x = _split_like(input, axes, batch).to_local()
        outs = func(x, states if lstm else states[0], [p.to_local() for p in params],
                    has_biases, layers, dropout, train, bidirectional, batch_first)
        size = input.shape[batch]
        return (_wrap(outs[0], input, axes, batch, size),) + tuple(
            _wrap(h, input, axes, 1, size) for h in outs[1:])
    return handler


# the torch functions global mode hands here when an argument is a global tensor
HANDLERS = {f: _on_pieces(f) for f in (_VF.lstm, _VF.gru, _VF.rnn_tanh, _VF.rnn_relu)}

__all__ = ["HANDLERS"]
