"""What a ``gt.memory()`` block finds alive when it begins (sim/memory.py's "alive at the
start"): the global tensors the calling frames reach, and every tensor of what the block was
passed or runs (modules, optimizers, containers), each counted by the tracker as its kind."""
from __future__ import annotations

import sys

import torch

from ..tensor import GlobalTensor


def scan(tracker, frame) -> None:
    """The global tensors the calling frames reach (plain tensors there are not counted)."""
    seen: set[int] = set()
    while frame is not None:
        for value in list(frame.f_locals.values()):
            visit(tracker, value, seen, "activations", 0)
        frame = frame.f_back


def visit(tracker, obj, seen: set, kind: str, depth: int, plain: bool = False) -> None:
    """Count the tensors ``obj`` holds as alive at the start: the global ones, and with
    ``plain`` every one (what gt.memory(...) was passed, a module the block runs)."""
    if id(obj) in seen or depth > 8:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        visit_tensor(tracker, obj, kind, plain)
    elif isinstance(obj, torch.nn.Module):
        visit_module(tracker, obj, seen, depth, plain)
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            visit(tracker, state, seen, "optimizer", depth + 1, plain)
        for group in obj.param_groups:
            visit(tracker, group.get("params", ()), seen, "parameters", depth + 1, plain)
    elif isinstance(obj, dict):
        for v in list(obj.values()):
            visit(tracker, v, seen, kind, depth + 1, plain)
    elif isinstance(obj, (list, tuple, set)):
        for v in list(obj):
            visit(tracker, v, seen, kind, depth + 1, plain)


def visit_tensor(tracker, t: torch.Tensor, kind: str, plain: bool) -> None:
    if not (plain or distributed(t)):
        return
    if isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad):
        tracker.found(t, "parameters")
        if t.requires_grad and not _hooked(tracker, t):  # a frozen one has no gradient
            tracker._handles.append(t.register_post_accumulate_grad_hook(tracker._gradient_ready))
        if t.grad is not None:
            tracker.found(t.grad, "gradients")
    else:
        tracker.found(t, kind)


def _hooked(tracker, t: torch.Tensor) -> bool:
    """Whether ``t`` has this block's gradient hook. Read from the tensor itself: a weak
    reference to it would make ``torch.utils.swap_tensors`` refuse it (``to_empty``,
    ``gt.nn.load_pretrained`` inside the block)."""
    hooks = getattr(t, "_post_accumulate_grad_hooks", None) or {}
    return any(h == tracker._gradient_ready for h in hooks.values())


def visit_module(tracker, module: torch.nn.Module, seen: set, depth: int,
                 plain: bool = False) -> None:
    for sub in module.modules():
        seen.add(id(sub))
        if plain:
            if sub in tracker._used:
                continue
            tracker._used.add(sub)
        unit = sub.__dict__.get("_gt_fsdp_unit")
        params = list(sub._parameters.values())
        if unit is not None:  # the pieces, whether the module holds them or gathered views
            params += [p.sharded for p in unit.params]
        for p in params:
            if isinstance(p, torch.Tensor) and id(p) not in seen:
                seen.add(id(p))
                visit_tensor(tracker, p, "parameters", plain)
        for b in sub._buffers.values():
            if isinstance(b, torch.Tensor) and (plain or distributed(b)):
                tracker.found(b, "parameters")
        if unit is not None:
            if unit.comm is not None and unit.comm.flat is not None:
                tracker.found(unit.comm.flat, "communication")
            if unit.pending is not None:
                tracker.found(unit.pending, "gradients")


def distributed(t: torch.Tensor) -> bool:
    """Whether ``t`` is a global tensor (or torch's DTensor, FSDP2's parameters): its storage
    is this rank's piece by construction, so a frame that reaches it shows what the rank holds."""
    if isinstance(t, GlobalTensor):
        return True
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, getattr(dtensor, "DTensor", ()))
