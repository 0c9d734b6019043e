"""``gt.simulate(world_size, rank=0)``: run a job's code for a world that does not exist and read
what every rank would hold and send (SPEC "Simulation", docs/simulate.md)::

    with gt.simulate(world_size=1024) as sim:
        gt.init()
        grid = gt.placement("cpu", torch.arange(1024).reshape(8, 16, 8), axes=("dp", "fsdp", "tp"))
        model = Transformer(cfg); model.to_global(grid, tp_plan)
        opt = torch.optim.AdamW(model.parameters())
        loss = model(tokens).loss; loss.backward(); opt.step()
    print(sim.report())
"""
from __future__ import annotations

import collections
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import GlobalTensorError
from ..observe import reset, set_watchers
from ..world import simulated
from .factories import MetaFactories
from .knowable import Unify
from .memory import KINDS, MemoryTracker
from ..placement import Placement
from .ranks import bytes_of, classes, placement_members, ranges

# a wire event's labels that carry metadata, not the model's data (kept apart from the counts)
_METADATA = ("metadata", "layout check", "cost probe")

__all__ = ["simulate", "Simulation", "StepTime"]


class Recorder:
    """What ``gt.comm_trace`` would record on every rank: the observer of redistributions and
    of the runtime's other collectives, spread over the ranks each involves."""

    def __init__(self, world: int):
        self.world = world
        self.sent = collections.defaultdict(lambda: np.zeros(world, dtype=np.int64))  # (kind, axis)
        self.counts = collections.defaultdict(lambda: np.zeros(world, dtype=np.int64))  # (kind, axis)
        self.everyone = np.ones(world, dtype=np.int64)

    def _add(self, kind: str, axis, who: np.ndarray, nbytes: int) -> None:
        self.sent[kind, axis] += who * nbytes
        self.counts[kind, axis] += who

    def _who(self, ranks) -> np.ndarray:
        """1 on each of ``ranks`` (a Placement, placements, ranks; None: the whole world)."""
        if ranks is None:
            return self.everyone
        if isinstance(ranks, Placement):
            return placement_members(ranks, self.world)
        who = np.zeros(self.world, dtype=np.int64)
        for r in ranks:
            if isinstance(r, Placement):
                who |= placement_members(r, self.world)
            else:
                who[r] = 1
        return who

    def wire_event(self, event) -> None:
        """The wire's one event (runtime/wire.py ``Sent``), charged to each of its ranks under
        (collective, axis); metadata exchanges under the axis ``"metadata"``."""
        axis = "metadata" if event.why.label in _METADATA else event.why.axis
        key = (event.collective, axis)
        if event.by_rank is None:
            self._add(event.collective, axis, self._who(event.ranks), event.nbytes)
            return
        ranks = list(event.by_rank)
        self.sent[key][ranks] += np.array([event.by_rank[r] for r in ranks], dtype=np.int64)
        self.counts[key][ranks] += 1

    def comm_called(self, name: str) -> None:
        self._add("gt.comm." + name, None, self.everyone, 0)


