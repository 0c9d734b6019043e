"""What dispatch does for one (op, input layouts, arguments): a decision, made once and cached.

    Plain         redistribute the inputs to the chosen targets, run the op (or a kernel) on the
                  pieces, wrap the outputs
    Decomposed    run the op's decomposition into ops with rules (each part re-enters dispatch)
    ViaFunctional an in-place op whose result cannot keep self's layout: out of place, then write
    InplaceView   an in-place op that changes self's shape (squeeze_, t_): self takes the result
    Contextual    a choice that moves inputs: decided again per context (gradients, moved pieces)
    Special       copy_, item, foreach (special.py)
    NoRule        an op without a rule on broadcast inputs (any of the above): warns once
"""
from __future__ import annotations

import threading
import warnings

import torch
from torch.utils._mode_utils import no_dispatch

from .. import observe
from ..world import world
from ..world.simulated import simulated
from .._cache import Bounded
from ..debug import user_frame
from ..errors import GlobalTensorError
from ..layout import Layout
from ..sbp import replicated
from ..ops import KERNELS, KernelContext
from ..ops.pieces import nothing_held, zero_pieces
from ..redistribute import moved, moved_targets, redistribute_local
from ..runtime.failure import local_failure
from ..runtime.meta import object_from
from ..tensor import GlobalTensor
from .args import local_args
from .outputs import OutSpec, canonical, empties, lazy_bits, new_wrapper, wrap, wrapper_device
from .aliasing import LINK, link, write_back, write_into


_WARNED = Bounded(10_000)  # ops already warned about (no rule: broadcast fallback)


def my_coord(placement):
    return placement.coord_of(world.get_rank())


def _maybe_outside(piece) -> bool:
    """Outside the placement pieces are (0,)*ndim: a non-empty one of ndim > 0 proves inside."""
    return piece.numel() == 0 or piece.dim() == 0


