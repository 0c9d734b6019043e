"""``gt.auto_layout``: the layout that fits, chosen before launch (docs/auto_layout.md).

    space.py     the candidate layouts (pipeline x data x fully_shard x tensor axes and their
                 options), the links' figures, the batch, the memory bound: pure
    megatron.py  the tensor-parallel plan found from the model (Megatron's pairs)
    build.py     a layout applied to a model: blocks, to_global / fully_shard / checkpointing /
                 Pipeline, the code that spells it, one training step
    figures.py   a simulation's per-rank figures, extrapolated over blocks and priced
    forks.py     each simulation in a fork of the searching process, a few at once
    search.py    the search: bounds, simulations, verification
    table.py     the answer: rows, best first, printable and appliable
"""
from .build import Blocks, checkpoint, stage_modules
from .search import auto_layout
from .space import Batch, Layout, Links
from .table import Row, Table

__all__ = ["Batch", "Blocks", "Layout", "Links", "Row", "Table", "auto_layout", "checkpoint",
           "stage_modules"]
