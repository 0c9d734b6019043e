"""Operators on global tensors: ``__torch_dispatch__`` below autograd.

Every aten op on a GlobalTensor lands in :func:`dispatch`: unwrap the inputs, choose a signature
with ``rules.choose``, redistribute the inputs the signature asks for, run the op on the local
pieces, wrap the outputs with the signature's sbp. The choice, the output layouts and any
argument rewriting are decided once per (op, input layouts, non-tensor arguments) and cached, so
an op that needs no communication costs a dict lookup, the local op and the wrapping.

Ranks outside the placement run every redistribution (SPMD) but skip the local op: their pieces
are empty, with the output's ndim and dtype (from a run of the op on meta tensors).
"""
from __future__ import annotations

import math
import threading
import warnings

import torch

from . import debug as _debug
from . import env, random, rules
from .errors import GlobalTensorError
from .layout import Layout
from .rules import LOCAL, NUMBER, Call, Ref
from .sbp import Broadcast, PartialSum, format_sbp
from .tensor import GlobalTensor, redistribute_local

aten = torch.ops.aten
_DECISIONS: dict = {}      # cache of a pure function of the key: (op, layouts, args) -> decision
_BY_ID: dict = {}          # the same decisions keyed by the layouts' ids (no hashing of layouts)
_PINNED: list = []         # the layouts named in _BY_ID's keys, kept alive while it holds them
_WARNED: set = set()       # ops already warned about (no rule: broadcast fallback)


def dispatch(func, types, args, kwargs):
    """Run aten op ``func`` on global tensors (called by GlobalTensor.__torch_dispatch__)."""
    tensors = []
    try:
        fast = _fast_key(func, args, kwargs, tensors)
    except _LocalTensor as found:
        args, kwargs = _adopt_locals(args, kwargs, found)
        tensors = []
        fast = _fast_key(func, args, kwargs, tensors)
    if _debug.is_debug():  # GT_DEBUG: every rank runs this op on these layouts (see debug.py)
        _debug.check("aten." + _op_name(func), args=_debug.op_args(args, kwargs))
    decision = _BY_ID.get(fast)
    if decision is None:
        decision = _lookup(func, args, kwargs, tensors, fast)
    return decision.run(func, args, kwargs, tensors)


def _lookup(func, args, kwargs, tensors, fast):
    """The decision by value (layouts compared by value), deciding on a miss; then remembered
    under ``fast`` too, with the layouts it names kept alive so their ids stay theirs."""
    key = _key(func, args, kwargs, [])
    decision = _DECISIONS.get(key)
    if decision is None:
        decision = _decide(func, args, kwargs, tensors)
        if len(_DECISIONS) > 100_000:
            _DECISIONS.clear()
        _DECISIONS[key] = decision
    if len(_BY_ID) > 20_000:
        _BY_ID.clear()
        _PINNED.clear()
    _BY_ID[fast] = decision
    _PINNED.append([t._layout for t in tensors])
    return decision


# ----------------------------------------------------------------------------- the cache key


def _describe(value, tensors: list):
    cls = type(value)
    if cls is GlobalTensor:
        tensors.append(value)
        return value._layout, value.dtype
    if cls is float or cls is complex:
        return NUMBER  # a value no rule looks at (lr, eps, alpha): keep it out of the key
    if cls is list or cls is tuple:
        return tuple(_describe(v, tensors) for v in value)
    if isinstance(value, torch.Tensor):
        if isinstance(value, GlobalTensor):
            tensors.append(value)
            return value._layout, value.dtype
        return _describe_local(value)
    if isinstance(value, torch.Generator):
        return None
    return value


class _LocalTensor(Exception):
    """A non-scalar local tensor among the arguments (allowed only from autograd's engine)."""

    def __init__(self, value):
        self.value = value


def _adopt_locals(args, kwargs, found):
    """Inside backward, autograd makes full-size local tensors (zeros for the gradients of
    unused outputs): take them as broadcast values on the placement of the global inputs."""
    if torch._C._current_graph_task_id() < 0:
        _describe_local(found.value, strict=True)
    placement = _first_placement(args, kwargs)
    coord = _my_coord(placement)

    def adopt(v):
        if isinstance(v, GlobalTensor):
            return v
        if isinstance(v, torch.Tensor) and v.dim() != 0:
            layout = Layout(placement, (rules.B,) * placement.ndim, tuple(v.shape))
            return GlobalTensor._make(v if coord is not None else v.new_empty((0,) * v.dim()), layout)
        if isinstance(v, (list, tuple)):
            return type(v)(adopt(x) for x in v)
        return v
    return [adopt(a) for a in args], {k: adopt(v) for k, v in kwargs.items()}


