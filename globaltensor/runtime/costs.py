"""The planner's cost figures for this job: given (``gt.set_costs``, ``GT_COSTS``), or measured
by a short probe when the world starts, and agreed by every rank (docs/planner.md, "Cost model").

A plan must be the same on every rank, so the figures are too: the probe's are the largest any
rank measured (one all_reduce of two numbers), and a cache file's are read by rank 0 and
broadcast. Changing them clears every cached plan and choice; graphs already compiled keep the
plans they traced.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist

from .. import _cache
from ..errors import GlobalTensorError
from ..plan import cost
from . import wire

_WHY = wire.Why("cost probe", "gt.measure_costs()")

ENV = "GT_COSTS"  # "measure" (the default), "default", or "alpha=1e-4,beta=1e-9"
CACHE_ENV = "GT_COSTS_CACHE"  # a JSON file keeping measured figures per backend, size and hosts
PROBE_BYTES = 1 << 20  # the bandwidth probe's all_reduce: 1 MiB
_LATENCY_CALLS, _BANDWIDTH_CALLS = 15, 3


def costs() -> cost.Costs:
    """The figures the planner prices with now (``str()`` says what and from where)."""
    return cost.current()


def set_costs(alpha: float | None = None, beta: float | None = None, *,
              costs: cost.Costs | None = None) -> cost.Costs:
    """Price every later plan with ``alpha`` seconds per collective and ``beta`` seconds per
    byte (or with ``costs``, e.g. one returned earlier); returns the figures used before.

    Call it on every rank with the same figures (plans must agree), before compiling: a graph
    compiled earlier keeps the plans it traced. ``gt.set_costs()`` with no argument restores
    the built-in defaults.
    """
    if costs is None:
        if alpha is None and beta is None:
            costs = cost.DEFAULT
        else:
            now = cost.current()
            costs = cost.Costs(now.alpha if alpha is None else alpha,
                               now.beta if beta is None else beta, source="given")
    elif not isinstance(costs, cost.Costs):
        raise GlobalTensorError(
            f"expected costs= to be figures returned by gt.costs() or gt.set_costs(), found "
            f"{type(costs).__name__}; or pass alpha= and beta= in seconds")
    before = cost.use(costs)
    if before != costs:
        _cache.clear_all()
    return before


def parse(text: str) -> cost.Costs | str:
    """``GT_COSTS``'s value: "measure", "default" (strings), or given figures."""
    text = text.strip()
    if text in ("", "measure", "default"):
        return text or "measure"
    figures = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        try:
            if name not in ("alpha", "beta") or name in figures:
                raise ValueError(name)
            figures[name] = float(value)
        except ValueError:
            raise GlobalTensorError(
                f"expected {ENV} to be 'measure', 'default' or 'alpha=SECONDS,beta=SECONDS', "
                f"found {text!r}; e.g. {ENV}=alpha=1e-4,beta=1e-9") from None
    if len(figures) != 2:
        raise GlobalTensorError(
            f"expected {ENV} to give both alpha and beta, found {text!r}; e.g. "
            f"{ENV}=alpha=1e-4,beta=1e-9")
    return cost.Costs(figures["alpha"], figures["beta"], source="given")


def wanted() -> cost.Costs | str:
    """What ``GT_COSTS`` asks for (read before the world is joined, so a bad value stops every
    rank before any collective)."""
    return parse(os.environ.get(ENV, "measure"))


def at_start(wanted: cost.Costs | str, device: str = "cpu") -> cost.Costs:
    """What the world's start does (every rank together) with :func:`wanted`'s answer: the
    defaults, given figures, or figures from the cache file or measured on the world's group
    with tensors on ``device``."""
    if wanted == "default":
        return set_costs()
    if isinstance(wanted, cost.Costs):
        set_costs(costs=wanted)
        return wanted
    return measure(device=device, cache=os.environ.get(CACHE_ENV) or None)


def measure(device: str = "cpu", cache: str | None = None) -> cost.Costs:
    """Measure α and β on the world's group (every rank calls this at the same point; well
    under a second) and price every later plan with them; returns them (in a world of one, the
    figures in use, unchanged). ``cache``: a JSON file
    to read figures from (keyed by backend, world size and hosts) and to write new ones to."""
    if not dist.is_initialized():
        raise GlobalTensorError(
            "gt.measure_costs() needs a started world; call gt.init() (or launch the script "
            "with `python launch.py --nproc_per_node N script.py`) first")
    if dist.get_world_size() == 1:
        return cost.current()  # a world of one sends nothing: there is nothing to measure
    key = _cache_key(device) if cache else None
    found = _read(cache, key) if cache and dist.get_rank() == 0 else None
    if cache:
        found = wire.broadcast_object(found, 0, _WHY)
    if found is not None:
        figures = cost.Costs(*found, source="cache")
    else:
        figures = _probe(device)
        if cache and dist.get_rank() == 0:
            _write(cache, key, figures)
    set_costs(costs=figures)
    return figures


def probe_device(backend: str) -> str:
    """Where the probe's tensors live: this rank's GPU where NCCL carries cuda tensors (the
    figures the planner needs then), else the CPU."""
    if "nccl" in backend and torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return f"cuda:{local % torch.cuda.device_count()}"
    return "cpu"


def _probe(device: str) -> cost.Costs:
    """α: the median time of a one-element all_reduce; β: a 1 MiB all_reduce's time beyond α,
    per byte the ring sends from each rank. Every rank takes the largest figures measured."""
    n = dist.get_world_size()
    small = torch.zeros(1, device=device)
    big = torch.zeros(PROBE_BYTES // 4, device=device)

    def timed(t, calls):
        times = []
        for _ in range(calls + 1):
            if device != "cpu":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            wire.all_reduce(t, None, _WHY, None)
            if device != "cpu":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    # the first call of each size is not counted: it lines the ranks up and warms the buffers
    # (no barrier: with NCCL it would pick its own device, not this rank's)
    alpha = timed(small, _LATENCY_CALLS)
    sent = 2 * (n - 1) / n * PROBE_BYTES
    beta = max(timed(big, _BANDWIDTH_CALLS) - alpha, 0.0) / sent
    agreed = torch.tensor([alpha, beta], dtype=torch.float64, device=device)
    wire.all_reduce(agreed, None, _WHY, None, op=dist.ReduceOp.MAX)
    alpha, beta = agreed.tolist()
    # a floor far below any real link: a probe lost in timer noise still prices bytes
    return cost.Costs(max(alpha, 1e-7), max(beta, 1e-13), source="measured")


def _cache_key(device: str) -> str:
    hosts = wire.all_gather_object(socket.gethostname(), _WHY)
    backend = dist.get_backend()
    return f"{backend}/{device}/{len(hosts)} ranks/{','.join(sorted(set(hosts)))}"


def _read(path: str, key: str):
    try:
        with open(path) as f:
            entry = json.load(f).get(key)
        return None if entry is None else (float(entry["alpha"]), float(entry["beta"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # a missing or unreadable cache is measured again


def _write(path: str, key: str, figures: cost.Costs) -> None:
    try:
        with open(path) as f:
            table = json.load(f)
        if not isinstance(table, dict):
            table = {}
    except (OSError, ValueError):
        table = {}
    table[key] = {"alpha": figures.alpha, "beta": figures.beta}
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    os.replace(temporary, path)


__all__ = ["at_start", "costs", "measure", "parse", "probe_device", "set_costs", "wanted"]
