"""``python -m globaltensor --nproc_per_node 4 train.py``: the launcher (see globaltensor/launch/cli.py)."""
import sys

from .launch import main

if __name__ == "__main__":
    sys.exit(main())