def _first_placement(args, kwargs):
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, GlobalTensor):
            return v._layout.placement
        if isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, GlobalTensor):
                    return x._layout.placement
    raise GlobalTensorError("internal: no global tensor among the arguments; please report this")


def _describe_local(value: torch.Tensor, strict: bool = False):
    if value.dim() != 0 and not strict:
        raise _LocalTensor(value)
    if value.dim() != 0:
        raise GlobalTensorError(
            f"an operator got a global tensor and a local tensor of shape {list(value.shape)}; "
            f"expected global tensors (or 0-dim local scalars) only. Make the local tensor "
            f"global first, e.g. t.to_global(placement=x.placement, sbp=gt.sbp.broadcast) for "
            f"a full value on every rank"
        )
    return LOCAL, value.dtype


def _fast_describe(value, tensors: list):
    cls = type(value)
    if cls is GlobalTensor:
        tensors.append(value)
        return id(value._layout), value.dtype
    if cls is float or cls is complex:
        return NUMBER
    if cls is list or cls is tuple:
        return tuple(_fast_describe(v, tensors) for v in value)
    if isinstance(value, torch.Tensor):
        if isinstance(value, GlobalTensor):
            tensors.append(value)
            return id(value._layout), value.dtype
        return _describe_local(value)
    if isinstance(value, torch.Generator):
        return None
    return value


def _fast_key(func, args, kwargs, tensors):
    parts = [func]
    for a in args:
        if type(a) is GlobalTensor:  # the common case, inline
            tensors.append(a)
            parts.append((id(a._layout), a.dtype))
        else:
            parts.append(_fast_describe(a, tensors))
    if kwargs:
        for k, v in kwargs.items():
            parts.append(k)
            parts.append(_fast_describe(v, tensors))
    return tuple(parts)


def _key(func, args, kwargs, tensors):
    parts = [func]
    for a in args:
        parts.append(_describe(a, tensors))
    if kwargs:
        for k, v in kwargs.items():
            parts.append(k)
            parts.append(_describe(v, tensors))
    return tuple(parts)


# ----------------------------------------------------------------------------- rebuilding args


def _swap(value, it):
    """``value`` with every global tensor replaced by the next piece from ``it``."""
    cls = type(value)
    if cls is GlobalTensor:
        return next(it)
    if cls is list or cls is tuple:
        if not any(isinstance(v, GlobalTensor) for v in value):
            return value
        return cls(_swap(v, it) for v in value)
    return value


def _local_args(args, kwargs, pieces):
    it = iter(pieces)
    largs = [_swap(a, it) for a in args]
    lkwargs = {k: _swap(v, it) for k, v in kwargs.items()} if kwargs else {}
    return largs, lkwargs


def _my_coord(placement):
    return placement.coord_of(env.get_rank())


def _moved(t: GlobalTensor, target: Layout):
    """``t``'s piece laid out as ``target``, remembered on ``t`` while ``t`` is unchanged.

    Backward reuses what forward moved (a saved activation is redistributed once, not again
    for its gradient formula) and a gradient read by two formulas is moved once. Leaves that
    require grad (parameters) are not remembered: a gathered copy would outlive the step.
    Every rank takes the same path (the cache follows the op sequence), so SPMD holds.
    """
    cache = t.__dict__.get("_gt_moves")
    # in-place ops through dispatch run below autograd, so they bump the wrapper's version, not
    # the piece's (the same on every rank); writes into to_local() bump the piece's
    version = (t._version, t._local._version)
    if cache is not None:
        hit = cache.get(target)
        if hit is not None and hit[0] == version:
            return hit[1]
    piece = redistribute_local(t._local, t._layout, target)
    if not (t.is_leaf and t.requires_grad):
        if cache is None:
            cache = t.__dict__["_gt_moves"] = {}
        cache[target] = (version, piece)
    return piece


def _maybe_outside(piece) -> bool:
    """A rank outside the placement holds (0,)*ndim pieces; a non-empty piece of ndim > 0 proves
    this rank is inside, so the common case skips asking for the rank."""
    return piece.numel() == 0 or piece.dim() == 0


# ----------------------------------------------------------------------------- decisions