class Simulation:
    """The block and its figures; ``gt.simulate(world_size, rank=0)`` makes one."""

    def __init__(self, world_size: int, rank: int = 0, costs=None):
        for name, value in (("world_size", world_size), ("rank", rank)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise GlobalTensorError(f"gt.simulate: expected {name} to be an int, found {value!r}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise GlobalTensorError(f"gt.simulate: expected world_size >= 1 and 0 <= rank < "
                                    f"world_size, found world_size={world_size}, rank={rank}")
        self.world_size, self.rank = world_size, rank
        self.costs = _figures(costs)  # what the plans are priced with (the report says)
        self.memory = MemoryTracker(ranks=world_size, bytes_of=bytes_of(world_size))
        self.recorder = Recorder(world_size)
        self._flops = 0
        self._ops = 0

    # ---- the block -------------------------------------------------------------------------
    def __enter__(self) -> "Simulation":
        self._world = simulated.enter(self.world_size, self.rank)
        try:
            from ..runtime.costs import set_costs
            self._costs_before = set_costs(costs=self.costs)
            self._factories = MetaFactories(self.memory)
            self._factories.__enter__()
            self._unify = Unify()  # known values meeting meta ones (sim/knowable.py)
            self._unify.__enter__()
            self.memory.start(None)
            self.memory.on_op = self._count_flops
            self._watch = set_watchers(recorder=self.recorder)
        except BaseException:
            simulated.leave(self._world)
            raise
        return self

    def __exit__(self, *exc):
        try:
            reset(self._watch)
            self.memory.__exit__(*exc)
            self._unify.__exit__(*exc)
            self._factories.__exit__(*exc)
        finally:
            from ..runtime.costs import set_costs
            set_costs(costs=self._costs_before)
            simulated.leave(self._world)
        return False

    def _count_flops(self, func, args, kwargs, out) -> None:
        from torch.utils.flop_counter import flop_registry

        self._ops += 1
        formula = flop_registry.get(func._overloadpacket)
        if formula is None:
            return
        local = [getattr(a, "_local", a) for a in args]
        out = getattr(out, "_local", out) if isinstance(out, torch.Tensor) else out
        try:
            self._flops += formula(*local, **(kwargs or {}), out_val=out)
        except Exception:  # noqa: BLE001 - a formula that does not take these arguments
            pass

    # ---- the figures -----------------------------------------------------------------------
    def peak_bytes(self, rank: int, kind: str | None = None) -> int:
        """The peak of live tensor bytes on ``rank`` (kind None), or the highest ``kind``
        ("parameters", "gradients", "optimizer", "activations", "communication") reached."""
        return self.memory.peak_bytes(kind, rank=self._rank(rank))

    def live_bytes(self, rank: int, kind: str | None = None) -> int:
        """What ``rank`` holds when the block ends (the parameters, their gradients, the
        optimizer's state: what the next step starts from)."""
        return self.memory.live_bytes(kind, rank=self._rank(rank))

    def comm_bytes(self, rank: int, metadata: bool = False) -> dict[str, int]:
        """{collective: bytes ``rank`` sends}, as ``gt.comm_trace`` counts them (``metadata``:
        with the shape and object exchanges, as ``bytes_per_rank_with_metadata`` does)."""
        rank = self._rank(rank)
        out = collections.Counter()
        for (kind, axis), sent in self.recorder.sent.items():
            if metadata or axis != "metadata":
                out[kind] += int(sent[rank])
        return {k: v for k, v in out.items() if v or k.startswith("gt.comm")}

    def collectives(self, rank: int, metadata: bool = False) -> dict[str, int]:
        """{collective: how many times ``rank`` runs it}, as ``gt.comm_trace().counts()``."""
        rank = self._rank(rank)
        out = collections.Counter()
        for (kind, axis), count in self.recorder.counts.items():
            if metadata or axis != "metadata":
                out[kind] += int(count[rank])
        return {k: v for k, v in out.items() if v}

    def flops(self) -> int:
        """The floating-point operations this simulation's rank computes (torch's flop
        formulas on its pieces, for the ops that have one: matmuls, convolutions, attention)."""
        return self._flops

    def operators(self) -> int:
        """How many operators this simulation's rank dispatched (each one a rank's eager
        overhead in the real run)."""
        return self._ops

    def step_time(self, alpha: float | None = None, bandwidth: float | None = None,
                  flops: float = 1e14, axes: dict | None = None) -> "StepTime":
        """The step's seconds on the slowest rank, with its parts (a :class:`StepTime`): each
        collective costs ``alpha`` plus its bytes over ``bandwidth`` (or the ``(alpha,
        bandwidth)`` given for its placement axis in ``axes``), summed per axis; by default the
        figures the block's plans were priced with (``self.costs``: alpha, 1 / beta); the
        computation is this rank's flop count over ``flops``. The slowest rank is the one whose
        communication is largest (the flop count is the simulating rank's, taken as every
        rank's); ``total`` is its axes' seconds plus the compute seconds, exactly."""
        axes = axes or {}
        alpha = self.costs.alpha if alpha is None else alpha
        bandwidth = 1 / self.costs.beta if bandwidth is None else bandwidth
        per_axis: dict = {}
        for key, count in self.recorder.counts.items():
            a, bw = axes.get(key[1], (alpha, bandwidth))
            seconds = count * a + self.recorder.sent[key] / bw  # per rank
            per_axis[key[1]] = per_axis.get(key[1], 0.0) + seconds
        slowest = int(np.argmax(sum(per_axis.values(), np.zeros(self.world_size))))
        return StepTime.of({axis: float(v[slowest]) for axis, v in per_axis.items()},
                           self._flops / flops, slowest)

    def report(self) -> str:
        """Per rank class (ranks whose figures are equal): the peak of live bytes by kind,
        bytes sent per collective and axis, collective counts; then the worst ranks."""
        keys = sorted(self.recorder.sent, key=str)
        rows = ([self.memory.peak] + [self.memory.kind_peaks[k] for k in KINDS]
                + [self.recorder.sent[k] for k in keys] + [self.recorder.counts[k] for k in keys])
        groups = classes(np.stack(rows)) if rows else [np.arange(self.world_size)]
        lines = [f"gt.simulate: {self.world_size} ranks, {len(groups)} rank class"
                 f"{'' if len(groups) == 1 else 'es'}; plans priced with {self.costs}"]
        for ranks in groups:
            r = int(ranks[0])
            lines.append(f"ranks {ranges(ranks)}:")
            lines.append(f"  peak {_fmt(self.memory.peak[r])}: " + ", ".join(
                f"{k} {_fmt(self.memory.at_peak[k][r])}" for k in KINDS))
            for key in keys:
                if self.recorder.counts[key][r]:
                    where = f" on {key[1]}" if key[1] else ""
                    lines.append(f"  {key[0]}{where}: {int(self.recorder.counts[key][r])} x, "
                                 f"{_fmt(self.recorder.sent[key][r])} sent")
        worst = np.argsort(-self.memory.peak, kind="stable")[:3]
        lines.append("highest peaks: " + ", ".join(
            f"rank {int(r)} {_fmt(self.memory.peak[r])}" for r in worst))
        return "\n".join(lines)

    def _rank(self, rank) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise GlobalTensorError(f"gt.simulate: expected a rank in [0, {self.world_size}), "
                                    f"found {rank!r}")
        return rank


@dataclass(frozen=True)
class StepTime:
    """``sim.step_time()``'s alpha-beta estimate of one step on the slowest rank ``rank``:
    ``communication`` is ``{axis: seconds}`` over the keys ``step_time(axes=...)`` takes (a
    placement axis's name, ``"axis i"`` for an unnamed one, ``"fully_shard"``, ``"gradient
    buckets"``, ``"pipeline"``, and ``None`` for collectives on no one axis: a move between
    placements, ``gt.comm`` calls), ``compute`` the flop count over the flop rate, and
    ``total`` their sum (no overlap), exactly: ``math.fsum([*communication.values(),
    compute])``, the sum rounded once, whatever the order of the parts. ``float(t)`` is
    the total, and so is a format spec (``f"{t:.3f}"``); ``str(t)`` is a one-line summary."""
    total: float
    communication: dict
    compute: float
    rank: int

    @classmethod
    def of(cls, communication: dict, compute: float, rank: int) -> "StepTime":
        """The result of these parts, its total their exact sum (``math.fsum``)."""
        return cls(math.fsum([*communication.values(), compute]), dict(communication), compute,
                   rank)

    @property
    def communication_total(self) -> float:
        """The communication seconds of every axis together (``math.fsum``, as the total)."""
        return math.fsum(self.communication.values())

    def __float__(self) -> float:
        return self.total

    def __format__(self, spec: str) -> str:
        return format(self.total, spec) if spec else str(self)

    def __str__(self) -> str:
        parts = ", ".join(f"{'no axis' if axis is None else axis} {_secs(v)}"
                          for axis, v in self.communication.items())
        return (f"step {_secs(self.total)} on rank {self.rank}: compute {_secs(self.compute)}, "
                f"communication {_secs(self.communication_total)}"
                + (f" ({parts})" if parts else ""))


def _secs(seconds: float) -> str:
    for scale, unit in ((1, "s"), (1e-3, "ms")):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e6:.3g} us"


