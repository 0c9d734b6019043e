"""Sharded checkpoints: global tensors in ``torch.distributed.checkpoint`` (DCP).

A global tensor tells DCP's planners which piece of the logical tensor this rank holds, through
the hooks DTensor implements (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``): its box from the ``Layout`` (global offsets and sizes). DCP does the
rest: each rank writes the pieces it owns, a piece several ranks hold (a broadcast axis) is
written once (DCP drops equal write items but one), and loading reads, for the box each rank of
the *destination* layout holds, the parts of the saved pieces that overlap it. So a checkpoint
saved on a 2x2 grid as (S(0), S(1)) loads on 2 ranks as S(1), as B, or in one process into plain
tensors, and no rank ever holds more than its own piece::

    import torch.distributed.checkpoint as dcp
    dcp.save({"model": model.state_dict()}, checkpoint_id="ckpt")       # every rank
    dcp.load({"model": other.state_dict()}, checkpoint_id="ckpt")       # any layout, any world

``save`` / ``load`` below wrap this for a model, its optimizer and extra values, with checks
that turn a bad directory, a shape or a key that differs into a ``GlobalTensorError`` on every
rank before anything is read or written.

Partial sums are reduced when saved: a tensor with a ``partial_sum`` axis is summed over it
while DCP plans the save (a reduce_scatter where a dim is free to split), so the checkpoint
holds the logical value. Loading into a ``partial_sum`` tensor gives the value to coordinate 0 of each partial
axis and zeros elsewhere (the factories' convention).
"""
from __future__ import annotations

import contextlib
import contextvars
import glob
import os
import shutil
import threading
import uuid
import warnings

import torch

from . import world
from .errors import GlobalTensorError
from .layout import Box, Layout, box_numel
from .sbp import Broadcast, PartialSum, Split
from .tensor import GlobalTensor, redistribute

__all__ = ["load", "save", "install_checkpoint_methods"]

_REDUCED = "_gt_reduced"  # a partial tensor's summed piece, from planning to writing
# pieces of partial tensors to zero once every rank's load plan is made (gt.checkpoint.load:
# a load that fails in planning leaves the destination as it was); None: zero them at once
_ZERO_LATER: contextvars.ContextVar[list | None] = contextvars.ContextVar("gt_zero_later",
                                                                         default=None)


# ------------------------------------------------------------------ the hooks DCP's planners call


def _create_write_items(self: GlobalTensor, fqn: str, obj=None) -> list:
    """The piece this rank writes (none outside the placement or for an empty piece).

    Collective for a partial tensor (every rank of the world plans every tensor of a save, in
    the same order, so the sum runs here): the summed piece waits on the tensor for
    ``__get_tensor_shard__``."""
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                       TensorProperties)
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    layout, local = _savable(self)
    box = _written_box(layout)
    if box is None:
        return []
    if local is not self._local:
        self.__dict__[_REDUCED] = local
    offsets, sizes = _chunk(box)
    return [WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                    properties=TensorProperties(dtype=self.dtype),
                                    size=torch.Size(layout.shape)))]


def _create_chunk_list(self: GlobalTensor) -> list:
    """The box this rank's piece must be filled with when loading (none outside the placement,
    for an empty piece, or off coordinate 0 of a partial axis: that piece is zeroed)."""
    self.__dict__.pop(_REDUCED, None)  # a save's leftover (its write went to another rank)
    layout = self._layout
    coord = _coord(layout)
    if coord is None:
        return []
    if any(coord[a] for a in layout.partial_axes):
        deferred = _ZERO_LATER.get()
        if deferred is None:
            self._local.zero_()
        else:
            deferred.append(self._local)
        return []
    box = layout.box(coord)
    if box_numel(box) == 0:
        return []
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    offsets, sizes = _chunk(box)
    return [ChunkStorageMetadata(offsets=offsets, sizes=sizes)]


def _get_tensor_shard(self: GlobalTensor, index) -> torch.Tensor:
    """This rank's piece: the one DCP writes when saving, the one it fills when loading."""
    reduced = self.__dict__.pop(_REDUCED, None)
    if reduced is not None:
        return reduced
    if self._layout.numel() == 0:
        return self._local.new_empty(self._layout.shape)
    return self._local


def install_checkpoint_methods() -> None:
    """Give GlobalTensor DTensor's checkpoint hooks (called once by globaltensor/__init__.py)."""
    GlobalTensor.__create_write_items__ = _create_write_items
    GlobalTensor.__create_chunk_list__ = _create_chunk_list
    GlobalTensor.__get_tensor_shard__ = _get_tensor_shard


def _savable(x: GlobalTensor) -> tuple[Layout, torch.Tensor]:
    """``x``'s layout and piece with every partial axis summed."""
    layout = x._layout
    if not layout.is_partial:
        return layout, x._local
    summed = _summed(layout)
    return summed, redistribute(x, summed)._local