class Plain:
    """Redistribute inputs to ``targets``, run the op (or a kernel) locally, wrap the outputs."""

    __slots__ = ("targets", "outs", "kernel", "rewrite", "inplace", "call", "placement", "slots",
                 "op", "single")

    def __init__(self, targets, outs, kernel, rewrite, inplace, call, slots, op):
        self.targets, self.outs, self.kernel = targets, outs, kernel
        self.rewrite, self.inplace, self.call = rewrite, inplace, call
        self.placement = targets[0].placement
        # positions of the global tensors when they are all plain positional args (fast path)
        self.slots = slots if kernel is None and rewrite is None else None
        self.op = op  # the C++ op behind the OpOverload: one Python frame less per call
        self.single = type(outs) is _OutSpec and not inplace

    def pieces(self, tensors):
        out = []
        for t, target in zip(tensors, self.targets):
            layout = t._layout
            if layout is target or layout == target:
                out.append(t._local)
            else:
                out.append(_moved(t, target))
        return out

    def run(self, func, args, kwargs, tensors):
        if self.slots is not None:
            return self._run_simple(func, args, kwargs, tensors)
        pieces = self.pieces(tensors)
        if self.kernel is not None:
            largs, lkwargs = _local_args(args, kwargs, pieces)
            coord = _my_coord(self.placement)
            ctx = KernelContext(func, self.call, self.targets, self.outs, coord, pieces)
            result = KERNELS[self.kernel](ctx, largs, lkwargs)
        elif _maybe_outside(pieces[0]) and _my_coord(self.placement) is None:
            result = _empties(self.outs, pieces)
        else:
            largs, lkwargs = _local_args(args, kwargs, pieces)
            if self.rewrite is not None:
                self.rewrite(self, largs, pieces)
            result = func(*largs, **lkwargs)
        if self.inplace:
            return args[0]
        return _wrap(result, self.outs)

    def _run_simple(self, func, args, kwargs, tensors):
        largs = list(args)
        first = None
        for t, target, slot in zip(tensors, self.targets, self.slots):
            layout = t._layout
            if layout is target or layout == target:
                piece = t._local
            else:
                piece = _moved(t, target)
            largs[slot] = piece
            if first is None:
                first = piece
        if _maybe_outside(first) and _my_coord(self.placement) is None:
            result = _empties(self.outs, [first])
        else:
            result = self.op(*largs, **kwargs)
        if self.single:
            outs = self.outs
            out = _new_wrapper(GlobalTensor, outs.shape, strides=outs.strides, dtype=result.dtype,
                               device=result.device, requires_grad=False)
            out._local = result
            out._layout = outs.layout
            return out
        if self.inplace:
            return args[0]
        return _wrap(result, self.outs)


class Decomposed:
    """Run a decomposition into ops with rules (each re-enters dispatch).

    The parts run below autograd, so the tensors made inside (``mm``'s result in ``addmm``)
    do not require grad even when the op's inputs do; while a decomposition with an input that
    will get a gradient runs, :func:`_context` takes every tensor but the op's own
    grad-free inputs as getting one."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def run(self, func, args, kwargs, tensors):
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
            return self.fn(*args, **kwargs)
        stack = _decomposing()
        stack.append(frozenset(id(t) for t in tensors if not t.requires_grad))
        try:
            return self.fn(*args, **kwargs)
        finally:
            stack.pop()


_THREAD = threading.local()  # per thread: ranks of run_ranks are threads


def _decomposing() -> list:
    """This thread's stack of running decompositions with gradients: each entry holds the ids
    of that op's inputs that get no gradient."""
    stack = getattr(_THREAD, "decomposing", None)
    if stack is None:
        stack = _THREAD.decomposing = []
    return stack


class ViaFunctional:
    """An in-place op whose result cannot keep ``self``'s layout: compute the out-of-place op,
    then write the value back into ``self``'s layout (the write may make a P piece)."""

    __slots__ = ("functional",)

    def __init__(self, functional):
        self.functional = functional

    def run(self, func, args, kwargs, tensors):
        out = self.functional(*args, **kwargs)
        _write_into(args[0], out)
        return args[0]


class Contextual:
    """A call whose cheapest signature moves inputs. Which signature is cheapest then also
    depends on the *context*: which inputs will get a gradient (moving one costs the move its
    gradient needs in backward, see ``rules.backward_cost``) and which layouts the inputs
    already hold moved pieces for (those moves are free). The context is read on every call
    (only calls that move inputs pay for it) and a decision is kept per context.

    A signature that moves nothing costs nothing in any context and stays the cheapest, so the
    no-communication path never gets here."""

    __slots__ = ("by_context",)

    def __init__(self):
        self.by_context = {}

    def run(self, func, args, kwargs, tensors):
        context = _context(tensors)
        decision = self.by_context.get(context)
        if decision is None:
            decision = _decide(func, args, kwargs, tensors, context)
            if len(self.by_context) > 256:
                self.by_context.clear()
            self.by_context[context] = decision
        return decision.run(func, args, kwargs, tensors)


