"""Deciding what to do with a call (a cache miss): the special handlers, decompositions, the
rule's cheapest signature, or the broadcast fallback for ops without a rule."""
from __future__ import annotations

import collections

import torch
from torch.utils._pytree import tree_leaves

from ..errors import GlobalTensorError
from ..ops import MOVES, Choice, arg_value, choose, entry, qualified, rule_for
from ..sbp import PartialSum, replicated
from ..tensor import GlobalTensor
from .args import call_of, slots_of
from .decisions import (AdoptIndexScalars, Contextual, Decomposed, InplaceView, NoRule, Plain,
                        RunToLearn, Special, ViaFunctional)
from .outputs import DataDependent, OutSpec, meta_result, out_specs
from .special import SPECIAL, foreach, foreach_on_pieces, mixed_placements, pointwise_on_pieces
from .aliasing import is_view, write_into

# op name -> how many decisions took the broadcast fallback (read by benchmarks/op_coverage.py;
# counted on cache misses only, so never on the warm path)
FALLBACKS: collections.Counter = collections.Counter()
LEARNT: collections.Counter = collections.Counter()  # op name -> data-dependent runs on B inputs


def op_name(func) -> str:
    return qualified(func)  # "add.Tensor"; "mylib::cube.default" for another namespace


def decide(func, args, kwargs, tensors, key, context=None):
    """The decision for this call (``key``: its cache key by id, see args.flatten). Without
    ``context``, a signature that moves an input gives a :class:`Contextual` decision instead
    (decided again per context); with it, the choice counts the context (see
    ``decisions.context``)."""
    name = op_name(func)
    if not tensors:
        raise GlobalTensorError(f"internal: {name} reached dispatch with no global tensor")
    placement = tensors[0]._layout.placement
    if any(t._layout.placement != placement for t in tensors):
        mixed_placements(tensors, name)
    if func in SPECIAL:
        return Special(SPECIAL[func])
    if name.startswith("_foreach_"):
        return Special(foreach_on_pieces if pointwise_on_pieces(func, args, kwargs, tensors)
                       else foreach)
    if name.split(".")[0] in _FILLS_OUT and _only_out_is_global(func, args, kwargs):
        return Special(_fill_out)
    _check_no_out(func, name)
    index_scalars = _local_index_scalars(func, args, kwargs)
    if index_scalars:
        return AdoptIndexScalars(index_scalars)
    if entry(name.split(".")[0]).decompose:
        fn = _decomposition(func)
        if fn is not None:
            return Decomposed(fn)
    call = call_of(name, key, len(args), tensors, frozenset(str(t).split(".")[-1] for t in func.tags))
    inplace = _is_inplace(func) and isinstance(args[0], GlobalTensor)
    if inplace and _changes_shape(func, args, kwargs, name):
        return InplaceView(_out_of_place(func, name))
    layouts = tuple(t._layout for t in tensors)
    itemsizes = tuple(t.dtype.itemsize for t in tensors)
    fixed = (0,) if inplace else ()
    if context is None:
        choice = choose(call, layouts, itemsizes, fixed=fixed, stay_or_moves=True)
        if choice is MOVES:
            return Contextual(decide, key)  # it moves inputs: the context may change the winner
        if choice is not None and any(t is not l and t != l for t, l in zip(choice.ins, layouts)):
            return Contextual(decide, key)  # it moves inputs: the context may change the winner
        if choice is not None and _leaves_partial(choice, layouts):
            # a partial-sum input kept partial: where its sum is already at hand (moved for an
            # earlier op, e.g. an RMSNorm's variance), resolving it is free and wins the tie
            return Contextual(decide, key)
    else:
        grads, free = context
        choice = choose(call, layouts, itemsizes, fixed=fixed, grads=grads or (), free=free or ())
    has_rule = rule_for(call) is not None
    if choice is None and not has_rule and _composite(func):
        return Decomposed(func.decompose)
    if choice is None and inplace:
        return _via_functional(func, name)
    if choice is None:
        choice = _broadcast_choice(func, name, layouts)
        decision = _plain(func, args, kwargs, tensors, choice, inplace, call, key)
        return decision if has_rule else NoRule(decision, func, name, layouts[0].placement)
    return _plain(func, args, kwargs, tensors, choice, inplace, call, key)


def _leaves_partial(choice, layouts) -> bool:
    grid = layouts[0].placement.shape
    return any(isinstance(v, PartialSum) and grid[a] > 1
               for out in choice.outs for a, v in enumerate(out)) and any(
        isinstance(v, PartialSum) and grid[a] > 1
        for layout in layouts for a, v in enumerate(layout.sbp))


def _plain(func, args, kwargs, tensors, choice, inplace, call, key):
    try:
        meta = meta_result(func, args, kwargs, call.op)
    except DataDependent:
        if inplace:
            raise
        LEARNT[call.op] += 1
        full = replicated(tensors[0]._layout.placement.ndim)
        return RunToLearn(tuple(t._layout if t._layout.sbp == full else t._layout.with_sbp(full)
                                for t in tensors))
    if inplace:
        outs = OutSpec(tensors[0]._layout, tensors[0].dtype)
    else:
        outs = out_specs(meta, choice.outs, choice.ins[0].placement, call.op)
    view = None
    if is_view(func) and isinstance(args[0], GlobalTensor):  # does it alias its input's pieces?
        view = choice.ins[0] != tensors[0]._layout
    return Plain(choice.ins, outs, choice.kernel, entry(call.packet).rewrite, inplace, call,
                 slots_of(key, len(args)), getattr(func, "_op", func), view,
                 _mutated(func, call, args, kwargs, tensors, inplace))