def _summed(layout: Layout) -> Layout:
    """``layout`` with each partial axis split along the largest dim no later axis splits (a
    reduce_scatter: each rank keeps a part of the sum, and writes it), or broadcast where no
    such dim is left (an all_reduce)."""
    sbp = list(layout.sbp)
    for axis, v in enumerate(sbp):
        if isinstance(v, PartialSum):
            later = {w.dim for w in layout.sbp[axis + 1:] if isinstance(w, Split)}
            free = [d for d in range(layout.ndim) if d not in later and layout.shape[d] > 1]
            sbp[axis] = Split(max(free, key=lambda d: layout.shape[d])) if free else Broadcast()
    return Layout(layout.placement, tuple(sbp), layout.shape)


def _written_box(layout: Layout) -> Box | None:
    """The box this rank describes to the save planner: its own when not empty; the whole
    (empty) tensor at coordinate 0 when the tensor has no element."""
    coord = _coord(layout)
    if coord is None:
        return None
    if layout.numel() == 0:
        return tuple((0, s) for s in layout.shape) if not any(coord) else None
    box = layout.box(coord)
    return box if box_numel(box) else None


def _coord(layout: Layout):
    """This rank's grid coordinate in ``layout`` (None outside the placement). A hook that runs
    in a thread with no world (``dcp.async_save`` inside ``gt.testing.run_ranks``, whose worlds
    are per thread) cannot know its rank: refuse rather than describe another rank's piece."""
    if layout.placement.size > 1 and not world.is_initialized():
        raise GlobalTensorError(
            f"a global tensor on {layout.placement.size} ranks reached torch.distributed."
            f"checkpoint in a thread with no torch.distributed world, so its rank is unknown "
            f"(e.g. dcp.async_save inside gt.testing.run_ranks, whose worlds are per thread); "
            f"save from the rank's own thread (dcp.save), or in real processes")
    return layout.placement.coord_of(world.get_rank())


def _chunk(box: Box) -> tuple[torch.Size, torch.Size]:
    return torch.Size(lo for lo, _ in box), torch.Size(hi - lo for lo, hi in box)


# ------------------------------------------------------------ save / load for the common case

MODEL, OPTIMIZER, EXTRA = "model", "optimizer", "extra"
_STAGING, _OLD = ".saving", ".replaced-"


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
    path = _checked_path(path, "save")
    _check_arguments(model, optimizer, "save")
    state = _state_dicts(model, optimizer)
    if extra is not None:
        if not isinstance(extra, dict):
            raise GlobalTensorError(
                f"gt.checkpoint.save: expected extra= to be a dict of values, found "
                f"{type(extra).__name__}; e.g. extra={{'step': step}}")
        state[EXTRA] = extra
    dcp, _ = _dcp()
    try:
        with _single_process_quiet():
            dcp.save(state, storage_writer=_writer(path), no_dist=not world.is_initialized())
    except dcp.CheckpointException as e:
        raise _ours(e) from None


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
    dcp, _ = _dcp()
    path = _checked_path(path, "load")
    _check_arguments(model, optimizer, "load")
    reader = _reader(path)
    problem = _directory_problem(path, reader)
    fresh = optimizer is not None and not optimizer.state
    state: dict = {}
    if not problem:
        state = _state_dicts(model, optimizer)  # a fresh optimizer's state is made here
        extra = _extra_placeholders(reader.read_metadata())
        if extra:
            state[EXTRA] = extra
    try:
        with _single_process_quiet():
            dcp.load(state, storage_reader=reader, planner=_planner(path, problem),
                     no_dist=not world.is_initialized())
    except dcp.CheckpointException as e:
        if fresh:
            optimizer.state.clear()  # as it was: get_state_dict gave it zero moments
        raise _ours(e) from None
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
    _, dsd = _dcp()
    state = {}
    if model is not None:
        state[MODEL] = dsd.get_model_state_dict(model)
    if optimizer is not None:
        state[OPTIMIZER] = dsd.get_optimizer_state_dict(model, optimizer)
    return state


def _set_state_dicts(model, optimizer, state: dict) -> None:
    """Hand what DCP loaded to torch's set_state_dict helpers (the model's tensors were filled
    in place; the optimizer's state dict is applied here)."""
    _, dsd = _dcp()
    if optimizer is not None:
        dsd.set_state_dict(model, optimizer, model_state_dict=state[MODEL],
                           optim_state_dict=state[OPTIMIZER])
    elif model is not None:
        dsd.set_model_state_dict(model, state[MODEL])


# ------------------------------------------- checks; DCP's writer, reader and planner, extended