def _context(tensors) -> tuple:
    """(which inputs will get a gradient, or None; the layouts each input holds moved pieces
    of, or None). The same on every rank: requires_grad and the moves follow the program."""
    grads = None
    if torch.is_grad_enabled():
        grads = tuple(t.requires_grad for t in tensors)
        stack = getattr(_THREAD, "decomposing", None)
        if stack:  # inside a decomposition: tensors made by its parts are on the gradient path
            grad_free = stack[-1]
            grads = tuple(g or id(t) not in grad_free for g, t in zip(grads, tensors))
        if not any(grads):
            grads = None
    free = None
    moves = [t.__dict__.get("_gt_moves") for t in tensors]
    if any(moves):
        # the targets only, not whether a piece is stale: ranks outside the placement skip
        # in-place ops, so versions may differ between ranks while the moves do not
        free = tuple(frozenset(m) if m else frozenset() for m in moves)
    return grads, free


class Special:
    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def run(self, func, args, kwargs, tensors):
        return self.fn(func, args, kwargs, tensors)


def _write_into(self: GlobalTensor, value):
    """``self``'s piece := ``value``'s logical value laid out as ``self``."""
    if isinstance(value, GlobalTensor):
        if value.shape != self.shape:
            value = aten.expand.default(value, list(self.shape))
        piece = redistribute_local(value._local, value._layout, self._layout)
        if _my_coord(self._layout.placement) is not None:
            self._local.copy_(piece)
        return
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        if self._layout.is_partial:
            raise GlobalTensorError(
                f"cannot write a local scalar into a partial_sum global tensor (sbp "
                f"{format_sbp(self.sbp)}): every rank would add it. Convert the target with "
                f".to_global(sbp=gt.sbp.broadcast) first, or write a global tensor")
        self._local.copy_(value)
        return
    _describe_local(value, strict=True)


def _copy_(func, args, kwargs, tensors):
    self, src = args[0], args[1]
    if not isinstance(self, GlobalTensor):
        raise GlobalTensorError(
            f"copy_ of a global tensor into a local tensor of shape {list(self.shape)}; expected "
            f"a global target. Use x.full_tensor() or x.to_local() to get local data")
    if isinstance(src, GlobalTensor) and src.placement != self.placement:
        _mixed_placements([self, src], "copy_")
    _write_into(self, src)
    return self


def _local_scalar_dense(func, args, kwargs, tensors):
    x = tensors[0]
    full = Layout(x._layout.placement, (rules.B,) * x._layout.placement.ndim, x._layout.shape)
    piece = redistribute_local(x._local, x._layout, full)
    if _my_coord(full.placement) is None:
        raise GlobalTensorError(
            f"this rank is outside {x.placement!r}, so it holds no value to read; use "
            f"x.item() (collective: every rank gets the value) instead of a local read")
    return piece.item()


def _foreach(func, args, kwargs, tensors):
    """``torch._foreach_*``: the same op on each element, through dispatch."""
    base, inplace = _foreach_base(func)
    n = max(len(a) for a in args if isinstance(a, (list, tuple)))
    positional = [a.name for a in base._schema.arguments if not a.kwarg_only]
    keyword = [a.name for a in base._schema.arguments if a.kwarg_only]
    results = []
    for i in range(n):
        elem_args = [_element(a, i, func) for a in args]
        elem_kwargs = {k: _element(v, i, func) for k, v in kwargs.items()}
        # a scalar the foreach op takes positionally may be keyword-only in the base op
        extra = elem_args[len(positional):]
        elem_kwargs.update(zip(keyword, extra))
        results.append(base(*elem_args[:len(positional)], **elem_kwargs))
    return None if inplace else results


def _element(value, i, func):
    if isinstance(value, (list, tuple)):
        return value[i]
    if isinstance(value, torch.Tensor) and not isinstance(value, GlobalTensor) and value.dim() == 1 \
            and func._overloadname == "Tensor":
        return value[i].item()  # a tensor of per-element scalars
    return value


