"""``gt.auto_layout``: which layout fits in memory and is fastest, before launch
(SPEC "Choosing a layout", docs/auto_layout.md).

1. ``build()`` runs under ``torch.device("meta")``: the model, no data.
2. The tensor-parallel plan: the user's ``sbp_plan`` (``candidates={"sbp_plan": ...}``) or the
   Megatron pairs found from one forward on meta (``megatron.py``).
3. Every layout of the world (``space.py``) whose parameters, gradients and optimizer state
   alone fit (the bound) is a candidate. Each is simulated (in a fork, ``forks.py``) with two
   blocks per stage, then three, for two training steps (the optimizer's state lives in the
   second), played from one rank (a pipeline's first and last stage's); each figure is
   extrapolated to the model's blocks (``figures.py``). Each dp x fsdp family's most sharded
   member goes first: where it does not fit, no member does. The rest follow in the order
   of a lower bound on their step, until the bound cannot beat the fastest that fits.
4. The fastest that fits by the estimate is simulated whole, until the fastest is one
   simulated whole: that row is "verified", and first in the table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from ..errors import GlobalTensorError
from . import forks
from .build import Blocks, apply, batch_sbp, loss_of, make_placement, train_step
from .figures import Figures, extrapolated, measured, priced, snapshot
from .megatron import find_plan, patterns
from .space import Batch, Layout, Links, enumerate_layouts, static_bound, time_bound
from .table import Row, Table, gib

__all__ = ["auto_layout"]


@dataclass
class _Job:
    """What every candidate's simulation shares."""

    model: torch.nn.Module  # the whole model, on meta
    blocks: Blocks
    batch: Batch
    vocab: int
    links: Links
    rate: float
    budget: int
    sim_costs: object = None
    param_bytes: int = 0
    templates: dict = field(default_factory=dict)  # blocks kept -> model

    def template(self, keep: int) -> torch.nn.Module:
        if keep not in self.templates:
            self.templates[keep] = self.blocks.truncated(self.model, min(keep, len(self.blocks)))
        return self.templates[keep]


def auto_layout(build, world_size: int, *, memory_per_rank, batch, costs=None, flops=None,
                candidates=None, progress: bool = True) -> Table:
    """The layouts of ``build()``'s model on ``world_size`` ranks, simulated and priced, best
    first (a :class:`Table`); see the module docstring and docs/auto_layout.md.

    Args:
        build: makes the model (called under ``torch.device("meta")``: no data).
        world_size: ranks of the job.
        memory_per_rank: bytes a rank may hold (an int, or a string like ``"80GB"``/``"24GiB"``).
        batch: the global batch's shape ``(sequences, positions)`` of token ids, or
            ``gt.auto.Batch(shape, loss_fn=..., forward=..., optimizer=...)``.
        costs: the links: ``gt.auto.Links(alpha, bandwidth, node=(alpha, bandwidth),
            ranks_per_node=8)``, or figures from ``gt.costs()`` (the real job's: its plans are
            then chosen with them too); None: the figures in use here.
        flops: each rank's flop rate (flop/s); None: the planner's (1 / ``cost.FLOP``).
        candidates: ``{"pp": [...], "dp": [...], "fsdp": [...], "tp": [...], "checkpoint":
            [...], "reshard_after_forward": [...], "microbatches": [...], "sbp_plan": {pattern:
            style}}``: keeps only those values, and the user's tensor-parallel plan.
        progress: a progress bar (tqdm) while it searches.
    """
    job, layouts = _prepare(build, world_size, memory_per_rank, batch, costs, flops,
                            candidates or {})
    rows, todo = [], []
    for layout in layouts:
        bound = static_bound(layout, job.param_bytes)
        if bound > job.budget:
            rows.append(Row(layout, False, bound, {}, {}, None, f"pruned: parameters, gradients "
                            f"and optimizer state alone need {gib(bound)} per rank"))
        else:
            todo.append(layout)
    rows += _simulate_all(job, todo, progress)
    rows = _verify(job, rows)
    table = Table(sorted(rows, key=Row.order), job.blocks, job.budget, world_size)
    if not table.rows or not table.rows[0].fits:
        raise GlobalTensorError(_nothing_fits(table))
    return table