def _dcp():
    """torch.distributed.checkpoint and its state_dict helpers, imported on first use (about
    0.7 s here: ``import globaltensor`` does not pay for it)."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict as dsd

    return dcp, dsd


@contextlib.contextmanager
def _single_process_quiet():
    """In a world of one (no torch.distributed) DCP warns that it assumes one process: so do
    we, and say nothing."""
    if world.is_initialized():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
        yield


def _checked_path(path, verb: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise GlobalTensorError(
            f"gt.checkpoint.{verb}: expected a directory path (str or os.PathLike), found "
            f"{type(path).__name__}")
    return os.path.abspath(os.fspath(path))


def _save_target_problem(path: str) -> str:
    """A path save must not replace: a file, or a directory that is not a checkpoint."""
    if os.path.isdir(path) and os.listdir(path) and not _has_metadata(path):
        return (f"gt.checkpoint.save: expected {path} to be a new path or a checkpoint "
                f"directory, found a directory of other files (no {_METADATA}); save into "
                f"another path, nothing was written")
    if os.path.exists(path) and not os.path.isdir(path):
        return (f"gt.checkpoint.save: expected {path} to be a directory, found a file; save "
                f"into another path, nothing was written")
    return ""


def _writer(path: str):
    """DCP's FileSystemWriter into ``path + ".saving"``, whose coordinator (rank 0) checks
    ``path`` and empties the staging directory before any rank writes (DCP's global planning
    step), and moves the complete checkpoint to ``path`` after writing ``.metadata`` (DCP's
    finish step). Both run inside DCP's own collectives: an error there reaches every rank as
    a CheckpointException, with no collective of ours added to a save."""
    dcp, _ = _dcp()
    staging = path + _STAGING

    class Writer(dcp.FileSystemWriter):
        def prepare_global_plan(self, plans):
            problem = _save_target_problem(path) or _emptied(staging)
            if problem:
                shutil.rmtree(staging, ignore_errors=True)
                raise GlobalTensorError(problem)
            return super().prepare_global_plan(plans)

        def finish(self, metadata, results):
            super().finish(metadata, results)
            problem = _swap(staging, path)
            if problem:
                raise GlobalTensorError(problem)

    return Writer(staging)


def _reader(path: str):
    """DCP's FileSystemReader of ``path`` that reads the metadata once: for the checks before
    the load, then for DCP (an empty one when the directory has none to read)."""
    dcp, _ = _dcp()

    class Reader(dcp.FileSystemReader):
        metadata = None

        def read_metadata(self, *args, **kwargs):
            if self.metadata is None:
                self.metadata = super().read_metadata(*args, **kwargs)
            return self.metadata

    return Reader(path)


def _planner(path: str, problem: str):
    """DCP's DefaultLoadPlanner that, on every rank, raises the problem this rank found with
    the directory, or a key or shape that differs, before DCP's first collective of a load
    (its plan): that collective takes the error to every rank before anything is read or
    zeroed."""
    dcp, _ = _dcp()

    class Planner(dcp.DefaultLoadPlanner):
        zero_later: list = []

        def create_local_plan(self):
            found = problem or _mismatch(path, self.original_state_dict, self.state_dict,
                                         self.metadata)
            if found:
                raise GlobalTensorError(found)
            self.zero_later = []
            token = _ZERO_LATER.set(self.zero_later)
            try:
                return super().create_local_plan()
            finally:
                _ZERO_LATER.reset(token)

        def finish_plan(self, plan):  # every rank's plan is made: now pieces may change
            for piece in self.zero_later:
                piece.zero_()
            return super().finish_plan(plan)

    return Planner()


def _ours(e: BaseException) -> BaseException:
    """A CheckpointException carrying our GlobalTensorError (raised on a rank inside DCP's
    steps) as that error, naming the rank when not every rank found it; any other failure as
    DCP raised it."""
    failures = getattr(e, "failures", {})
    for rank, (exc, _) in sorted(failures.items()):
        if isinstance(exc, GlobalTensorError):
            alone = world.is_initialized() and len(failures) < world.get_world_size()
            return GlobalTensorError(str(exc) + (f" (on rank {rank})" if alone else ""))
    return e


def _emptied(path: str) -> str:
    """``path`` an empty directory (the leftover of an interrupted save is removed)."""
    try:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    except OSError as e:
        return f"gt.checkpoint.save: could not create {path}: {e}; nothing was written"
    return ""


def _swap(staging: str, path: str) -> str:
    """Put the complete checkpoint at ``path``; the one it replaces is deleted in the
    background (a thread the interpreter waits for at exit; a leftover of a process killed
    meanwhile is deleted by the next save to ``path``)."""
    old = f"{path}{_OLD}{uuid.uuid4().hex[:12]}"
    try:
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(staging, path)
    except OSError as e:
        return (f"gt.checkpoint.save: wrote the checkpoint to {staging} but could not move it "
                f"to {path}: {e}; move it yourself")
    _delete_later(glob.glob(glob.escape(path + _OLD) + "*"))
    return ""


def _delete_later(paths: list[str]) -> None:
    if paths:
        threading.Thread(target=lambda: [shutil.rmtree(p, ignore_errors=True) for p in paths],
                         name="gt-checkpoint-delete").start()


_METADATA = ".metadata"


def _has_metadata(path: str) -> bool:
    return os.path.isfile(os.path.join(path, _METADATA))


def _directory_problem(path: str, reader) -> str:
    """What is wrong with the checkpoint directory ``path``, "" when nothing (its metadata is
    then read, into ``reader``); when something is, the reader gets an empty metadata."""
    fix = "pass the directory gt.checkpoint.save (or dcp.save) wrote"
    if not os.path.exists(path):
        problem = f"gt.checkpoint.load: expected a checkpoint directory, found no {path}; {fix}"
    elif not os.path.isdir(path):
        problem = f"gt.checkpoint.load: expected a checkpoint directory, found a file {path}; {fix}"
    elif not _has_metadata(path):
        problem = (f"gt.checkpoint.load: expected a complete checkpoint in {path}, found no "
                   f"{_METADATA} (DCP writes it last: the save that wrote this directory did not "
                   f"finish); {fix}")
    else:
        try:
            problem = _missing_data(path, reader.read_metadata())
        except Exception as e:  # noqa: BLE001 - any failure to read it is the same bad input
            problem = (f"gt.checkpoint.load: could not read {os.path.join(path, _METADATA)} "
                       f"({type(e).__name__}: {e}); {fix}")
    if problem:
        reader.metadata = _dcp()[0].Metadata(state_dict_metadata={}, storage_data={})
    return problem


def _missing_data(path: str, metadata) -> str:
    """Every data file the metadata names exists and is long enough."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        found = os.path.getsize(file) if os.path.isfile(file) else None
        if found is None or found < size:
            what = "no such file" if found is None else f"{found} bytes"
            return (f"gt.checkpoint.load: expected a complete checkpoint in {path}, found "
                    f"{name} missing or cut short (expected at least {size} bytes, found "
                    f"{what}); copy the whole directory again or load another checkpoint")
    return ""


