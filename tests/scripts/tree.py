"""A rank that starts a child process of its own, reports both pids, then waits to be stopped."""
import os
import subprocess
import sys
import time

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(f"pids {os.getpid()} {child.pid}", flush=True)
time.sleep(60)
