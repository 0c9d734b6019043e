"""``gt.comm``: the user's collectives: torch.distributed's calls (torch style, in place) and
value-style calls for Fabric / Ignite users, barriers, and ``group_of_ranks`` to make a group
(cached per world, with the world's timeout). See ``collectives`` and docs/collectives.md. The
tensor layer's own communication is in ``runtime/``.
"""
from ..runtime.groups import group_of_ranks
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
    "reduce_scatter_tensor", "scatter", "send", "group_of_ranks",
]