def _extra_placeholders(metadata) -> dict:
    """The ``extra`` values saved, as places for DCP to load them into."""
    out: dict = {}
    for key, md in metadata.state_dict_metadata.items():
        where = (metadata.planner_data or {}).get(key)
        if not where or where[0] != EXTRA:
            continue
        value = torch.empty(md.size, dtype=md.properties.dtype) if hasattr(md, "size") else None
        _set_at(out, where[1:], value)
    return out


def _set_at(root, path, value) -> None:
    """``root[path[0]][path[1]]... = value``, making dicts (str keys) and lists (int keys)."""
    node = root
    for key, following in zip(path[:-1], path[1:]):
        make = [] if isinstance(following, int) else {}
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            node[key] = make if node[key] is None else node[key]
        else:
            node.setdefault(key, make)
        node = node[key]
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


def _mismatch(path: str, state: dict, here: dict, metadata) -> str:
    """Keys missing on either side (within model / optimizer) and shapes that differ, between
    ``state`` flattened as DCP flattens it (``here``: "optimizer.state.w1.exp_avg") and the
    checkpoint's metadata."""
    saved = metadata.state_dict_metadata
    sections = tuple(f"{s}." for s in (MODEL, OPTIMIZER) if s in state)
    problems = []
    absent = [k for k in here if k not in saved]
    unexpected = [k for k in saved if k.startswith(sections) and k not in here]
    if absent:
        problems.append(f"{len(absent)} key(s) the checkpoint lacks ({_few(absent)})")
    if unexpected:
        problems.append(f"{len(unexpected)} saved key(s) nothing here takes ({_few(unexpected)})")
    shapes = [f"{k}: saved {_saved_shape(saved[k])}, here {list(v.shape)}"
              for k, v in here.items() if k in saved and isinstance(v, torch.Tensor)
              and _saved_shape(saved[k]) != list(v.shape)]
    if shapes:
        problems.append(f"{len(shapes)} shape(s) that differ ({_few(shapes)})")
    if not problems:
        return ""
    return (f"gt.checkpoint.load({path}): expected the keys and shapes of the checkpoint, found "
            + "; ".join(problems) + ". Build the model (and optimizer) as they were when saved "
            "(any placement and sbp will do), or load a subset yourself with dcp.load and "
            "DefaultLoadPlanner(allow_partial_load=True); nothing was loaded")


def _saved_shape(md):
    return list(md.size) if isinstance(md, _dcp()[0].TensorStorageMetadata) else "a non-tensor value"


def _few(items, n: int = 4) -> str:
    head = "; ".join(items[:n])
    return head + (f"; and {len(items) - n} more" if len(items) > n else "")
