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
from ..observe import comm_called

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
    """The group-relative rank of ``rank`` (global) or ``group_rank``; 0 when neither is given.
    Both are checked here, on the calling rank, before anything is sent: a rank outside the
    group would otherwise leave every rank waiting for the whole timeout."""
    if rank is not None and group_rank is not None:
        raise GlobalTensorError(f"expected one of {role} and group_{role}, found both "
                                f"({role}={rank}, group_{role}={group_rank}); pass only one")
    if rank is None:
        if group_rank is None:
            return 0
        return _checked_index(group_rank, size(group), f"group_{role}", "the group's size")
    world = dist.get_world_size()
    rank = _checked_index(rank, world, role, "the world size")
    if group is None or group is dist.group.WORLD:
        return rank
    members = dist.get_process_group_ranks(group)
    if rank not in members:
        raise GlobalTensorError(
            f"expected {role} to be the global rank of a member of the group {sorted(members)}, "
            f"found {role}={rank}; pass a member's global rank, or group_{role}= its index in "
            f"the group")
    return dist.get_group_rank(group, rank)


def peer(group, rank: int | None, group_rank: int | None, role: str) -> int:
    """A point-to-point peer (send's dst, recv's src) as a group rank: checked like ``root``,
    and never this rank itself (gloo would wait for a message to itself until the timeout)."""
    if rank is None and group_rank is None:
        raise GlobalTensorError(f"expected {role}= (a global rank) or group_{role}=, found "
                                f"neither; pass the peer's rank")
    r = root(group, rank, group_rank, role)
    if r == my_group_rank(group):
        given = f"{role}={rank}" if rank is not None else f"group_{role}={group_rank}"
        raise GlobalTensorError(f"expected {role} to be another rank than this one, found {given} "
                                f"(this rank); a rank cannot send to or receive from itself")
    return r


def checked_tag(tag) -> int:
    """A point-to-point tag: an int in [0, 2**31) (gloo's and torch's range)."""
    return _checked_index(tag, 2 ** 31, "tag", "a non-negative 32-bit int", "pass such an int")


def _checked_index(value, bound: int, name: str, what: str,
                   fix: str = "pass the rank of a member") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            if isinstance(value, bool):
                raise TypeError
            value = int(value.__index__())  # numpy and 0-dim integer tensors
        except (AttributeError, TypeError, ValueError, RuntimeError):
            raise GlobalTensorError(
                f"expected {name} to be an int, found {_short(value)} "
                f"({type(value).__name__}); pass an int") from None
    if not 0 <= value < bound:
        raise GlobalTensorError(
            f"expected {name} in [0, {bound}) ({what}), found {name}={value}; {fix}")
    return value


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


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


# ---------------------------------------------------------------------------------------------
# torch style on views: a contiguous stand-in, written back
# ---------------------------------------------------------------------------------------------


def stand_in(x):
    """(what to hand to torch, write-back or None) for an output argument: a tensor or a list of
    them. torch's backends treat a tensor as its storage from the first element on, so a
    non-contiguous view (``base[::2]``) would get wrong values and ``base`` writes outside the
    view: such an output gets a contiguous copy, written into the view once the call is done."""
    if isinstance(x, torch.Tensor):
        if x.is_contiguous():
            return x, None
        copy = x.contiguous()  # its values too: broadcast's root and all_reduce read them
        return copy, lambda: x.copy_(copy)
    if isinstance(x, (list, tuple)) and any(isinstance(t, torch.Tensor) and not t.is_contiguous()
                                            for t in x):
        pairs = [stand_in(t) for t in x]
        backs = [back for _, back in pairs if back is not None]
        return type(x)(t for t, _ in pairs), lambda: [back() for back in backs]
    return x, None


def dense(x):
    """An input argument (a tensor or a list of them) as contiguous tensors (copied where
    needed)."""
    if isinstance(x, torch.Tensor):
        return x.contiguous()
    if isinstance(x, (list, tuple)):
        return type(x)(t.contiguous() if isinstance(t, torch.Tensor) else t for t in x)
    return x


def written(got, stand, original, back, async_op: bool):
    """What a torch-style call run on ``stand`` (the stand-in of ``original``) returns: the
    write-back runs when the call completes (in ``wait()`` when async); the stand-in returned
    becomes the caller's own argument."""
    if back is None:
        return got
    if async_op:
        return PendingWork(got, back)
    back()
    return original if got is stand else got


def done(result, async_op: bool):
    """An op this rank ran synchronously: a completed work when async was asked for."""
    return PendingWork(None, None) if async_op else result
