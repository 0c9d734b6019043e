"""Launch a globaltensor job: ``python launch.py --nproc_per_node 4 script.py [args...]``.

A thin entry point; the launcher lives in globaltensor/launch/ (see docs/launcher.md).
"""
import sys

__globaltensor_launcher__ = True  # globaltensor/_startup.py: this process needs no torch
from globaltensor.launch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
