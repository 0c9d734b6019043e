"""A layout applied to a model: the ``to_global`` / ``fully_shard`` / checkpoint / ``Pipeline``
calls, the code that spells them, and one training step of the batch on the result.

The model's **blocks** are its largest run of modules of one class (HF's
``model.model.layers``, the repeated children of an ``nn.Sequential``): the units fully_shard
wraps, what checkpointing recomputes, what pipeline stages split, and what a search keeps one
or two of (``truncated``).
"""
from __future__ import annotations

import copy
import functools
import inspect
from collections import OrderedDict

import torch

from ..errors import GlobalTensorError
from .megatron import plan_fn
from .space import Batch, Layout

__all__ = ["Blocks", "apply", "batch_sbp", "code", "checkpoint", "make_placement", "train_step"]


class Blocks:
    """Where a model's blocks live: ``parent`` (a ModuleList or Sequential) and the names of
    the children that are blocks, in order."""

    def __init__(self, model: torch.nn.Module):
        best, best_size = None, 0
        for prefix, parent in model.named_modules():
            if not isinstance(parent, (torch.nn.ModuleList, torch.nn.Sequential)):
                continue
            for run in _runs(list(parent.named_children())):
                size = sum(p.numel() for _, m in run for p in m.parameters())
                if len(run) >= 2 and size > best_size:
                    best, best_size = (prefix, parent, [n for n, _ in run]), size
        if best is None:
            raise GlobalTensorError(
                f"gt.auto_layout: expected the model to hold its blocks in an nn.ModuleList or "
                f"nn.Sequential (two or more modules of one class, as HF's model.layers), found "
                f"none in {type(model).__name__}")
        self.prefix, self.parent, self.names = best
        self.all_names = list(self.parent._modules)

    def __len__(self) -> int:
        return len(self.names)

    def modules(self, model=None) -> list[torch.nn.Module]:
        parent = self.parent if model is None else model.get_submodule(self.prefix)
        return [parent.get_submodule(n) for n in self.names]

    def truncated(self, model: torch.nn.Module, keep: int) -> torch.nn.Module:
        """A deep copy of ``model`` (on meta: no data is copied) with only its first ``keep``
        blocks; its :class:`Blocks` is ``twin.__dict__["_gt_blocks"]``."""
        twin = copy.deepcopy(model)
        parent = twin.get_submodule(self.prefix) if self.prefix else twin
        for name in self.names[keep:]:
            delattr(parent, name)
        names = self.names[:keep]  # (a Sequential keeps its children's names: plans match)
        twin.__dict__["_gt_blocks"] = self._of(parent, names)
        return twin

    def _of(self, parent, names) -> "Blocks":
        twin = object.__new__(Blocks)
        twin.prefix, twin.parent, twin.names = self.prefix, parent, list(names)
        twin.all_names = list(parent._modules)
        return twin

    @classmethod
    def of(cls, model) -> "Blocks":
        """The blocks of ``model``: those a truncation kept, or found."""
        return model.__dict__.get("_gt_blocks") or cls(model)


def _runs(children):
    """Maximal runs of consecutive children of one class."""
    run = []
    for name, m in children:
        if run and type(run[-1][1]) is not type(m):
            yield run
            run = []
        run.append((name, m))
    if run:
        yield run


def make_placement(layout: Layout, device: str = "cpu", stage: int = 0):
    """The placement of pipeline stage ``stage`` (the whole world when pp is 1): ranks
    ``arange(world).reshape(pp, dp, fsdp, tp)[stage]``, axes of degree > 1 named."""
    from ..placement import placement

    axes = layout.axes()
    per = layout.world // layout.pp
    ranks = torch.arange(stage * per, (stage + 1) * per).reshape([d for _, d in axes])
    return placement(device, ranks.tolist(), axes=tuple(n for n, _ in axes))


def batch_sbp(grid) -> tuple:
    """The batch's sbp on a stage's placement: split on dim 0 over the data axes ("dp",
    "fsdp"), broadcast over "tp"."""
    from ..sbp import broadcast, split

    return tuple(broadcast if n == "tp" else split(0) for n in grid.axes)


def checkpoint(module: torch.nn.Module) -> torch.nn.Module:
    """Activation checkpointing of ``module`` (torch.utils.checkpoint, non-reentrant): its
    forward keeps only its inputs and recomputes the rest in backward. In place; returns it.
    Its parameters keep their names (no wrapper module)."""
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
    module.forward = checkpointed
    return module


def _lay_out(module, layout: Layout, grid, plan, blocks):
    """One stage (or the whole model): the tp plan on "tp", units per block and the root on
    "fsdp", checkpointing per block."""
    from ..nn.fully_shard import fully_shard

    module.to_global(grid, plan_fn(dict(plan), "tp") if layout.tp > 1 else None)
    for block in blocks:
        if layout.checkpoint:
            checkpoint(block)
        if layout.fsdp > 1:
            fully_shard(block, grid, "fsdp", reshard_after_forward=layout.reshard_after_forward)
    if layout.fsdp > 1:
        fully_shard(module, grid, "fsdp", reshard_after_forward=layout.reshard_after_forward)
    return module


def apply(model: torch.nn.Module, layout: Layout, device: str = "cpu", blocks: Blocks = None):
    """``model`` laid out as ``layout``: the model itself, or a ``gt.nn.Pipeline`` of its
    stages when pp > 1 (an nn.Sequential cut between blocks)."""
    from ..nn.pipeline import Pipeline

    blocks = blocks or Blocks.of(model)
    if layout.pp == 1:
        return _lay_out(model, layout, make_placement(layout, device), layout.plan,
                        blocks.modules(model))
    stages, spans = stage_modules(model, layout.pp, blocks)
    for s, (stage, (lo, hi)) in enumerate(zip(stages, spans)):
        _lay_out(stage, layout, make_placement(layout, device, s), layout.plan,
                 list(stage)[lo:hi])
    return Pipeline(stages, microbatches=layout.microbatches, schedule="1f1b")


