"""What one simulated layout costs: every rank's peak by kind, the second step's traffic per
axis, its flops and operators; extrapolated from two and three blocks per stage to the model's
blocks, and priced with the links' figures. Pure arithmetic on numpy vectors (one entry per
rank)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..sim.memory import KINDS

__all__ = ["Figures", "StepEstimate", "measured", "extrapolated", "priced"]


@dataclass
class Figures:
    """Per rank vectors: ``peak`` and ``at_peak[kind]`` (bytes live at that rank's peak);
    ``counts[key]`` and ``sent[key]`` of the step after the mark, keyed (collective, axis);
    ``flops`` and ``ops`` of that step on the simulating rank."""

    peak: np.ndarray
    at_peak: dict
    counts: dict
    sent: dict
    flops: float
    ops: float

    def worst(self) -> int:
        return int(np.argmax(self.peak))


def snapshot(sim) -> tuple:
    """The simulation's running sums now, to subtract from the block's end (the mark)."""
    rec = sim.recorder
    return ({k: v.copy() for k, v in rec.counts.items()}, {k: v.copy() for k, v in rec.sent.items()},
            sim.flops(), sim.operators())


def measured(sim, mark, stage_ranks=None, other=None) -> Figures:
    """The figures of ``sim`` since ``mark``; with ``other`` (a second simulation of the same
    job played from another stage's rank) the ranks in ``stage_ranks`` take their memory from
    it (a pipeline's peak is exact for the simulated rank's stage)."""
    counts0, sent0, flops0, ops0 = mark
    rec = sim.recorder
    zero = np.zeros(sim.world_size, dtype=np.int64)
    counts = {k: v - counts0.get(k, zero) for k, v in rec.counts.items()}
    sent = {k: v - sent0.get(k, zero) for k, v in rec.sent.items()}
    peak = sim.memory.peak.astype(np.float64).copy()
    at_peak = {k: sim.memory.at_peak[k].astype(np.float64).copy() for k in KINDS}
    if other is not None:
        for ranks, source in zip(stage_ranks, other):
            peak[ranks] = source.memory.peak[ranks]
            for k in KINDS:
                at_peak[k][ranks] = source.memory.at_peak[k][ranks]
    return Figures(peak, at_peak, counts, sent, float(sim.flops() - flops0),
                   float(sim.operators() - ops0))


def extrapolated(one: Figures, two: Figures, blocks: int, first: int = 1) -> Figures:
    """Figures for ``blocks`` blocks per stage from those of ``first`` and ``first + 1``: each
    figure grows by the last block's increment per further block (a block's parameters, its
    gradients, its optimizer state, its saved activations, its gathers and reductions, its
    flops)."""
    n = blocks - first

    def line(a, b):
        return np.maximum(a + n * (b - a), 0)

    keys = set(one.counts) | set(two.counts)
    zero = np.zeros_like(one.peak)
    return Figures(
        line(one.peak, two.peak), {k: line(one.at_peak[k], two.at_peak[k]) for k in KINDS},
        {k: line(one.counts.get(k, zero), two.counts.get(k, zero)) for k in keys},
        {k: line(one.sent.get(k, zero), two.sent.get(k, zero)) for k in keys},
        max(one.flops + n * (two.flops - one.flops), 0.0),
        max(one.ops + n * (two.ops - one.ops), 0.0))


@dataclass(frozen=True)
class StepEstimate:
    """One step's seconds on the slowest rank: ``compute`` (its stage's flops over the rate,
    plus the operators' overhead, times what is left of a pipeline's bubble), ``communication``
    {axis: seconds}, ``bubble`` (a pipeline's factor (M + S - 1) / M), ``total``."""

    total: float
    compute: float
    communication: dict = field(default_factory=dict)
    bubble: float = 1.0
    rank: int = 0
    matmul: float = 0.0  # the flops' part of compute: the same for layouts of one local batch

    def __float__(self) -> float:
        return self.total


def priced(f: Figures, layout, links, rate: float) -> tuple[StepEstimate, dict]:
    """The step's estimate, and {axis: bytes the slowest rank sends} (metadata apart)."""
    world = len(f.peak)
    per_axis: dict = {}
    for key, count in f.counts.items():
        if key[1] == "metadata":
            continue
        a, bw = links.of(key[1], layout)
        per_axis[key[1]] = per_axis.get(key[1], np.zeros(world)) + count * a + f.sent[key] / bw
    slowest = int(np.argmax(sum(per_axis.values(), np.zeros(world)))) if per_axis else 0
    comm = {axis: float(v[slowest]) for axis, v in per_axis.items()}
    sent: dict = {}
    for key, v in f.sent.items():
        if key[1] != "metadata" and v[slowest]:
            sent[key[1]] = sent.get(key[1], 0) + int(v[slowest])
    bubble = (layout.microbatches + layout.pp - 1) / layout.microbatches if layout.pp > 1 else 1.0
    # where ranks share a processor, an idle stage's share goes to the busy ones: the step
    # takes the longer of the work at the shared rate and the bubbled path at the whole rate
    path = max(1.0, bubble / max(links.ranks_per_processor, 1.0))
    matmul = f.flops / rate * path
    compute = matmul + f.ops * links.overhead * path
    return StepEstimate(math.fsum([compute, *comm.values()]), compute, comm, bubble,
                        slowest, matmul), sent