def _foreach_base(func):
    name = func._schema.name.split("::")[1][len("_foreach_"):]
    inplace = name.endswith("_")
    packet = getattr(aten, name, None)
    if packet is None:
        raise GlobalTensorError(f"no per-tensor op for {func}; please report this")
    wanted = {"List": ("Tensor", "default"), "Scalar": ("Scalar", "default", "Tensor"),
              "ScalarList": ("Scalar", "default", "Tensor"), "Tensor": ("Scalar", "default", "Tensor"),
              "default": ("default",)}.get(func._overloadname, (func._overloadname, "default"))
    for overload in wanted:
        if overload in packet.overloads():
            return getattr(packet, overload), inplace
    raise GlobalTensorError(f"no per-tensor overload of aten.{name} for {func}; please report this")


# ----------------------------------------------------------------------------- deciding

_SPECIAL = {
    aten.copy_.default: _copy_,
    aten._local_scalar_dense.default: _local_scalar_dense,
}


def _op_name(func) -> str:
    return f"{func._schema.name.split('::')[1]}.{func._overloadname}"


def _mixed_placements(tensors, op):
    found = sorted({repr(t.placement) for t in tensors})
    raise GlobalTensorError(
        f"{op}: expected global tensors of one placement, found {len(found)}: {', '.join(found)}; "
        f"move them to one placement first with x.to_global(placement=...)")


def _decide(func, args, kwargs, tensors, context=None):
    """The decision for this call. Without ``context``, a signature that moves an input gives a
    :class:`Contextual` decision instead (decided again per context); with it, the choice
    counts the context (see :func:`_context`)."""
    name = _op_name(func)
    if not tensors:
        raise GlobalTensorError(f"internal: {name} reached dispatch with no global tensor")
    placement = tensors[0]._layout.placement
    if any(t._layout.placement != placement for t in tensors):
        _mixed_placements(tensors, name)
    if func in _SPECIAL:
        return Special(_SPECIAL[func])
    if name.startswith("_foreach_"):
        return Special(_foreach)
    _check_no_out(func, name)
    packet = name.split(".")[0]
    if packet in rules.DECOMPOSE:
        fn = _decomposition(func)
        if fn is not None:
            return Decomposed(fn)
    call = _call(func, name, args, kwargs)
    inplace = _is_inplace(func) and isinstance(args[0], GlobalTensor)
    layouts = tuple(t._layout for t in tensors)
    itemsizes = tuple(t.dtype.itemsize for t in tensors)
    fixed = (0,) if inplace else ()
    if context is None:
        choice = rules.choose(call, layouts, itemsizes, fixed=fixed)
        if choice is not None and any(t is not l and t != l for t, l in zip(choice.ins, layouts)):
            return Contextual()  # it moves inputs: the context may change which signature wins
    else:
        grads, free = context
        choice = rules.choose(call, layouts, itemsizes, fixed=fixed, grads=grads or (),
                              free=free or ())
    has_rule = rules.rule_for(call) is not None
    if choice is None and not has_rule and _composite(func):
        return Decomposed(func.decompose)
    if choice is None and inplace:
        return _via_functional(func, name, has_rule)
    if choice is None:
        choice = _broadcast_choice(func, name, layouts, has_rule)
    return _plain(func, args, kwargs, tensors, choice, inplace, call)


def _check_no_out(func, name):
    for a in func._schema.arguments:
        if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write:
            raise GlobalTensorError(
                f"{name}: out= arguments are not supported on global tensors; assign the result "
                f"instead (y = op(x)) or use the in-place form")


def _is_inplace(func) -> bool:
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def _composite(func) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


def _decomposition(func):
    if _composite(func):
        return func.decompose
    from torch._decomp import decomposition_table

    return decomposition_table.get(func)


def _via_functional(func, name, has_rule):
    if torch.Tag.nondeterministic_seeded in func.tags:
        raise GlobalTensorError(
            f"{name}: cannot fill a partial_sum global tensor with random values; convert it "
            f"with .to_global(sbp=gt.sbp.broadcast) first")
    packet = getattr(aten, func._schema.name.split("::")[1].rstrip("_"), None)
    functional = getattr(packet, func._overloadname, None) if packet is not None else None
    if functional is None:
        raise GlobalTensorError(
            f"{name}: no signature keeps the target's layout and the op has no out-of-place "
            f"form; convert the target to gt.sbp.broadcast first")
    return ViaFunctional(functional)


