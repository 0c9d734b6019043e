"""Data parallel training: ``gt.nn.parallel.DistributedDataParallel`` (distributed.py)."""
from .distributed import Bucket, DistributedDataParallel, plan_buckets

__all__ = ["Bucket", "DistributedDataParallel", "plan_buckets"]
