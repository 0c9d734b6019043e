"""Clean exits (docs/launcher.md, "What happens at exit"): a job whose ranks all succeed exits 0
on every rank, every time, however it was started (launch.py, torchrun-style variables, srun's
variables, gt.spawn), for a two-line script and for one that works and never calls
destroy_process_group; rank 0, which hosts the store, leaves last; a failing rank still exits at
once with its error.

Each run starts processes that import torch (seconds here): the default suite runs each way of
starting REPEAT times, `pytest -m slow` runs it 20 times. Every run has a timeout."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import globaltensor as gt
from globaltensor import launch
from globaltensor.launch.spawn import SpawnError
from globaltensor.testing import run_script

REPEAT, SLOW_REPEAT = 1, 20  # the default run: the working script once per way
RUN_TIMEOUT = 90

SHORT = """
import globaltensor as gt
gt.init()
print("rank", gt.env.get_rank(), flush=True)
"""
# works (a global op, a collective, a group per placement axis) and never destroys the world
WORK = """
import torch
import globaltensor as gt
gt.init()
p = gt.placement("cpu", list(range(gt.env.get_world_size())))
x = torch.arange(8.0).to_global(p, gt.sbp.broadcast).to_global(p, gt.sbp.split(0))
t = torch.ones(1)
gt.comm.all_reduce(t)
print("rank", gt.env.get_rank(), (x * 2).sum().item(), t.item(), flush=True)
"""
ENV = {k: v for k, v in os.environ.items()
       if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
ENV.update(OMP_NUM_THREADS="1", GT_TIMEOUT="60")


def _rank_env(way: str, rank: int, port: int) -> dict:
    """One rank's variables as torchrun or srun sets them (no launcher of ours)."""
    if way == "torchrun":
        return dict(ENV, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                    LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return dict(ENV, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS="2",
                SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="77", MASTER_PORT=str(port))


def _run_ranks(source: str, way: str, tmp_path, env=None, timeout=RUN_TIMEOUT):
    """Start two ranks as ``way`` does; return (exit codes, outputs, exit times) by rank."""
    script = tmp_path / "rank_script.py"
    script.write_text(source)
    port = launch.free_port()
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                              env=dict(_rank_env(way, r, port), **(env or {})))
             for r in (0, 1)]
    ended = [None, None]  # time.monotonic() when each rank's process ended
    deadline = time.monotonic() + timeout
    try:
        while None in ended and time.monotonic() < deadline:
            for r, p in enumerate(procs):
                if ended[r] is None and p.poll() is not None:
                    ended[r] = time.monotonic()
            time.sleep(0.01)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outs = [p.communicate(timeout=10) for p in procs]
    return [p.returncode for p in procs], outs, ended


def _expected(source: str, rank: int) -> str:
    return f"rank {rank}" + (" 56.0 2.0" if source is WORK else "")


def _one_run(way: str, source: str, tmp_path) -> None:
    if way == "launch":
        run = run_script(source, 2, timeout=RUN_TIMEOUT, env=ENV)
        assert run.returncode == 0, run.stderr[-3000:]
        for rank in (0, 1):
            assert run.rank_lines(rank) == [_expected(source, rank)], run.stdout
        assert "[launch]" not in run.stderr, run.stderr[-3000:]
        return
    codes, outs, _ = _run_ranks(source, way, tmp_path)
    assert codes == [0, 0], outs
    assert [o.split("\n")[0] for o, _ in outs] == [_expected(source, 0), _expected(source, 1)]


def _spawned_work(local_rank):
    import torch

    gt.init()
    t = torch.ones(1) * (local_rank + 1)
    gt.comm.all_reduce(t)
    return t.item()  # never destroys the world: gt.spawn's process leaves it


def _repeat(way: str, times: int, tmp_path) -> None:
    for i in range(times):
        if way == "spawn":  # gt.spawn raises if a process does not exit 0 after its result
            assert gt.spawn(_spawned_work, nproc_per_node=2, timeout=RUN_TIMEOUT) == [3.0, 3.0]
        else:
            _one_run(way, WORK if i % 2 == 0 else SHORT, tmp_path)


