"""Linear algebra and FFTs over batch dims, and complex views.

A matrix op (inverse, solve, decompositions) reads the whole of its last two dims (the *core*)
but treats each batch entry on its own, so its batch dims may stay split. An FFT mixes the
values of the dims it transforms only.

    B    B    -> B ...        everything replicated
    S(b) S(b) -> S(b) ...     a batch dim b (before the core) that every tensor input has, at
                              the same place and size (no broadcasting over it): every output
                              is split on it too (outputs start with the batch dims)
    B    S(k) -> S(k)         triangular/LU solves with left=True: the columns of the right-hand
                              side are independent (k its last dim); left=False: its rows
    fft:  S(d) -> S(d)        a dim the FFT does not transform; P -> P (an FFT is linear)
    view_as_real / view_as_complex / conj_physical / _conj / complex:  S(d) -> S(d) (not the
                              (re, im) dim), P -> P (linear over the reals); _conj's piece is a
                              conjugate view, its bit on the wrapper too (outputs.lazy_bits), and
                              a move resolves it (runtime.execute: no collective sends the bit)
"""
from __future__ import annotations

from .rules import B, S, Call, Ref, Row, dims_of, repeat, sig

from .registry import register

# op -> (number of outputs, (tensor input, its core dims)...): an input's leading dims before
# its core are its batch dims; a row splits a batch dim only when every input has the same
# batch shape (no broadcasting over batch dims)
M, V = 2, 1  # a matrix core, a vector core
BATCHED = {
    "linalg_solve_triangular": (1, ("self", M), ("B", M)),
    "linalg_lu_solve": (1, ("LU", M), ("pivots", V), ("B", M)),
    "lu_unpack": (3, ("LU_data", M), ("LU_pivots", V)),
    "linalg_pinv.atol_rtol_tensor": (1, ("self", M), ("atol", 0), ("rtol", 0)),
    "_linalg_svd": (3, ("A", M)), "linalg_inv_ex": (2, ("A", M)),
    "_linalg_solve_ex": (4, ("A", M), ("B", None)), "linalg_lu_factor_ex": (3, ("A", M)),
    "linalg_cholesky_ex": (2, ("self", M)), "linalg_eig": (2, ("self", M)),
    "_linalg_eigh": (2, ("A", M)), "linalg_ldl_factor_ex": (3, ("self", M)),
    "linalg_ldl_solve": (1, ("LD", M), ("pivots", V), ("B", M)),
    "_linalg_det": (3, ("A", M)), "_linalg_slogdet": (4, ("A", M)), "linalg_lu": (3, ("A", M)),
    "linalg_qr": (2, ("A", M)), "linalg_householder_product": (1, ("input", M), ("tau", V)),
    "cholesky": (1, ("self", M)), "cholesky_inverse": (1, ("self", M)),
    "cholesky_solve": (1, ("self", M), ("input2", M)),
    "triangular_solve": (2, ("self", M), ("A", M)), "linalg_matrix_exp": (1, ("self", M)),
    "ormqr": (1, ("self", M), ("input2", V), ("input3", M)), "linalg_eigvals": (1, ("self", M)),
    "_linalg_check_errors": (0, ("info", 0)),
}
# solves: the right-hand side input, whose columns (left=True) or rows are independent
RHS = {"linalg_solve_triangular": "B", "linalg_lu_solve": "B", "cholesky_solve": "self",
       "triangular_solve": "self"}


def _empty_outputs(call: Call) -> bool:
    """Whether the call gives some outputs as empty placeholders (no batch dims to split)."""
    return (call.get("compute_uv", True) is False or call.get("compute_v", True) is False
            or call.get("unpack_data", True) is False or call.get("unpack_pivots", True) is False
            or call.get("mode", "reduced") == "r")


def _batch_dims(call: Call, cores) -> int:
    """How many leading batch dims every tensor input shares (0 when they differ)."""
    batch = None
    a_shape = call.shape_of(cores[0][0])
    for name, core in cores:
        shape = call.shape_of(name)
        if shape is None:
            continue
        if core is None:  # _linalg_solve_ex's B: a vector where it is A's shape minus one dim
            core = V if len(shape) == 1 or tuple(shape) == tuple(a_shape[:-1]) else M
        if len(shape) < core:
            return 0
        mine = tuple(shape[:len(shape) - core])
        if batch is not None and mine != batch:
            return 0
        batch = mine
    return len(batch or ())