def _prepare(build, world, memory, batch, costs, flops, allowed):
    from ..plan import cost

    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise GlobalTensorError(f"gt.auto_layout: expected world_size an int >= 1, found {world!r}")
    budget = _bytes(memory)
    batch = Batch.of(batch)
    with torch.device("meta"):
        model = build()
    if not isinstance(model, torch.nn.Module):
        raise GlobalTensorError(f"gt.auto_layout: expected build() to return an nn.Module, "
                                f"found {type(model).__name__}")
    blocks = Blocks(model)
    vocab = batch.vocab or _vocab(model)
    links, sim_costs = _links(costs)
    job = _Job(model, blocks, batch, vocab, links, flops or 1 / cost.FLOP, budget, sim_costs,
               _param_bytes(model))
    plan = allowed.get("sbp_plan")
    if plan is None:
        plan = patterns(find_plan(job.template(min(2, len(blocks))), _meta_run(job)))
    plan = tuple(plan.items())
    heads = [getattr(getattr(model, "config", None), a, None)
             for a in ("num_attention_heads", "num_key_value_heads")]
    tp_ok = _tp_ok(model, dict(plan), [h for h in heads if h], links)
    pipeline = isinstance(model, torch.nn.Sequential) and not blocks.prefix
    layouts = enumerate_layouts(world, blocks=len(blocks), sequences=batch.shape[0], tp_ok=tp_ok,
                                pipeline=pipeline, allowed=allowed)
    if not plan:
        layouts = [l for l in layouts if l.tp == 1]
    return job, [replace(l, plan=plan) for l in layouts]


def _meta_run(job):
    def run(model):
        ids = torch.randint(0, job.vocab, (1, min(job.batch.shape[1], 16)), device="meta")
        loss_of(model, job.batch, ids)
    return run


def _family(layout: Layout) -> tuple:
    """Layouts that differ only in how the data ranks split into dp x fsdp: one local batch,
    one tensor-parallel and pipeline traffic, one compute."""
    return (layout.pp, layout.tp, layout.microbatches, layout.checkpoint,
            layout.reshard_after_forward)


def _simulate_all(job: _Job, todo: list[Layout], progress: bool) -> list[Row]:
    """First each family's most sharded layout (fsdp largest): where it does not fit, no layout
    of the family does (more sharding never grows the peak: the parameters, gradients and
    optimizer state shrink, the activations and a gathered unit stay), and its figures bound
    the others' steps. Then branch and bound: the rest in the order of their time bounds, until
    the next bound cannot beat the fastest fitting layout found."""
    families: dict = {}
    for layout in todo:
        families.setdefault(_family(layout), []).append(layout)
    bar, rows, known = _bar(len(todo), progress), [], {}
    try:
        rest = []
        groups = list(families.values())
        for members in groups:
            members.sort(key=lambda l: -l.fsdp)
        firsts = _estimates(job, [m[0] for m in groups])
        for members, figures in zip(groups, firsts):
            first = _row(job, members[0], figures)
            rows.append(first)
            bar.update(1)
            if not first.fits:
                rows += [Row(l, False, 0, {}, {}, None, f"pruned: {members[0]} (more sharded) "
                             f"does not fit", skipped=True) for l in members[1:]]
                bar.update(len(members) - 1)
                continue
            known[_family(members[0])] = first.step.matmul + sum(
                v for a, v in first.step.communication.items() if a in ("tp", "pipeline"))
            rest += members[1:]
        best = min((r.step.total for r in rows if r.fits), default=math.inf)
        rest.sort(key=lambda l: _bound(job, l, known))
        for layout in rest:
            bar.update(1)
            bound = _bound(job, layout, known)
            if bound >= best:
                rows.append(Row(layout, False, 0, {}, {}, None, f"pruned: it cannot beat "
                                f"{best:.3g} s (its bound {bound:.3g} s)", skipped=True))
                continue
            row = _row(job, layout, _estimate(job, layout))
            rows.append(row)
            if row.fits:
                best = min(best, row.step.total)
    finally:
        bar.close()
    return rows


def _bound(job: _Job, layout: Layout, known: dict) -> float:
    return time_bound(layout, job.param_bytes, job.links, known.get(_family(layout), 0.0))


