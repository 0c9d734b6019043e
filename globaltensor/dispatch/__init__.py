"""Operators on global tensors: ``__torch_dispatch__`` below autograd.

Every aten op on a GlobalTensor lands in :func:`dispatch`: one walk over the arguments gives the
cache key (args.py); a cached *decision* (decisions.py) runs the call: redistribute the inputs
the chosen signature asks for, run the op on the local pieces, wrap the outputs (outputs.py).
A miss decides (decide.py) by the op's rule in ``ops/``. So an op that needs no communication
costs the walk, a dict lookup, the local op and the wrapping.

    args.py       the one walk over (args, kwargs): key by id, key by value, Call, local args
    decide.py     the choice on a miss: special op, decomposition, rule, broadcast fallback
    decisions.py  Plain, Decomposed, ViaFunctional, Contextual, Special
    special.py    copy_, item, foreach
    outputs.py    output layouts (a meta run), wrappers, the empty pieces of outside ranks
    adopt.py      local tensors taken as broadcast values in global mode (GT_DEBUG compares them)
    aliasing.py   views made from moved pieces: a write into one reaches its base

Ranks outside the placement run every redistribution (SPMD) but skip the local op: their pieces
are empty, with the output's ndim and dtype.
"""
from __future__ import annotations

from .. import debug as _debug
from .._cache import Bounded, ById
from ..runtime.agreement import check
from .adopt import adopt_locals
from .args import LocalTensorFound, by_value, flatten
from .decide import decide, op_name
from .decisions import Plain

_DECISIONS = Bounded(100_000)  # (op, layouts by value, args) -> decision: a pure function's cache
# the same decisions keyed by the layouts' ids (no hashing of layouts), each held as the callable
# that runs it (Plain.runner: the fast path's method itself, one Python frame less per call)
_BY_ID = ById(20_000)
_DEBUG = _debug.FLAG  # None until first read, then whether GT_DEBUG's checks run (debug.py)


def dispatch(cls, func, types, args=(), kwargs=None):
    """Run aten op ``func`` on global tensors: ``GlobalTensor.__torch_dispatch__`` itself."""
    if kwargs is None:
        kwargs = {}
    try:
        key, tensors = flatten(func, args, kwargs)
    except LocalTensorFound as found:
        args, kwargs = adopt_locals(func, args, kwargs, found.value)
        key, tensors = flatten(func, args, kwargs)
    if _DEBUG.get() is not False and _debug.is_debug():  # GT_DEBUG: every rank runs this op
        check("aten." + op_name(func), args=_debug.op_args(args, kwargs))  # (see debug.py)
    run = _BY_ID.get(key)
    if run is None:
        run = _lookup(func, args, kwargs, tensors, key)
    return run(func, args, kwargs, tensors)


def _lookup(func, args, kwargs, tensors, key):
    """The decision by value (layouts compared by value), deciding on a miss; then remembered
    (as its runner) under ``key`` too, pinning the layouts it names so their ids stay theirs."""
    value_key = by_value(key, tensors)
    decision = _DECISIONS.get(value_key)
    if decision is None:
        decision = _DECISIONS.put(value_key, decide(func, args, kwargs, tensors, key))
    return _BY_ID.put(key, runner(decision), pinned=[t._layout for t in tensors])


def runner(decision):
    """What dispatch keeps and calls for ``decision``: its ``run``, or for a Plain decision on
    the fast path, ``_run_simple`` itself (one Python frame less per operator call)."""
    if type(decision) is Plain and decision.slots is not None:
        return decision._run_simple
    return decision.run


__all__ = ["dispatch"]
