"""Scans, order statistics and index ops along one dim: that dim whole, the others split.

    B    -> B ...          everything replicated
    S(d) -> S(d') ...      a dim the op does not run along keeps its split (renumbered when the
                           reduced dim goes: keepdim=False)
    cummax / cummin / logcumsumexp:   along ``dim``
    kthvalue / median / nanmedian / mode (.dim):   reduce ``dim`` (values and indices)
    aminmax:               reduce ``dim`` (or everything)
    nansum / count_nonzero:  a reduced split dim gives P (they are sums of pieces)
    index_fill / index_copy / index_reduce (self, dim, index, [source]):  a dim other than
                           ``dim`` split on self (and source) alike, index whole;
                           index_copy is linear in (self, source): P B P -> P
    take(x, index):        x whole, the index split: B S(d) -> S(d); P B -> P
    trace, vdot:           trace P -> P; vdot S(0) S(0) -> P (a dot product), P B / B P -> P
"""
from __future__ import annotations

from .reductions import all_reduced_rows, reduced_rows, along_dim
from .rules import B, P, S, Call, Ref, Row, dim_of, dims_of, sig
from .registry import register


def _one_dim(call: Call, nouts: int, default=-1, partial=None):
    """Reduce one dim (``dim`` argument, ``default`` when absent); keepdim renumbers."""
    nd = len(call.shapes[0])
    dim = dim_of(call.get("dim", default), nd)
    keep = bool(call.get("keepdim", False))
    rows = [Row((B,), (B,) * nouts)]
    for d in range(nd):
        if d != dim:
            rows.append(Row((S(d),), (S(d if keep else d - (d > dim)),) * nouts))
    return tuple(rows)


def order_statistic(call: Call):
    """kthvalue / median.dim / nanmedian.dim / mode: values and indices along ``dim``."""
    if len(call.shapes[0]) == 0:
        return (sig("B -> B B"),)
    return _one_dim(call, 2)


def whole(nouts: int):
    def rule(call: Call):
        return all_reduced_rows(call, nouts, None)
    return rule


def aminmax(call: Call):
    if call.get("dim") is None or len(call.shapes[0]) == 0:
        return all_reduced_rows(call, 2, None)
    return _one_dim(call, 2)


def sum_like(call: Call):
    """nansum / count_nonzero: sums, so a reduced split dim gives P."""
    nd = len(call.shapes[0])
    dims = dims_of(call.get("dim"), nd)
    if nd == 0:
        return (sig("B -> B"),)
    rows = reduced_rows(call, 1, "") if len(dims) < nd or call.get("keepdim", False) else \
        all_reduced_rows(call, 1, "")
    # no P input: a count of partial sums is not the count of the sum, nor does a nansum of
    # parts skip the NaNs the sum has
    return tuple(r for r in rows if r.ins[0] != P)


def index_along(linear: bool):
    """``index_fill / index_copy / index_reduce(self, dim, index, [source], ...)``."""
    def rule(call: Call):
        x = call.shapes[0]
        nd = len(x)
        dim = dim_of(call.get("dim"), max(nd, 1))
        n = len(call.shapes)
        src = call.get("source")
        rows = [Row((B,) * n, (B,))]
        for d in range(nd):
            if d == dim:
                continue
            ins = []
            for i, shape in enumerate(call.shapes):
                if i == 0 or (isinstance(src, Ref) and i == src.index):
                    ins.append(S(d) if len(shape) == nd and shape[d] == x[d] else None)
                else:
                    ins.append(B)
            if None not in ins:
                rows.append(Row(tuple(ins), (S(d),)))
        if linear and isinstance(src, Ref):
            rows.append(Row(tuple(P if i in (0, src.index) else B for i in range(n)), (P,)))
        return tuple(rows)
    return rule


def take(call: Call):
    nd = len(call.shapes[1])
    return tuple([sig("B B -> B"), sig("P B -> P")] + [Row((B, S(d)), (S(d),)) for d in range(nd)])


def vdot(call: Call):
    return (sig("B B -> B"), sig("S(0) S(0) -> P"), sig("P B -> P"), sig("B P -> P"))


register("cummax", "cummin", rule=along_dim(nouts=2))
register("logcumsumexp", rule=along_dim())
register("kthvalue", "median.dim", "nanmedian.dim", "mode", rule=order_statistic)
register("median.default", "nanmedian.default", rule=whole(1))
register("aminmax", rule=aminmax)
register("nansum", "count_nonzero", rule=sum_like)
register("index_fill", "index_fill_", "index_reduce", "index_reduce_", rule=index_along(False))
register("index_copy", "index_copy_", rule=index_along(True))
register("take", rule=take)
register("trace", rule=lambda call: (sig("B -> B"), sig("P -> P")))
register("vdot", rule=vdot)
