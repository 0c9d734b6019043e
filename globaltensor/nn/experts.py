"""Expert parallelism: the routed token rows go to their experts' owners by all-to-all (SPEC
"Experts", docs/experts.md).

HF's mixture-of-experts models compute their experts in one module whose class transformers'
``use_experts_implementation`` decorates (Qwen3-MoE, Mixtral, DeepSeek-V3, ...): stacked expert
weights ``(experts, ...)`` and ``forward(hidden_states, top_k_index, top_k_weights)``, the tokens
flattened. ``module.to_global`` gives such a module a class (:func:`install`) whose forward, when
the stacked experts are split on a placement axis (``S(0)`` on "ep") and the tokens are split on
the same axis, runs the routed computation as expert parallelism does:

1. each rank tells each member of the axis the rows, the (token, choice) pairs and the
   expert indices out of range it will send (a small all-to-all: every rank of the axis raises
   the same error for a bad index);
2. each pair's row and local expert go to its expert's owner, and each token's hidden state
   goes once to each owner of one of its choices (DeepEP's dispatch to ranks, not experts),
   with the pairs' router weights (all-to-all-v's of the counts);
3. each owner runs transformers' own experts implementation (``config._experts_implementation``:
   grouped_mm, eager, ...) on its experts' pieces and the pairs' rows, one choice per row, and
   weighs and sums them per row received;
4. the summed rows come back the same way and each rank adds them into its tokens.

Backward is the mirror: the rows', weights' and results' all-to-alls are an autograd function
whose backward is the other direction. All go through the wire (``Why("expert dispatch")``):
gt.comm_trace names them, and gt.simulate, where the router's choices are not known, counts
them for a router that chooses uniformly (the balance a load-balancing loss aims at).

On the other axes the tokens are whole (``B``). Where the experts are whole there too, each rank
computes on plain pieces. Where their features are split (Megatron inside each expert: "tp"),
the owner's computation runs on global tensors on the ranks that share its "ep" coordinate,
whose rows are the same: dispatch's rules split each expert there as they split any matmul.
Any other layout (experts whole, tokens split on two axes, a module with submodules holding
parameters) runs as before, through the ``_grouped_mm`` rules (docs/ops.md).
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import GlobalTensorError
from ..layout import Layout
from ..placement import Placement
from ..runtime import wire
from ..runtime.groups import group_along
from ..sbp import Broadcast, Split, broadcast, partial_sum, replicated
from ..tensor import FromLocal, GlobalTensor, as_global_grad, redistribute
from ..world import world

__all__ = ["install", "set_experts_method", "METHODS"]

# how a split experts module computes (gt.set_experts_method): "all_to_all" dispatches the
# routed rows; "all_reduce" keeps the _grouped_mm rules (every rank all tokens, partial sums)
METHODS = ("all_to_all", "all_reduce")
_METHOD = ["all_to_all"]


def set_experts_method(method: str) -> str:
    """``gt.set_experts_method("all_reduce")``: how an experts module split on an axis computes
    from now on, on this process (alike on every rank): ``"all_to_all"`` (the default: token
    dispatch) or ``"all_reduce"`` (the ``_grouped_mm`` rules). Returns the one before."""
    if method not in METHODS:
        raise GlobalTensorError(f"set_experts_method expects one of {list(METHODS)}, found "
                                f"{method!r}; e.g. gt.set_experts_method(\"all_to_all\")")
    before, _METHOD[0] = _METHOD[0], method
    return before


# --------------------------------------------------------------------------- the module's class

def is_experts_module(module: torch.nn.Module) -> bool:
    """transformers' experts contract: ``use_experts_implementation`` set ``_is_expert_parallel``
    and ``config``; the stacked weights are 3-D parameters with ``num_experts`` rows."""
    if not hasattr(module, "_is_expert_parallel") or not hasattr(module, "config"):
        return False
    stacked = [getattr(module, n, None) for n in ("down_proj", "gate_up_proj", "up_proj")]
    return (isinstance(getattr(module, "num_experts", None), int)
            and isinstance(stacked[0], torch.Tensor) and stacked[0].dim() == 3
            and any(isinstance(t, torch.Tensor) and t.dim() == 3 for t in stacked[1:]))


def install(module: torch.nn.Module) -> None:
    """Give each experts module under ``module`` (itself included) the class whose forward
    dispatches tokens when its layout asks (see the module's docstring)."""
    for sub in module.modules():
        if is_experts_module(sub) and "_gt_experts" not in type(sub).__dict__:
            sub.__class__ = _dispatching(type(sub))


@functools.cache
def _dispatching(cls: type) -> type:
    """A subclass of ``cls`` (same name and module) whose forward is :func:`forward`."""
    def forward_(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        plan = None if args or kwargs else plan_for(self, hidden_states, top_k_index)
        if plan is None:
            return cls.forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        return forward(self, cls.forward, plan, hidden_states, top_k_index, top_k_weights)

    # under torch.compile the dispatch runs as Python (its counts are data: a graph ends
    # before the experts and another starts after, as around fully_shard's hooks)
    namespace = {"forward": torch.compiler.disable(forward_, recursive=True), "_gt_experts": True, "__module__": cls.__module__,
                 "__qualname__": cls.__qualname__,
                 "_gt_plain_class": cls.__dict__.get("_gt_plain_class", cls)}
    return type(cls.__name__, (cls,), namespace)


# --------------------------------------------------------------------------- the plan

@dataclass(frozen=True)
class Plan:
    """How one call dispatches: the placement, the "ep" axis, this rank's group along it (its
    ranks ascending: the group's own order), each member's experts ``[start, stop)``, the
    tokens' sbp, the result's (partial sums on the other axes where the owners' experts are
    split there), and the placement of the ranks sharing this rank's "ep" coordinate (None
    when the experts are whole on every other axis: the owners compute on plain pieces). A
    rank outside the placement has no group, no members."""

    placement: Placement
    axis: int
    group: object
    members: tuple
    bounds: tuple
    token_sbp: tuple
    out_sbp: tuple
    shared: Placement | None

    @property
    def me(self) -> int:
        return self.members.index(world.get_rank())


def plan_for(module, hidden, top_k_index) -> Plan | None:
    """The dispatch of this call, or None where it runs as before: the same answer on every
    rank (it reads layouts only)."""
    if _METHOD[0] != "all_to_all" or not isinstance(hidden, GlobalTensor) or hidden.dim() != 2:
        return None
    placement = hidden.placement
    if (not isinstance(top_k_index, GlobalTensor)
            or any(True for _ in module.children() if any(True for _ in _.parameters()))):
        return None
    stacked = _stacked(module)
    if len(stacked) != len(list(module.parameters(recurse=False))):
        return None  # a parameter that is not per expert: no owner's piece of it
    axis = _expert_axis(stacked, placement)
    if axis is None or placement.hierarchy[axis] == 1:
        return None
    whole = all(isinstance(v, Broadcast) for t in stacked
                for a, v in enumerate(t.sbp) if a != axis)
    token_sbp, out_sbp = ((tuple(Split(0) if a == axis else other for a in range(placement.ndim)))
                          for other in (broadcast, broadcast if whole else partial_sum))
    coord = placement.coord_of(world.get_rank())
    if coord is None:
        return Plan(placement, axis, None, (), (), token_sbp, out_sbp, None)
    group, ranks = group_along(placement, axis, coord)
    members = tuple(sorted(ranks))
    layout = stacked[0]._layout
    bounds = tuple(layout.box(placement.coord_of(r))[0] for r in members)
    shared = None if whole else _shared(placement, axis, coord)
    return Plan(placement, axis, group, members, bounds, token_sbp, out_sbp, shared)


def _stacked(module) -> list:
    """The module's own parameters whose dim 0 is the experts (weights and biases)."""
    return [p for _, p in module.named_parameters(recurse=False)
            if p.dim() >= 1 and p.shape[0] == module.num_experts]


def _expert_axis(stacked, placement) -> int | None:
    """The one axis that splits every stacked parameter's expert dim, or None."""
    if not stacked or not all(isinstance(p, GlobalTensor) and p.placement == placement
                              for p in stacked):
        return None
    axes = {tuple(a for a, v in enumerate(p.sbp) if v == Split(0)) for p in stacked}
    if len(axes) != 1:
        return None
    (found,) = axes
    return found[0] if len(found) == 1 else None


def _shared(placement: Placement, axis: int, coord) -> Placement:
    """The ranks sharing ``coord`` on ``axis``: the placement of the other axes."""
    ranks = np.take(placement.ranks, coord[axis], axis=axis)
    names = None if placement.axes is None else tuple(
        n for a, n in enumerate(placement.axes) if a != axis)
    return Placement(placement.type, ranks.tolist(), axes=names)


# --------------------------------------------------------------------------- the call

def forward(module, plain_forward, plan: Plan, hidden, top_k_index, top_k_weights):
    """The routed experts of this call by token dispatch (the module's docstring, 1-4)."""
    hidden, top_k_index, top_k_weights = (_laid_out(t, plan.token_sbp)
                                          for t in (hidden, top_k_index, top_k_weights))
    x, ids, weights = hidden.to_local(), top_k_index.to_local(), top_k_weights.to_local()
    layout = Layout(plan.placement, plan.out_sbp, tuple(hidden.shape))
    if not plan.members:  # a rank outside the placement: an empty piece, nothing sent
        return FromLocal.apply(x * 0, layout, None)
    with _plain_torch():  # plain pieces: their factories stay plain
        name = type(module).__name__
        why = wire.Why("expert dispatch", f"experts dispatch ({name})",
                       wire.axis_name(plan.placement, plan.axis))
        route = _route(plan, ids.reshape(x.shape[0], -1), module.num_experts, why)
        got = _AllToAll.apply(x[route.tokens], route.send, route.recv, plan, why)
        pair_why = wire.Why(why.label, f"experts weights ({name})", why.axis)
        w = _AllToAll.apply(weights.reshape(-1)[route.order], route.pairs_send, route.pairs_recv,
                            plan, pair_why)
        dtype = torch.promote_types(torch.promote_types(x.dtype, weights.dtype),
                                    module.down_proj.dtype)
        compute = _on_pieces if plan.shared is None else _on_shared
        if plan.bounds[plan.me][0] == plan.bounds[plan.me][1]:  # an owner of no expert
            compute = _no_experts
        out = compute(module, plain_forward, plan, got.to(dtype), route, w)
        back = wire.Why(why.label, f"experts combine ({name})", why.axis)
        returned = _AllToAll.apply(out, route.recv, route.send, plan, back)
        y = returned.new_zeros((x.shape[0], returned.shape[1]))
        y = y.index_add(0, route.tokens, returned).to(x.dtype)
    return FromLocal.apply(y, layout, None)


def _laid_out(t, sbp) -> GlobalTensor:
    if not isinstance(t, GlobalTensor):
        raise GlobalTensorError(
            f"expert parallelism: expected the router's top_k_index and top_k_weights to be "
            f"global tensors like the hidden states, found a {type(t).__name__}; compute them "
            f"from the hidden states (as HF's routers do)")
    return t if t.sbp == sbp else t.to_global(sbp=sbp)


@dataclass
class Route:
    """This rank's rows to send (``tokens``: a token once per member owning one of its choices,
    in member order), its pairs in the order they are sent (``order``: by member, token,
    choice), the rows and pairs it sends to and receives from each member, and of each pair
    received its row among the rows received and its local expert."""

    tokens: torch.Tensor
    order: torch.Tensor
    send: list
    recv: list
    pairs_send: list
    pairs_recv: list
    row_of_pair: torch.Tensor
    local_ids: torch.Tensor


def _route(plan: Plan, ids: torch.Tensor, experts: int, why) -> Route:
    """Step 1: which rows and pairs go to which member, the counts exchanged with them (and
    the pairs' rows and local experts sent); in gt.simulate (no values) those of a router
    choosing uniformly (:func:`_even_route`)."""
    n, (tokens, k) = len(plan.members), ids.shape
    counts_why, pairs_why = (wire.Why(why.label, why.op.replace("dispatch", what), why.axis)
                             for what in ("counts", "pairs"))
    if ids.is_meta:
        return _even_route(plan, tokens, k, experts, (counts_why, pairs_why))
    owner_of = torch.repeat_interleave(torch.arange(n), torch.tensor(
        [b - a for a, b in plan.bounds])).to(ids.device)
    bad = int(((ids < 0) | (ids >= experts)).sum())
    clamped = ids.clamp(0, experts - 1)
    owner = owner_of[clamped]  # (tokens, k)
    held = torch.zeros((n, tokens), dtype=torch.bool, device=ids.device)
    held[owner, torch.arange(tokens, device=ids.device).unsqueeze(1).expand_as(owner)] = True
    send = held.sum(dim=1)
    position = (held.reshape(-1).cumsum(0) - 1).view(n, tokens)  # each sent row's place
    start = torch.cumsum(send, 0) - send
    order = torch.sort(owner.reshape(-1), stable=True).indices  # by member, token, choice
    token_of = torch.arange(tokens * k, device=ids.device) // k
    rows = (position[owner.reshape(-1), token_of] - start[owner.reshape(-1)])[order]
    starts = torch.tensor([a for a, _ in plan.bounds], device=ids.device)
    local = (clamped.reshape(-1) - starts[owner.reshape(-1)])[order]
    pairs = torch.bincount(owner.reshape(-1), minlength=n)
    message = torch.stack([send.cpu(), pairs.cpu(), torch.full((n,), bad)], dim=1)
    table = _send_rows(message, [1] * n, [1] * n, plan, counts_why)
    _check_indices(table[:, 2], plan, experts)
    width = max(b - a for a, b in plan.bounds)
    meta = _send_rows(rows * width + local, pairs.tolist(), table[:, 1].tolist(), plan,
                      pairs_why)
    recv = table[:, 0].tolist()
    first = torch.repeat_interleave(torch.cumsum(table[:, 0], 0) - table[:, 0], table[:, 1])
    return Route(held.nonzero()[:, 1], order, send.tolist(), recv, pairs.tolist(),
                 table[:, 1].tolist(), first.to(ids.device) + meta // width, meta % width)


def _even_route(plan: Plan, tokens: int, k: int, experts: int, whys) -> Route:
    """gt.simulate's route (meta tensors): a router choosing each token's k experts uniformly.
    Each member gets an even share of the pairs, and as rows the tokens expected to have a
    choice among its m experts: ``tokens * (1 - C(E - m, k) / C(E, k))``, rounded; every
    member receives what it sends (the same spread on every rank)."""
    n = len(plan.members)
    meta = torch.empty((n, 3), dtype=torch.int64, device="meta")
    _send_rows(meta, [1] * n, [1] * n, plan, whys[0])
    total = tokens * k
    pairs = [total // n + (g < total % n) for g in range(n)]
    rows = [round(tokens * (1 - math.comb(experts - (b - a), k) / math.comb(experts, k)))
            for a, b in plan.bounds]
    _send_rows(torch.empty(total, dtype=torch.int64, device="meta"), pairs, pairs, plan, whys[1])
    empty = lambda size: torch.empty(size, dtype=torch.int64, device="meta")  # noqa: E731
    return Route(empty(sum(rows)), empty(total), rows, rows, pairs, pairs, empty(total),
                 empty(total))


def _check_indices(bad: torch.Tensor, plan: Plan, experts: int) -> None:
    """Every member sent its count of expert indices out of range: each raises alike."""
    if int(bad.sum()):
        where = {r: int(b) for r, b in zip(plan.members, bad.tolist()) if b}
        raise GlobalTensorError(
            f"expert parallelism: expected every top_k_index entry in [0, {experts}) (the "
            f"module's num_experts), found {sum(where.values())} out of range, on ranks "
            f"{sorted(where)} ({where}); check the router (its top-k over num_experts logits)")


class _AllToAll(torch.autograd.Function):
    """Rows to the members by counts (step 2 or 4); backward sends the gradients back."""

    @staticmethod
    def forward(ctx, rows, send, recv, plan, why):
        ctx.args = (send, recv, plan, why)
        return _send_rows(rows, send, recv, plan, why)

    @staticmethod
    def backward(ctx, grad):
        send, recv, plan, why = ctx.args
        back = wire.Why(why.label, why.op + " backward", why.axis)
        return _send_rows(grad.contiguous(), recv, send, plan, back), None, None, None, None


def _send_rows(rows, send, recv, plan: Plan, why) -> torch.Tensor:
    if not rows.is_meta:
        return wire.all_to_all_rows(rows, send, recv, plan.group, why, plan.members)
    # gt.simulate: the even spread's figure, for every member of every group along the axis
    row = rows[0].numel() * rows.element_size() if rows.shape[0] else 0
    expected = (sum(send) - send[plan.me]) * row
    return wire.all_to_all_rows(rows, send, recv, plan.group, why, plan.placement,
                                nbytes=expected)


# --------------------------------------------------------------------------- the owners' compute

class _Owner:
    """The experts module as its owner sees it: its experts' pieces (``overrides``), the rest
    of its attributes (config, act_fn, _apply_gate, ...) the module's own."""

    def __init__(self, module, overrides: dict):
        self.__dict__.update(overrides)
        self.__dict__["_gt_module"] = module

    def __getattr__(self, name):
        return getattr(self.__dict__["_gt_module"], name)


def _weighed(plain_forward, owner, rows, row_of_pair, local_ids, w, ones):
    """transformers' experts implementation on the owner's pairs (each pair's row, one choice
    per row), weighed by the router and summed per row received."""
    y = plain_forward(owner, rows[row_of_pair], local_ids.view(-1, 1), ones)
    y = y * w.unsqueeze(-1)
    return y.new_zeros((rows.shape[0], y.shape[1])).index_add(0, row_of_pair, y)


def _global(t: torch.Tensor, like: GlobalTensor) -> GlobalTensor:
    """An integer tensor every rank of ``like``'s placement holds alike, as a broadcast one."""
    return GlobalTensor._make(t, Layout(like.placement, like.sbp, tuple(t.shape)))


def _on_pieces(module, plain_forward, plan: Plan, rows, route: Route, w):
    """The owner's experts whole on the other axes: a computation on plain pieces."""
    start, stop = plan.bounds[plan.me]
    owner = _Owner(module, {**{n: p.to_local() for n, p in module.named_parameters(recurse=False)},
                            "num_experts": stop - start, "_is_expert_parallel": False})
    ones = torch.ones((w.shape[0], 1), dtype=w.dtype, device=rows.device)
    with _plain_torch():
        return _weighed(plain_forward, owner, rows, route.row_of_pair, route.local_ids, w, ones)


def _on_shared(module, plain_forward, plan: Plan, rows, route: Route, w):
    """The owner's experts split on the other axes: the computation on global tensors on the
    ranks that share this "ep" coordinate (their rows are the same)."""
    from ..mode.global_mode import GlobalMode

    sub = plan.shared
    whole = replicated(sub.ndim)
    rows = FromLocal.apply(rows, Layout(sub, whole, tuple(rows.shape)), None)
    w = FromLocal.apply(w, Layout(sub, whole, tuple(w.shape)), None)
    ones = _global(torch.ones((w.shape[0], 1), dtype=w.dtype, device=w._local.device), w)
    start, stop = plan.bounds[plan.me]
    pieces = {n: _Restrict.apply(p, _restricted(p, plan, sub))
              for n, p in module.named_parameters(recurse=False)}
    owner = _Owner(module, {**pieces, "num_experts": stop - start, "_is_expert_parallel": False})
    with GlobalMode(sub):
        out = _weighed(plain_forward, owner, rows, _global(route.row_of_pair, w),
                       _global(route.local_ids, w), w, ones)
    # one layout on every "ep" coordinate (their choices saw other row counts): partial sums,
    # which any layout becomes without a message
    sbp = tuple(v for a, v in enumerate(plan.out_sbp) if a != plan.axis)
    return (out if out.sbp == sbp else out.to_global(sbp=sbp)).to_local()


def _no_experts(module, plain_forward, plan: Plan, rows, route: Route, w):
    """An owner of no expert (fewer experts than ranks) receives no row and computes none;
    its empty result still hangs from the rows, the weights and its (empty) pieces, as every
    owner's does, so its backward runs the mirrors the other ranks run."""
    linked = sum((p.to_local().sum() * 0 for p in module.parameters(recurse=False)
                  if p.requires_grad), w.sum() * 0)
    return rows * 0 + linked


def _restricted(p: GlobalTensor, plan: Plan, sub: Placement) -> Layout:
    """``p``'s piece along the "ep" axis as a global tensor of the other axes' ranks."""
    shape = list(p.shape)
    shape[0] = p._local.shape[0]
    sbp = tuple(v for a, v in enumerate(p.sbp) if a != plan.axis)
    return Layout(sub, sbp, tuple(shape))


class _Restrict(torch.autograd.Function):
    """A parameter's "ep" piece as a global tensor of the ranks sharing the coordinate; its
    gradient there is the piece's whole gradient (every row for these experts came here)."""

    @staticmethod
    def forward(ctx, p: GlobalTensor, layout: Layout):
        ctx.layouts = (p._layout, layout)
        return GlobalTensor._make(p._local.view_as(p._local), layout)

    @staticmethod
    def backward(ctx, grad):
        full, sub = ctx.layouts
        grad = redistribute(as_global_grad(grad, sub), sub)
        return GlobalTensor._make(grad._local, full), None


@contextlib.contextmanager
def _plain_torch():
    """No torch-function mode (global mode) while plain pieces compute: their factories are
    plain tensors."""
    popped = []
    try:
        while torch._C._len_torch_function_stack():
            popped.append(torch._C._pop_torch_function_stack())
        yield
    finally:
        for mode in reversed(popped):
            torch._C._push_on_torch_function_stack(mode)
