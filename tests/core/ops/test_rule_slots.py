"""Every rule's rows against the call's *global* inputs, for calls whose 0-dim inputs are partly
plain tensors (the property that would have caught issue 52's nll_loss_backward: under
torch.compile, and from autograd in eager backward, its ``total_weight`` arrives as a plain 0-dim
tensor, and its fixed table had a column for it).

The calls are the aten calls torch's OpInfo samples make, forward and backward, seen two ways:
eagerly (a dispatch mode) and traced (make_fx's graph, as AOTAutograd records it). Each call is
given to its op's rule with every tensor global, then with each choice of its 0-dim tensors
local (a constant the same on every rank, which dispatch passes through as a plain tensor); the
rows must have one column per global input, and the choice must return a signature or None
(never an internal error). Pure: no ranks.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from globaltensor.errors import GlobalTensorError
from globaltensor.layout import Layout
from globaltensor.ops import LOCAL, NUMBER, Call, Ref, choose, rule_for
from globaltensor.ops.naming import qualified
from globaltensor.ops.registry import OPS, register, rows_for
from globaltensor.ops.rules import sig
from globaltensor.sbp import broadcast, split

from helpers import G2, op_db, opinfo_samples


class _Calls(TorchDispatchMode):
    """Records (op, args, kwargs) of every aten call it sees, tensors as themselves."""

    def __init__(self, found: list):
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.found.append((func, args, kwargs))
        return func(*args, **kwargs)


def _run(opinfo, sample):
    """The op on the sample, then a backward of its float outputs (where there is one)."""
    out = opinfo.op(sample.input, *sample.args, **sample.kwargs)
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)
            and o.requires_grad and o.is_floating_point()]
    leaves = [x for x in tree_flatten((sample.input, sample.args, sample.kwargs))[0]
              if isinstance(x, torch.Tensor) and x.requires_grad]
    if outs and leaves:
        torch.autograd.grad(sum(o.sum() for o in outs), leaves, allow_unused=True)


def eager_calls(opinfo, sample) -> list:
    found: list = []
    try:
        with _Calls(found):
            _run(opinfo, sample)
    except Exception:  # noqa: BLE001 - a sample torch itself refuses
        pass
    return found


def traced_calls(opinfo, sample) -> list:
    """The aten calls of make_fx's graph of forward and backward, tensors as their fake values."""
    from torch.fx.experimental.proxy_tensor import make_fx

    leaves, spec = tree_flatten((sample.input, sample.args, sample.kwargs))
    where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def fn(*tensors):
        values = list(leaves)
        for i, t in zip(where, tensors):
            values[i] = t
        from torch.utils._pytree import tree_unflatten
        inp, args, kwargs = tree_unflatten(values, spec)
        out = opinfo.op(inp, *args, **kwargs)
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)
                and o.requires_grad and o.is_floating_point()]
        grads = [t for t in tensors if t.requires_grad]
        if outs and grads:
            return torch.autograd.grad(sum(o.sum() for o in outs), grads, allow_unused=True)
        return out

    try:
        graph = make_fx(fn, tracing_mode="fake")(*[leaves[i] for i in where])
    except Exception:  # noqa: BLE001 - a sample make_fx cannot trace
        return []
    found = []
    for node in graph.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        value = lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a  # noqa: E731
        found.append((node.target, tree_map(value, node.args), tree_map(value, node.kwargs)))
    return found


def _marked(value, tensors: list, local: set):
    """``value`` as a Call holds it (see dispatch/args.py): a global tensor as Ref, a 0-dim
    local one as LOCAL, a float as NUMBER."""
    if isinstance(value, torch.Tensor):
        k = len(tensors)
        tensors.append(value)
        return LOCAL if k in local else Ref(k - sum(1 for j in local if j < k))
    if isinstance(value, (list, tuple)):
        return tuple(_marked(v, tensors, local) for v in value)
    if isinstance(value, (float, complex)):
        return NUMBER
    if isinstance(value, (torch.Generator, torch.SymInt, torch.SymFloat)):
        return None
    return value


def call_variants(func, args, kwargs):
    """(Call, shapes of its global inputs) with every tensor global, then each set of its 0-dim
    tensors local (at most 3 of them, one global input always left)."""
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if any(type(n) is not int for t in tensors for n in t.shape):
        return  # a data-dependent size in a traced graph
    scalars = [i for i, t in enumerate(tensors) if t.dim() == 0][:3]
    name = qualified(func)
    tags = frozenset(str(t).split(".")[-1] for t in func.tags)
    for n in range(len(scalars) + 1):
        for local in itertools.combinations(scalars, n):
            if len(local) == len(tensors):
                continue
            seen: list = []
            marked = tuple(_marked(a, seen, set(local)) for a in args)
            kw = tuple(sorted((k, _marked(v, seen, set(local))) for k, v in kwargs.items()))
            shapes = tuple(tuple(t.shape) for i, t in enumerate(seen) if i not in local)
            yield Call(name, shapes, marked, kw, tags), local