class Plain:
    """Redistribute inputs to ``targets``, run the op (or a kernel) locally, wrap the outputs."""

    __slots__ = ("targets", "outs", "kernel", "rewrite", "inplace", "call", "placement", "slots",
                 "positional", "op", "view", "mutated")

    def __init__(self, targets, outs, kernel, rewrite, inplace, call, slots, op, view=None,
                 mutated=()):
        # canonical: a piece made by a decision carries its output layout, also canonical, so
        # the next op's ``layout is target`` holds without comparing layouts field by field
        self.targets, self.outs, self.kernel = tuple(canonical(t) for t in targets), outs, kernel
        self.rewrite, self.inplace, self.call = rewrite, inplace, call
        self.placement = targets[0].placement
        # a view op: None for other ops, else whether its input was moved (views.py)
        self.view = view
        # the inputs (by index) the op writes besides an in-place op's self
        self.mutated = mutated
        # positions of the global tensors when they are all plain positional args: the local
        # args are then built by position, not by a walk; with nothing else to do, the fast path
        self.positional = slots
        self.slots = slots if not (kernel or view or mutated) else None
        self.op = op  # the C++ op behind the OpOverload: one Python frame less per call

    def pieces(self, tensors):
        out = []
        for t, target in zip(tensors, self.targets):
            layout = t._layout
            out.append(t._local if layout is target or layout == target else moved(t, target))
        return out

    def local_args(self, args, kwargs, pieces):
        if self.positional is None:
            return local_args(args, kwargs, pieces)
        largs = list(args)
        for slot, piece in zip(self.positional, pieces):
            largs[slot] = piece
        return largs, kwargs

    def run(self, func, args, kwargs, tensors):
        if self.slots is not None:
            return self._run_simple(func, args, kwargs, tensors)
        pieces = self.pieces(tensors)
        if self.kernel is not None:
            largs, lkwargs = self.local_args(args, kwargs, pieces)
            ctx = KernelContext(func, self.call, self.targets, self.outs, my_coord(self.placement),
                                pieces, redistribute_local,
                                lambda: empties(self.outs, pieces, kwargs))
            try:
                with observe.counted_inside():
                    result = KERNELS[self.kernel](ctx, largs, lkwargs)
            except Exception as error:  # noqa: BLE001 - _failed re-raises what is not local
                result = self._failed(error, pieces)
        elif _maybe_outside(pieces[0]) and my_coord(self.placement) is None:
            result = empties(self.outs, pieces, kwargs)
        else:
            largs, lkwargs = self.local_args(args, kwargs, pieces)
            if self.rewrite is not None:
                self.rewrite(self, largs, pieces)
            try:
                result = self.op(*largs, **lkwargs)
            except Exception as error:  # noqa: BLE001 - _failed re-raises what is not local
                result = self._failed(error, pieces)
        for i in self.mutated:  # an input the op wrote: if it was moved, the write reached a copy
            t, target = tensors[i], self.targets[i]
            if t._layout != target:
                write_into(t, GlobalTensor._make(pieces[i], target))
            _written(t)
        if self.inplace:
            return _written(args[0])
        out = wrap(result, self.outs)
        if self.view is not None:
            link(out, args[0], self.call.op, args, kwargs, self.view)
        return out

    def _failed(self, error, pieces):
        """The local op raised. If this rank holds an empty piece (an uneven split gave it none
        of a dim) and each result is an empty piece or a partial sum here, its results are
        zeros of their local shapes (what the op gives on empty inputs) instead of an error on
        this rank alone; a result that would hold values (B or S, non-empty) is never made up.
        Our own errors pass. Any other failure may be this rank's alone (the meta run checked
        shapes and dtypes): with other ranks in the world it becomes the same
        ``LocalOpFailed`` on every rank (runtime/failure.py), never a hang."""
        if isinstance(error, GlobalTensorError):
            raise error
        coord = my_coord(self.placement)
        if isinstance(error, RuntimeError) and any(
                p.numel() == 0 for p in pieces if isinstance(p, torch.Tensor)) and nothing_held(
                self.outs, coord):
            return zero_pieces(self.outs, coord, pieces[0].device)
        if world.get_world_size() == 1:
            raise error
        raise _local_error(str(self.call.op), self.placement, pieces, error) from error

    def _run_simple(self, func, args, kwargs, tensors):
        # every op whose global tensors are plain positional args (a rewrite of sizes aside):
        # each piece straight to its slot; dispatch calls it directly (dispatch.runner)
        largs = list(args)
        slots = self.slots
        for t, target, slot in zip(tensors, self.targets, slots):
            layout = t._layout
            largs[slot] = t._local if layout is target or layout == target else moved(t, target)
        first = largs[slots[0]]
        if (first.numel() == 0 or first.dim() == 0) and my_coord(self.placement) is None:
            result = empties(self.outs, [first], kwargs)  # _maybe_outside, inline
        else:
            pieces = None
            if self.rewrite is not None:  # local sizes from global ones (a view's)
                pieces = [largs[s] for s in slots]
                self.rewrite(self, largs, pieces)
            try:
                result = self.op(*largs, **kwargs)
            except Exception as error:  # noqa: BLE001 - _failed re-raises what is not local
                result = self._failed(error, pieces or [largs[s] for s in slots])
        if self.inplace:
            return _written(args[0])
        outs = self.outs
        if type(outs) is OutSpec:  # wrap, inline: one output (outputs.wrap)
            out = new_wrapper(GlobalTensor, outs.shape, dtype=result.dtype, device=wrapper_device(result, outs.layout.placement) if result.is_meta else result.device)
            out._local, out._layout = result, outs.layout
            if outs.complex:
                lazy_bits(out, result)
        else:
            out = wrap(result, outs)
        if self.view is not None and LINK in args[0].__dict__:  # a view of a linked view is
            link(out, args[0], self.call.op, args, kwargs, False)  # linked too (views.py)
        return out


def _written(target):
    """``target`` after an in-place op: a view that does not alias its base writes back."""
    if LINK in target.__dict__:
        write_back(target)
    return target


_THREAD = threading.local()  # per thread: ranks of run_ranks are threads


def _decomposing() -> list:
    """This thread's stack of running decompositions with gradients: each entry holds the ids
    of that op's inputs that get no gradient."""
    stack = getattr(_THREAD, "decomposing", None)
    if stack is None:
        stack = _THREAD.decomposing = []
    return stack


class Decomposed:
    """Run a decomposition into ops with rules (each re-enters dispatch).

    The parts run below autograd, so the tensors made inside (``mm``'s result in ``addmm``)
    do not require grad even when the op's inputs do; while a decomposition with an input that
    will get a gradient runs, :func:`context` takes every tensor but the op's own grad-free
    inputs as getting one."""

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


