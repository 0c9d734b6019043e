"""The executor's emitters: how one step of a plan is issued, eager, traced or simulated.

Each is a wire's data calls (runtime/wire.py: every byte goes through there, each step
announced as one event) plus the executor's policy for that kind of piece: ``EAGER`` on real
pieces (torch.distributed in place; the point-to-point CPU paths of pairwise.py and
exchange.py go through the wire too), ``TRACED`` under ``torch.compile`` (the pieces are fake
or functional tensors; functional collectives, so the traced graph holds them as values),
``SIMULATED`` on ``gt.simulate``'s meta pieces (nothing sent; results of the shapes they would
have) and ``NO_DATA`` on a meta piece in a real world (a model built on meta: nothing moves and
nothing is announced). The executor picks one per plan with :func:`emitter_for`; every step is
worked out the same way for all (shapes, padding, orders, trims), only the call differs. Every
other eager/traced difference is the emitter's too (the executor never asks which it holds):
the first-use tag, what a failing step becomes, the result's freshness, the Exchange step, and
whether gathers may run point to point.
"""
from __future__ import annotations

import torch

from ..plan import LocalSlice, ZeroFill
from ..world import world
from ..world.simulated import simulated
from .exchange import exchange_eager, exchange_traced
from .failure import executor_failure
from .guard import step_ranks, step_words
from .layoutcheck import check_first_use, simulated_first_use
from .wire import EagerWire, NoDataWire, SimulatedWire, TracedWire


def is_traced(piece: torch.Tensor) -> bool:
    """Whether ``piece`` is being traced (a fake tensor, or a functional one over a fake one:
    dynamo's and AOTAutograd's tracing), not a tensor with data."""
    if type(piece) is torch.Tensor and not torch._is_functional_tensor(piece):
        return False  # the eager case, decided without importing anything
    from torch._subclasses.fake_tensor import is_fake
    return is_fake(piece)


class Eager(EagerWire):
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

    def exchange(self, step, local: torch.Tensor, rank: int, tag: int) -> torch.Tensor:
        return exchange_eager(step, local, rank, tag, self)


class Traced(TracedWire):
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


class _Meta:
    """Meta pieces (a simulation's, or a meta-built model's in a real world): nothing sent."""

    point_to_point = False

    @staticmethod
    def first_use_tag(plan, local: torch.Tensor, rank: int) -> int:
        return 0

    @staticmethod
    def failure(plan, index: int, error: Exception) -> Exception:
        return error

    @staticmethod
    def fresh(out: torch.Tensor, local: torch.Tensor, plan) -> torch.Tensor:
        """A piece of its own size: a view into a padded collective's buffer is copied out,
        as the CPU's point-to-point gathers land exactly (a simulation weighs storages)."""
        if out is local or out.untyped_storage().nbytes() > out.numel() * out.element_size():
            return out.clone(memory_format=torch.contiguous_format)
        return out

    @staticmethod
    def exchange(step, local: torch.Tensor, rank: int, tag: int) -> torch.Tensor:
        return local.new_empty(step.after.local_shape_of_rank(rank))


class Simulated(_Meta, SimulatedWire):
    """``gt.simulate``: each step announced as the real run announces it, nothing sent."""

    @staticmethod
    def first_use_tag(plan, local: torch.Tensor, rank: int) -> int:
        """The first-use check's records, as the real run's ranks exchange them."""
        return simulated_first_use(plan, local)


class NoData(_Meta, NoDataWire):
    """A meta piece in a real world: nothing moves, nothing is announced."""


EAGER, TRACED, SIMULATED, NO_DATA = Eager(), Traced(), Simulated(), NoData()


def emitter_for(piece: torch.Tensor):
    """The emitter for a plan run on ``piece``: TRACED while tracing, SIMULATED on a meta piece
    in ``gt.simulate`` (NO_DATA in a real world), else EAGER."""
    if type(piece) is torch.Tensor and piece.is_meta:
        return SIMULATED if simulated() else NO_DATA
    return TRACED if is_traced(piece) else EAGER
