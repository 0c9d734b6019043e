"""Rows over head-tail splits: a rule whose rows do not read positions along the dims they
split (``Rule.order_free``) runs them as well on pieces that hold those dims permuted
(docs/long_context.md, "Head-tail").

A head-tail layout is its plain layout of the tensor permuted along the dim
(:meth:`Layout.plain`). An op that commutes with one permutation applied alike to the split
dims of its inputs and outputs (element-wise ops, contractions and reductions over the dim,
rows that keep it whole) gives on those pieces the permuted result's pieces: its row ``S(d) ...
-> S(e)`` holds with every split on that axis head-tail, provided every input it splits there
has one size along the split dim (the permutation depends on the size and the axis's ranks).
Such rows are added on each axis where an input is head-tail; a candidate that would put a
head-tail split beside another split of the same dim is left out. The fuzzer runs random
programs on head-tail inputs against the full tensors (tests/ranks/ops/test_fuzz.py): a rule
that claims order-freedom wrongly fails there.

Pure: no torch.distributed, no rank.
"""
from __future__ import annotations

from ...sbp import HEAD_TAIL, Split
from ..rules import Row, Rule

# the kernels that read no positions along a split dim (sizes, or another dim's range, only)
ORDER_FREE_KERNELS = frozenset({"mean_partial", "softmax_split", "softmax_back_split",
                                "addmm_partial", "squeeze", "embedding_vocab", "nll",
                                "nll_back", "loss_mean", "attention_pieces"})


def with_balanced(rule: Rule, layouts, options, grid, fixed=(), free=()):
    """``(options, rule)`` with, on each axis of more than one rank where an input is
    head-tail, the order-free rows also in their head-tail form; the rule's check then also
    leaves out candidates splitting a head-tail dim on another axis. ``fixed``: inputs (an
    in-place op's self) whose layout, and the result's, must not change; ``free``: per input,
    the layouts it is already available in (a head-tail one counts as an input's own)."""
    if not rule.order_free:
        return options, rule
    added = False
    out = []
    for axis, opts in enumerate(options):
        if grid[axis] > 1 and (any(_balanced(layout.sbp[axis]) for layout in layouts) or any(
                _balanced(f.sbp[axis]) for fs in free for f in fs)):
            own = [layout.sbp[axis] for layout in layouts]
            more = [o for o in (_head_tail(rule, layouts, o) for o in opts) if o is not None
                    and all(o[3][i] == own[i] for i in fixed)
                    and not (fixed and o[1].outs[0] != own[fixed[0]])]
            added |= bool(more)
            opts = opts + more
        out.append(opts)
    if not added:
        return options, rule
    return out, Rule(rule.rows, _checked(rule.check), rule.frames, rule.ragged, rule.work,
                     rule.order_free, rule.sends)


def _balanced(value) -> bool:
    return type(value) is Split and value.balance is not None


def _head_tail(rule: Rule, layouts, option):
    """The head-tail form of one axis option (index, row, values, resolved), or None."""
    index, row, values, resolved = option
    sizes = {layout.shape[v.dim] for layout, v in zip(layouts, resolved) if type(v) is Split}
    if len(sizes) != 1 or any(_balanced(v) for v in resolved):
        return None  # splits nothing, or dims of several sizes (several permutations)
    if row.kernel is not None and row.kernel not in ORDER_FREE_KERNELS:
        return None
    if rule.order_free is not True and not rule.order_free(row):
        return None
    ins = tuple(Split(v.dim, HEAD_TAIL) if type(v) is Split else v for v in resolved)
    outs = tuple(Split(v.dim, HEAD_TAIL) if type(v) is Split else v for v in row.outs)
    return index, Row(ins, outs, row.kernel), ins, ins


def _checked(check):
    def both(call, grid, ins, outs):
        return (_nests_none(ins, grid) and _nests_none(outs, grid)
                and (check is None or check(call, grid, ins, outs)))
    return both


def _nests_none(sbps, grid) -> bool:
    """No head-tail split of a dim another axis (of more than one rank) also splits."""
    for sbp in sbps:
        for a, v in enumerate(sbp):
            if _balanced(v) and grid[a] > 1 and any(
                    b != a and type(w) is Split and w.dim == v.dim and grid[b] > 1
                    for b, w in enumerate(sbp)):
                return False
    return True


__all__ = ["with_balanced"]