class ViaFunctional:
    """An in-place op whose result cannot keep ``self``'s layout: compute the out-of-place op,
    then write the value back into ``self``'s layout (the write may make a P piece)."""

    __slots__ = ("functional", "write")

    def __init__(self, functional, write):
        self.functional, self.write = functional, write

    def run(self, func, args, kwargs, tensors):
        self.write(args[0], self.functional(*args, **kwargs))
        return _written(args[0])


class InplaceView:
    """An in-place op that changes ``self``'s shape (``squeeze_``, ``unsqueeze_``, ``t_``,
    ``transpose_``): the out-of-place op gives the new piece and layout, ``self`` takes both,
    and the wrapper's sizes and strides follow (the op run on its metadata alone, as torch's
    ``return_and_correct_aliasing`` does for wrapper subclasses)."""

    __slots__ = ("functional",)

    def __init__(self, functional):
        self.functional = functional

    def run(self, func, args, kwargs, tensors):
        target = args[0]
        out = self.functional(*args, **kwargs)
        target._local, target._layout = out._local, out._layout
        target.__dict__.pop("_gt_moves", None)  # pieces moved from the old layout
        with no_dispatch():
            meta = torch._C._meta_in_tls_dispatch_include()
            torch._C._set_meta_in_tls_dispatch_include(True)
            try:
                func(*args, **kwargs)
            finally:
                torch._C._set_meta_in_tls_dispatch_include(meta)
        return target


class Contextual:
    """A call whose cheapest signature moves inputs. Which signature is cheapest then also
    depends on the *context*: which inputs will get a gradient (moving one costs the move its
    gradient needs in backward, see ``ops.backward_cost``) and which layouts the inputs
    already hold moved pieces for (those moves are free). The context is read on every call
    (only calls that move inputs pay for it) and a decision is kept per context.

    A signature that moves nothing costs nothing in any context and stays the cheapest, so the
    no-communication path never gets here."""

    __slots__ = ("by_context", "decide", "key")

    def __init__(self, decide, key):
        self.by_context, self.decide, self.key = Bounded(256), decide, key

    def run(self, func, args, kwargs, tensors):
        ctx = context(tensors)
        decision = self.by_context.get(ctx)
        if decision is None:
            decision = self.by_context.put(ctx, self.decide(func, args, kwargs, tensors, self.key, ctx))
        return decision.run(func, args, kwargs, tensors)


def context(tensors) -> tuple:
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
    # the targets only, not whether a piece is stale: ranks outside the placement skip in-place
    # ops, so versions may differ between ranks while the moves do not
    free = tuple(moved_targets(t) for t in tensors)
    return grads, (free if any(free) else None)


class Special:
    """An op with its own handler: ``fn(func, args, kwargs, tensors)``."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def run(self, func, args, kwargs, tensors):
        return self.fn(func, args, kwargs, tensors)


class NoRule:
    """The decision for an op without a rule, run on broadcast inputs (``decision``): warns once
    per op, by the placement's first rank, at the user's line, the first time that rank runs
    it. Not when deciding: thread-ranks (gt.testing) share one process's decisions, and the rank
    that decides first would otherwise settle whether rank 0 ever warns."""

    __slots__ = ("decision", "func", "name", "first")

    def __init__(self, decision, func, name: str, placement):
        self.decision, self.func, self.name = decision, func, name
        self.first = min(placement.flat_ranks)

    def run(self, func, args, kwargs, tensors):
        if self.name not in _WARNED and world.get_rank() == self.first:
            _WARNED.put(self.name, True)
            where = user_frame(2) or ("<globaltensor>", 0)
            warnings.warn_explicit(
                f"globaltensor: no SBP rule for {self.func}; running it on broadcast inputs "
                f"(correct, but every rank gathers the whole inputs; shown once, by rank "
                f"{self.first}). To add a rule: gt.ops.register({self.name!r}, rule=...) (or "
                f"{self.name.split('.')[0]!r} for all its overloads); see docs/ops.md.",
                UserWarning, where[0], where[1])
        return self.decision.run(func, args, kwargs, tensors)


class RunToLearn:
    """An op whose output shape depends on its data (nonzero, unique, masked_select, x[mask],
    bincount, repeat_interleave, equal, allclose...): meta tensors cannot tell the shape, so
    the members run it on broadcast inputs and the result is broadcast, its shape learnt from
    the run. Ranks outside the placement learn shapes, dtypes and plain values (``equal``'s
    bool) from the placement's first rank, one object broadcast over the world; when the
    placement holds every rank nothing is sent."""

    __slots__ = ("targets", "placement")

    def __init__(self, targets):
        self.targets = targets
        self.placement = targets[0].placement

    def run(self, func, args, kwargs, tensors):
        pieces = [t._local if t._layout == target else moved(t, target)
                  for t, target in zip(tensors, self.targets)]
        inside = my_coord(self.placement) is not None
        result = None
        if inside:
            largs, lkwargs = local_args(args, kwargs, pieces)
            try:
                result = func(*largs, **lkwargs)
            except Exception as error:  # noqa: BLE001 - every member runs the same full values
                if isinstance(error, GlobalTensorError) or world.get_world_size() == 1:
                    raise
                raise _local_error(str(func), self.placement, pieces, error) from error
        if self.placement.size != world.get_world_size():  # asked per call: decisions outlive worlds
            result = _from_first_member(result, self.placement, inside)
        return _broadcast_wrapped(result, self.placement)


def _described(value):
    """What an outside rank needs of a result: shapes and dtypes of tensors, plain values."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, [_described(v) for v in value])
    return ("value", value)