def stage_modules(model, pp: int, blocks: Blocks | None = None):
    """An nn.Sequential cut into ``pp`` stages of whole blocks (the fuller stages first): the
    modules before the blocks go to the first stage, those after to the last. Returns the
    stages (nn.Sequential each) and, per stage, the span ``(lo, hi)`` of its blocks in it."""
    blocks = blocks or Blocks.of(model)
    if not isinstance(model, torch.nn.Sequential) or blocks.prefix:
        raise GlobalTensorError(
            f"gt.auto_layout: a pipeline needs the model as an nn.Sequential of its layers "
            f"(blocks among its children), found {type(model).__name__}; leave pp at 1")
    names = list(model._modules)
    first = names.index(blocks.names[0])
    per, extra = divmod(len(blocks), pp)
    counts = [per + (s < extra) for s in range(pp)]
    stages, spans, at = [], [], 0
    for s, n in enumerate(counts):
        lo = at
        hi = first + sum(counts[:s + 1]) if s < pp - 1 else len(names)
        members = names[lo:hi]
        start = first - lo if s == 0 else 0
        # the children keep the model's names: a plan's patterns match in every stage
        stages.append(torch.nn.Sequential(OrderedDict((m, model._modules[m]) for m in members)))
        spans.append((start, start + n))
        at = hi
    return stages, spans


def train_step(target, layout: Layout, batch: Batch, ids, opt=None) -> torch.Tensor | float:
    """One step's forward and backward of ``ids`` on the laid-out ``target`` (a model or a
    Pipeline), then ``opt.step()`` and ``zero_grad`` if ``opt`` is given; returns the loss."""
    from ..nn.pipeline import Pipeline

    if isinstance(target, Pipeline):
        loss = target.step(ids, target=ids, loss_fn=batch.loss_fn or _cross_entropy)
    else:
        loss = loss_of(target, batch, ids)
        loss.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad()
    return loss


def loss_of(model, batch: Batch, ids):
    if batch.forward is not None:
        return batch.forward(model, ids)
    if batch.loss_fn is None and takes_labels(model):
        return model(input_ids=ids, labels=ids).loss
    return (batch.loss_fn or _cross_entropy)(model(ids), ids)


def takes_labels(model) -> bool:
    try:
        return "labels" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _cross_entropy(output, ids):
    return torch.nn.functional.cross_entropy(output.flatten(0, -2).float(), ids.flatten())


def code(layout: Layout, blocks: Blocks, model_name: str = "model", device: str = "cuda") -> str:
    """The calls :func:`apply` makes, for the user to paste."""
    axes = layout.axes()
    shape = ", ".join(str(d) for _, d in axes)
    names = "".join(f'"{n}", ' for n, _ in axes)
    lines = ["import torch, globaltensor as gt"]
    if layout.tp > 1:
        lines.append("plan = gt.nn.sbp_plan({")
        lines += [f'    "{p}": {_spelling(s)},' for p, s in layout.plan]
        lines.append("})")
    tp = ", plan" if layout.tp > 1 else ""
    if layout.pp == 1:
        ranks = f"torch.arange({layout.world}).reshape({shape})"
        lines.append(f'grid = gt.placement("{device}", {ranks}.tolist(), axes=({names}))')
        lines.append(f"{model_name}.to_global(grid{tp})")
        blocks_expr = f"{model_name}.{blocks.prefix}" if blocks.prefix else model_name
        lines += _units(layout, f"for block in {blocks_expr}:", model_name, "")
        return "\n".join(lines)
    _, spans = stage_modules(_Shape(blocks), layout.pp, blocks)
    per = layout.world // layout.pp
    lines.append(f"stages, spans = gt.auto.stage_modules({model_name}, {layout.pp})"
                 f"  # spans: {spans}")
    lines.append("for s, (stage, (lo, hi)) in enumerate(zip(stages, spans)):")
    ranks = f"torch.arange(s * {per}, (s + 1) * {per}).reshape({shape})"
    lines.append(f'    grid = gt.placement("{device}", {ranks}.tolist(), axes=({names}))')
    lines.append(f"    stage.to_global(grid{tp})")
    lines += _units(layout, "for block in stage[lo:hi]:", "stage", "    ")
    lines.append(f"pipe = gt.nn.Pipeline(stages, microbatches={layout.microbatches}, "
                 f'schedule="1f1b")')
    return "\n".join(lines)


class _Shape(torch.nn.Sequential):
    """Stand-in children with a model's block names, for :func:`code` to work out spans."""

    def __init__(self, blocks: Blocks):
        super().__init__()
        for name in blocks.all_names:
            self.add_module(name, torch.nn.Identity())


def _units(layout: Layout, loop: str, root: str, indent: str) -> list[str]:
    reshard = f", reshard_after_forward={layout.reshard_after_forward}"
    inner = []
    if layout.checkpoint:
        inner.append(f"{indent}    gt.auto.checkpoint(block)")
    if layout.fsdp > 1:
        inner.append(f'{indent}    gt.nn.fully_shard(block, grid, "fsdp"{reshard})')
    out = [indent + loop] + inner if inner else []
    if layout.fsdp > 1:
        out.append(f'{indent}gt.nn.fully_shard({root}, grid, "fsdp"{reshard})')
    return out


def _spelling(style) -> str:
    if isinstance(style, str):
        return f'gt.nn.{"rowwise" if style == "rowwise" else "colwise"}("tp")'
    return getattr(style, "spelling", None) or repr(style)
