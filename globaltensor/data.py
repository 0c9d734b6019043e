"""``gt.data.loader``: global batches from a map-style dataset, each rank reading its own piece.

The order of the samples depends on ``(seed, epoch)`` and the dataset's length only: global
batch ``i`` of an epoch holds the samples ``order[i * batch_size:(i + 1) * batch_size]``,
whatever the world size or the layout (unlike ``DistributedSampler``, whose order depends on
the number of replicas). A rank reads only the samples of its piece of dim 0 (the ranks of a
broadcast axis read the same ones), collates them, and wraps them as its piece: no
communication. ``state_dict()`` is a batch count, so a job resumes mid-epoch on any world size::

    loader = gt.data.loader(dataset, placement, batch_size=32, sbp=gt.sbp.split(0), seed=0)
    for epoch in range(3):
        for x, y in loader:        # global tensors of 32 samples, S(0)
            ...

``items=`` (a function of a dataset index: the items that sample adds to a mean, e.g. its labels
that are not ignored) makes ``loader.num_items`` the global batch's count, known on every rank
without communication (every rank knows every index of the batch). Given to a loss as its
divisor (HF's ``num_items_in_batch=``), the mean over a split batch needs no collective in the
middle of the forward: the loss stays a partial sum until it is read (docs/user_guide.md, "Data").
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
import torch.utils.data
from torch.utils._pytree import tree_flatten, tree_map

from .world import world
from .convert import check_placement, device_for
from .errors import GlobalTensorError
from .layout import Layout
from .placement import Placement
from .sbp import Broadcast, PartialSum, Split, format_sbp, normalize
from .tensor import GlobalTensor

__all__ = ["GlobalLoader", "loader", "sample_order"]


def sample_order(length: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The dataset indices of one epoch, in order: ``randperm(length)`` drawn from a generator
    seeded with ``seed + epoch`` (as ``DistributedSampler``), or ``0..length-1``."""
    if not shuffle:
        return list(range(length))
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(length, generator=generator).tolist()


class GlobalLoader:
    """What :func:`loader` returns: iterable once per epoch, with ``len``, ``set_epoch``,
    ``state_dict`` and ``load_state_dict``."""

    def __init__(self, dataset, placement: Placement, batch_size: int, sbp, shuffle: bool,
                 seed: int, drop_last: bool, collate_fn: Callable | None, loader_kwargs: dict,
                 items: Callable[[int], int] | None = None):
        self.dataset = _checked_dataset(dataset)
        self.placement = check_placement(placement)
        self.sbp = _checked_sbp(sbp, self.placement)
        self.batch_size = _checked_batch_size(batch_size)
        self.shuffle, self.drop_last = _checked_flag("shuffle", shuffle), _checked_flag(
            "drop_last", drop_last)
        self.seed = int(seed)
        self.collate_fn = collate_fn or torch.utils.data.default_collate
        self.loader_kwargs = loader_kwargs
        self.epoch = 0
        self.batch = 0  # global batches of this epoch already yielded
        if items is not None and not callable(items):
            raise GlobalTensorError(
                f"gt.data.loader: expected items= to be a function of a dataset index giving "
                f"the items that sample adds to a mean, found {type(items).__name__}; e.g. "
                f"items=lambda i: int((dataset[i]['labels'][1:] != -100).sum())")
        self.items = items
        self.num_items: int | None = None  # the last batch's count of items (with items=)

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at its first batch (the loader also counts epochs by itself)."""
        self.epoch, self.batch = int(epoch), 0

    def state_dict(self) -> dict:
        """Where the loader is: the next global batch, by epoch and index (no rank's data)."""
        return {"epoch": self.epoch, "batch": self.batch, "seed": self.seed,
                "batch_size": self.batch_size, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "length": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        """Resume where ``state_dict()`` was taken, on any world size or layout; the sampling
        options must be the ones it was taken with (else the order would differ)."""
        for key in ("seed", "batch_size", "shuffle", "drop_last", "length"):
            mine = len(self.dataset) if key == "length" else getattr(self, key)
            if key in state and state[key] != mine:
                raise GlobalTensorError(
                    f"loader.load_state_dict: the state was taken with {key}={state[key]!r}, "
                    f"this loader has {key}={mine!r}; the order of the batches would differ. "
                    f"Build the loader with {key}={state[key]!r} to resume")
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])

    def __iter__(self) -> Iterator[Any]:
        order = sample_order(len(self.dataset), self.shuffle, self.seed, self.epoch)
        batches = [order[i * self.batch_size:(i + 1) * self.batch_size] for i in range(len(self))]
        pieces = [_piece_range(len(b), self.placement, self.sbp) for b in batches]
        start = self.batch
        reads = _reader(self, [_indices_to_read(b, r) for b, r in zip(batches, pieces)][start:])
        for batch, piece, local in zip(batches[start:], pieces[start:], reads):
            self.batch += 1
            if self.items is not None:
                self.num_items = _count_items(self.items, batch)
            yield _wrap(local, len(batch), piece, self)
        self.epoch, self.batch = self.epoch + 1, 0


