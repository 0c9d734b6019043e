"""The layouts ``gt.auto_layout`` chooses among, and the bounds that prune them. Pure: no
communication, no rank; a :class:`Layout` is a value.

A layout is a factorization of the world into pipeline stages x data x fully_shard x tensor
axes (ranks ``arange(world).reshape(pp, dp, fsdp, tp)``: tensor-parallel ranks adjacent, as
torchtitan and Megatron order them, so the "tp" groups stay inside a node), with, where they
apply: fully_shard units per block and the root on "fsdp" and ``reshard_after_forward``,
activation checkpointing per block, micro-batches of a 1F1B pipeline, and the tensor-parallel
plan (found from the model, ``megatron.py``, or the user's ``sbp_plan``) on "tp".
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Callable

from ..errors import GlobalTensorError

__all__ = ["Batch", "Links", "Layout", "enumerate_layouts", "static_bound", "time_bound"]


@dataclass(frozen=True)
class Layout:
    """One candidate: the degrees, and the options that apply to them."""

    pp: int = 1
    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    reshard_after_forward: bool = True  # fully_shard's, where fsdp > 1
    checkpoint: bool = False  # activation checkpointing of every block
    microbatches: int = 1  # a pipeline's (pp > 1), 1F1B
    plan: tuple = field(default=(), compare=False, repr=False)  # ((pattern, style), ...) on "tp"

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.fsdp * self.tp

    def axes(self) -> tuple[tuple[str, int], ...]:
        """The stage grid's axes of degree > 1, in rank order ("dp", "fsdp", "tp")."""
        named = (("dp", self.dp), ("fsdp", self.fsdp), ("tp", self.tp))
        return tuple((n, d) for n, d in named if d > 1) or (("dp", 1),)

    def __str__(self) -> str:
        parts = [f"{n} {d}" for n, d in (("pp", self.pp), ("dp", self.dp), ("fsdp", self.fsdp),
                                         ("tp", self.tp)) if d > 1] or ["one rank"]
        if self.fsdp > 1:
            parts.append("reshard" if self.reshard_after_forward else "no reshard")
        if self.checkpoint:
            parts.append("checkpoint")
        if self.pp > 1:
            parts.append(f"{self.microbatches} micro-batches")
        return ", ".join(parts)


@dataclass(frozen=True)
class Links:
    """The links' figures: ``alpha`` seconds per collective and ``bandwidth`` bytes per second
    between nodes; ``node`` ``(alpha, bandwidth)`` for an axis whose groups stay inside one node
    of ``ranks_per_node`` ranks; ``axes`` ``{axis: (alpha, bandwidth)}`` overrides by axis name.
    ``overhead``: seconds per operator a rank dispatches (eager Python's own cost, which a
    small model on a CPU feels); ``ranks_per_processor``:
    how many ranks share one processor (1 with a GPU per rank; 2 for 4 ranks on 2 CPU cores),
    which is how much of a pipeline's bubble the busy stages fill: ``flops`` and ``overhead``
    are a rank's while every rank computes."""

    alpha: float = 1e-5
    bandwidth: float = 25e9
    node: tuple | None = None
    ranks_per_node: int | None = None
    axes: dict = field(default_factory=dict)
    overhead: float = 0.0
    ranks_per_processor: float = 1.0

    def of(self, axis, layout: Layout) -> tuple[float, float]:
        """(alpha, bandwidth) of a step_time axis key: a name, "a+b", "pipeline", None."""
        if axis in self.axes:
            return self.axes[axis]
        if self.node is None or not self.ranks_per_node or not isinstance(axis, str):
            return self.alpha, self.bandwidth
        stride = {"tp": 1, "fsdp": layout.tp, "dp": layout.tp * layout.fsdp,
                  "pipeline": layout.tp * layout.fsdp * layout.dp}
        size = {"tp": layout.tp, "fsdp": layout.fsdp, "dp": layout.dp, "pipeline": layout.pp}
        parts = axis.split("+")
        if all(p in stride and stride[p] * size[p] <= self.ranks_per_node for p in parts):
            return self.node
        return self.alpha, self.bandwidth


