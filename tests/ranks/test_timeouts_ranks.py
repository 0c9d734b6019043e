"""Timeouts that explain: a stuck collective raises naming the operation and the ranks, on
thread-ranks (the words alone: tests/core/test_timeouts.py; gt.init(timeout=...) in real
processes: tests/processes/test_timeouts_processes.py)."""
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import globaltensor as gt
from globaltensor.runtime.agreement import check
from globaltensor.runtime.groups import group_of_ranks
from globaltensor.runtime.guard import guard
from globaltensor.world.world import world_timeout
from globaltensor.testing import run_ranks

from helpers import error_or_none  # (type name, message) of the GlobalTensorError, or None


def _shorten_world_timeout(seconds: float) -> None:
    """Like gt.init(timeout=seconds) for a thread-rank: groups made from now on inherit it.

    (The harness makes each world with its own run timeout; a shorter collective timeout lets a
    test see the collective's error before the harness gives up on the rank.)
    """
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    backend._set_default_timeout(datetime.timedelta(seconds=seconds))


# --- thread ranks --------------------------------------------------------------------------------


def test_subgroups_inherit_the_world_timeout():
    def body(rank):
        _shorten_world_timeout(3)
        pg = group_of_ranks((0, 1))
        if rank == 2:
            return str(world_timeout())
        return str(pg._get_backend(torch.device("cpu")).options._timeout)

    assert run_ranks(body, 3, timeout=30) == ["0:00:03"] * 3


@pytest.mark.parametrize("n,dst,words", [
    (6, "B", "(B,), [6]), step 1 of 1 (all_gather axis 0 dim 0)"),
    (5, "B", "(B,), [5]), step 1 of 1 (all_gatherv axis 0 dim 0)"),
    (6, "[1]", "(S(0),), [6]), step 1 of 1 (send/recv ranks [0, 1] -> [1])"),
    (6, "P->B", "(B,), [6]), step 1 of 1 (all_reduce axis 0"),
], ids=["all_gather", "all_gatherv", "exchange", "all_reduce"])
def test_skipped_redistribution_times_out_naming_the_step(n, dst, words):
    """Debug off: the rank that waits names the operation, its ranks and the way to learn more.
    Gathers and exchanges are point-to-point messages on CPU: they keep the world's timeout."""
    def body(rank):
        _shorten_world_timeout(1)
        p = gt.placement("cpu", [0, 1])
        x = gt.arange(n, placement=p, sbp=gt.sbp.split(0))
        if dst == "P->B":
            x = gt.ones(n, placement=p, sbp=gt.sbp.partial_sum)
        if rank == 1:
            return None  # skips the redistribution
        if dst in ("B", "P->B"):
            return error_or_none(lambda: x.to_global(sbp=gt.sbp.broadcast))
        return error_or_none(lambda: x.to_global(placement=gt.placement("cpu", [1])))

    out = run_ranks(body, 2, timeout=30)
    kind, msg = out[0]
    assert kind == "CollectiveTimeoutError"
    src = "(P,)" if dst == "P->B" else "(S(0),)"
    assert msg.startswith(f"to_global: redistribution Layout(placement('cpu', ranks=[0, 1]), {src}, [{n}]) -> ")
    assert words in msg
    assert "timed out on rank 0 among ranks [0, 1]" in msg
    assert "Run with GT_DEBUG=1 to learn where each rank was" in msg


def test_debug_names_the_rank_that_moved_past_a_collective():
    """Debug on, and a collective below the checks: the guard names who got past it."""
    def body(rank):
        _shorten_world_timeout(1)
        gt.set_debug(True, timeout=2.5)
        pg = group_of_ranks((0, 1))
        check("step one")
        if rank == 0:
            # let rank 1 get to its next check first (whatever the machine's load)
            c10d._get_default_store().wait(["gt_debug/w/1/1"], datetime.timedelta(seconds=20))

            def stuck():
                with guard("all_reduce in step one", ranks=[0, 1]):
                    dist.all_reduce(torch.ones(2), group=pg)
            return error_or_none(stuck)
        return error_or_none(lambda: check("step two"))  # skipped the all_reduce

    out = run_ranks(body, 2, timeout=30)
    kind, msg = out[0]
    assert kind == "CollectiveTimeoutError"
    assert "all_reduce in step one: timed out on rank 0 among ranks [0, 1]" in msg
    assert "rank 0: #0 step one, rank 1: #1 step two" in msg
    assert "Ranks [1] had already moved past this operation" in msg
    kind, msg = out[1]
    assert kind == "CollectiveTimeoutError"
    assert "rank 0 of the world did not arrive (rank 0 last checked in at #0 step one)" in msg


def test_skipped_user_collective_times_out_naming_it():
    def body(rank):
        _shorten_world_timeout(1)
        pg = group_of_ranks((0, 1))  # every rank makes the group
        if rank != 0:
            return None  # skips the collectives
        return (error_or_none(lambda: gt.comm.all_reduce(torch.ones(2))),
                error_or_none(lambda: gt.comm.broadcast(torch.ones(2), src=0, group=pg)))

    out = run_ranks(body, 3, timeout=30)
    (kind, msg), (kind2, msg2) = out[0]
    assert kind == kind2 == "CollectiveTimeoutError"
    assert msg.startswith("gt.comm.all_reduce: timed out on rank 0 among ranks [0, 1, 2]")
    assert msg2.startswith("gt.comm.broadcast: timed out on rank 0 among ranks [0, 1]")
