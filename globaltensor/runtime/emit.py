"""The executor's emitters: how one collective of a plan's step is issued (and, for
``gt.simulate``'s meta pieces, a third that issues nothing: :class:`Simulated`).

``EAGER`` calls torch.distributed's in-place collectives on real pieces (the executor's own
point-to-point paths for CPU gathers and reductions stay in execute.py / pairwise.py).
``TRACED`` runs under ``torch.compile`` (the pieces are fake or functional tensors): it emits
the functional collectives of ``torch.ops._c10d_functional`` (what
``torch.distributed._functional_collectives`` lowers to; gloo and NCCL run them), each followed
by its ``wait_tensor``, so the traced graph holds the collectives as values. The executor picks
an emitter once per plan with :func:`emitter_for`; every step is worked out the same way for
both (shapes, padding, orders, trims), only the call differs. Every other eager/traced
difference is the emitter's too (the executor never asks which it holds): the first-use tag,
what a failing step becomes, the result's freshness, the Exchange step, and whether gathers may
run point to point.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..plan import LocalSlice, ZeroFill
from ..world import world
from .exchange import exchange_eager, exchange_traced
from .failure import executor_failure
from .groups import all_gather_flat, byte_view, group_name, reduce_scatter_flat
from .guard import step_ranks, step_words
from .layoutcheck import check_first_use

@functools.cache
def _ops():
    """torch's traceable collectives (importing funcol registers them), looked up once."""
    import torch.distributed._functional_collectives  # noqa: F401 - registers the ops
    return torch.ops._c10d_functional


def is_traced(piece: torch.Tensor) -> bool:
    """Whether ``piece`` is being traced (a fake tensor, or a functional one over a fake one:
    dynamo's and AOTAutograd's tracing), not a tensor with data."""
    if type(piece) is torch.Tensor and not torch._is_functional_tensor(piece):
        return False  # the eager case, decided without importing anything
    from torch._subclasses.fake_tensor import is_fake
    return is_fake(piece)


