"""Launch a globaltensor job: ``python launch.py --nproc_per_node 4 script.py [args...]``.

A thin entry point; the launcher lives in globaltensor/launch/ (see docs/launcher.md).
"""
import sys

from globaltensor.launch import main

if __name__ == "__main__":
    sys.exit(main())
