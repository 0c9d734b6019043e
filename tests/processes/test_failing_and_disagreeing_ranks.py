"""In real processes: a rank whose program raises is named in
every other rank's error (its own report through the store); ranks that disagree on a tensor's
dtype or shape end with an error, never SIGABRT, also where one of them has run the plan before.

The ranks are started here directly (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT), not through
the launcher: the launcher stops the other ranks as soon as one exits, which would race with the
survivors printing the error under test."""
import os
import socket
import subprocess
import sys
import tempfile

import pytest

from helpers import ROOT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(source: str, n: int, timeout: float = 60) -> list[subprocess.CompletedProcess]:
    """Run ``source`` as ``n`` ranks of one job; every rank's completed process."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="gt-rel3-") as tmp:
        path = os.path.join(tmp, "script.py")
        with open(path, "w") as f:
            f.write(source)
        procs = []
        for rank in range(n):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
            env.pop("GT_DEBUG", None)
            procs.append(subprocess.Popen([sys.executable, path], cwd=ROOT, env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          stdin=subprocess.DEVNULL))
        done = []
        for p in procs:
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        return done


# --- 5. the failing rank is named ---------------------------------------------------------------

_ONE_RANK_RAISES = """
import globaltensor as gt
gt.init(timeout=30)
p = gt.placement.all("cpu")
x = gt.arange(6, placement=p, sbp=gt.sbp.split(0))
if gt.env.get_rank() == 1:
    raise RuntimeError("boom on purpose")
try:
    x.to_global(sbp=gt.sbp.broadcast)
    print("no error", flush=True)
except gt.GlobalTensorError as e:
    print("ERROR", type(e).__name__, "|", e, flush=True)
"""


def _check_named(runs):
    assert runs[1].returncode != 0 and "RuntimeError: boom on purpose" in runs[1].stderr
    for rank in (0, 2):
        out = runs[rank].stdout
        assert out.startswith("ERROR"), (rank, out, runs[rank].stderr[-2000:])
        assert "rank 1 left the job: its program raised RuntimeError: boom on purpose" in out, out
        assert f"[rank {rank} learnt it while waiting in" in out


def test_a_rank_that_raises_is_named_in_every_other_ranks_error():
    _check_named(_run_ranks(_ONE_RANK_RAISES, 3))


@pytest.mark.slow
def test_a_rank_that_raises_is_named_twenty_times_in_a_row():
    for _ in range(20):
        _check_named(_run_ranks(_ONE_RANK_RAISES, 3))


# --- 1. disagreeing ranks in real processes: an error, never SIGABRT --------------------------

_DISAGREE = """
import torch, globaltensor as gt
gt.init(timeout=4)
rank = gt.env.get_rank()
p = gt.placement.all("cpu")
if {warm}:  # every rank runs the float32 plan once: rank 1 alone then meets float64 first
    gt.ones(8, placement=p, sbp=gt.sbp.split(0)).to_global(sbp=gt.sbp.broadcast)
x = gt.ones(8, dtype=torch.float64 if rank == 1 else torch.float32, placement=p,
            sbp=gt.sbp.split(0))
try:
    y = x.to_global(sbp=gt.sbp.broadcast)
    print("VALUE", y.to_local().tolist(), flush=True)
except gt.GlobalTensorError as e:
    print("ERROR", type(e).__name__, "|", e, flush=True)
"""


@pytest.mark.parametrize("warm", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["first use", "one rank warm"])
def test_disagreeing_ranks_in_processes_never_abort_nor_return_garbage(warm):
    runs = _run_ranks(_DISAGREE.format(warm=warm), 3)
    for rank, run in enumerate(runs):
        assert run.returncode == 0, (rank, run.returncode, run.stderr[-2000:])  # never SIGABRT
        assert run.stdout.startswith("ERROR"), (rank, run.stdout)
        if not warm:
            assert "ShapeMismatchError" in run.stdout or "LocalOpFailed" in run.stdout
            assert "ranks [1]: float64 Layout(" in run.stdout
