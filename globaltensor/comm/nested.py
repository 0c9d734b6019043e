"""Nested data for value-style calls: flatten dict/list/tuple to leaves with paths, rebuild it.

A spec is ``None`` for a leaf, else ``(container type, keys or None, child specs)``.
"""
from __future__ import annotations

import torch

from .common import tensor_fact


def flatten(x) -> tuple:
    """``(spec, leaves, paths)`` of nested ``x``: its leaves in order, each with its path text."""
    leaves: list = []
    paths: list[str] = []
    spec = _walk(x, leaves, paths, "")
    return spec, leaves, paths


def _walk(x, leaves: list, paths: list, path: str):
    if isinstance(x, dict):
        keys = list(x)
        return (type(x), keys, [_walk(x[k], leaves, paths, f"{path}[{k!r}]") for k in keys])
    if isinstance(x, (list, tuple)):
        return (type(x), None, [_walk(v, leaves, paths, f"{path}[{i}]") for i, v in enumerate(x)])
    leaves.append(x)
    paths.append(path or "the value")
    return None


def unflatten(spec, it):
    """The structure ``spec`` describes, its leaves taken in order from iterator ``it``."""
    if spec is None:
        return next(it)
    kind, keys, children = spec
    values = [unflatten(c, it) for c in children]
    if keys is not None:
        try:
            return kind(zip(keys, values))
        except TypeError:  # e.g. defaultdict wants its factory first
            return dict(zip(keys, values))
    if hasattr(kind, "_fields"):  # namedtuple
        return kind(*values)
    return kind(values)


def has_tensor(x) -> bool:
    return any(isinstance(v, torch.Tensor) for v in flatten(x)[1])


def structure_fact(data, shapes: bool) -> str:
    """A rank-independent text of nested data: containers, keys, tensor dtypes (and shapes)."""
    spec, leaves, _ = flatten(data)
    it = iter(tensor_fact(v, shapes) if isinstance(v, torch.Tensor) else type(v).__name__
              for v in leaves)
    return _spec_text(spec, it)


def _spec_text(spec, leaves) -> str:
    if spec is None:
        return next(leaves)
    kind, keys, children = spec
    inner = [_spec_text(c, leaves) for c in children]
    if keys is not None:
        inner = [f"{k!r}: {v}" for k, v in zip(keys, inner)]
    return f"{kind.__name__}({', '.join(inner)})"