def _broadcast_choice(func, name, layouts, has_rule):
    if torch.Tag.nondeterministic_seeded in func.tags:
        raise GlobalTensorError(
            f"{name}: random op without an SBP rule; running it on each rank would give "
            f"broadcast replicas different values. Use gt.rand/gt.randn or ops with rules "
            f"(dropout, rand_like, bernoulli_, uniform_, normal_)")
    if not has_rule and name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(
            f"globaltensor: no SBP rule for aten.{name}; running it on broadcast inputs "
            f"(correct, but every rank gathers the whole inputs). See docs/ops.md to add a rule.",
            stacklevel=4)
    placement = layouts[0].placement
    full = (rules.B,) * placement.ndim
    targets = tuple(l if l.sbp == full else l.with_sbp(full) for l in layouts)
    return rules.Choice(targets, (full,), None, 0.0)


def _call(func, name, args, kwargs) -> Call:
    counter = iter(range(1 << 30))
    shapes = []

    def mark(v):
        if isinstance(v, GlobalTensor):
            shapes.append(v._layout.shape)
            return Ref(next(counter))
        if isinstance(v, torch.Tensor):
            return LOCAL
        if isinstance(v, (list, tuple)):
            return tuple(mark(x) for x in v)
        if isinstance(v, (float, complex)):
            return NUMBER
        if isinstance(v, torch.Generator):
            return None
        return v

    margs = tuple(mark(a) for a in args)
    mkwargs = tuple(sorted((k, mark(v)) for k, v in kwargs.items()))
    tags = frozenset(str(t).split(".")[-1] for t in func.tags)
    return Call(name, tuple(shapes), margs, mkwargs, tags)


# ----------------------------------------------------------------------------- outputs


def _to_meta(value):
    if isinstance(value, GlobalTensor):
        return torch.empty(value._layout.shape, dtype=value.dtype, device="meta")
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    return value


def _meta_result(func, args, kwargs, name):
    margs = [_to_meta(a) for a in args]
    mkwargs = {k: _to_meta(v) for k, v in kwargs.items()}
    try:
        return func(*margs, **mkwargs)
    except (NotImplementedError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and "meta" not in str(e).lower():
            raise GlobalTensorError(f"{name} on global tensors: {e}") from e
        raise GlobalTensorError(
            f"{name}: cannot work out the output shape without running the op (no meta "
            f"kernel: {e}); gather the inputs with x.full_tensor() and run it locally") from e


def _out_layouts(meta, outs, placement, name):
    flat = []

    def build(m):
        if isinstance(m, torch.Tensor):
            sbp = outs[len(flat)] if len(outs) > 1 else outs[0]
            layout = Layout(placement, sbp, tuple(m.shape))
            flat.append(layout)
            return _OutSpec(layout, m.dtype)
        if isinstance(m, (list, tuple)):
            return type(m)(build(x) for x in m)
        if m is None:
            return None
        raise GlobalTensorError(
            f"{name} returns a {type(m).__name__}, not a tensor; read global values with "
            f"x.full_tensor() / x.item() and compute locally")

    return build(meta)


class _OutSpec:
    """An output's layout and dtype, with the global strides a wrapper needs."""

    __slots__ = ("layout", "dtype", "shape", "strides")

    def __init__(self, layout, dtype):
        self.layout, self.dtype = layout, dtype
        self.shape = layout.shape
        strides, acc = [], 1
        for n in reversed(self.shape):
            strides.append(acc)
            acc *= max(n, 1)
        self.strides = tuple(reversed(strides))


_new_wrapper = torch.Tensor._make_wrapper_subclass


def _wrap(result, outs):
    if type(outs) is _OutSpec:
        # GlobalTensor._make, with the strides worked out once per decision
        out = _new_wrapper(GlobalTensor, outs.shape, strides=outs.strides, dtype=result.dtype,
                           device=result.device, requires_grad=False)
        out._local = result
        out._layout = outs.layout
        return out
    if outs is None:
        return None
    return type(outs)(_wrap(r, o) for r, o in zip(result, outs))


def _empties(outs, pieces):
    device = pieces[0].device if pieces else torch.device("cpu")
    if type(outs) is _OutSpec:
        return torch.empty((0,) * len(outs.layout.shape), dtype=outs.dtype, device=device)
    if outs is None:
        return None
    return type(outs)(_empties(o, pieces) for o in outs)


def _plain(func, args, kwargs, tensors, choice, inplace, call):
    name = call.op
    placement = choice.ins[0].placement
    meta = _meta_result(func, args, kwargs, name)
    if inplace:
        outs = _OutSpec(tensors[0]._layout, tensors[0].dtype)
    else:
        outs = _out_layouts(meta, choice.outs, placement, name)
    rewrite = REWRITES.get(call.packet)
    return Plain(choice.ins, outs, choice.kernel, rewrite, inplace, call, _slots(args, kwargs),
                 getattr(func, "_op", func))


def _slots(args, kwargs):
    """Indices of the global-tensor args if every one is a plain positional arg, else None."""
    if any(isinstance(v, (GlobalTensor, list, tuple)) for v in kwargs.values()):
        return None
    if any(isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a) for a in args):
        return None
    return tuple(i for i, a in enumerate(args) if isinstance(a, GlobalTensor))


