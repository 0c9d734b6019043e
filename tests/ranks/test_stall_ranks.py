"""The stall report (GT_STALL_REPORT, globaltensor/world/stalls.py): when no rank has made progress for
that long, every rank prints what each rank waits in (or, for a rank stuck in user code, the
line it runs at), long before the timeout.
In real processes: tests/processes/test_launcher_everyday_use.py."""
import datetime
import time

import pytest
import torch
import torch.distributed as dist

import globaltensor as gt
from globaltensor.world import stalls as watch, world
from globaltensor.testing import RankFailed, RanksHung, run_ranks


def _shorten_world_timeout(seconds: float) -> None:
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    backend._set_default_timeout(datetime.timedelta(seconds=seconds))


def test_item_under_if_rank_zero_is_reported_within_the_stall_time(capsys):
    def body(rank):
        _shorten_world_timeout(4)
        world.start_watch(stall_s=1)
        p = gt.placement("cpu", [0, 1])
        x = torch.ones(2).to_global(p, gt.sbp.partial_sum)
        if rank == 0:
            return x.sum().item()  # the classic: rank 1 never joins this all_reduce
        return gt.comm.all_reduce(torch.ones(1))

    start = time.monotonic()
    with pytest.raises((RankFailed, RanksHung)):
        run_ranks(body, 2, timeout=20)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "no rank has made progress" in line]
    assert len(lines) == 2, err  # once on every rank
    text = lines[0]
    assert "rank 0 waits in item() (collective #" in text and "all_reduce over [0, 1])" in text
    assert "rank 1 waits in gt.comm.all_reduce (collective #" in text
    assert "test_stall_ranks.py:" in text and "`return x.sum().item()" in text
    assert "gt.print0" in text
    assert time.monotonic() - start < 15


def test_a_rank_stuck_in_user_code_is_named_with_its_line(capsys):
    def body(rank):
        world.start_watch(stall_s=0.5)
        if rank == 0:
            time.sleep(3)  # stuck in user code: never reaches the barrier while rank 1 waits
        gt.comm.barrier()
        return rank

    assert run_ranks(body, 2, timeout=20) == [0, 1]  # the report does not stop the job
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "no rank has made progress" in line]
    assert lines, err
    text = lines[0]
    assert "rank 1 waits in gt.comm.barrier (collective #" in text
    assert "rank 0 has not reached a collective since its #" in text
    assert "test_stall_ranks.py:" in text and "`time.sleep(3)" in text
    assert "never reaches the collective" in text


def test_a_timeout_names_the_rank_stuck_in_user_code_and_its_line():
    def body(rank):
        _shorten_world_timeout(2)
        world.start_watch(stall_s=1)
        if rank == 0:
            time.sleep(4)  # never joins rank 1's barrier in time
        gt.comm.barrier()
        return rank

    with pytest.raises(RankFailed) as info:
        run_ranks(body, 2, timeout=30)
    text = str(info.value)
    assert "timed out on rank 1" in text
    assert "rank 0 had not reached a collective since its #" in text and "`time.sleep(4)" in text


def test_no_report_while_ranks_make_progress(capsys):
    def body(rank):
        world.start_watch(stall_s=2)
        for _ in range(8):  # each rank enters a collective at least every 0.3 s
            time.sleep(0.2 if rank == 0 else 0.05)
            gt.comm.barrier()
        return rank

    assert run_ranks(body, 2, timeout=20) == [0, 1]
    assert "no rank has made progress" not in capsys.readouterr().err


def test_the_report_text_groups_ranks_and_names_ranks_that_left():
    waits = {r: {"name": "gt.comm.barrier", "number": 7, "line": "t.py:3", "detail": "over [0, 1, 2]"}
             for r in (1, 2)}
    waits[0] = {"name": "item()", "number": 8, "line": "t.py:9", "detail": "all_reduce over [0, 1]"}
    text = watch.stall_report(waits, {3: ("ok", 12)}, 30.2)
    assert text.startswith("globaltensor: no rank has made progress for 30s (GT_STALL_REPORT): "
                           "rank 0 waits in item() (collective #8, all_reduce over [0, 1]) at "
                           "t.py:9; ranks [1, 2] wait in gt.comm.barrier (collective #7, over "
                           "[0, 1, 2]) at t.py:3; rank 3 finished (exit 0) after its collective #12.")


def test_stall_seconds_reads_the_environment():
    assert watch.stall_seconds({}) == 30 and watch.stall_seconds({"GT_STALL_REPORT": "2.5"}) == 2.5
    with pytest.raises(gt.GlobalTensorError, match="GT_STALL_REPORT"):
        watch.stall_seconds({"GT_STALL_REPORT": "soon"})
