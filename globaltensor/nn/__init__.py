"""Modules and global tensors: ``gt.nn``."""
from . import parallel
