"""sbp_fn helpers for the usual tensor-parallel styles (DTensor's ``ColwiseParallel``,
``RowwiseParallel``, ``SequenceParallel`` and ``parallelize_module``'s plan)::

    p = gt.placement("cpu", [[0, 1], [2, 3]], axes=("dp", "tp"))
    sbp_fn = gt.nn.sbp_plan({"*.q_proj": gt.nn.colwise("tp"), "*.o_proj": gt.nn.rowwise("tp")})
    model.to_global(p, sbp_fn)        # every other tensor broadcast

Each helper is an ``sbp_fn(name, tensor) -> sbp``, as ``module.to_global`` takes; an sbp is
given by axis (``{"tp": S(0)}``: the axes not named are broadcast), so one helper serves any grid.
"""
from __future__ import annotations

import fnmatch
from typing import Callable, Mapping

import torch

from ..sbp import Split

__all__ = ["colwise", "rowwise", "sbp_plan", "sequence"]

SbpFn = Callable[[str, torch.Tensor], object]


def colwise(axis="tp") -> SbpFn:
    """Column-wise (``nn.Linear``'s output features split): weight ``(out, in)`` and bias
    ``S(0)`` on ``axis``; the output of the layer is ``S(-1)`` there."""
    def sbp_fn(name: str, tensor: torch.Tensor):
        return {axis: Split(0)} if _leaf(name) in ("weight", "bias") else None
    sbp_fn.spelling = f"gt.nn.colwise({axis!r})"
    return sbp_fn


def rowwise(axis="tp") -> SbpFn:
    """Row-wise (input features split): weight ``S(1)`` on ``axis``, bias broadcast; fed a
    ``S(-1)`` input (a colwise layer's output), the layer's output is a partial sum there."""
    def sbp_fn(name: str, tensor: torch.Tensor):
        return {axis: Split(1)} if _leaf(name) == "weight" and tensor.dim() >= 2 else None
    sbp_fn.spelling = f"gt.nn.rowwise({axis!r})"
    return sbp_fn


def sequence(axis="tp", dim: int = 1) -> dict:
    """The sbp of a sequence-parallel activation: ``S(dim)`` (the sequence dim of a
    ``(batch, seq, hidden)`` input) on ``axis``, broadcast elsewhere; ``x.to_global(p, sbp=...)``.
    Norm weights stay broadcast (the default of :func:`sbp_plan`)."""
    return {axis: Split(dim)}


def sbp_plan(plan: Mapping[str, SbpFn], default: SbpFn | None = None) -> SbpFn:
    """One ``sbp_fn`` for a model: ``plan`` maps module names or patterns (``fnmatch``:
    ``"layers.*.mlp.up_proj"``, ``"*.q_proj"``) to the helper for that module's tensors; the
    first pattern that matches a tensor's module wins; others get ``default`` (broadcast)."""
    items = list(plan.items())

    def sbp_fn(name: str, tensor: torch.Tensor):
        module = name.rpartition(".")[0]
        for pattern, style in items:
            if fnmatch.fnmatchcase(module, pattern):
                return style(name, tensor)
        return default(name, tensor) if default is not None else None
    return sbp_fn


def _leaf(name: str) -> str:
    return name.rpartition(".")[2]
