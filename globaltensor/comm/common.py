"""What every ``gt.comm`` call shares: the world, group ranks and roots, reduce ops by name,
GT_DEBUG facts, and torch-style return values (the output argument, or a work)."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .. import debug, env
from ..errors import GlobalTensorError
from ..runtime.agreement import check
from ..trace import comm_called

ReduceOp = dist.ReduceOp
Red = dist.ReduceOp.RedOpType

# ---------------------------------------------------------------------------------------------
# the world, groups, roots and backends
# ---------------------------------------------------------------------------------------------


def ensure_world() -> None:
    """Collectives before gt.init(): join the job (a world of 1 when nothing is set)."""
    if not (dist.is_available() and dist.is_initialized()):
        env.init()


def size(group) -> int:
    return dist.get_world_size(group)


def group_size(group=None) -> int:
    """How many ranks ``group`` (default: the world) has; for layers above comm (e.g. DDP)."""
    ensure_world()
    return size(group)


def my_group_rank(group) -> int:
    """This rank's index within ``group`` (None: the world); the world must exist."""
    return dist.get_group_rank(group or dist.group.WORLD, dist.get_rank())


def group_rank(group=None) -> int:
    """This rank's index within ``group`` (default: the world)."""
    ensure_world()
    return my_group_rank(group)


def root(group, rank: int | None, group_rank: int | None, role: str) -> int:
    """The group-relative rank of ``rank`` (global) or ``group_rank``; 0 when neither is given."""
    if rank is not None and group_rank is not None:
        raise GlobalTensorError(f"expected one of {role} and group_{role}, found both "
                                f"({role}={rank}, group_{role}={group_rank}); pass only one")
    if rank is None:
        return 0 if group_rank is None else group_rank
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_group_rank(group, rank)


def backend_for(tensor: torch.Tensor, group) -> str:
    """The backend that moves ``tensor`` on ``group`` ("gloo", "nccl", ...)."""
    name = str(dist.get_backend(group))
    if ":" not in name:
        return name
    table = dict(part.split(":", 1) for part in name.split(","))
    return table.get(tensor.device.type, name)


def object_device(group) -> torch.device:
    """Where small bookkeeping tensors (numbers, shapes) live for ``group``: cpu for gloo."""
    return torch.device(c10d._get_object_coll_device(group))


# ---------------------------------------------------------------------------------------------
# reduce ops by name
# ---------------------------------------------------------------------------------------------

OP_NAMES = {
    "sum": ReduceOp.SUM, "mean": ReduceOp.AVG, "avg": ReduceOp.AVG, "max": ReduceOp.MAX,
    "min": ReduceOp.MIN, "prod": ReduceOp.PRODUCT, "product": ReduceOp.PRODUCT,
    "band": ReduceOp.BAND, "and": ReduceOp.BAND, "bor": ReduceOp.BOR, "or": ReduceOp.BOR,
    "bxor": ReduceOp.BXOR, "xor": ReduceOp.BXOR,
}
BITWISE = (Red.BAND, Red.BOR, Red.BXOR)


def to_reduce_op(op):
    """A ReduceOp from a ReduceOp, its enum value, or a name ("sum", "mean", "MAX", ...)."""
    if isinstance(op, (ReduceOp, Red)):
        return op
    if isinstance(op, str) and op.lower() in OP_NAMES:
        return OP_NAMES[op.lower()]
    raise GlobalTensorError(
        f"expected a reduce op (a torch.distributed.ReduceOp or one of "
        f"{sorted(OP_NAMES)}), found {op!r}; use reduce_op=\"sum\" or op=ReduceOp.SUM")


def kind(op) -> Red:
    """The enum value of a ReduceOp (or of an enum value: itself)."""
    return op if isinstance(op, Red) else op.op


# ---------------------------------------------------------------------------------------------
# GT_DEBUG: the facts every rank must agree on
# ---------------------------------------------------------------------------------------------


def agree(name: str, group, **facts) -> None:
    """With GT_DEBUG on: every rank of ``group`` must be making this call with these facts
    (otherwise every rank raises, naming the ranks that differ, instead of hanging). Every
    user collective calls this first, so an active ``gt.comm_trace()`` counts it here."""
    if debug.is_debug():
        ranks = None if group is None else dist.get_process_group_ranks(group)
        check("gt.comm." + name, ranks=ranks, **facts)
    comm_called(name)  # counted by an active gt.comm_trace()


def tensor_fact(t: torch.Tensor, shape: bool = True) -> str:
    return f"tensor({list(t.shape)}, {t.dtype})" if shape else f"tensor({t.dtype})"


def op_fact(op) -> str:
    return kind(to_reduce_op(op)).name


# ---------------------------------------------------------------------------------------------
# what a call returns
# ---------------------------------------------------------------------------------------------


def no_async(async_op: bool, name: str) -> None:
    """Value style returns the result, so it has no work to hand back."""
    if async_op:
        raise GlobalTensorError(
            f"expected async_op=False for value-style {name} (it returns the result), found "
            f"async_op=True; pass a tensor torch-style (in place) to get a work handle")


class PendingWork:
    """A torch Work plus the step this rank runs once it completes (the tail of a built op)."""

    __slots__ = ("_work", "_then", "_done")

    def __init__(self, work, then):
        self._work, self._then, self._done = work, then, False

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self._work is not None:
            self._work.wait() if timeout is None else self._work.wait(timeout)
        if not self._done:
            self._done = True
            if self._then is not None:
                self._then()
        return True

    def is_completed(self) -> bool:
        return self._done or self._work is None or self._work.is_completed()

    def is_success(self) -> bool:
        return self.is_completed()


def finish(result, work, async_op: bool, then=None):
    """torch style: the work when async, else run ``then`` and return the output argument."""
    if async_op:
        return work if then is None else PendingWork(work, then)
    if then is not None:
        then()
    return result


def done(result, async_op: bool):
    """An op this rank ran synchronously: a completed work when async was asked for."""
    return PendingWork(None, None) if async_op else result
