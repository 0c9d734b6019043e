"""Redistribution below autograd: plan, then execute, on this rank's piece.

``redistribute_local(piece, src, dst)`` is what ``to_global`` and dispatch call. ``moved(t,
target)`` is the same for a global tensor's piece, remembered on the tensor while it is
unchanged: backward reuses what forward moved (a saved activation is redistributed once, not
again for its gradient formula) and a gradient read by two formulas is moved once.
"""
from __future__ import annotations

import torch

from . import debug as _debug
from .world import world
from .world.simulated import simulated
from .layout import Layout
from .materialize import meta_piece
from .placement import Placement
from .plan import plan
from .runtime.agreement import check
from .runtime.execute import run
from .observe import redistribution, served_from_memo, watching
from .sbp import replicated


def whole_on_every_rank(layout: Layout) -> Layout:
    """Broadcast on every rank of the world (so full_tensor and item reach ranks outside the
    placement)."""
    size = world.get_world_size()
    placement = layout.placement
    if placement.size != size or set(placement.flat_ranks) != set(range(size)):
        placement = Placement(placement.type, list(range(size)))
    return Layout(placement, replicated(placement.ndim), layout.shape)


def redistribute_local(local: torch.Tensor, src: Layout, dst: Layout) -> torch.Tensor:
    """This rank's piece of ``dst`` from its piece of ``src``: plan, then execute (SPMD). A meta
    piece (a model built on the meta device, not yet materialized) holds no data: outside
    ``gt.simulate`` (which plays the moves) it becomes a meta piece of ``dst``, with no
    communication (docs/big_models.md)."""
    if src == dst:
        return local
    if local.is_meta and not simulated():
        return meta_piece(dst, local)
    if _debug.is_debug():  # named by the user's call (item(), print, aten.mm...): see debug.py
        check(_debug.user_call(2) or "redistribute", source=src, target=dst, dtype=local.dtype)
    if watching():  # gt.comm_trace() or torch.profiler: see observe.py
        return redistribution(run, plan(src, dst), local, world.get_rank())
    return run(plan(src, dst), local, world.get_rank())


def moved(t, target: Layout) -> torch.Tensor:
    """Global tensor ``t``'s piece laid out as ``target``, remembered on ``t`` while ``t`` is
    unchanged. Leaves that require grad (parameters) are not remembered: a gathered copy would
    outlive the step. Every rank takes the same path (the memo follows the op sequence), so
    SPMD holds."""
    if t.is_inference() or t._local.is_inference():
        # inference tensors keep no version counter: a write would go unseen, so nothing is
        # remembered (torch.inference_mode(); every rank takes this same path)
        return redistribute_local(t._local, t._layout, target)
    cache = t.__dict__.get("_gt_moves")
    # in-place ops through dispatch run below autograd, so they bump the wrapper's version, not
    # the piece's (the same on every rank); writes into to_local() bump the piece's
    version = (t._version, t._local._version)
    if cache is not None:
        hit = cache.get(target)
        if hit is not None and hit[0] == version:
            if watching():  # the policy hears of it: the op needs this move, sent earlier
                served_from_memo(plan(t._layout, target), hit[1])
            return hit[1]
    piece = redistribute_local(t._local, t._layout, target)
    if not (t.is_leaf and t.requires_grad):
        if cache is None:
            cache = t.__dict__["_gt_moves"] = {}
        cache[target] = (version, piece)
    return piece


def moved_targets(t) -> frozenset:
    """The layouts ``t`` holds remembered pieces of (whether stale or not)."""
    cache = t.__dict__.get("_gt_moves")
    return frozenset(cache) if cache else frozenset()


__all__ = ["moved", "moved_targets", "redistribute_local"]
