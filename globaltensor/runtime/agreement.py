"""The store side of GT_DEBUG checks: every rank publishes what it is about to do, then compares.

For the ``n``-th check of a scope (the world, or a group of ranks), rank ``r`` writes its
descriptor under ``gt_debug/<scope>/<n>/<r>`` in the default group's store and waits for the key
of every rank of the scope. All present and equal: go on. Some missing after the timeout: raise
naming them and the check each last passed. Some different: every rank raises the same message.

Bookkeeping: a rank deletes its key ``n - 1`` once check ``n`` has passed (by then every rank has
read it), so the store holds at most two keys per rank and scope. Sequence numbers are counted per
world (the default process group; each thread-rank of the test harness has its own) and scope.
"""
from __future__ import annotations

import time
import weakref
import zlib

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .. import debug
from ..world import stalls as watch
from ..debug import Descriptor
from ..errors import CollectiveTimeoutError, RankMismatchError
from ..world.world import is_initialized, world_timeout

_PREFIX = "gt_debug"
POLL_S = (0.0002, 0.05)  # a check polls the store for the others: first and longest pause
# default process group -> {scope: number of checks this rank started in it}
_SEQ: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _scope(ranks: tuple[int, ...], world: int) -> tuple[str, str]:
    """(key part, words) for a scope; the world is ``w``, a group a checksum of its ranks."""
    if ranks == tuple(range(world)):
        return "w", "the world"
    return f"g{len(ranks)}x{zlib.crc32(repr(ranks).encode()):08x}", f"group {list(ranks)}"


def _counters() -> dict:
    world = c10d._get_default_group()
    counters = _SEQ.get(world)
    if counters is None:
        counters = _SEQ[world] = {}
    return counters


def _next_seq(scope: str) -> int:
    counters = _counters()
    seq = counters.get(scope, 0)
    counters[scope] = seq + 1
    return seq


def _key(scope: str, seq: int, rank: int) -> str:
    return f"{_PREFIX}/{scope}/{seq}/{rank}"


def agree(op: str, facts: dict, ranks=None, timeout: float | None = None) -> None:
    """Every rank of ``ranks`` (default: the world) must call this with the same op and facts.

    Raises ``RankMismatchError`` on every rank when they differ, ``CollectiveTimeoutError`` on the
    ranks that waited when some did not arrive within ``timeout`` seconds (default: the world's).
    """
    if not is_initialized():
        return
    world, me = dist.get_world_size(), dist.get_rank()
    ranks = tuple(range(world)) if ranks is None else tuple(int(r) for r in ranks)
    if len(ranks) <= 1 or me not in ranks:
        return
    scope, words = _scope(ranks, world)
    store = c10d._get_default_store()
    mine = Descriptor.of(_next_seq(scope), op, facts, where=_where())
    store.set(_key(scope, mine.seq, me), mine.encode())
    keys = [_key(scope, mine.seq, r) for r in ranks]
    _wait_all(store, scope, words, ranks, keys, mine, me, timeout)
    descs = dict(zip(ranks, (Descriptor.decode(raw) for raw in store.multi_get(keys))))
    message = debug.disagreement(descs, words)
    if message:
        raise RankMismatchError(message)
    if mine.seq:
        store.delete_key(_key(scope, mine.seq - 1, me))


def _where() -> str:
    """The user's source line of this check (and, in backward, the autograd node running)."""
    line, origin = debug.user_line(3), debug.backward_origin()
    return f"{line}, {origin}" if origin else line


def _wait_all(store, scope, words, ranks, keys, mine: Descriptor, me: int, timeout) -> None:
    seconds = timeout if timeout is not None else world_timeout().total_seconds()
    watched = watch.current()
    if watched is not None:
        watched.enter(watch.Waiting(f"the GT_DEBUG check of {mine.title()}", ranks))
    try:
        cause = _poll(store, keys, seconds, watched, ranks, mine)
    finally:
        if watched is not None:
            watched.leave()
    if cause is None:
        return
    try:
        present = {r: store.check([k]) for r, k in zip(ranks, keys)}
    except RuntimeError as e:
        raise CollectiveTimeoutError(
            f"GT_DEBUG: rank {me} could not reach the job's store while checking global operation "
            f"{mine} ({e}); the rank hosting the store (rank 0) has probably died"
        ) from cause
    missing = [r for r, ok in present.items() if not ok]
    if not missing:
        return  # the last ones arrived just as the wait gave up
    last = {r: _previous(store, scope, mine.seq, r) for r in missing}
    raise CollectiveTimeoutError(
        debug.missing_message(me, mine, missing, last, seconds, words)
    ) from None


def _poll(store, keys, seconds: float, watched, ranks, mine: Descriptor):
    """Wait until every key is there (None), or the timeout passed (the error); polled, not a
    store wait, so that a rank that left the job meanwhile is seen at once: its waiters raise
    naming it (``watch.finished_message``) instead of waiting out the timeout."""
    start, pause = time.monotonic(), POLL_S[0]
    while True:
        try:
            if store.check(keys):
                return None
        except RuntimeError as e:  # the store went away
            return e
        if time.monotonic() - start > seconds:
            return CollectiveTimeoutError("Wait timeout")
        if pause >= POLL_S[1]:  # waiting for a while: has a missing rank left the job?
            finished = watch.finished_message(watched, ranks, f"global operation {mine}")
            if finished is not None:
                raise CollectiveTimeoutError("GT_DEBUG: " + finished)
        time.sleep(pause)
        pause = min(pause * 2, POLL_S[1])


def _previous(store, scope: str, seq: int, rank: int) -> Descriptor | None:
    """The descriptor ``rank`` published at check ``seq - 1`` (still in the store: see above)."""
    if seq == 0:
        return None
    key = _key(scope, seq - 1, rank)
    return Descriptor.decode(store.get(key)) if store.check([key]) else None


def whereabouts(ranks) -> dict[int, Descriptor | None]:
    """Where each of ``ranks`` last checked in, as far as the world-scope keys tell.

    Used after a collective timed out: a rank already at a later check than this one did not
    take part in the collective; a rank at the same check is stuck inside the same operation.
    Only meaningful with debug on (otherwise nothing is published: every entry is None).
    """
    if not is_initialized():
        return {}
    world = dist.get_world_size()
    nxt = _counters().get("w", 0)  # this rank's next check; it has passed nxt - 1
    store = c10d._get_default_store()
    out = {}
    for r in ranks:
        out[r] = None
        for seq in (nxt, nxt - 1):
            key = _key("w", seq, r)
            if 0 <= seq and r < world and store.check([key]):
                out[r] = Descriptor.decode(store.get(key))
                break
    return out


def check(op: str, *, ranks=None, **facts) -> None:
    """Make every rank (of the world, or of ``ranks``) agree on ``op`` and ``facts`` first.

    A no-op when debug is off, outside an initialised world, or in a world of one. Pass only
    facts every rank must share (layouts, global shapes, dtypes, flags), never a local shape
    that may differ between ranks.
    """
    if debug.is_debug():
        agree(op, facts, ranks=ranks, timeout=debug.timeout_seconds())