def _mutated(func, call, args, kwargs, tensors, inplace) -> tuple[int, ...]:
    """The global inputs (by index) the op writes, besides an in-place op's ``self``: those its
    schema marks ``Tensor(a!)`` and those ``ops`` registers (``mutates=``)."""
    names = [a.name for a in func._schema.arguments
             if a.alias_info is not None and a.alias_info.is_write]
    names += entry(call.op).mutates or entry(call.packet).mutates
    found = []
    for name in names[1:] if inplace else names:
        value = arg_value(call.op, args, kwargs, name)
        found += [i for i, t in enumerate(tensors) if t is value]
    return tuple(found)


_INDEX_NAMES = frozenset({"index", "indices", "target"})


def _local_index_scalars(func, args, kwargs) -> tuple[str, ...]:
    """The index/target arguments given as 0-dim local tensors (decisions.AdoptIndexScalars)."""
    found = []
    for i, a in enumerate(func._schema.arguments):
        if a.name not in _INDEX_NAMES:
            continue
        v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
        if type(v) is torch.Tensor and v.dim() == 0:
            found.append(a.name)
    return tuple(found)


# deterministic factories torch's code calls with out= a tensor: nn.init.eye_'s
# torch.eye(n, m, out=w); the full value is made once on each rank, then written by pieces
_FILLS_OUT = frozenset({"eye", "arange", "linspace", "logspace", "zeros", "ones", "full"})


def _only_out_is_global(func, args, kwargs) -> bool:
    out = kwargs.get("out")
    return isinstance(out, GlobalTensor) and not any(
        isinstance(v, torch.Tensor) for v in tree_leaves((args, {k: v for k, v in kwargs.items()
                                                                 if k != "out"})))


def _fill_out(func, args, kwargs, tensors):
    """A deterministic factory with a global ``out=``: its full value, made on each rank (the
    one tensor: what ``eye_`` costs anywhere), written into ``out``'s pieces."""
    out = kwargs["out"]
    value = func(*args, **{**kwargs, "out": torch.empty(tuple(out.shape), dtype=out.dtype)})
    return out.copy_(value)


def _check_no_out(func, name):
    for a in func._schema.arguments:
        if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write:
            raise GlobalTensorError(
                f"{name}: out= arguments are not supported on global tensors; assign the result "
                f"instead (y = op(x)) or use the in-place form (where torch's own code for "
                f"another op passes out=, e.g. F.linear_cross_entropy's chunked options, call "
                f"that op without that path, or on local tensors)")


def _is_inplace(func) -> bool:
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def _changes_shape(func, args, kwargs, name) -> bool:
    """Whether in-place op ``func`` gives ``self`` another shape (squeeze_, t_, ...)."""
    result = meta_result(func, args, kwargs, name)
    return isinstance(result, torch.Tensor) and tuple(result.shape) != tuple(args[0].shape)


def _functional_packet(func):
    """The packet of in-place ``func``'s out-of-place op (``aten.squeeze`` for ``squeeze_``)."""
    return getattr(torch.ops.aten, func._schema.name.split("::")[1].rstrip("_"), None)


def _out_of_place(func, name):
    """The out-of-place op of in-place ``func`` (its overload chosen by the arguments)."""
    packet = _functional_packet(func)
    if packet is None:
        raise GlobalTensorError(f"{name}: no out-of-place form to run on global tensors; "
                                f"use the out-of-place op and assign its result")
    return packet


def _composite(func) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


def _decomposition(func):
    if _composite(func):
        return func.decompose
    from torch._decomp import decomposition_table  # torch's table is slow to import: on first use

    return decomposition_table.get(func)


def _via_functional(func, name):
    if torch.Tag.nondeterministic_seeded in func.tags:
        raise GlobalTensorError(
            f"{name}: cannot fill a partial_sum global tensor with random values; convert it "
            f"with .to_global(sbp=gt.sbp.broadcast) first")
    packet = _functional_packet(func)
    functional = getattr(packet, func._overloadname, None) if packet is not None else None
    if functional is None:
        raise GlobalTensorError(
            f"{name}: no signature keeps the target's layout and the op has no out-of-place "
            f"form; convert the target to gt.sbp.broadcast first")
    return ViaFunctional(functional, write_into)


def _broadcast_choice(func, name, layouts):
    if torch.Tag.nondeterministic_seeded in func.tags:
        raise GlobalTensorError(
            f"{name}: random op without an SBP rule; running it on each rank would give "
            f"broadcast replicas different values. Use gt.rand/gt.randn or ops with rules "
            f"(dropout, rand_like, bernoulli, normal, poisson, multinomial, uniform_; "
            f"docs/sbp.md, 'Random ops')")
    FALLBACKS[name] += 1
    full = replicated(layouts[0].placement.ndim)
    targets = tuple(l if l.sbp == full else l.with_sbp(full) for l in layouts)
    return Choice(targets, (full,), None, 0.0)
