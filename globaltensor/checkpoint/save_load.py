"""The user's ``gt.checkpoint.save`` / ``load``: a model, its optimizer and extra values, with
the checks that turn a bad directory, a shape or a key that differs into a ``GlobalTensorError``
on every rank before anything is read or written."""
from __future__ import annotations

import torch

from ..world import world
from ..errors import GlobalTensorError
from .storage import (EXTRA, MODEL, OPTIMIZER, checked_path, dcp_modules, directory_problem,
                      extra_placeholders, our_error, planner_of, reader_of, single_process_quiet,
                      writer_of)


def save(path, *, model: torch.nn.Module | None = None,
         optimizer: torch.optim.Optimizer | None = None, extra: dict | None = None) -> None:
    """Save ``model``'s and ``optimizer``'s state and the ``extra`` values into the directory
    ``path``; collective: every rank of the world calls it, and writes only the pieces it owns.

    The state dicts come from torch's ``get_state_dict`` (keys are the parameters' names; an
    AdamW's ``exp_avg`` / ``exp_avg_sq`` are global tensors laid out as their parameters).
    ``extra`` holds small values every rank agrees on (a step count, a config); DCP keeps one
    copy. The checkpoint is written next to ``path`` and moved there when complete, so an
    interrupted save leaves a previous checkpoint at ``path`` as it was::

        gt.checkpoint.save("ckpt", model=model, optimizer=opt, extra={"step": 5})
    """
    path = checked_path(path, "save")
    _check_arguments(model, optimizer, "save")
    state = _state_dicts(model, optimizer)
    if extra is not None:
        if not isinstance(extra, dict):
            raise GlobalTensorError(
                f"gt.checkpoint.save: expected extra= to be a dict of values, found "
                f"{type(extra).__name__}; e.g. extra={{'step': step}}")
        state[EXTRA] = extra
    dcp, _ = dcp_modules()
    try:
        with single_process_quiet():
            dcp.save(state, storage_writer=writer_of(path), no_dist=not world.is_initialized())
    except dcp.CheckpointException as e:
        raise our_error(e) from None


def load(path, *, model: torch.nn.Module | None = None,
         optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a checkpoint written by :func:`save` (or by ``dcp.save`` with the keys ``model`` /
    ``optimizer``) into ``model`` and ``optimizer``, in their current placements and sbps,
    whatever the layout and world size it was saved with; returns the saved ``extra`` dict.
    Collective: every rank of the world calls it.

    Before anything is read, every rank checks the directory (complete, no file missing or
    short) and the keys and shapes of what it loads into; a difference raises the same
    ``GlobalTensorError`` on every rank, and the model and optimizer are left as they were::

        model.to_global(placement, sbp_fn)           # any layout, any number of ranks
        opt = torch.optim.AdamW(model.parameters())
        extra = gt.checkpoint.load("ckpt", model=model, optimizer=opt)
    """
    dcp, _ = dcp_modules()
    path = checked_path(path, "load")
    _check_arguments(model, optimizer, "load")
    reader = reader_of(path)
    problem = directory_problem(path, reader)
    fresh = optimizer is not None and not optimizer.state
    state: dict = {}
    if not problem:
        state = _state_dicts(model, optimizer)  # a fresh optimizer's state is made here
        extra = extra_placeholders(reader.read_metadata())
        if extra:
            state[EXTRA] = extra
    try:
        with single_process_quiet():
            dcp.load(state, storage_reader=reader, planner=planner_of(path, problem),
                     no_dist=not world.is_initialized())
    except dcp.CheckpointException as e:
        if fresh:
            optimizer.state.clear()  # as it was: get_state_dict gave it zero moments
        raise our_error(e) from None
    _set_state_dicts(model, optimizer, state)
    return state.get(EXTRA, {})


def _check_arguments(model, optimizer, verb: str) -> None:
    if model is not None and not isinstance(model, torch.nn.Module):
        raise GlobalTensorError(
            f"gt.checkpoint.{verb}: expected model= to be a torch.nn.Module, found "
            f"{type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise GlobalTensorError(
            f"gt.checkpoint.{verb}: expected optimizer= to be a torch.optim.Optimizer, found "
            f"{type(optimizer).__name__}")
    if optimizer is not None and model is None:
        raise GlobalTensorError(
            f"gt.checkpoint.{verb}: an optimizer's state is keyed by its parameters' names, "
            f"found optimizer= without model=; pass the model too")


def _state_dicts(model, optimizer) -> dict:
    """``{"model": ..., "optimizer": ...}`` from torch's get_state_dict helpers."""
    _, dsd = dcp_modules()
    state = {}
    if model is not None:
        state[MODEL] = dsd.get_model_state_dict(model)
    if optimizer is not None:
        state[OPTIMIZER] = dsd.get_optimizer_state_dict(model, optimizer)
    return state


def _set_state_dicts(model, optimizer, state: dict) -> None:
    """Hand what DCP loaded to torch's set_state_dict helpers (the model's tensors were filled
    in place; the optimizer's state dict is applied here)."""
    _, dsd = dcp_modules()
    if optimizer is not None:
        dsd.set_state_dict(model, optimizer, model_state_dict=state[MODEL],
                           optim_state_dict=state[OPTIMIZER])
    elif model is not None:
        dsd.set_model_state_dict(model, state[MODEL])
