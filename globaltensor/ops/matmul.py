"""Matrix products: split the free dims, or split the contracted dim into partial sums.

``mm``, ``bmm``, ``dot``, ``mv``, ``addmm`` and ``_grouped_mm`` have rules; ``linear``,
``matmul``, ``einsum`` & co run as their decomposition into ops with rules.
"""
from __future__ import annotations

import torch

from .rules import B, P, S, Call, Row, broadcasting, fit, table

from .registry import register

MM = table(
    "S(0) B    -> S(0)",   # rows of the left operand split: each rank computes its rows
    "B    S(1) -> S(1)",   # columns of the right operand split: each rank computes its columns
    "S(1) S(0) -> P",      # the contracted dim split: local products are partial sums
    "P    B    -> P",      # linear in the left operand
    "B    P    -> P",      # ... and in the right one
    "B    B    -> B",      # everything replicated
)
BMM = table(
    "S(0) S(0) -> S(0)",   # batch split: independent matmuls
    "S(1) B    -> S(1)",   # rows split
    "B    S(2) -> S(2)",   # columns split
    "S(2) S(1) -> P",      # contracted dim split: partial sums
    "P    B    -> P",      # linear in the left operand
    "B    P    -> P",      # ... and in the right one
    "B    B    -> B",      # everything replicated
)
DOT = table(
    "S(0) S(0) -> P",      # both vectors split alike: partial sums
    "P    B    -> P",      # linear in either operand
    "B    P    -> P",
    "B    B    -> B",
)
MV = table(
    "S(0) B    -> S(0)",   # matrix rows split
    "S(1) S(0) -> P",      # contracted dim split
    "P    B    -> P",
    "B    P    -> P",
    "B    B    -> B",
)

def addmm(call: Call):
    """``addmm(bias, m1, m2, beta, alpha) = beta * bias + alpha * (m1 @ m2)`` (nn.Linear with a
    bias, GPT-2's Conv1D): mm's rows with the bias split as the output, in the output's dims
    (the bias broadcasts against (rows, columns): a (n,) or (1, n) bias stays whole for a row
    split), and for the partial-sum rows the bias added on one rank only (kernel
    "addmm_partial") or given as a partial sum itself.

        bias         m1    m2    -> out
        S(0)         S(0)  B     -> S(0)    bias split where it has the rows (else B)
        S(1)         B     S(1)  -> S(1)    bias split where it has the columns (else B)
        B            S(1)  S(0)  -> P       kernel: the bias on the first rank of the axis
        B            P     B     -> P       kernel, likewise
        B            B     P     -> P       kernel, likewise
        P            S(1)  S(0)  -> P       a partial bias plus partial products
        P            P     B     -> P
        P            B     P     -> P
        B            B     B     -> B
    """
    rows = (
        Row((S(0), S(0), B), (S(0),)),   # the bias in the output's dims: B where it lacks one
        Row((S(1), B, S(1)), (S(1),)),
        Row((B, S(1), S(0)), (P,), "addmm_partial"),
        Row((B, P, B), (P,), "addmm_partial"),
        Row((B, B, P), (P,), "addmm_partial"),
        Row((P, S(1), S(0)), (P,)),
        Row((P, P, B), (P,)),
        Row((P, B, P), (P,)),
        Row((B, B, B), (B,)),
    )
    frame = (call.shapes[1][0], call.shapes[2][1])
    return broadcasting(rows, call.shapes, inputs=(0,), frame=frame)


def _k_addmm_partial(ctx, largs, lkwargs):
    """A partial-sum addmm: every rank adds its product, the bias only once along each axis
    where the result is a partial sum of products (on that axis' first rank)."""
    if ctx.coord is None:
        return ctx.empties()
    bias, m1, m2 = largs[0], largs[1], largs[2]
    beta, alpha = ctx.arg(largs, lkwargs, "beta", 1), ctx.arg(largs, lkwargs, "alpha", 1)
    out_sbp = ctx.outs.layout.sbp
    kernel_axes = [a for a, v in enumerate(out_sbp)
                   if v == P and ctx.targets[0].sbp[a] != P]  # the bias is whole there
    if all(ctx.coord[a] == 0 for a in kernel_axes):
        return torch.addmm(bias, m1, m2, beta=beta, alpha=alpha)
    product = torch.mm(m1, m2)
    return product if alpha == 1 else product * alpha


