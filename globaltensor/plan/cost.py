"""The α-β cost model, as functions of ints: what a step sends, copies and writes (elements).

The step values (:mod:`.steps`) and the search's int-coded space (:mod:`.space`) both call
these, so a step costs the same, to the bit, whichever asks (docs/planner.md, "Cost model").
"""
from __future__ import annotations

import dataclasses
import math

from ..errors import GlobalTensorError


@dataclasses.dataclass(frozen=True)
class Costs:
    """The figures the planner prices with, in seconds: ``alpha`` per collective (or per
    point-to-point message on the busiest rank), ``beta`` per byte the busiest rank sends,
    ``memory`` per byte a step writes (local steps cost only this, so a plan never prefers a
    collective to a local step) and ``copy`` per byte the executor packs or unpacks (a dim
    other than 0, uneven pieces: it breaks ties such as which of two gathers goes first).
    ``source``: where they came from ("default", "given", "measured", "cache")."""

    alpha: float
    beta: float
    memory: float = 1e-12
    copy: float = 2e-12
    source: str = "default"

    def __post_init__(self):
        for name in ("alpha", "beta", "memory", "copy"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value <= 0):
                raise GlobalTensorError(
                    f"expected {name} as a finite number of seconds > 0, found {value!r}; e.g. "
                    f"gt.set_costs(alpha=1e-4, beta=1e-9) (100 us a collective, 1 GB/s)")

    def __str__(self):
        return (f"alpha {self.alpha * 1e6:.3g} us per collective, beta {self.beta * 1e9:.3g} ns "
                f"per byte ({1 / self.beta / 1e9:.3g} GB/s), {self.source}")


DEFAULT = Costs(alpha=1e-5, beta=1e-10)
# The figures in use, read at call time by every cost of the planner and the signature choice
# (``cost.ALPHA``, never a copy bound by name): :func:`use` rebinds them.
ALPHA, BETA, MEMORY, COPY = DEFAULT.alpha, DEFAULT.beta, DEFAULT.memory, DEFAULT.copy
# Seconds per flop of an op's own compute, for the few rules that state it (``Rule.work``:
# attention): 100 GFLOP/s, a CPU core's order; on every device it is far above what gathering
# k and v costs per flop saved, which is all the choice needs of it.
FLOP = 1e-11
_CURRENT = DEFAULT
# plans are searched for this item size (a Layout has no dtype); costs scale with it anyway
SEARCH_ITEMSIZE = 4


def current() -> Costs:
    """The figures in use."""
    return _CURRENT


def use(costs: Costs) -> Costs:
    """Price every later plan with ``costs``; returns the figures used before. Plans and
    choices made under other figures are kept by the caller's caches: clear them
    (``_cache.clear_all()``), as ``gt.set_costs`` does."""
    global ALPHA, BETA, MEMORY, COPY, _CURRENT
    before, _CURRENT = _CURRENT, costs
    ALPHA, BETA, MEMORY, COPY = costs.alpha, costs.beta, costs.memory, costs.copy
    return before


def seconds(latency: int, sent: int, written: int, copied: int, itemsize: int) -> float:
    """The cost of ``latency`` α terms, ``sent`` elements on the busiest rank, ``written``
    elements of result and ``copied`` elements packed or unpacked."""
    return (ALPHA * latency + BETA * (sent * itemsize) + MEMORY * written * itemsize
            + COPY * copied * itemsize)


def axis_step(n: int, latency: int, sent: int, written: int, copied: int, itemsize: int) -> float:
    """:func:`seconds` of a step along an axis of ``n`` ranks: 0 where ``n`` is 1 (every sbp
    holds the same box there, a relabelling)."""
    if n == 1:
        return 0.0
    return seconds(latency, sent, written, copied, itemsize)


# what each collective sends and copies, from the largest piece before (``piece``) and after
# (``result``) it, on an axis of ``n`` ranks


def gather_sent(n: int, piece: int) -> int:
    """all_gather (ring, padded to the largest piece) and all_gatherv (exact): n - 1 pieces."""
    return (n - 1) * piece


def gather_copied(piece: int, result: int, even: bool, lands: bool) -> int:
    """all_gather: a short piece is copied into a padded send buffer (unless ``even``); the
    received blocks are the result only along dim 0 with only the last piece short
    (``lands``), else they are unpacked."""
    return (0 if even else piece) + (0 if lands else result)


def gatherv_copied(dim: int, result: int) -> int:
    """all_gatherv: along dim 0 pieces land in place; else each is placed."""
    return 0 if dim == 0 else result


def all_reduce_sent(n: int, piece: int) -> int:
    """all_reduce (ring: reduce_scatter + all_gather)."""
    return -(-2 * (n - 1) * piece // n)


def reduce_scatter_sent(n: int, result: int) -> int:
    """reduce_scatter (ring, chunks padded to the largest)."""
    return (n - 1) * result


def reduce_scatter_copied(piece: int, lands: bool) -> int:
    """reduce_scatter: the piece is the buffer only along dim 0, even (``lands``)."""
    return 0 if lands else piece


def all_to_all_copied(src_dim: int, dst_dim: int, piece: int, result: int) -> int:
    """all_to_all: packing unless ``dst_dim`` is 0, unpacking unless ``src_dim`` is."""
    return (piece if dst_dim else 0) + (result if src_dim else 0)


def exchange(latency: int, sent: int, result: int, itemsize: int) -> float:
    """A point-to-point exchange: ``latency`` messages on the busiest rank, ``sent`` elements
    from the busiest sender, packed, and every piece of the ``result`` placed."""
    return seconds(latency, sent, result, sent + result, itemsize)


__all__ = ["ALPHA", "BETA", "COPY", "Costs", "DEFAULT", "MEMORY", "SEARCH_ITEMSIZE", "all_reduce_sent",
           "all_to_all_copied", "axis_step", "exchange", "gather_copied", "gather_sent",
           "current", "gatherv_copied", "reduce_scatter_copied", "reduce_scatter_sent", "seconds", "use"]