def loader(dataset, placement: Placement, batch_size: int, sbp=None, *, shuffle: bool = True,
           seed: int = 0, drop_last: bool = False, collate_fn: Callable | None = None,
           items: Callable[[int], int] | None = None, **loader_kwargs) -> GlobalLoader:
    """Global batches of ``batch_size`` samples of a map-style ``dataset`` (``len`` and
    ``dataset[i]``), laid out on ``placement`` with ``sbp`` (default ``S(0)`` on every axis: the
    batch split over all ranks; ``B`` on an axis: its ranks read the same samples; a named
    ``{"dp": S(0)}`` on named axes; ``S(d)`` for ``d > 0`` splits the collated batch's dim d).

    Each rank reads and collates only the samples of its piece, with ``collate_fn`` (torch's
    ``default_collate`` by default); tensors in the collated batch become global tensors,
    anything else (strings) stays this rank's samples. ``loader_kwargs`` (``num_workers``,
    ``pin_memory``...) go to the ``torch.utils.data.DataLoader`` that reads them.

    ``items``: a function of a dataset index giving the items that sample adds to a mean (its
    labels that are not ignored); ``loader.num_items`` is then the count of the batch last
    yielded, the same int on every rank, computed without communication. Pass it as the mean's
    divisor (HF: ``model(ids, labels=labels, num_items_in_batch=loader.num_items)``) and the
    forward has no collective (a mean with ignored labels otherwise all-reduces its count).

    >>> loader = gt.data.loader(dataset, gt.placement.all("cpu"), batch_size=8, seed=0)
    >>> x, y = next(iter(loader))      # the same 8 samples whatever the world size
    """
    if sbp is None:
        sbp = (Split(0),) * placement.ndim if isinstance(placement, Placement) else Split(0)
    return GlobalLoader(dataset, placement, batch_size, sbp, shuffle, seed, drop_last,
                        collate_fn, loader_kwargs, items)


def _count_items(items: Callable[[int], int], batch: list[int]) -> int:
    """The items of a global batch: ``items(i)`` summed over its indices (on every rank)."""
    total = 0
    for index in batch:
        n = items(index)
        if isinstance(n, torch.Tensor) and n.numel() == 1:
            n = n.item()
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise GlobalTensorError(
                f"gt.data.loader: expected items({index}) to be an int >= 0 (the items sample "
                f"{index} adds to a mean), found {n!r}")
        total += n
    return total


def _checked_sbp(sbp, placement: Placement) -> tuple:
    values = normalize(sbp, placement.ndim, placement.axes)
    if any(isinstance(v, PartialSum) for v in values):
        raise GlobalTensorError(
            f"gt.data.loader: expected sbp of split(dim) or broadcast per placement axis, found "
            f"{format_sbp(values)}; a batch read from a dataset is no partial sum. Use S(0) to "
            f"split the batch, B to give the ranks of an axis the same samples")
    return values


def _checked_dataset(dataset):
    """A map-style dataset (``len`` and ``dataset[i]``): the order is drawn over its indices."""
    iterable = isinstance(dataset, torch.utils.data.IterableDataset)
    if iterable or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        kind = "an IterableDataset" if iterable else "no __len__ and __getitem__"
        raise GlobalTensorError(
            f"gt.data.loader: expected a map-style dataset (__len__ and __getitem__, sample i "
            f"is dataset[i]: the order of a batch is drawn over the indices), found "
            f"{type(dataset).__name__}, {kind}. Give it __len__ and __getitem__, or load its "
            f"samples into a list: gt.data.loader(list(samples), ...); a stream too large for "
            f"that: read it with torch's DataLoader on each rank and make each batch global "
            f"with gt.from_local(batch, placement, gt.sbp.split(0))")
    return dataset


