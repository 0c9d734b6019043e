"""Modules and global tensors: ``gt.nn``, for the user who trains.

    module.py      module.to_global / gt.nn.to_global, to_local; a converted module's entry
                   points run in global mode
    styles.py      ready-made sbp_fns (column / row parallel, ...)
    pretrained.py  HF's save_pretrained on a converted model (one tensor at a time, rank 0 writes)
    loading.py     gt.nn.load_pretrained: an HF safetensors folder read by pieces
    fully_shard.py gt.nn.fully_shard, MixedPrecision: FSDP2's surface (docs/fully_shard.md)
    units.py       a sharded unit's state and schedule: hooks, prefetch, the Unshard node
    pipeline.py    gt.nn.Pipeline: stages on disjoint placements, micro-batches (docs/pipeline.md)
    schedules.py   the schedules as tables (gpipe, 1f1b, interleaved-1f1b): pure
    stages.py      a pipeline's stages, its micro-batches, what crosses between stages
    experts.py     expert parallelism: HF's experts modules dispatch tokens by all-to-all
                   (docs/experts.md)
    parallel/      DistributedDataParallel"""
from . import parallel
from .module import to_global, to_local
from .fully_shard import FSDPModule, MixedPrecision, fully_shard
from .loading import load_pretrained
from .pipeline import Pipeline
from .styles import colwise, rowwise, sbp_plan, sequence
from ..grads import set_bucket_cap_mb

__all__ = ["FSDPModule", "MixedPrecision", "Pipeline", "fully_shard", "load_pretrained", "parallel", "to_global", "to_local", "colwise", "rowwise", "sbp_plan", "sequence",
           "set_bucket_cap_mb"]