class Eager:
    """Real collectives, in place into buffers made here."""

    point_to_point = True  # gloo's gathers and reductions may run as isend/irecv batches

    @staticmethod
    def first_use_tag(plan, local: torch.Tensor, rank: int) -> int:
        """The tag of the plan's messages; its first run in a world checks that the ranks
        agree on it (layoutcheck.py): an error, not a crash."""
        return check_first_use(plan, local, rank)

    @staticmethod
    def failure(plan, index: int, error: Exception) -> Exception:
        """What a step that raised on this rank becomes: the same error on every rank at once
        (failure.py), in a world of more than one."""
        if world.get_world_size() == 1:
            return error
        return executor_failure(step_words(plan, index), step_ranks(plan.steps[index]), error)

    @staticmethod
    def fresh(out: torch.Tensor, local: torch.Tensor, plan) -> torch.Tensor:
        """``out`` as a contiguous tensor that never shares the caller's storage."""
        if out.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
            return out.clone(memory_format=torch.contiguous_format)
        return out.contiguous()

    @staticmethod
    def exchange(step, local: torch.Tensor, rank: int, tag: int) -> torch.Tensor:
        return exchange_eager(step, local, rank, tag)

    @staticmethod
    def all_gather(send: torch.Tensor, n: int, group) -> torch.Tensor:
        """The members' ``send`` buffers stacked along dim 0, in the group's rank order."""
        buf = send.new_empty([n * send.shape[0]] + list(send.shape[1:]))
        if buf.numel():  # any dtype: its bytes (gloo rejects some: int16, uint16, float8...)
            all_gather_flat(byte_view(buf), byte_view(send), group=group)
        return buf

    @staticmethod
    def reduce_scatter(send: torch.Tensor, n: int, group) -> torch.Tensor:
        """The sum over members of block ``g`` of ``send`` (dim 0 cut in ``n``) on group rank g."""
        out = send.new_empty([send.shape[0] // n] + list(send.shape[1:]))
        if out.numel():
            reduce_scatter_flat(out, send, group=group)
        return out

    @staticmethod
    def all_reduce(local: torch.Tensor, group) -> torch.Tensor:
        out = local.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def all_to_all(send, recv_splits, send_splits, group, communicate: bool) -> torch.Tensor:
        recv = send.new_empty(sum(recv_splits))
        if communicate:  # any dtype: its bytes
            size = send.element_size()
            dist.all_to_all_single(byte_view(recv), byte_view(send),
                                   [k * size for k in recv_splits],
                                   [k * size for k in send_splits], group=group)
        return recv


class Traced:
    """Functional collectives: each returns a new tensor, recorded in the graph being traced."""

    point_to_point = False  # a traced graph holds collectives only

    @staticmethod
    def first_use_tag(plan, local: torch.Tensor, rank: int) -> int:
        return 0  # checked when the compiled graph's plan ran eager, not when traced

    @staticmethod
    def failure(plan, index: int, error: Exception) -> Exception:
        return error  # tracing is the same on every rank: it fails alike

    @staticmethod
    def fresh(out: torch.Tensor, local: torch.Tensor, plan) -> torch.Tensor:
        """No storage to compare: a fresh tensor unless a collective made it."""
        made = any(not isinstance(s, (LocalSlice, ZeroFill)) for s in plan.steps)
        return out.contiguous() if made else out.clone(memory_format=torch.contiguous_format)

    def exchange(self, step, local: torch.Tensor, rank: int, tag: int) -> torch.Tensor:
        return exchange_traced(step, local, rank, self)

    @staticmethod
    def all_gather(send: torch.Tensor, n: int, group) -> torch.Tensor:
        if send.numel() == 0:
            return send.new_empty([n * send.shape[0]] + list(send.shape[1:]))
        c10d = _ops()
        out = c10d.all_gather_into_tensor(send.contiguous(), n, group_name(group))
        return c10d.wait_tensor(out)

    @staticmethod
    def reduce_scatter(send: torch.Tensor, n: int, group) -> torch.Tensor:
        if send.numel() == 0:
            return send.new_empty([send.shape[0] // n] + list(send.shape[1:]))
        c10d = _ops()
        out = c10d.reduce_scatter_tensor(send.contiguous(), "sum", n, group_name(group))
        return c10d.wait_tensor(out)

    @staticmethod
    def all_reduce(local: torch.Tensor, group) -> torch.Tensor:
        c10d = _ops()
        out = c10d.all_reduce(local.contiguous(), "sum", group_name(group))
        return c10d.wait_tensor(out)

    @staticmethod
    def all_to_all(send, recv_splits, send_splits, group, communicate: bool) -> torch.Tensor:
        if not communicate:
            return send.new_empty(sum(recv_splits))
        c10d = _ops()
        out = c10d.all_to_all_single(send.contiguous(), list(recv_splits), list(send_splits),
                                     group_name(group))
        return c10d.wait_tensor(out)


class Simulated:
    """``gt.simulate``: meta pieces, nothing sent; each collective's result is an empty (meta)
    tensor of the shape it would have. What was sent is recorded from the plan by the
    simulation's trace (observe.py), as ``gt.comm_trace`` records it in a real run."""

    point_to_point = False

    @staticmethod
    def first_use_tag(plan, local: torch.Tensor, rank: int) -> int:
        return 0

    @staticmethod
    def failure(plan, index: int, error: Exception) -> Exception:
        return error

    @staticmethod
    def fresh(out: torch.Tensor, local: torch.Tensor, plan) -> torch.Tensor:
        return out if out is not local else out.clone()

    @staticmethod
    def exchange(step, local: torch.Tensor, rank: int, tag: int) -> torch.Tensor:
        return local.new_empty(step.after.local_shape_of_rank(rank))

    @staticmethod
    def all_gather(send: torch.Tensor, n: int, group) -> torch.Tensor:
        return send.new_empty([n * send.shape[0]] + list(send.shape[1:]))

    @staticmethod
    def reduce_scatter(send: torch.Tensor, n: int, group) -> torch.Tensor:
        return send.new_empty([send.shape[0] // n] + list(send.shape[1:]))

    @staticmethod
    def all_reduce(local: torch.Tensor, group) -> torch.Tensor:
        return torch.empty_like(local, memory_format=torch.contiguous_format)

    @staticmethod
    def all_to_all(send, recv_splits, send_splits, group, communicate: bool) -> torch.Tensor:
        return send.new_empty(sum(recv_splits))


EAGER, TRACED, SIMULATED = Eager(), Traced(), Simulated()


def emitter_for(piece: torch.Tensor):
    """The emitter for a plan run on ``piece``: TRACED while tracing, SIMULATED on a meta piece
    (``gt.simulate``), else EAGER."""
    if type(piece) is torch.Tensor and piece.is_meta:
        return SIMULATED
    return TRACED if is_traced(piece) else EAGER
