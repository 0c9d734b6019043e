"""Timeouts that explain, in real processes through the launcher: gt.init(timeout=...) makes a
skipped redistribution an error naming it, not a hang."""
import os

from globaltensor.testing import run_script


# --- real processes through the launcher, gt.init(timeout=...) ---------------------------------------

_SKIPPER = """
import datetime, sys
import torch.distributed.distributed_c10d as c10d
import globaltensor as gt
gt.init(timeout=2)
store = c10d._get_default_store()
p = gt.placement.all("cpu")
for phase, flag in (("plain", False), ("GT_DEBUG=1", None)):  # None: as GT_DEBUG says
    gt.set_debug(flag)
    x = gt.arange(8, placement=p, sbp=gt.sbp.split(0))
    if gt.env.get_rank() == 1:   # skips the redistribution below, but stays alive
        store.wait([phase], datetime.timedelta(seconds=60))
        continue
    try:
        x.to_global(sbp=gt.sbp.broadcast)
        print(phase, "| no error")
    except gt.GlobalTensorError as e:
        print(phase, "|", type(e).__name__, "|", str(e).replace("\\n", " "))
    store.set(phase, "done")
"""


def test_init_timeout_end_to_end():
    """gt.init(timeout=2) in real processes; a rank skips a redistribution, without and with
    GT_DEBUG=1 (read from the environment): rank 0 gets an error naming it, not a hang."""
    env = dict(os.environ, GT_DEBUG="1", OMP_NUM_THREADS="1")
    run = run_script(_SKIPPER, 2, timeout=90, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    plain, checked = run.rank_lines(0)
    assert plain.startswith("plain | CollectiveTimeoutError | to_global: redistribution "), plain
    assert "step 1 of 1 (all_gather axis 0 dim 0): timed out on rank 0 among ranks [0, 1]" in plain
    assert checked.startswith("GT_DEBUG=1 | CollectiveTimeoutError | GT_DEBUG: rank 0 waited 2s (the timeout) at "
                              "global operation #1 to_global("), checked
    assert "rank 1 of the world did not arrive (rank 1 last checked in at #0 gt.arange)" in checked


_ONE_RANK_FAILS = """
import torch
import globaltensor as gt
gt.init(timeout=60)
p = gt.placement("cpu", [0, 1])
x = gt.tensor(torch.arange(8.0).reshape(4, 2), placement=p, sbp=gt.sbp.broadcast)
index = torch.tensor([[0], [1]]) if gt.env.get_rank() == 0 else torch.tensor([[2], [9]])
idx = index.to_global(placement=p, sbp=gt.sbp.split(0))  # global (4, 1), split by rows
y = x.gather(0, idx)  # each rank gathers with its rows; rank 1's index 9 is out of range
print("rank", gt.env.get_rank(), "went on", (y * 2).full_tensor().sum().item(), flush=True)
"""


def test_a_local_op_failing_on_one_rank_ends_the_job_promptly():
    """A global op whose local computation fails on one rank only (a data-dependent error): in a
    real job that rank exits with its error and the launcher stops the others at once, instead
    of leaving them in the next collective until the world's timeout."""
    import time

    start = time.monotonic()
    run = run_script(_ONE_RANK_FAILS, 2, timeout=90, env=dict(os.environ, OMP_NUM_THREADS="1"))
    elapsed = time.monotonic() - start
    assert run.returncode != 0
    assert "index 9 is out of bounds" in run.stdout + run.stderr
    assert "[launch] rank 1 (local rank 1" in run.stderr  # the failing rank first, whoever ended
    assert "the last traceback of rank 1's stderr" in run.stderr  # first
    assert elapsed < 40  # the world's timeout is 60 s: nobody waited for it


_EMPTY_PIECE_REFUSED = """
import torch
import globaltensor as gt
from globaltensor.ops import register, table

@torch.library.custom_op("gt_tests::three_ones", mutates_args=())
def three_ones(x: torch.Tensor) -> torch.Tensor:  # ones(3), but refusing an empty x, like
    if x.numel() == 0:                            # some of torch's kernels
        raise RuntimeError("Non-empty tensor expected")
    return x.new_ones(3)

@three_ones.register_fake
def _(x):
    return x.new_empty(3)

register("gt_tests::three_ones.default", rule=lambda call: table("B -> B", "S(0) -> B"))
gt.init(timeout=60)
x = gt.tensor(torch.ones(1, 4), placement=gt.placement("cpu", [0, 1]), sbp=gt.sbp.split(0))
y = three_ones(x)  # 1 row over 2 ranks: rank 1's piece is empty, its kernel raises
x.to_global(sbp=gt.sbp.broadcast)
print("rank", gt.env.get_rank(), "holds", y.to_local().tolist(), flush=True)
"""


def test_a_kernel_refusing_an_empty_piece_never_makes_up_a_result_that_holds_values():
    """Where a rank's piece is empty and its kernel refuses it, zeros are its result only when
    they are exact (an empty piece, a partial sum of nothing: the upsampling, padding and fft
    rows of test_ops_coverage on uneven splits). This result is B with 3 values: zeros there
    would be a replica differing from rank 0's ones, silently; the job fails with the error."""
    run = run_script(_EMPTY_PIECE_REFUSED, 2, timeout=90, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode != 0
    assert "Non-empty tensor expected" in run.stdout + run.stderr
    assert "holds [0.0, 0.0, 0.0]" not in run.stdout