# ----------------------------------------------------------------------------- size rewrites
# Ops whose arguments name global sizes get the local sizes of this rank's pieces.


def _rewrite_view(plain, largs, pieces):
    if not pieces[0].is_contiguous():
        largs[0] = pieces[0].contiguous()  # the global tensor is contiguous; its piece may not be
    out = plain.outs.layout
    if not any(not isinstance(v, (Broadcast, PartialSum)) for v in out.sbp):
        return
    src = plain.targets[0].shape
    groups = rules.view_groups(src, out.shape)
    local_in = pieces[0].shape
    size = list(out.shape)
    split_dims = {v.dim for v in out.sbp if not isinstance(v, (Broadcast, PartialSum))}
    for gi, gj in groups:
        if gj and gj[0] in split_dims:
            rest = math.prod(out.shape[j] for j in gj[1:])
            size[gj[0]] = math.prod(local_in[i] for i in gi) // max(rest, 1)
    largs[1] = size


def _rewrite_expand(plain, largs, pieces):
    out = plain.outs.layout
    size = list(largs[1])
    for v in out.sbp:
        if not isinstance(v, (Broadcast, PartialSum)):
            size[v.dim] = -1
    largs[1] = size


def _rewrite_select_backward(plain, largs, pieces):
    sizes = list(largs[1])
    dim = largs[2] % len(sizes)
    local = list(pieces[0].shape)
    largs[1] = local[:dim] + [sizes[dim]] + local[dim:]


def _rewrite_slice_backward(plain, largs, pieces):
    sizes = list(largs[1])
    dim = largs[2] % len(sizes)
    local = list(pieces[0].shape)
    local[dim] = sizes[dim]
    largs[1] = local


REWRITES = {
    "view": _rewrite_view, "_unsafe_view": _rewrite_view, "reshape": _rewrite_view,
    "expand": _rewrite_expand,
    "select_backward": _rewrite_select_backward, "slice_backward": _rewrite_slice_backward,
}


# ----------------------------------------------------------------------------- kernels
# Local computations for the rows whose local op differs from the op itself (rules name them).
# Every rank calls a kernel, ranks outside the placement too (coord None): kernels that draw
# random numbers or communicate must do so on every rank alike, then return empty pieces.


class KernelContext:
    __slots__ = ("func", "call", "targets", "outs", "coord", "pieces")

    def __init__(self, func, call, targets, outs, coord, pieces):
        self.func, self.call, self.targets, self.outs = func, call, targets, outs
        self.coord, self.pieces = coord, pieces

    def empties(self):
        return _empties(self.outs, self.pieces)


def _argv(largs, lkwargs, pos, name, default=None):
    if pos < len(largs):
        return largs[pos]
    return lkwargs.get(name, default)


def _k_mean_partial(ctx, largs, lkwargs):
    """mean over a split dim: the local sum over the global count (a partial sum)."""
    if ctx.coord is None:
        return ctx.empties()
    x, shape = largs[0], ctx.targets[0].shape
    dtype = lkwargs.get("dtype")
    if ctx.call.op == "mean.default":
        dims, keepdim = tuple(range(len(shape))), False
    else:
        dims = rules._dims(_argv(largs, lkwargs, 1, "dim"), len(shape))
        keepdim = bool(_argv(largs, lkwargs, 2, "keepdim", False))
    count = math.prod(shape[d] for d in dims)
    total = x.sum(dim=dims, keepdim=keepdim, dtype=dtype) if dims else x.to(dtype or x.dtype)
    return total / count


def _k_loss_mean(ctx, largs, lkwargs):
    """mse_loss & co (and their backward) with reduction='mean' on split inputs: the local
    result with reduction='sum', over the global element count."""
    if ctx.coord is None:
        return ctx.empties()
    at = 3 if ctx.call.packet.endswith("_backward") else 2
    largs = list(largs)
    if at < len(largs):
        largs[at] = 2
    else:
        lkwargs = dict(lkwargs, reduction=2)
    shape = ctx.targets[1 if at == 3 else 0].shape
    return ctx.func(*largs, **lkwargs) / math.prod(shape)


