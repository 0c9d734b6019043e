"""A job whose rank 1 fails on every attempt (no torch, so it starts in milliseconds).

    fail_always.py DIR

Every rank writes DIR/attempt_<A>_rank_<R> holding its MASTER_PORT and TORCHELASTIC_MAX_RESTARTS
(A: TORCHELASTIC_RESTART_COUNT). Rank 1 waits until rank 0 has written its file for this
attempt, then raises; rank 0 sleeps for a minute (the launcher has to stop it).
"""
import os
import pathlib
import sys
import time

folder = pathlib.Path(sys.argv[1])
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
mine = folder / f"attempt_{attempt}_rank_{rank}"
mine.write_text(f"{os.environ['MASTER_PORT']} {os.environ['TORCHELASTIC_MAX_RESTARTS']}")
if rank != 1:
    time.sleep(60)
    sys.exit(0)
end = time.monotonic() + 30
while not (folder / f"attempt_{attempt}_rank_0").exists() and time.monotonic() < end:
    time.sleep(0.01)
raise RuntimeError(f"rank 1 fails on attempt {attempt}")
