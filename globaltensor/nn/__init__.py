"""Modules and global tensors: ``gt.nn``."""
from . import parallel
from .module import to_global, to_local
from ..grads import set_bucket_cap_mb
