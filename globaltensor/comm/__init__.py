"""Communication: the only package that imports torch.distributed.

``gt.comm`` is also the user's collectives: torch.distributed's calls (torch style, in place) and
value-style calls for Fabric / Ignite users. See ``collectives`` and docs/collectives.md.
"""
from .collectives import (
    ReduceOp,
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    irecv,
    isend,
    monitored_barrier,
    rank_zero_first,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
    send,
)

__all__ = [
    "ReduceOp", "all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "broadcast", "gather", "irecv", "isend",
    "monitored_barrier", "rank_zero_first", "recv", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "send",
]