# torch._grouped_mm(a, b, offs): one matmul per group g (an expert). Columns: a, b, offs (the
# offsets are read whole: B in every row). Every row runs kernel "grouped_mm", which shifts the
# offsets into this rank's token and expert windows and meets the CPU kernel's 16-byte strides.
# 2-D a (tokens M, K) x 3-D b (G, K, N), offs over the tokens -> (M, N): token rows
# [offs[g-1], offs[g]) times b[g] (HF's MoE experts forward and their input gradient)
GROUPED_TOKENS = table(
    "B    B    B -> B",      # everything whole
    "B    S(2) B -> S(1)",   # Megatron column split of each expert: its output features
    "S(1) S(1) B -> P",      # Megatron row split: the contracted features, partial sums
    "P    B    B -> P",      # linear in the tokens
    "B    P    B -> P",      # ... and in the weights
    "S(0) B    B -> S(0)",   # token split: each rank its rows, the offsets shifted to its window
    "B    S(0) B -> P",      # expert parallel: each rank its experts' rows, zeros elsewhere
)
# 2-D a (K, M tokens) x 2-D b (M tokens, N), offs over the tokens -> (G, K, N): per group the
# product over its token range (the experts' weight gradients)
GROUPED_WEIGHTS = table(
    "B    B    B -> B",      # everything whole
    "S(0) B    B -> S(1)",   # the left operand's rows (features K) split
    "B    S(1) B -> S(2)",   # the right operand's columns (features N) split
    "P    B    B -> P",      # linear in the left operand
    "B    P    B -> P",      # ... and in the right one
    "S(1) S(0) B -> P",      # token split (the grouped contracted dim): sums over each window
    "B    B    B -> S(0)",   # expert parallel: each rank the products of its own experts
)
# 3-D a (G, M, K) x 2-D b (K, N), offs over N -> (M, N): columns [offs[g-1], offs[g]) from a[g]
GROUPED_COLUMNS = table(
    "B    B    B -> B",      # everything whole
    "S(1) B    B -> S(0)",   # the rows M split
    "S(2) S(0) B -> P",      # the contracted dim split: partial sums
    "P    B    B -> P",      # linear in a
    "B    P    B -> P",      # ... and in b
)
# 3-D a (G, M, K) x 3-D b (G, K, N), no offs -> (G, M, N): bmm's rows (the offs column absent)
GROUPED_BATCHED = tuple(Row(r.ins + (B,), r.outs) for r in BMM)


