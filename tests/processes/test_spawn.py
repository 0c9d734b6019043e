"""gt.spawn: a real world of processes, results back by local rank, failures named, timeouts.

Each spawned process imports torch (seconds here), so there are few of these and each checks a lot.
"""
import os
import time

import pytest
import torch
import torch.distributed as dist

import globaltensor as gt
from globaltensor.launch.spawn import SpawnError


def _world(local_rank, scale):
    gt.init()
    t = torch.tensor([scale * (gt.env.get_rank() + 1)])
    dist.all_reduce(t)
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK")
    return {"local_rank": local_rank, "rank": gt.env.get_rank(),
            "world_size": gt.env.get_world_size(), "node_rank": gt.env.get_node_rank(),
            "env": [os.environ[n] for n in names], "sum": t.item(), "pgid": os.getpgid(0),
            "pid": os.getpid(), "tensor": t * torch.ones(3)}  # a tensor comes back by value


def _fail_on_rank_1(local_rank, folder):
    if local_rank == 1:
        while not os.path.exists(os.path.join(folder, "pid_0")):  # rank 0 is up
            time.sleep(0.01)
        raise KeyError("boom on rank 1")
    with open(os.path.join(folder, "pid_0.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(folder, "pid_0.tmp"), os.path.join(folder, "pid_0"))
    time.sleep(60)  # must be stopped by spawn, not waited for


def _hang(local_rank):
    time.sleep(60)


def test_spawn_runs_a_real_world_and_returns_results_by_rank():
    out = gt.spawn(_world, args=(2.0,), nproc_per_node=2, timeout=60)
    assert [r["local_rank"] for r in out] == [0, 1] and [r["rank"] for r in out] == [0, 1]
    for rank, r in enumerate(out):
        assert (r["world_size"], r["node_rank"], r["sum"]) == (2, 0, 6.0)  # 2*1 + 2*2
        assert r["env"] == [str(rank), str(rank), "2", "2", "0"]
        assert r["pgid"] == r["pid"]  # each rank leads its own process group
        assert r["tensor"].tolist() == [6.0, 6.0, 6.0]


def test_failing_process_raises_with_rank_and_traceback_and_stops_the_others(tmp_path):
    with pytest.raises(SpawnError, match=r"rank 1 \(local rank 1, pid \d+\) raised KeyError") as e:
        gt.spawn(_fail_on_rank_1, args=(str(tmp_path),), nproc_per_node=2, timeout=60)
    assert "--- traceback of rank 1 ---" in str(e.value) and "_fail_on_rank_1" in str(e.value)
    assert isinstance(e.value, gt.GlobalTensorError)
    pid = int((tmp_path / "pid_0").read_text())
    with pytest.raises(ProcessLookupError):  # rank 0 was stopped and reaped
        os.kill(pid, 0)


def test_timeout_stops_the_job_and_names_the_ranks():
    with pytest.raises(SpawnError, match=r"within 3s, found ranks \[0\] still running"):
        gt.spawn(_hang, nproc_per_node=1, timeout=3)


def test_unpicklable_fn_is_refused_before_starting():
    with pytest.raises(SpawnError, match="expected fn and args that can be pickled"):
        gt.spawn(lambda rank: rank, nproc_per_node=2)
    with pytest.raises(SpawnError, match="expected nproc_per_node >= 1, found 0"):
        gt.spawn(_hang, nproc_per_node=0)
    with pytest.raises(SpawnError, match="found node_rank 3 with nnodes 2"):
        gt.spawn(_hang, nproc_per_node=1, nnodes=2, node_rank=3)


def _joined_by_spawn(local_rank):
    joined_before_fn = dist.is_initialized()
    t = torch.tensor([float(local_rank + 1)])
    gt.comm.all_reduce(t)
    return joined_before_fn, dist.get_backend(), t.item()


def test_spawn_takes_ignites_backend_argument():
    """Ignite's idist.spawn(backend, fn, ...): with backend= each process joins the world first."""
    assert gt.spawn(_joined_by_spawn, nproc_per_node=2, backend="gloo", timeout=60) == \
        [(True, "gloo", 3.0), (True, "gloo", 3.0)]
    with pytest.raises(SpawnError, match=r"expected backend= one of \['gloo', 'nccl'.*found 'glue'"):
        gt.spawn(_joined_by_spawn, nproc_per_node=2, backend="glue")