@dataclass(frozen=True)
class Batch:
    """The global batch: ``shape`` of the token ids (sequences, positions), drawn from
    ``[0, vocab)`` (default: the model's input embedding's size), and how the loss is made.
    ``loss_fn(output, ids)`` for a model that returns logits (default: cross-entropy over the
    last dim); ``forward(model, ids) -> loss`` for one that computes its own (default where the
    model's forward takes ``labels``: ``model(input_ids=ids, labels=ids).loss``, HF's).
    ``optimizer(params)`` makes the optimizer (default AdamW)."""

    shape: tuple
    loss_fn: Callable | None = None
    forward: Callable | None = None
    vocab: int | None = None
    optimizer: Callable | None = None

    @classmethod
    def of(cls, batch) -> "Batch":
        if isinstance(batch, Batch):
            return batch
        if isinstance(batch, (tuple, list)) and batch and all(
                isinstance(n, int) and n > 0 for n in batch):
            return cls(tuple(batch))
        raise GlobalTensorError(
            f"gt.auto_layout: expected batch= the global batch's shape, e.g. (64, 2048) "
            f"(sequences, positions), or gt.auto.Batch(shape, loss_fn=..., forward=...); "
            f"found {batch!r}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(world: int, *, blocks: int, sequences: int, tp_ok: Callable[[int], bool],
                      pipeline: bool, allowed: dict | None = None) -> list[Layout]:
    """Every layout of ``world`` ranks the project can apply, before bounds: pp stages (only
    for a pipeline-able model, at most ``blocks``), data ranks dp x fsdp that each get at least
    one of ``sequences`` (and one per micro-batch), tp where ``tp_ok`` says the model divides;
    per structure the variants of reshard_after_forward (fsdp > 1), checkpointing and
    micro-batches (pp, 2 pp, 4 pp that the local batch holds). ``allowed``: {field: values}
    keeps only those values (the user's ``candidates=``)."""
    allowed = allowed or {}
    out = []
    for pp, dp, fsdp, tp in itertools.product(*[_divisors(world)] * 4):
        if pp * dp * fsdp * tp != world or not tp_ok(tp):
            continue
        if pp > 1 and (not pipeline or pp > blocks):
            continue
        data = dp * fsdp
        if data > sequences:
            continue
        base = Layout(pp, dp, fsdp, tp)
        for reshard in ((True, False) if fsdp > 1 else (True,)):
            for ckpt in (False, True):
                for micro in ((pp, 2 * pp, 4 * pp) if pp > 1 else (1,)):
                    if micro * data > sequences:
                        continue
                    out.append(replace(base, reshard_after_forward=reshard, checkpoint=ckpt,
                                       microbatches=micro))
    return [c for c in out if all(getattr(c, k) in v for k, v in allowed.items()
                                  if k in _FIELDS)]


_FIELDS = ("pp", "dp", "fsdp", "tp", "reshard_after_forward", "checkpoint", "microbatches")


def static_bound(layout: Layout, param_bytes: int, state_per_param: float = 2.0) -> int:
    """A lower bound on a rank's peak: its share of the parameters, their gradients and the
    optimizer's state (``state_per_param`` parameter-sized tensors: AdamW's two moments), as
    if every tensor were split over the pipeline, fully_shard and tensor axes alike."""
    shards = layout.pp * layout.fsdp * layout.tp
    return int(param_bytes * (2 + state_per_param) / shards)


def time_bound(layout: Layout, param_bytes: int, links: "Links", known: float = 0.0) -> float:
    """A lower bound on a layout's estimated step (``figures.priced``), 10% below what it must
    take: ``known`` seconds (a sibling's flops' seconds and tensor-parallel and pipeline
    traffic: the layouts of one family share their local shapes, so these are the same; their
    operators differ, fully_shard's add some, so they count 0), plus fully_shard's
    gathers (one per forward, one more per backward when resharding) and reduce-scatter of
    the unit's bytes, ``(n - 1) / n`` of them per rank, plus a data axis's all-reduce of the
    gradients' share (at least ``(n - 1) / n`` of it)."""
    shard_bytes = param_bytes / (layout.pp * layout.tp)
    seconds = known
    if layout.fsdp > 1:
        moves = 2 + (1 if layout.reshard_after_forward else 0)
        seconds += moves * shard_bytes * (layout.fsdp - 1) / layout.fsdp / links.of("fsdp", layout)[1]
    if layout.dp > 1:
        share = shard_bytes / layout.fsdp
        seconds += share * (layout.dp - 1) / layout.dp / links.of("dp", layout)[1]
    return 0.9 * seconds