def _fmt(n) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def _figures(costs):
    """The figures a simulation prices its plans with: ``costs`` (figures from ``gt.costs()``
    or ``gt.set_costs()``, "default", or GT_COSTS's "alpha=...,beta=..." text), else what
    ``GT_COSTS`` asks the real job for ("default", given figures), else (GT_COSTS unset or
    "measure": a simulation measures nothing) the figures in use in this process."""
    from ..plan import cost
    from ..runtime.costs import ENV, parse

    if costs is None:
        costs = os.environ.get(ENV, "measure")
    if isinstance(costs, str):
        costs = parse(costs)
    if costs == "measure":
        return cost.current()
    if costs == "default":
        return cost.DEFAULT
    if not isinstance(costs, cost.Costs):
        raise GlobalTensorError(
            f"gt.simulate: expected costs= to be figures from gt.costs() or gt.set_costs(), "
            f"'default' or 'alpha=SECONDS,beta=SECONDS', found {costs!r}")
    return costs


def simulate(world_size: int, *, rank: int = 0, costs=None) -> Simulation:
    """Run a job's code for ``world_size`` ranks in this one process, with no data and no
    messages, and read what every rank would hold and send (docs/simulate.md).

    Inside ``with gt.simulate(world_size) as sim:`` the world is a fake one of ``world_size``
    ranks (``gt.init()`` is a no-op, ``gt.env.get_rank()`` answers ``rank``), torch's
    factories make meta tensors, and every global operation is chosen and planned as in a real
    run; the plans' collectives and the pieces' bytes are counted for every rank, from the
    layouts.

    Args:
        world_size: the ranks of the job simulated (an int >= 1).
        rank: the rank whose code path runs (keyword; default 0). SPMD code takes the same
            path on every rank; simulate once per stage for a pipeline's stages.
        costs: the figures the plans are priced with, as the real job's would be: figures
            from ``gt.costs()`` / ``gt.set_costs()``, ``"default"`` or ``"alpha=...,beta=..."``;
            by default what ``GT_COSTS`` gives ("default" or figures); unset or "measure",
            the figures in use here (a real job measures its own, which can choose other
            plans: pass them, or set ``GT_COSTS`` for both). The report names them.

    Returns:
        A :class:`Simulation`, the context manager itself; after the block read
        ``sim.report()``, ``sim.peak_bytes(rank, kind)``, ``sim.live_bytes(rank, kind)``,
        ``sim.comm_bytes(rank)``, ``sim.collectives(rank)``, ``sim.flops()`` and
        ``sim.step_time(...)`` (a :class:`StepTime`: total seconds, per axis and compute).

    Example::

        with gt.simulate(world_size=8) as sim:  # no gt.init() needed inside: a no-op
            grid = gt.placement("cpu", [[0, 1, 2, 3], [4, 5, 6, 7]], axes=("dp", "tp"))
            model = torch.nn.Linear(1024, 1024).to_global(grid, gt.nn.colwise("tp"))
            x = torch.randn(64, 1024).to_global(grid, (gt.sbp.split(0), gt.sbp.broadcast))
            model(x).sum().backward()
        print(sim.report()); print(sim.peak_bytes(0, "parameters"), sim.step_time())

    Not modelled: values (``item()``, ``print(x)`` of a global tensor raise; operators whose
    output shape depends on data, like ``nonzero``, cannot run); memory the allocator keeps
    beyond live tensors and one operator's own workspace; tensors made before the block; other
    ranks' flops (the simulating rank's are taken as every rank's); in ``step_time``, overlap
    of communication with compute, contention and real bandwidth curves (an alpha-beta bound
    to compare layouts with, not a wall time). ``gt.comm`` collectives are counted, not sized.
    Inside a process that joined a real world, that world is set aside for the block and
    comes back after it.
    """
    return Simulation(world_size, rank, costs)