WAYS = [pytest.param("launch", marks=pytest.mark.slow),  # (launch.py: test_launch_processes)
        pytest.param("torchrun", marks=pytest.mark.slow),
        pytest.param("srun", marks=pytest.mark.slow), "spawn"]


@pytest.mark.parametrize("way", WAYS)
def test_a_job_whose_ranks_succeed_exits_0_on_every_rank_every_time(way, tmp_path):
    _repeat(way, REPEAT, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("way", WAYS)
def test_twenty_times_in_a_row(way, tmp_path):
    _repeat(way, SLOW_REPEAT, tmp_path)


ORDER = """
import sys, time
import globaltensor as gt
gt.init()
rank = gt.env.get_rank()
if rank == 1:
    time.sleep(2.0)  # rank 0, with the store, is done long before
print("done", rank, time.time(), flush=True)
"""


@pytest.mark.slow  # the default run checks every way of starting exits 0
def test_rank_0_hosts_the_store_and_leaves_after_the_others(tmp_path):
    codes, outs, ended = _run_ranks(ORDER, "torchrun", tmp_path)
    assert codes == [0, 0], outs
    rank_1_done = float(outs[1][0].split()[2])  # its last line of work (its exit follows)
    rank_0_ended = time.time() - (time.monotonic() - ended[0])
    assert rank_0_ended > rank_1_done, "rank 0 left while rank 1 worked: the store went with it"


FAIL = """
import os, sys, time
import globaltensor as gt
gt.init()
rank = gt.env.get_rank()
how = os.environ["HOW"]
if rank == int(os.environ["FAILING"]):
    if how == "raise":
        raise KeyError("boom on rank %d" % rank)
    if how == "exit":
        sys.exit(3)
    os.kill(os.getpid(), 9)
time.sleep(float(os.environ["OTHER_SLEEPS"]))
print("survived", rank, flush=True)
"""


@pytest.mark.parametrize("failing, how, code", [  # the first in the default run, all under -m slow
    (1, "raise", 1), pytest.param(1, "exit", 3, marks=pytest.mark.slow),
    pytest.param(0, "raise", 1, marks=pytest.mark.slow)])
def test_a_failing_rank_exits_at_once_with_its_error(failing, how, code, tmp_path):
    start = time.monotonic()
    env = {"FAILING": str(failing), "HOW": how, "OTHER_SLEEPS": "3", "GT_TIMEOUT": "60"}
    codes, outs, ended = _run_ranks(FAIL, "torchrun", tmp_path, env=env)
    assert codes[failing] == code, outs
    assert codes[1 - failing] == 0, outs
    assert ended[failing] - start < 30  # not the 60 s timeout: it did not wait for anyone
    assert ended[failing] < ended[1 - failing], "the failing rank waited for the other"
    if how == "raise":
        assert f"KeyError: 'boom on rank {failing}'" in outs[failing][1]


@pytest.mark.slow
def test_rank_0_waits_for_a_killed_rank_only_until_the_timeout(tmp_path):
    env = {"FAILING": "1", "HOW": "kill", "OTHER_SLEEPS": "0", "GT_TIMEOUT": "3"}
    codes, outs, ended = _run_ranks(FAIL, "torchrun", tmp_path, env=env)
    assert codes == [0, -signal.SIGKILL], outs
    assert outs[0][0] == "survived 0\n"
    assert re.search(r"rank 0 waited \d+s at exit for ranks \[1\] to finish; leaving without them",
                     outs[0][1]), outs[0][1]


def _crash_after_returning(local_rank):
    import atexit

    gt.init()
    if local_rank == 1:
        atexit.register(os.abort)  # the result is sent, then the process dies on its way out
    return local_rank


def test_spawn_reports_a_process_that_crashes_after_returning_its_result():
    with pytest.raises(SpawnError, match=r"expected every process to exit 0 after returning its "
                                         r"result, found rank 1 \(local rank 1, pid \d+\) was "
                                         r"killed by SIGABRT while leaving the world"):
        gt.spawn(_crash_after_returning, nproc_per_node=2, timeout=RUN_TIMEOUT)
