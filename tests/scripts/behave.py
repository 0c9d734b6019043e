"""A rank that misbehaves on purpose (no torch, so it starts in milliseconds).

    behave.py DIR NPROC ACTING_RANK ACTION

Every rank prints ``pid <pid>`` and marks DIR/started_<rank>. The acting rank waits until all
NPROC ranks have started, writes a line to stderr, then does ACTION:
``exit:<code>``, ``sigkill``, ``hang`` or ``ok``. For ``hang`` and ``ok`` the other ranks exit 0
at once; for the failures they sleep for a minute (so the launcher has to stop them).
"""
import os
import pathlib
import signal
import sys
import time

folder, nproc, acting, action = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rank = int(os.environ["RANK"])
print(f"pid {os.getpid()}", flush=True)
pathlib.Path(folder, f"started_{rank}").touch()

if rank != acting:
    if action not in ("hang", "ok"):
        time.sleep(60)
    sys.exit(0)

end = time.monotonic() + 30
while len(list(pathlib.Path(folder).glob("started_*"))) < nproc and time.monotonic() < end:
    time.sleep(0.01)
print(f"rank {rank} about to {action}", file=sys.stderr, flush=True)
if action.startswith("exit:"):
    sys.exit(int(action.split(":")[1]))
if action == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
if action == "hang":
    time.sleep(60)
