"""A pipeline's stages and what crosses between them (gt.nn.Pipeline's helpers): a stage's
placement, the checks on stages and inputs, the sbp a tensor takes on the next stage, the
micro-batches of a global batch, and the tensors a simulation or a rank outside the last stage
makes in place of a received one."""
from __future__ import annotations

import torch

from .. import observe
from ..errors import GlobalTensorError
from ..layout import Layout
from ..placement import Placement
from ..sbp import PartialSum, Split, broadcast, replicated
from ..tensor import GlobalTensor
from ..world import world


def placement_of(stage: torch.nn.Module, index: int) -> Placement:
    found: dict[Placement, str] = {}
    for name, t in list(stage.named_parameters()) + list(stage.named_buffers()):
        if not isinstance(t, GlobalTensor):
            raise GlobalTensorError(
                f"stage {index}: expected every parameter and buffer to be global, found "
                f"{name!r} local; lay the stage out first: stage.to_global(placement, sbp_fn)")
        found.setdefault(t.placement, name)
    if len(found) != 1:
        what = ("no parameters or buffers" if not found else
                "tensors on several placements: " + ", ".join(f"{n!r} on {p!r}" for p, n in found.items()))
        raise GlobalTensorError(
            f"stage {index}: expected its parameters on one placement (the stage's), found "
            f"{what}; lay each stage out on its own placement with stage.to_global(placement, ...)")
    return next(iter(found))


def check_disjoint(places: list[Placement]) -> None:
    for i, a in enumerate(places):
        for b in places[i + 1:]:
            shared = sorted(set(a.flat_ranks) & set(b.flat_ranks))
            if shared:
                raise GlobalTensorError(
                    f"expected the stages' placements to be disjoint, found {a!r} and {b!r} "
                    f"sharing ranks {shared}; a rank runs one placement's stages")


def sent_sbp(sbp) -> tuple:
    """What crosses a stage boundary: partial sums reduced first (a point-to-point move needs
    whole values)."""
    return tuple(broadcast if isinstance(v, PartialSum) else v for v in sbp)


def sbp_on(sbp, placement: Placement) -> tuple:
    """The sbp a tensor takes on the next placement: the same where the grids have as many
    axes; otherwise its splits, in axis order (each dim once), on the first axes of the next
    grid and broadcast on the rest (a batch split over "dp" stays split over the next
    stage's first axis)."""
    sbp = sent_sbp(sbp)
    if len(sbp) == placement.ndim:
        return sbp
    splits = []
    for v in sbp:
        if isinstance(v, Split) and all(v.dim != w.dim for w in splits):
            splits.append(v)
    splits = splits[:placement.ndim]
    return tuple(splits) + replicated(placement.ndim - len(splits))


def blank(layout: Layout, dtype) -> GlobalTensor:
    """In a simulation: a received tensor of ``layout`` (no data), counted on its ranks."""
    piece = torch.empty(layout.local_shape_of_rank(world.get_rank()), dtype=dtype, device="meta")
    got = GlobalTensor._make(piece, layout)
    observe.storage_kind(got, "activations")
    return got


def empty_piece(layout: Layout, pipe) -> GlobalTensor:
    """A global tensor of ``layout`` on a rank outside its placement (no piece)."""
    ref = next(pipe.stages[-1].parameters())._local
    local = torch.empty(layout.local_shape_of_rank(world.get_rank()), dtype=ref.dtype,
                        device=ref.device)
    return GlobalTensor._make(local, layout)


def checked_inputs(inputs, target) -> list:
    if not inputs:
        raise GlobalTensorError("expected at least one input: pipe.step(x, target=y, loss_fn=...)")
    for name, x in [(f"input {i}", x) for i, x in enumerate(inputs)] + (
            [("target", target)] if target is not None else []):
        if not isinstance(x, GlobalTensor) or x.dim() == 0:
            raise GlobalTensorError(
                f"expected {name} to be a global tensor with a batch dim (dim 0), found "
                f"{type(x).__name__}{'' if not isinstance(x, torch.Tensor) else ' of shape ' + str(list(x.shape))}; "
                f"make it with gt.tensor(..., placement=, sbp=) or x.to_global(placement, sbp)")
    rows = {x.shape[0] for x in inputs} | ({target.shape[0]} if target is not None else set())
    if len(rows) > 1:
        raise GlobalTensorError(
            f"expected the inputs and the target to have the same number of rows (dim 0), found "
            f"{sorted(rows)}")
    return list(inputs)


def split_batch(x: GlobalTensor, placement: Placement, bounds) -> list[GlobalTensor]:
    """``x``'s rows ``lo:hi`` for each of ``bounds``, on the stage's ``placement``: x's sbp kept
    where the grids have as many axes (a data-parallel batch stays split over the same axes),
    broadcast otherwise. The batch moves once with dim 0 whole (a gather of the rows, where x
    splits them), so each micro-batch is a local slice, then split again (no communication)."""
    sbp = sbp_on(x.sbp, placement)
    whole = tuple(broadcast if isinstance(v, Split) and v.dim == 0 else v for v in sbp)
    if x.placement != placement or tuple(x.sbp) != whole:
        x = x.to_global(placement=placement, sbp=whole)
    return [x[lo:hi] if whole == sbp else x[lo:hi].to_global(sbp=sbp) for lo, hi in bounds]


def tensors_of(out, s: int) -> list:
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    for t in outs:
        if not isinstance(t, GlobalTensor):
            raise GlobalTensorError(
                f"stage {s}: expected its forward to return global tensors (one, or a tuple), "
                f"found {type(t).__name__}; the next stage takes them as its arguments")
    return outs
