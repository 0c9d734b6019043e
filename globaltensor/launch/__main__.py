"""``python -m globaltensor.launch --nproc_per_node 4 train.py``: the launcher (see cli.py)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