def _k_nll_mean(ctx, largs, lkwargs):
    """nll_loss with a batch split and reduction='mean': the local sum over the global total
    weight (an all-reduce of one number, on every rank)."""
    largs = list(largs)
    largs[3] = 2  # reduction = sum
    if ctx.coord is None:
        total, weight = largs[0].new_zeros(()), largs[0].new_zeros(())
    else:
        total, weight = ctx.func(*largs, **lkwargs)
    dst = ctx.outs[1].layout
    partial = tuple(rules.P if isinstance(v, rules.S) else d
                    for v, d in zip(ctx.targets[0].sbp, dst.sbp))
    weight = redistribute_local(weight, Layout(dst.placement, partial, ()), dst)
    if ctx.coord is None:
        return ctx.empties()
    return total / weight, weight


def _k_embedding_vocab(ctx, largs, lkwargs):
    """embedding with a vocabulary-split weight: rows this rank lacks give 0 (a partial sum)."""
    if ctx.coord is None:
        return ctx.empties()
    weight, indices = largs[0], largs[1]
    lo, hi = ctx.targets[0].box(ctx.coord)[0]
    outside = (indices < lo) | (indices >= hi)
    local = (indices - lo).masked_fill(outside, 0)
    out = aten.embedding.default(weight, local)
    return out.masked_fill_(outside.unsqueeze(-1), 0)


def _k_dropout(ctx, largs, lkwargs):
    """native_dropout: the mask is drawn per global position, so replicas agree."""
    x, p = largs[0], _argv(largs, lkwargs, 1, "p")
    train = _argv(largs, lkwargs, 2, "train", True)
    if train is False:
        return ctx.empties() if ctx.coord is None else ctx.func(*largs, **lkwargs)
    u = random.uniform_piece(ctx.outs[0].layout, ctx.coord, torch.float32, x.device)
    if ctx.coord is None:
        return ctx.empties()
    mask = u >= p
    scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
    return x * mask * scale, mask


def _random_values(packet, layout, coord, dtype, device, largs, lkwargs):
    if packet in ("normal_", "randn_like"):
        z = random.normal_piece(layout, coord, dtype, device)
        if packet == "normal_":
            z = z * _argv(largs, lkwargs, 2, "std", 1.0) + _argv(largs, lkwargs, 1, "mean", 0.0)
        return z
    if packet == "randint_like":
        if len(largs) > 2 or "high" in lkwargs:
            low, high = _argv(largs, lkwargs, 1, "low", 0), _argv(largs, lkwargs, 2, "high")
        else:
            low, high = 0, _argv(largs, lkwargs, 1, "high")
        return random.randint_piece(low, high, layout, coord, dtype, device)
    u_dtype = dtype if dtype in (torch.float64, torch.float32) else torch.float32
    u = random.uniform_piece(layout, coord, u_dtype, device)
    if packet == "uniform_":
        lo, hi = _argv(largs, lkwargs, 1, "from", 0.0), _argv(largs, lkwargs, 2, "to", 1.0)
        return u * (hi - lo) + lo
    if packet in ("bernoulli_", "bernoulli"):
        p = _argv(largs, lkwargs, 1, "p", 0.5)
        if packet == "bernoulli" and len(largs) == 1 and "p" not in lkwargs:
            p = largs[0]  # bernoulli(probs)
        return u < p
    if packet == "exponential_":
        return -torch.log1p(-u) / _argv(largs, lkwargs, 1, "lambd", 1.0)
    return u  # rand_like


def _k_random(ctx, largs, lkwargs):
    """Random fills and *_like draws: values depend on the global position only."""
    packet = ctx.call.packet
    inplace = packet.endswith("_")
    spec = ctx.outs
    layout = ctx.targets[0] if inplace else spec.layout
    dtype = spec.dtype
    device = ctx.pieces[0].device
    values = _random_values(packet, layout, ctx.coord, dtype, device, largs, lkwargs)
    if ctx.coord is None:
        return None if inplace else ctx.empties()
    if inplace:
        largs[0].copy_(values)
        return largs[0]
    return values.to(dtype)


KERNELS = {
    "mean_partial": _k_mean_partial,
    "nll_mean": _k_nll_mean,
    "loss_mean": _k_loss_mean,
    "embedding_vocab": _k_embedding_vocab,
    "dropout": _k_dropout,
    "random": _k_random,
}


def clear_cache() -> None:
    """Forget every cached decision (tests; after changing rules at run time)."""
    _DECISIONS.clear()
    _BY_ID.clear()
    _PINNED.clear()
    _WARNED.clear()


__all__ = ["dispatch", "clear_cache", "KERNELS"]