def _checked_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise GlobalTensorError(
            f"gt.data.loader: expected {name}=True or {name}=False, found {name}={value!r} "
            f"({type(value).__name__}); pass a bool (a string such as \"no\" is truthy)")
    return value


def _checked_batch_size(batch_size) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise GlobalTensorError(
            f"gt.data.loader: expected a positive int batch_size (samples per global batch), "
            f"found {batch_size!r}")
    return batch_size


def _piece_range(n: int, placement: Placement, sbp) -> tuple[int, int] | None:
    """This rank's [start, stop) of a batch of ``n`` samples (dim 0), or None outside."""
    coord = placement.coord_of(world.get_rank())
    if coord is None:
        return None
    dim0 = tuple(v if isinstance(v, Split) and v.dim == 0 else Broadcast() for v in sbp)
    return Layout(placement, dim0, (n,)).box(coord)[0]


def _indices_to_read(batch: list[int], piece) -> list[int]:
    """The samples this rank reads; an empty piece reads the batch's first sample (for the
    dtypes and sample shapes of its empty piece; the rows are dropped in ``_wrap``)."""
    if piece is None or piece[0] == piece[1]:
        return batch[:1]
    return batch[piece[0]:piece[1]]


def _reader(owner: GlobalLoader, index_lists: list[list[int]]):
    """The collated samples of each index list, through torch's DataLoader."""
    return iter(torch.utils.data.DataLoader(owner.dataset, batch_sampler=index_lists,
                                            collate_fn=owner.collate_fn, **owner.loader_kwargs))


def _wrap(local, n: int, piece, owner: GlobalLoader):
    """Each tensor of the collated ``local`` samples -> the global tensor of the batch."""
    empty = piece is None or piece[0] == piece[1]
    _check_split_dims(local, owner.sbp)

    def one(t):
        if not isinstance(t, torch.Tensor):
            return t[:0] if empty and isinstance(t, (list, tuple)) else t
        return _global_batch(t[:0] if empty else t, n, owner)
    return tree_map(one, local)


def _check_split_dims(local, sbp) -> None:
    """A split dim that no tensor of the collated batch has would broadcast them all: the
    batch would come out whole on every rank. The same samples' shapes on every rank: every
    rank raises alike, at the first batch."""
    shapes = [list(t.shape) for t in tree_flatten(local)[0] if isinstance(t, torch.Tensor)]
    most = max((len(s) for s in shapes), default=0)
    for axis, v in enumerate(sbp):
        if isinstance(v, Split) and v.dim >= most:
            raise GlobalTensorError(
                f"gt.data.loader: sbp {format_sbp(sbp)} splits dim {v.dim} on placement axis "
                f"{axis}, found a collated batch whose tensors have at most {most} dims (shapes "
                f"{shapes}, dim 0 the batch); no tensor would be split, every rank would get it "
                f"whole. Pick a dim below {most} (S(0): the batch dim; S(1): the samples' first "
                f"dim), or B for the same samples on that axis")


def _global_batch(t: torch.Tensor, n: int, owner: GlobalLoader) -> GlobalTensor:
    if t.dim() == 0:
        raise GlobalTensorError(
            "gt.data.loader: expected collate_fn to stack samples on a batch dim 0, found a "
            "0-dim tensor; return tensors whose dim 0 is the batch")
    placement = owner.placement
    # a split of a dim this tensor lacks (labels next to sequence-split inputs): broadcast
    sbp = tuple(Broadcast() if isinstance(v, Split) and v.dim >= t.dim() else v
                for v in owner.sbp)
    layout = Layout(placement, sbp, (n,) + tuple(t.shape[1:]))
    coord = placement.coord_of(world.get_rank())
    if coord is None:
        local = t.new_empty((0,) * t.dim())
    else:  # t holds this rank's rows; other split dims are sliced here
        rows = layout.box(coord)[0]
        local = t[(slice(0, rows[1] - rows[0]),) + layout.slices(coord)[1:]]
    return GlobalTensor(local.to(device_for(placement)).contiguous(), layout)
