"""Modules and global tensors: ``gt.nn``."""
from . import parallel
from .module import to_global, to_local
