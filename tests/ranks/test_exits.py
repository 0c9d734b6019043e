"""globaltensor.world.exits on thread ranks sharing one store (milliseconds): gt.init's closing
rendezvous, and who waits for whom at exit (the process tests are tests/processes/
test_clean_exit.py)."""
import datetime
import threading
import time

import pytest
import torch.distributed as dist

from globaltensor.errors import GlobalTensorError
from globaltensor.world.exits import WorldExit, rendezvous

SECONDS = datetime.timedelta(seconds=10)


def _on_threads(fn, world_size):
    results, threads = [None] * world_size, []
    for r in range(world_size):
        def body(r=r):
            results[r] = fn(r)
        threads.append(threading.Thread(target=body, daemon=True))
        threads[-1].start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return results


def test_rendezvous_returns_once_every_rank_came_and_counts_worlds_on_one_store():
    store = dist.HashStore()
    assert _on_threads(lambda r: rendezvous(store, r, 3, SECONDS), 3) == [0, 0, 0]
    assert _on_threads(lambda r: rendezvous(store, r, 3, SECONDS), 3) == [1, 1, 1]  # a new world


def test_rendezvous_with_a_rank_missing_names_how_many_came():
    store = dist.HashStore()
    with pytest.raises(GlobalTensorError, match=r"expected all 2 ranks to finish gt.init within "
                                                r"0.2s, found 1 \(rank 0 waited\)"):
        rendezvous(store, 0, 2, datetime.timedelta(seconds=0.2))


def _exit(store, rank, world_size, seconds=10.0):
    return WorldExit(store, rank, world_size, datetime.timedelta(seconds=seconds), 0)


def test_rank_0_leaves_after_the_others_and_they_never_wait():
    store, left = dist.HashStore(), {}

    def leave(rank):
        time.sleep(0.3 * rank)  # rank 2 finishes last
        _exit(store, rank, 3)(failed=False)
        left[rank] = time.monotonic()

    _on_threads(leave, 3)
    assert left[0] >= left[2] >= left[1]
    assert [store.get(f"gt/exit/0/{r}") for r in (1, 2)] == [b"ok", b"ok"]


def test_rank_0_failing_does_not_wait_and_a_failing_rank_says_so():
    store = dist.HashStore()
    start = time.monotonic()
    _exit(store, 0, 2)(failed=True)  # rank 1 never left: rank 0 fails without waiting
    assert time.monotonic() - start < 1
    _exit(store, 1, 2)(failed=True)
    assert store.get("gt/exit/0/1") == b"failed"


def test_rank_0_waits_only_until_the_timeout_and_names_who_did_not_leave(capsys):
    store = dist.HashStore()
    _exit(store, 2, 4)(failed=False)
    leave = _exit(store, 0, 4, seconds=0.3)
    leave(failed=False)
    leave(failed=False)  # runs once: atexit and gt.spawn may both call it
    err = capsys.readouterr().err
    assert "rank 0 waited 0s at exit for ranks [1, 3] to finish; leaving without them" in err
    assert err.count("rank 0 waited") == 1
