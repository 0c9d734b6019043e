"""The thread-per-rank harness itself: real gloo, timeouts, failing-rank reports."""
import pytest
import torch
import torch.distributed as dist

import globaltensor as gt
from globaltensor.testing import RankFailed, RanksHung, run_ranks


@pytest.mark.parametrize("n", [1, 2, 4])
def test_all_reduce_on_thread_ranks(n):
    def body(rank):
        t = torch.full((2,), float(rank))
        dist.all_reduce(t)
        return t.tolist(), gt.env.get_rank(), gt.env.get_world_size(), gt.env.get_local_rank()

    out = run_ranks(body, n, timeout=30)
    total = float(sum(range(n)))
    assert out == [([total, total], r, n, r) for r in range(n)]


def test_failing_rank_traceback_is_reported():
    def body(rank):
        if rank == 1:
            raise KeyError("boom on one")
        dist.barrier()

    with pytest.raises(RankFailed, match="rank 1 of 3 raised KeyError") as info:
        run_ranks(body, 3, timeout=30)
    assert "boom on one" in str(info.value) and "Traceback" in str(info.value)


def test_skipped_collective_is_reported_as_hang():
    def body(rank):
        if rank != 0:
            dist.barrier()

    with pytest.raises(RanksHung, match=r"ranks \[1, 2\] still running"):
        run_ranks(body, 3, timeout=2)


def test_node_info_per_thread():
    out = run_ranks(lambda r: (gt.env.get_local_rank(), gt.env.get_node_rank(),
                               gt.env.get_node_size(), gt.env.get_local_world_size()),
                    4, timeout=30, local_world_size=2)
    assert out == [(0, 0, 2, 2), (1, 0, 2, 2), (0, 1, 2, 2), (1, 1, 2, 2)]
