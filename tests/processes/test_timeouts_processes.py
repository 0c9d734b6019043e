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
    assert plain.startswith("plain | CollectiveTimeoutError | redistribution "), plain
    assert "step 1 of 1 (all_gather axis 0 dim 0): timed out on rank 0 among ranks [0, 1]" in plain
    assert checked.startswith("GT_DEBUG=1 | CollectiveTimeoutError | GT_DEBUG: rank 0 waited 2s (the timeout) at "
                              "global operation #1 to_global("), checked
    assert "rank 1 of the world did not arrive (rank 1 last checked in at #0 gt.arange)" in checked