def check_call(call: Call) -> str | None:
    """What is wrong with the rule's answer for ``call``, or None."""
    if rule_for(call) is None:
        return None
    try:
        rule = rows_for(call)
    except GlobalTensorError as e:
        return str(e) if "internal" in str(e) else None
    except Exception:  # noqa: BLE001 - a rule that reads an argument a sample leaves odd
        return None
    n = len(call.shapes)
    bad = [str(r) for r in rule.rows if len(r.ins) != n]
    if bad:
        return f"rows {bad} for {n} global inputs"
    if rule.frames is not None and len(rule.frames) != n:
        return f"{len(rule.frames)} frames for {n} global inputs"
    layouts = tuple(Layout(G2, (broadcast,), s) for s in call.shapes)
    try:
        choose(call, layouts, tuple(8 for _ in layouts))
    except GlobalTensorError as e:
        if "internal" in str(e):
            return str(e)
    return None


def _has_out(func) -> bool:
    return any(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write
               for a in func._schema.arguments)


def sweep(calls_of, samples: int) -> dict:
    """op -> first problem found, over every OpInfo op's first ``samples`` samples."""
    problems: dict = {}
    checked = set()
    for opinfo in op_db():
        for sample in opinfo_samples(opinfo, samples):
            for func, args, kwargs in calls_of(opinfo, sample):
                if _has_out(func):
                    continue  # dispatch refuses out= before any rule (decide._check_no_out)
                for call, local in call_variants(func, args, kwargs):
                    key = (call.op, call.shapes, call.args, call.kwargs)
                    if key in checked:
                        continue
                    checked.add(key)
                    problem = check_call(call)
                    if problem and call.op not in problems:
                        problems[call.op] = f"{problem} (local 0-dim tensors: {local})"
    return problems


def test_the_nll_loss_backward_call_of_a_compiled_hf_loss_has_rows_for_its_global_inputs():
    """The call issue 52 met: ``total_weight`` a plain 0-dim tensor, grad / scores / targets
    global. Its rows lose the total_weight column and keep their choices: the batch split."""
    call = Call("nll_loss_backward.default", ((), (64, 256), (64,)),
                (Ref(0), Ref(1), Ref(2), None, 1, -100, LOCAL))
    rule = rows_for(call)
    assert {len(r.ins) for r in rule.rows} == {3}
    assert any(str(r).startswith("B S(0) S(0) -> S(0)") for r in rule.rows)
    scores = Layout(G2, (split(0),), (64, 256))
    choice = choose(call, (Layout(G2, (broadcast,), ()), scores, Layout(G2, (split(0),), (64,))),
                    (8, 8, 8))
    assert choice is not None and choice.ins[1] == scores and choice.outs[0] == (split(0),)


def test_a_row_asking_a_local_scalar_for_a_partial_sum_cannot_run():
    """reduction='sum': total_weight's column is P in one row; a plain 0-dim tensor is a
    constant (B), so that row is dropped, not kept with the column cut off."""
    call = Call("nll_loss_backward.default", ((), (8, 5), (8,)),
                (Ref(0), Ref(1), Ref(2), None, 2, -100, LOCAL))
    rows = [str(r) for r in rows_for(call).rows]
    assert rows and all(len(r.split("->")[0].split()) == 3 for r in rows)
    assert not any(r.startswith("B S(0) S(0) ->") for r in rows)  # the row that wanted P


def test_rows_of_any_other_length_are_still_an_internal_error():
    def rule(call):
        return (sig("B B B B -> B"),)
    name = "addcmul.default"
    saved = OPS.get(name)
    OPS.pop(name, None)
    try:
        register(name, rule=rule)
        call = Call(name, ((3,), (3,)), (Ref(0), Ref(1), LOCAL))
        with pytest.raises(GlobalTensorError, match="internal: a rule for addcmul"):
            rows_for(call)
    finally:
        OPS.pop(name, None)
        if saved is not None:
            OPS[name] = saved


def test_every_rule_has_rows_for_the_global_inputs_of_eager_calls():
    """OpInfo's first sample of every op, forward and backward, seen eagerly."""
    assert sweep(eager_calls, samples=1) == {}


@pytest.mark.slow
def test_every_rule_has_rows_for_the_global_inputs_of_traced_calls():
    """The same over make_fx's graphs (AOTAutograd's view of a compiled step), two samples."""
    assert sweep(traced_calls, samples=2) == {}
