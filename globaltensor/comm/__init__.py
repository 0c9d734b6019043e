"""``gt.comm``: the user's collectives: torch.distributed's calls (torch style, in place) and
value-style calls for Fabric / Ignite users, barriers, and ``group_of_ranks`` to make a group
(cached per world, with the world's timeout). See docs/collectives.md. The tensor layer's own
communication is in ``runtime/``.

    collectives.py  each call picks torch style or value style by its arguments
    torch_style.py  torch.distributed's calls, in place, returning the output argument
    values.py       value style: nested data (torch's pytree), Python numbers, picklable objects
    built.py        operations a backend lacks, built from others (gather on NCCL...)
    barriers.py     barrier, rank_zero_first, monitored_barrier (through the store)
    common.py       what every call shares: world, roots, reduce-op names, GT_DEBUG facts
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