def batched(call: Call):
    """Matrix ops: any batch dim every input shares passes its split to every output; the
    right-hand side of a solve may be split along its independent columns (rows)."""
    nouts, *cores = BATCHED.get(call.op) or BATCHED[call.packet]
    n = len(call.shapes)
    rows = [Row(repeat(n, B), repeat(nouts, B))]
    if _empty_outputs(call):
        return tuple(rows)
    nb = _batch_dims(call, cores)
    rows += [Row(repeat(n, S(d)), repeat(nouts, S(d))) for d in range(nb)]
    rhs = RHS.get(call.packet)
    if rhs is not None and nouts == 1 and call.is_global(rhs):
        left = True if call.packet == "cholesky_solve" else call.get("left", True)
        nd = len(call.shape_of(rhs))
        index = call.get(rhs).index
        # an independent dim of the rhs is a dim of the output at the same place only when
        # the rhs is not broadcast against the matrix's batch dims
        if nd >= 2 and all(len(s) <= nd for s in call.shapes):
            k = nd - 1 if left else nd - 2
            rows.append(Row(tuple(S(k) if i == index else B for i in range(n)), (S(k),)))
    return tuple(rows)


def cross(call: Call):
    """``linalg_cross(x, y, dim)``: the cross-product dim whole; other dims split alike (equal
    shapes: no broadcasting)."""
    nd = len(call.shapes[0])
    dim = call.get("dim", -1) % nd
    rows = [sig("B B -> B")]
    if len(set(call.shapes)) == 1:
        rows += [Row((S(d), S(d)), (S(d),)) for d in range(nd) if d != dim]
    return tuple(rows)


def _fft_dims(call: Call) -> tuple[int, ...]:
    return dims_of(call.get("dim"), len(call.shapes[0]))


def fft(call: Call):
    """``_fft_r2c`` / ``_fft_c2c`` / ``_fft_c2r(x, dim, ...)``: the transformed dims whole."""
    dims = _fft_dims(call)
    nd = len(call.shapes[0])
    return (sig("B -> B"), sig("P -> P")) + tuple(
        Row((S(d),), (S(d),)) for d in range(nd) if d not in dims)


def complex_view(drop_last: bool):
    """view_as_real (adds a last dim of 2), view_as_complex (removes it), conj: splits pass."""
    def rule(call: Call):
        nd = len(call.shapes[0])
        keep = nd - 1 if drop_last else nd
        return (sig("B -> B"), sig("P -> P")) + tuple(Row((S(d),), (S(d),)) for d in range(keep))
    return rule


def view_as_real(call: Call):
    """``view_as_real``: kernel "real_view" (a piece that carries the conjugate bit, as a
    ``_conj`` of a piece gives, is resolved first: torch refuses to view it)."""
    return tuple(Row(r.ins, r.outs, "real_view") for r in complex_view(False)(call))


def _k_real_view(ctx, largs, lkwargs):
    if ctx.coord is None:
        return ctx.empties()
    x = largs[0]
    return ctx.func(x.resolve_conj() if x.is_conj() else x)


def complex_(call: Call):
    """``complex(real, imag)``: element-wise (equal shapes), linear in both together."""
    rows = [sig("B B -> B")]
    if isinstance(call.get("real"), Ref) and isinstance(call.get("imag"), Ref):
        rows.append(sig("P P -> P"))
        if call.shapes[0] == call.shapes[1]:
            rows += [Row((S(d), S(d)), (S(d),)) for d in range(len(call.shapes[0]))]
    return tuple(rows)


def polar(call: Call):
    """``polar(abs, angle)``: element-wise (equal shapes); not linear."""
    rows = [sig("B B -> B")]
    if call.shapes[0] == call.shapes[1]:
        rows += [Row((S(d), S(d)), (S(d),)) for d in range(len(call.shapes[0]))]
    return tuple(rows)


for _op in BATCHED:
    register(_op, rule=batched)
register("linalg_cross", rule=cross)
register("_fft_r2c", "_fft_c2c", "_fft_c2r", rule=fft)
register("view_as_real", rule=view_as_real, kernels={"real_view": _k_real_view})
register("_conj_physical", "conj_physical", "_conj", rule=complex_view(False))
register("view_as_complex", rule=complex_view(True))
register("complex", rule=complex_)
register("polar", rule=polar)