def _estimate(job: _Job, layout: Layout, whole: bool = False) -> Figures:
    return _estimates(job, [layout], whole)[0]


def _estimates(job: _Job, layouts: list[Layout], whole: bool = False) -> list[Figures]:
    """Each layout's figures: simulated whole where a stage holds at most three blocks (or
    ``whole``), else extrapolated from two and three blocks per stage."""
    tasks, plans = [], []
    for layout in layouts:
        per_stage = math.ceil(len(job.blocks) / layout.pp)
        # two and three blocks: with one, fully_shard's prefetch and the loss's moment shift the
        # peak, and its increment is not a middle block's
        counts = [per_stage] if whole or per_stage <= 3 else [2, 3]
        plans.append((len(tasks), counts, per_stage))
        tasks += [(layout, k) for k in counts]
    done = _simulations(job, tasks)
    return [done[at] if len(counts) == 1 else
            extrapolated(done[at], done[at + 1], per_stage, first=counts[0])
            for at, counts, per_stage in plans]


def _simulations(job: _Job, tasks: list) -> list[Figures]:
    """:func:`_simulated_here` of each ``(layout, per_stage)``, each in a fork of this process
    (``forks.py``): what one simulation leaves behind in the process (a cache, a registry)
    cannot reach the next, so a layout's figures do not depend on the order the layouts are
    simulated in."""
    for layout, per_stage in tasks:
        job.template(per_stage * layout.pp)  # made here, so every fork starts from it
    return forks.run_all(lambda layout, per_stage: _simulated_here(job, layout, per_stage),
                         tasks, describe=lambda task: str(task[0]))


def _simulated_here(job: _Job, layout: Layout, per_stage: int) -> Figures:
    """Two training steps of ``layout`` with ``per_stage`` blocks per stage, simulated; for a
    pipeline once from its first stage's first rank and once from its last's."""
    per = layout.world // layout.pp
    stages = [0] if layout.pp == 1 else [0, layout.pp - 1]
    sims = [_one(job, layout, per_stage, rank=s * per) for s in stages]
    if len(sims) == 1:
        return measured(*sims[0])
    f = measured(*sims[0], stage_ranks=[list(range((layout.pp - 1) * per, layout.world))],
                 other=[sims[1][0]])
    # a middle stage holds what the first does or less (1F1B: fewer micro-batches in flight);
    # the first stage's simulation counts its local slices as copies there, so take the first's
    # the work: a rank's flops count its own pieces, its stage's (the fuller of the first and
    # the last, which holds the head and the loss); it dispatches every stage's operators
    # (on empty pieces for the others'), so its own are 1 / pp of them
    f.flops = max(f.flops, measured(*sims[1]).flops)
    f.ops = f.ops / layout.pp
    middle = slice(per, (layout.pp - 1) * per)
    f.peak[middle] = f.peak[0]
    for v in f.at_peak.values():
        v[middle] = v[0]
    return f


def _one(job: _Job, layout: Layout, per_stage: int, rank: int):
    from ..factories import randint
    from ..sim.simulate import simulate

    keep = per_stage * layout.pp
    template = job.template(keep)
    model = Blocks.of(template).truncated(template, keep)  # a fresh copy to lay out
    with simulate(layout.world, rank=rank, costs=job.sim_costs) as sim:
        target = apply(model, layout, "cpu", Blocks.of(model))
        model.to_empty(device="cpu")
        params = target.parameters()
        opt = (job.batch.optimizer or (lambda p: torch.optim.AdamW(p, lr=1e-4)))(params)
        grid = make_placement(layout, "cpu", 0)
        ids = randint(0, job.vocab, job.batch.shape, placement=grid, sbp=batch_sbp(grid))
        train_step(target, layout, job.batch, ids, opt)
        mark = snapshot(sim)
        train_step(target, layout, job.batch, ids, opt)
    return sim, mark


def _row(job: _Job, layout: Layout, f: Figures, status: str | None = None) -> Row:
    worst = f.worst()
    step, sent = priced(f, layout, job.links, job.rate)
    peak = int(f.peak[worst])
    kinds = {k: int(v[worst]) for k, v in f.at_peak.items()}
    per_stage = math.ceil(len(job.blocks) / layout.pp)
    status = status or (f"simulated with 2 and 3 blocks per stage, extrapolated to {per_stage}"
                        if per_stage > 3 else "simulated whole")
    return Row(layout, peak <= job.budget, peak, kinds, sent, step, status,
               verified=per_stage <= 3)


