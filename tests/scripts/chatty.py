"""A torch-free rank for the launcher's output tests: ``chatty.py ACTION``.

``progress``: writes ``tick <time>\\r`` with no newline, then waits 3 s before ending the line.
``traceback``: 30 lines of noise on stderr, then a traceback with torch's ``[rank0]:`` prefix
on every line, then exit 1. ``abort``: os.abort() (SIGABRT, as gloo on a mismatch). ``bars``: a tqdm
bar of 4 steps on stderr, a print on stdout in the middle.
"""
import os
import sys
import time

rank, action = os.environ["RANK"], sys.argv[1]
if action == "progress":
    sys.stdout.write(f"tick {time.time()}\r")
    sys.stdout.flush()
    time.sleep(3)
    print("done")
elif action == "traceback":
    for i in range(30):
        print(f"noise {i}", file=sys.stderr)
    for line in ("Traceback (most recent call last):", '  File "train.py", line 3, in <module>',
                 "RuntimeError: boom"):
        print(f"[rank{rank}]: {line}", file=sys.stderr)
    sys.exit(1)
elif action == "abort":
    print(f"rank {rank} aborting", file=sys.stderr, flush=True)
    os.abort()
elif action == "bars":  # a tqdm bar on stderr, with a print on stdout in the middle
    from tqdm import tqdm

    for i in tqdm(range(4), mininterval=0, ncols=60, ascii=True):
        time.sleep(0.3)
        if i == 1:
            print("between", flush=True)
    print("after", file=sys.stderr)
else:
    print(f"rank {rank} of {os.environ['WORLD_SIZE']} says {action}")
