"""Ops whose result cannot be a global tensor: conversions to a sparse or mkldnn layout.

A global tensor is dense (``torch.strided``): its pieces are slices of one dense value, and
the planner moves them as such. These ops have no row; their rule raises a clear error naming
the op before anything runs (every rank alike), instead of a sparse piece inside a dense
wrapper failing later in torch's own code.

    (no row)   _to_sparse, _to_sparse_csr / csc / bsr / bsc, _to_sparse_semi_structured,
               to_mkldnn: an error saying how to convert the whole value or one piece
"""
from __future__ import annotations

from ..errors import GlobalTensorError
from .rules import Call
from .registry import register


def not_dense(call: Call):
    """No row: the result would not be dense."""
    layout = "mkldnn" if "mkldnn" in call.packet else "sparse"
    raise GlobalTensorError(
        f"{call.op}: expected an op whose result is dense (torch.strided), as every global "
        f"tensor is; found a conversion to a {layout} layout. Convert the whole value "
        f"(x.full_tensor(), the same on every rank) or this rank's piece (x.to_local()) instead")


register("_to_sparse", "_to_sparse_csr", "_to_sparse_csc", "_to_sparse_bsr", "_to_sparse_bsc",
         "_to_sparse_semi_structured", "to_mkldnn", rule=not_dense)
