"""Modules and global tensors: ``gt.nn``."""
from . import parallel
from .module import to_global, to_local
from .styles import colwise, rowwise, sbp_plan, sequence
from ..grads import set_bucket_cap_mb

__all__ = ["parallel", "to_global", "to_local", "colwise", "rowwise", "sbp_plan", "sequence",
           "set_bucket_cap_mb"]