def grouped_mm(call: Call):
    """``_grouped_mm(a, b, offs=None, bias=None, out_dtype=None)``: the table of its form, every
    row through kernel "grouped_mm". With a bias (not on CPU) no row: it runs on B inputs."""
    if call.get("bias") is not None:
        return ()
    forms = {(2, 3): GROUPED_TOKENS, (2, 2): GROUPED_WEIGHTS, (3, 2): GROUPED_COLUMNS,
             (3, 3): GROUPED_BATCHED}
    rows = forms.get((len(call.shapes[0]), len(call.shapes[1])), ())
    present = (True, True, call.is_global("offs"))
    if not present[2] and (len(call.shapes[0]), len(call.shapes[1])) != (3, 3):
        return ()  # groups given by a local offs: nothing to shift; torch needs offs here
    return tuple(Row(r.ins, r.outs, "grouped_mm") for r in fit(rows, present))


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a copy whose matrix stride is a multiple of 16 bytes (what _grouped_mm's CPU
    kernel asks): a piece of a split feature dim may have a stride the full tensor lacks."""
    unit = max(1, 16 // x.element_size())
    rows, cols = x.shape[-2], x.shape[-1]
    stride = x.stride()
    if x.data_ptr() % 16 == 0 and (
            (stride[-1] == 1 and stride[-2] % unit == 0 and stride[-2] >= max(1, cols))
            or (stride[-2] == 1 and stride[-1] % unit == 0 and stride[-1] >= max(1, rows))):
        return x
    padded = x.new_empty((*x.shape[:-1], -(-max(cols, 1) // unit) * unit))[..., :cols]
    return padded.copy_(x)


def _window(bounds, experts, tokens):
    """Experts ``[g0, g1)`` and tokens ``[r0, r1)``: this rank's token range ``[lo, hi)``
    relative to ``r0`` and the local offsets (each expert's end, relative to ``lo``)."""
    (g0, g1), (r0, r1) = experts, tokens
    clip = lambda v: min(max(v - r0, 0), r1 - r0)  # noqa: E731
    lo = clip(bounds[g0 - 1]) if g0 > 0 else 0
    ends = [clip(bounds[g]) for g in range(g0, g1)]
    hi = ends[-1] if ends else lo
    return lo, hi, [e - lo for e in ends]


def _k_grouped_mm(ctx, largs, lkwargs):
    """The local grouped matmul of this rank's expert and token windows (:func:`_windows`);
    rows or experts outside the windows are zeros."""
    if ctx.coord is None:
        return ctx.empties()
    a, b = largs[0], largs[1]
    offs = ctx.arg(largs, lkwargs, "offs")
    rest = _rest(ctx, largs, lkwargs)
    windows = _windows(ctx, b.dim() == 2) if offs is not None and a.dim() == 2 else None
    if windows is None:  # no window to shift: the op on aligned pieces
        return ctx.func(_aligned(a), _aligned(b), offs=offs, **rest)
    lo, hi, ends = _window(offs.tolist(), *windows)
    out = torch.zeros(ctx.outs.layout.local_shape(ctx.coord), dtype=ctx.outs.dtype, device=a.device)
    if hi == lo:
        return out
    local = torch.tensor(ends, dtype=offs.dtype, device=offs.device)
    if b.dim() == 2:  # the weights' form: (experts, K, N) of this rank's experts
        return ctx.func(_aligned(a[:, lo:hi]), _aligned(b[lo:hi]), offs=local, **rest)
    out[lo:hi] = ctx.func(_aligned(a[lo:hi]), _aligned(b), offs=local, **rest)
    return out


def _windows(ctx, weights: bool):
    """(experts, tokens) this rank holds, or None when it holds them all: the token window is
    a's box on the token dim, the expert window b's box on dim 0 (tokens x experts) or the
    output's (the weights' form)."""
    token_dim = 1 if weights else 0
    tokens = ctx.targets[0].box(ctx.coord)[token_dim]
    expert_layout = ctx.outs.layout if weights else ctx.targets[1]
    experts = expert_layout.box(ctx.coord)[0]
    if tokens == (0, ctx.targets[0].shape[token_dim]) and experts == (0, expert_layout.shape[0]):
        return None
    return experts, tokens


def _rest(ctx, largs, lkwargs) -> dict:
    """The call's arguments besides a, b and offs (out_dtype; bias has no row)."""
    values = {n: ctx.arg(largs, lkwargs, n) for n in ("bias", "out_dtype")}
    return {n: v for n, v in values.items() if v is not None}


register("mm", rule=lambda call: MM, order_free=True)
register("addmm", rule=addmm, kernels={"addmm_partial": _k_addmm_partial}, order_free=True)
register("bmm", rule=lambda call: BMM, order_free=True)
register("dot", rule=lambda call: DOT, order_free=True)
register("mv", rule=lambda call: MV, order_free=True)
register("_grouped_mm", rule=grouped_mm, kernels={"grouped_mm": _k_grouped_mm})
register("addmv", "baddbmm", "addbmm", "addmm_", "baddbmm_", "linear", "matmul", "einsum",
         decompose=True)