def _rebuilt(desc, device):
    kind = desc[0]
    if kind == "tensor":
        return ("shape", desc[1], torch.empty((0,) * len(desc[1]), dtype=desc[2], device=device))
    if kind in ("tuple", "list"):
        items = [_rebuilt(d, device) for d in desc[1]]
        return tuple(items) if kind == "tuple" else list(items)
    return desc[1]


def _from_first_member(result, placement, inside):
    first = int(placement.flat_ranks[0])
    desc = object_from(first, _described(result) if world.get_rank() == first else None)
    return result if inside else _rebuilt(desc, torch.device("cpu"))


def _broadcast_wrapped(result, placement):
    full = replicated(placement.ndim)
    if isinstance(result, tuple) and len(result) == 3 and result[0] == "shape":
        _, shape, empty = result  # an outside rank: an empty piece of the learnt shape
        return GlobalTensor._make(empty, Layout(placement, full, shape))
    if isinstance(result, torch.Tensor):
        return GlobalTensor._make(result, Layout(placement, full, tuple(result.shape)))
    if isinstance(result, (tuple, list)):
        return type(result)(_broadcast_wrapped(r, placement) for r in result)
    return result


class AdoptIndexScalars:
    """A 0-dim local tensor given as an op's index or target (``index_select(x, 0,
    torch.tensor(1))``, ``nll_loss(x, torch.tensor(3))``) is data, not a pointwise scalar: it
    becomes a 0-dim broadcast global tensor and the call is dispatched again."""

    __slots__ = ("names",)

    def __init__(self, names):
        self.names = names

    def run(self, func, args, kwargs, tensors):
        placement = tensors[0]._layout.placement
        inside = my_coord(placement) is not None
        full = replicated(placement.ndim)

        def adopt(v):
            if type(v) is torch.Tensor and v.dim() == 0:
                return GlobalTensor._make(v if inside else v.new_empty(()), Layout(placement, full, ()))
            return v
        schema = func._schema.arguments
        args = list(args)
        for i, a in enumerate(schema):
            if a.name not in self.names:
                continue
            if i < len(args) and not a.kwarg_only:
                args[i] = adopt(args[i])
            elif a.name in kwargs:
                kwargs = dict(kwargs, **{a.name: adopt(kwargs[a.name])})
        return func(*args, **kwargs)


def _local_error(op: str, placement, pieces, error: BaseException) -> GlobalTensorError:
    """What a local computation that raised becomes: the same ``LocalOpFailed`` on every rank;
    in ``gt.simulate`` (meta pieces), an error saying the operator needs values."""
    if simulated() and any(isinstance(p, torch.Tensor) and p.is_meta for p in pieces):
        from ..debug import user_line
        return GlobalTensorError(
            f"gt.simulate: {op} cannot run without data ({user_line(3)}): inside a simulation "
            f"tensors hold none, and this operator needs values (an output shape that depends "
            f"on them, or a value read); torch said: {str(error).splitlines()[0][:200]}. Keep "
            f"it out of the simulated block, or branch on gt.env.simulated()")
    return local_failure(op, placement.flat_ranks, error)
