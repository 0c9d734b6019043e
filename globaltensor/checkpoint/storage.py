"""DCP's writer, reader and load planner, extended with the checks of a checkpoint directory:
a save is staged next to its path and moved there when complete; a load checks the directory,
the keys and the shapes on every rank before DCP's first collective."""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import threading
import uuid
import warnings

import torch

from ..world import world
from ..errors import GlobalTensorError
from .hooks import ZERO_LATER


MODEL, OPTIMIZER, EXTRA = "model", "optimizer", "extra"  # the keys of a checkpoint
_STAGING, _OLD = ".saving", ".replaced-"


def dcp_modules():
    """torch.distributed.checkpoint and its state_dict helpers, imported on first use (about
    0.7 s here: ``import globaltensor`` does not pay for it)."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict as dsd

    return dcp, dsd


@contextlib.contextmanager
def single_process_quiet():
    """In a world of one (no torch.distributed) DCP warns that it assumes one process: so do
    we, and say nothing."""
    if world.is_initialized():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
        yield


def checked_path(path, verb: str) -> str:
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


def writer_of(path: str):
    """DCP's FileSystemWriter into ``path + ".saving"``, whose coordinator (rank 0) checks
    ``path`` and empties the staging directory before any rank writes (DCP's global planning
    step), and moves the complete checkpoint to ``path`` after writing ``.metadata`` (DCP's
    finish step). Both run inside DCP's own collectives: an error there reaches every rank as
    a CheckpointException, with no collective of ours added to a save."""
    dcp, _ = dcp_modules()
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


def reader_of(path: str):
    """DCP's FileSystemReader of ``path`` that reads the metadata once: for the checks before
    the load, then for DCP (an empty one when the directory has none to read)."""
    dcp, _ = dcp_modules()

    class Reader(dcp.FileSystemReader):
        metadata = None

        def read_metadata(self, *args, **kwargs):
            if self.metadata is None:
                self.metadata = super().read_metadata(*args, **kwargs)
            return self.metadata

    return Reader(path)


def planner_of(path: str, problem: str):
    """DCP's DefaultLoadPlanner that, on every rank, raises the problem this rank found with
    the directory, or a key or shape that differs, before DCP's first collective of a load
    (its plan): that collective takes the error to every rank before anything is read or
    zeroed."""
    dcp, _ = dcp_modules()

    class Planner(dcp.DefaultLoadPlanner):
        zero_later: list = []

        def create_local_plan(self):
            found = problem or _mismatch(path, self.original_state_dict, self.state_dict,
                                         self.metadata)
            if found:
                raise GlobalTensorError(found)
            self.zero_later = []
            token = ZERO_LATER.set(self.zero_later)
            try:
                return super().create_local_plan()
            finally:
                ZERO_LATER.reset(token)

        def finish_plan(self, plan):  # every rank's plan is made: now pieces may change
            for piece in self.zero_later:
                piece.zero_()
            return super().finish_plan(plan)

    return Planner()


def our_error(e: BaseException) -> BaseException:
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


def directory_problem(path: str, reader) -> str:
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
        reader.metadata = dcp_modules()[0].Metadata(state_dict_metadata={}, storage_data={})
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


def extra_placeholders(metadata) -> dict:
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
    return list(md.size) if isinstance(md, dcp_modules()[0].TensorStorageMetadata) else "a non-tensor value"


def _few(items, n: int = 4) -> str:
    head = "; ".join(items[:n])
    return head + (f"; and {len(items) - n} more" if len(items) > n else "")
