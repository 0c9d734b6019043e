"""The tensor-parallel plan found from the model itself: Megatron's pairs.

A ``Linear`` whose output reaches other ``Linear``s only through element-wise ops, views and
attention is **column-wise** (its output features split), the ``Linear``s it reaches are
**row-wise** (their input features split; their output a partial sum); embeddings and the head
go on the vocabulary (the weight's vocabulary dim split). It is what Megatron, torchtitan's
``parallelize_llama`` and DTensor's examples write by hand for a transformer: q, k, v and
gate / up column-wise, o and down row-wise.

How: one forward of the model on meta tensors (no data) with a dispatch mode that follows, for
every tensor, the set of ``Linear``s whose output it carries ("taint"). An op that may mix the
split features (a reduction, a norm, an embedding, a matmul with a parameter, the loss) spoils
every ``Linear`` its inputs carry: a column-wise split there would need communication. What is
left unspoiled and reached a ``Linear`` is column-wise, and a ``Linear`` all of whose inputs'
carriers are column-wise is row-wise. A wrong guess costs speed, never correctness: any layout
computes the one-process result, and the simulation prices the plan found.
"""
from __future__ import annotations

import fnmatch
import re

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["find_plan", "plan_fn", "patterns"]

_aten = torch.ops.aten
# ops that keep features where they are (besides those torch tags pointwise): views, copies,
# concatenation and slicing, attention and its softmax, dropout
_KEEP = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "clone",
         "contiguous", "_to_copy", "copy_", "slice", "select", "cat", "stack", "split",
         "split_with_sizes", "unsqueeze", "squeeze", "unbind", "chunk", "narrow", "flatten",
         "unflatten", "alias", "detach", "repeat_interleave", "index_select", "_softmax",
         "softmax", "_safe_softmax", "native_dropout", "dropout", "bmm", "mm", "matmul", "baddbmm",
         "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
         "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
         "scaled_dot_product_attention", "masked_fill", "where", "lift_fresh", "empty_like",
         "zeros_like", "ones_like", "new_zeros", "new_empty", "fill_", "zero_"}


class _Taint(TorchDispatchMode):
    """Follows which Linears' outputs each tensor carries; spoils those that meet a mixing op."""

    def __init__(self, params):
        super().__init__()
        self.carried = WeakTensorKeyDictionary()
        self.params = params  # ids of parameters: a matmul with one is a layer of its own
        self.spoiled: set[str] = set()
        self.inside = 0  # > 0 while a Linear's own ops run

    def of(self, tensors) -> frozenset:
        out: set = set()
        for t in tensors:
            if isinstance(t, torch.Tensor):
                out |= self.carried.get(t, frozenset())
        return frozenset(out)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.inside:
            return out
        ins = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, torch.Tensor)]
        carried = self.of(ins)
        if not carried:
            return out
        name = func._overloadpacket.__name__
        keeps = torch.Tag.pointwise in func.tags or name in _KEEP
        if keeps and name in ("mm", "bmm", "matmul", "baddbmm") and \
                any(id(t) in self.params for t in ins):
            keeps = False
        if not keeps:
            self.spoiled |= carried
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.carried[t] = carried
        return out


def find_plan(model: torch.nn.Module, run) -> dict[str, str]:
    """{module name: "colwise" | "rowwise" | "vocab"} for ``model``, from one ``run(model)``
    (a forward on meta inputs, its loss included). Module names are the model's own
    (``model.layers.0.self_attn.q_proj``); :func:`patterns` folds repeated blocks."""
    linears = {m: n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    embeddings = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    mode = _Taint({id(p) for p in model.parameters()})
    feeds: dict[str, frozenset] = {}  # a Linear: the Linears its inputs carried

    def pre(module, args, kwargs):
        name = linears[module]
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        feeds[name] = feeds.get(name, frozenset()) | mode.of(tensors)
        mode.inside += 1

    def post(module, args, kwargs, out):
        mode.inside -= 1
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                mode.carried[t] = frozenset({linears[module]})

    hooks = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in linears]
    hooks += [m.register_forward_hook(post, with_kwargs=True) for m in linears]
    try:
        with torch.device("meta"), mode:  # (a kernel's own factories, sdpa's mask, on meta)
            run(model)
    finally:
        for h in hooks:
            h.remove()
    reached = set().union(*feeds.values()) if feeds else set()
    col = {n for n in reached if n not in mode.spoiled}
    row = {n for n, f in feeds.items() if f and f <= col and n not in col}
    plan = {n: "colwise" for n in sorted(col)}
    plan.update({n: "rowwise" for n in sorted(row)})
    vocab = {m.num_embeddings for m in embeddings.values()}
    for module, n in linears.items():
        if n not in plan and module.out_features in vocab:
            plan[n] = "colwise"  # the head: logits split on the vocabulary (a vocab-parallel loss)
    for n in embeddings:
        plan[n] = "vocab"
    return plan


def patterns(plan: dict[str, str]) -> dict[str, str]:
    """The plan with repeated blocks folded: ``model.layers.*.self_attn.q_proj`` where every
    block's module has the same style (names that differ keep their own entry)."""
    groups: dict[str, set] = {}
    for name, style in plan.items():
        groups.setdefault(re.sub(r"(^|\.)\d+\.", r"\1*.", name), set()).add((name, style))
    out: dict[str, str] = {}
    for pattern, members in groups.items():
        styles = {s for _, s in members}
        if len(members) > 1 and len(styles) == 1:
            out[pattern] = styles.pop()
        else:
            out.update(dict(sorted(members)))
    return out


def plan_fn(plan: dict, axis: str = "tp"):
    """The ``sbp_fn`` of a plan of styles ({pattern: "colwise" | "rowwise" | "vocab"}, or the
    user's own ``gt.nn`` helpers) on placement axis ``axis``."""
    from ..nn.styles import colwise, rowwise, sbp_plan

    styles = {"colwise": colwise(axis), "rowwise": rowwise(axis), "vocab": colwise(axis)}
    return sbp_plan({p: styles[s] if isinstance(s, str) else s for p, s in plan.items()})


def matches(plan: dict, name: str) -> str | None:
    """The style ``plan`` gives module ``name`` (the first pattern that matches)."""
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(name, pattern):
            return style
    return None