def _verify(job: _Job, rows: list[Row]) -> list[Row]:
    """Until the fastest row that fits is one simulated whole: simulate it whole (its figures
    replace the estimate's; it may then not fit, or be slower than the next)."""
    while True:
        first = min(rows, key=Row.order, default=None)
        if first is None or not first.fits or first.verified:
            return rows
        whole = _row(job, first.layout, _estimate(job, first.layout, whole=True),
                     "verified: simulated whole")
        whole.verified = True
        rows[rows.index(first)] = whole


def _nothing_fits(table: Table) -> str:
    """The error's text: the closest simulated layout (else the closest by the bound, whose
    figure is then a lower bound), its peak, what it lacks, what its peak holds."""
    simulated = [r for r in table.rows if r.step is not None]
    bounded = [r for r in table.rows if r.step is None and not r.skipped and r.peak]
    near = min(simulated or bounded, key=lambda r: r.peak, default=None)
    if near is None:
        return f"gt.auto_layout: no layout of {table.world} ranks was found for this model"
    lack = near.peak - table.budget
    what = (", ".join(f"{k} {gib(v)}" for k, v in near.kinds.items() if v) if near.kinds
            else "parameters, gradients and optimizer state alone")
    needs = "needs" if simulated else "needs at least"
    return (f"gt.auto_layout: expected a layout whose peak fits memory_per_rank={gib(table.budget)}"
            f"; found none among {len(table.rows)} on {table.world} ranks. The closest, {near.layout}, "
            f"{needs} {gib(near.peak)} per rank ({gib(lack)} more; at its peak: {what}). Give more "
            f"ranks or memory, a smaller batch, or a lower precision (build the model in bf16)")


def _bar(total: int, progress: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        progress = False
    if not progress:
        class _Quiet:
            def update(self, n): pass
            def close(self): pass
        return _Quiet()
    return tqdm(total=total, desc="gt.auto_layout", unit="layout", leave=False)


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _vocab(model) -> int:
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            return m.num_embeddings
    raise GlobalTensorError("gt.auto_layout: the model has no nn.Embedding to draw token ids "
                            "for; give gt.auto.Batch(shape, vocab=...)")


def _tp_ok(model, plan, heads, links):
    dims = []
    for name, m in model.named_modules():
        style = next((s for p, s in plan.items() if __import__("fnmatch").fnmatchcase(name, p)),
                     None)
        if isinstance(m, torch.nn.Linear) and style in ("colwise", "rowwise"):
            dims.append(m.out_features if style == "colwise" else m.in_features)
    node = links.ranks_per_node

    def ok(tp: int) -> bool:
        return tp == 1 or (all(d % tp == 0 for d in dims + heads)
                           and (node is None or tp <= node))
    return ok


def _links(costs):
    from ..plan import Costs, cost

    if costs is None:
        c = cost.current()
        return Links(alpha=c.alpha, bandwidth=1 / c.beta), None
    if isinstance(costs, Links):
        return costs, None
    if isinstance(costs, Costs):
        return Links(alpha=costs.alpha, bandwidth=1 / costs.beta), costs
    raise GlobalTensorError(f"gt.auto_layout: expected costs= gt.auto.Links(...) or figures from "
                            f"gt.costs(), found {costs!r}")


def _bytes(memory) -> int:
    if isinstance(memory, str):
        units = {"tib": 2**40, "gib": 2**30, "mib": 2**20, "kib": 2**10, "tb": 1e12, "gb": 1e9,
                 "mb": 1e6, "kb": 1e3, "b": 1}
        text = memory.strip().lower().replace(" ", "")
        for unit, scale in units.items():
            if text.endswith(unit):
                try:
                    return int(float(text[:-len(unit)]) * scale)
                except ValueError:
                    break
    elif isinstance(memory, (int, float)) and not isinstance(memory, bool) and memory > 0:
        return int(memory)
    raise GlobalTensorError(f"gt.auto_layout: expected memory_per_rank in bytes or as \"80GB\" / "
                            f"\"24GiB\", found {memory!r}")
