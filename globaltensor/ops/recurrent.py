"""Recurrent layers: the LSTM kernel torch runs on CPU, and packing outside global mode.

On CPU, ``nn.LSTM`` in float32 / bfloat16 runs one aten op per layer and direction,
``mkldnn_rnn_layer`` (its backward ``mkldnn_rnn_layer_backward``); GRU, RNN and a float64 LSTM
are decomposed by torch's C++ into matmuls and pointwise ops above the dispatcher (see
docs/ops.md). The layer op's input is time-major ``(T, batch, I)`` whatever ``batch_first``
says (torch transposes first), its states ``(batch, H)``; it returns
``(output (T, batch, H), hy, cy, workspace)``, the workspace an opaque buffer for backward.

``mkldnn_rnn_layer(input, w0, w1, w2, w3, hx, cx, ...)``:

    B    B B B B B    B    -> B    B    B    B   replicated
    S(1) B B B B S(0) S(0) -> S(1) S(0) S(0) B   batch split [rnn_batch]: each rank its sequences;
                                                 the workspace left empty (its global shape,
                                                 as torch's meta kernel says)

``mkldnn_rnn_layer_backward(input, w1..w4, hx, cx, output, hy, cy, grad_output?, grad_hy?,
grad_cy?, ..., workspace) -> (grad_input, gw1..gw4, grad_hx, grad_cx)``: replicated; batch
split ``S(1) B.. S(0) S(0) S(1) S(0) S(0) S(1) S(0) S(0) B -> S(1) P P P P S(0) S(0)`` (the
weights' gradients are sums over the batch); linear in the gradients (all present ``P``, the
rest ``B``) ``-> P``. Both kernels [rnn_backward] run the forward again on their pieces for the
workspace when they were given an empty one (a batch-split forward) or split the batch
themselves (a replicated forward's workspace is for the whole batch).

``_pack_padded_sequence`` has no row: its ``batch_sizes`` must be a plain CPU tensor torch's C++
reads; global mode packs on global tensors (``globaltensor/mode/packed.py``), so reaching here means
the call ran outside it: an error saying so.
"""
from __future__ import annotations

import torch

from ..errors import GlobalTensorError
from ..sbp import Split
from .rules import Call, fit, sig, with_arg
from .registry import register

_FORWARD_ARGS = ("input", "weight0", "weight1", "weight2", "weight3", "hx_", "cx_", "reverse",
                 "batch_sizes", "mode", "hidden_size", "num_layers", "has_biases",
                 "bidirectional", "batch_first", "train")
_BACKWARD_WEIGHTS = ("weight1", "weight2", "weight3", "weight4")


def rnn_layer(call: Call):
    """``mkldnn_rnn_layer``: the module's first table."""
    return (sig("B B B B B B B -> B B B B", "rnn_layer"),
            sig("S(1) B B B B S(0) S(0) -> S(1) S(0) S(0) B", "rnn_batch"))


def rnn_layer_backward(call: Call):
    """``mkldnn_rnn_layer_backward``: replicated, batch split, linear in the gradients."""
    grads = tuple(call.is_global(n) for n in ("grad_output", "grad_hy", "grad_cy"))
    present = (True,) * 10 + grads + (True,)
    rows = [sig("B B B B B B B B B B B B B B -> B B B B B B B", "rnn_backward"),
            sig("S(1) B B B B S(0) S(0) S(1) S(0) S(0) S(1) S(0) S(0) B "
                "-> S(1) P P P P S(0) S(0)", "rnn_backward"),
            sig("B B B B B B B B B B P P P B -> P P P P P P P", "rnn_backward")]
    return fit(rows, present)


def _contiguous(largs, lkwargs):
    """The arguments with every tensor contiguous: torch's mkldnn kernels read their memory as
    contiguous without checking, and a piece may be a strided view (a transposed batch)."""
    fix = lambda v: v.contiguous() if isinstance(v, torch.Tensor) else v  # noqa: E731
    return [fix(v) for v in largs], {k: fix(v) for k, v in lkwargs.items()}


def _k_rnn_layer(ctx, largs, lkwargs):
    """The layer on the whole batch, from contiguous pieces."""
    if ctx.coord is None:
        return ctx.empties()
    largs, lkwargs = _contiguous(largs, lkwargs)
    output, hy, cy, workspace = ctx.func(*largs, **lkwargs)
    return output, hy, cy, _no_workspace(ctx) if workspace is None else workspace


def _nothing_to_run(ctx, largs, lkwargs):
    """The result of a rank with no sequence to run, or None: outside the placement, empties;
    a piece with no sequence, zeros (torch's kernel refuses an empty batch)."""
    if ctx.coord is None:
        return ctx.empties()
    if ctx.arg(largs, lkwargs, "input").numel() == 0:
        return ctx.zeros()
    return None


def _k_rnn_batch(ctx, largs, lkwargs):
    """The layer on this rank's sequences; the workspace left empty (backward remakes it)."""
    done = _nothing_to_run(ctx, largs, lkwargs)
    if done is not None:
        return done
    largs, lkwargs = _contiguous(largs, lkwargs)
    output, hy, cy, _ = ctx.func(*largs, **lkwargs)
    return output, hy, cy, _no_workspace(ctx)


def _no_workspace(ctx):
    """An empty workspace: the global shape torch's meta kernel gives (no grad mode, or a
    batch split whose backward makes its own)."""
    return torch.zeros(ctx.outs[3].layout.local_shape(ctx.coord), dtype=ctx.outs[3].dtype)


def _workspace(ctx, largs, lkwargs):
    """The forward's workspace for these pieces: the one given when it is for this very batch
    (a replicated forward's, met by a replicated backward), else the forward run again."""
    given = ctx.arg(largs, lkwargs, "workspace")
    if given is not None and given.numel() > 0 and not any(isinstance(v, Split) for v in ctx.targets[0].sbp):
        return given
    value = lambda name: ctx.arg(largs, lkwargs, name)  # noqa: E731
    args = [value(n) for n in ("input",) + _BACKWARD_WEIGHTS + ("hx_", "cx_tmp")]
    args += [value(n) for n in _FORWARD_ARGS[7:]]
    with torch.enable_grad():  # without grad mode torch's kernel makes no workspace
        return torch.ops.aten.mkldnn_rnn_layer.default(*args)[3]


def _k_rnn_backward(ctx, largs, lkwargs):
    """The layer's backward on this rank's pieces, with the workspace of these pieces."""
    done = _nothing_to_run(ctx, largs, lkwargs)
    if done is not None:
        return done
    largs, lkwargs = _contiguous(largs, lkwargs)
    args, kwargs = list(largs), dict(lkwargs)
    kwargs = with_arg(ctx.call.op, args, kwargs, "workspace", _workspace(ctx, largs, lkwargs))
    return ctx.func(*args, **kwargs)


def not_in_global_mode(call: Call):
    """No row: torch's C++ reads batch_sizes from memory (see the module's docstring)."""
    raise GlobalTensorError(
        f"{call.op}: expected pack_padded_sequence on global tensors to run in global mode, "
        f"where its batch_sizes stay the plain CPU tensor torch's C++ reads; found it called "
        f"outside. Call it inside a converted module's forward (module.to_global enters global "
        f"mode) or under `with gt.global_mode(placement):`")


register("mkldnn_rnn_layer", rule=rnn_layer, kernels={"rnn_layer": _k_rnn_layer, "rnn_batch": _k_rnn_batch})
register("mkldnn_rnn_layer_backward", rule=rnn_layer_backward,
         kernels={"rnn_backward": _k_rnn_backward})
register("_pack_padded_sequence", rule=not_in_global_mode)
