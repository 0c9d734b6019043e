"""Ranks that disagree on a tensor's global shape, dtype or layout, with GT_DEBUG off: an error
on every rank, never a crash or another rank's bytes read as data.

A receive buffer is sized from this rank's own layout. gloo's point-to-point receive takes a
message no longer than its buffer (the rest stays as it was: uninitialised memory) and aborts the
process on a longer one (a size enforce in gloo's network thread: SIGABRT). So ranks that differ
-- ``gt.ones(8, dtype=float64 if rank == 1 else float32)``, ``gt.arange(7 if rank == 0 else 6)``
-- would crash or return garbage in the first redistribution. Two guards, both free after the
first use of a plan:

1. **First use.** The first time this rank runs a plan with a dtype (in this world), it sends a
   fixed-size record (a checksum of the dtype and both layouts, and their text) to every other
   rank of the plan's placements and receives theirs, on a tag of its own. Records that differ:
   the rank publishes the table of who has what (``failure.publish_mismatch``) and closes its
   groups, so every rank raises at once, the ranks outside the plan included.
2. **Tagged data.** Every data message of a plan travels on a tag derived from that checksum, so
   a rank running another plan (one it has run before, so it skips the first-use check) never
   matches it: the two wait and the world's timeout names the step, instead of reading bytes of
   another size.

Every rank of the world runs every plan (SPMD), so every rank records the same plans in the same
order and clears its record at the same point: the ranks of a plan always agree on whether it is
a first use. The record is per world (the default process group; each thread-rank has its own).
"""
from __future__ import annotations

import weakref
import zlib

import torch
import torch.distributed.distributed_c10d as c10d

from .. import debug
from .._cache import ById
from ..errors import ShapeMismatchError
from ..plan import LocalSlice, Reorder, ZeroFill
from . import failure, wire
from .guard import step_guard
from .pairwise import send_recv

RECORD_BYTES = 1024  # one fixed size on every rank: a record can never overflow a receive
CHECK_TAG = 2 ** 31 - 1  # above every data tag (data_tag() is at most 2**31 - 3)
MAX_SEEN = 65536  # plans (with a dtype) remembered per world; all ranks clear at the same point

# (id(plan), dtype) -> (word, record bytes, data tag, ranks to check with); pins the plan
_WORDS = ById(8192)
# default process group -> {word of every plan this rank has run in that world}
_SEEN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# torch keeps the default group in ``_world._default_pg`` (a property ``default_pg`` reads it)
_DEFAULT_PG = "_default_pg" if hasattr(c10d._world, "_default_pg") else "default_pg"
_LAST: tuple = (lambda: None, None)  # (weak reference to the world asked last, its record)


def data_tag(plan, dtype: torch.dtype) -> int:
    """The tag this plan's data messages travel on (even; a second phase adds one): derived
    from the checksum of its layouts and dtype, so another plan's messages never match."""
    return _WORDS.computed(plan, dtype, _describe)[2]


def _describe(plan, dtype):
    """(checksum, record, data tag, the ranks to check with: None for a plan that sends nothing
    between ranks (local slices and zero fills) or has one rank)."""
    text = f"{str(dtype).replace('torch.', '')} {plan.src!r} -> {plan.dst!r}"
    word = zlib.crc32(text.encode())
    raw = word.to_bytes(8, "little") + text.encode()[:RECORD_BYTES - 8]
    record = raw + bytes(RECORD_BYTES - len(raw))
    members = sorted(set(plan.src.placement.flat_ranks) | set(plan.dst.placement.flat_ranks))
    local = all(isinstance(s, (LocalSlice, ZeroFill, Reorder)) for s in plan.steps)
    return word, record, 2 + 2 * (word % (2 ** 30 - 2)), (
        None if local or len(members) == 1 else members)


def check_first_use(plan, local: torch.Tensor, rank: int) -> int:
    """On this rank's first run of ``plan`` with ``local.dtype`` in this world: exchange records
    with the other ranks of the plan's placements and raise on every rank if any differ.
    Returns the plan's data tag."""
    (_, record, tag, members), first = _first_use(plan, local.dtype)
    if not first or rank not in members:
        return tag
    call = debug.user_call(2)  # only on a first use: microseconds
    records = _exchange(plan, local, record, [r for r in members if r != rank], rank)
    records[rank] = record
    if any(r != record for r in records.values()):
        raise _mismatch(records, call)
    return tag


def simulated_first_use(plan, local: torch.Tensor) -> int:
    """``gt.simulate``'s first use of ``plan``: the check's records announced for every rank of
    its placements and its receive buffers made, as the real run's ranks make them (each sends
    its record to every other and receives theirs); nothing is compared. Its data tag."""
    (_, _, tag, members), first = _first_use(plan, local.dtype)
    if not first:
        return tag
    wire.announce("send", wire.Why("layout check", "first use of a plan"), tuple(members),
                  RECORD_BYTES * (len(members) - 1), torch.uint8)
    received = local.new_empty(RECORD_BYTES * (len(members) - 1), dtype=torch.uint8)
    # the receive buffers, alive together (one of their bytes: a world's check makes thousands)
    del received
    return tag


def _first_use(plan, dtype) -> tuple[tuple, bool]:
    """The plan's facts (:func:`_describe`) and whether this is its first use with ``dtype`` in
    this world by a plan with ranks to check with (recorded now: the next use is not)."""
    facts = _WORDS.get((id(plan), dtype))  # the warm path: one dict lookup
    if facts is None:
        facts = _WORDS.computed(plan, dtype, _describe)
    if facts[3] is None:  # nobody to disagree with
        return facts, False
    seen = _seen_in_world()
    if seen is None or facts[0] in seen:
        return facts, False
    if len(seen) >= MAX_SEEN:
        seen.clear()
    seen.add(facts[0])
    return facts, True


def _seen_in_world() -> set | None:
    """This world's record (None without a world): an attribute read and a compare when the
    world is the one asked last (``world.cached_rank``'s way)."""
    global _LAST
    world = getattr(c10d._world, _DEFAULT_PG)
    last, seen = _LAST
    if last() is world or world is None:
        return seen if world is not None else None
    seen = _SEEN.get(world)
    if seen is None:
        seen = _SEEN[world] = set()
    _LAST = (weakref.ref(world), seen)
    return seen


def _exchange(plan, local, record: bytes, peers: list[int], rank: int) -> dict[int, bytes]:
    """Send ``record`` to every peer and receive each peer's, as one batch."""
    mine = torch.frombuffer(bytearray(record), dtype=torch.uint8).to(local.device)
    received = {peer: torch.empty(RECORD_BYTES, dtype=torch.uint8, device=local.device)
                for peer in peers}
    wire.announce("send", wire.Why("layout check", "first use of a plan"), tuple(peers) + (rank,),
                  RECORD_BYTES * len(peers), torch.uint8)
    ops = [(True, mine, peer, CHECK_TAG) for peer in peers]
    ops += [(False, buf, peer, CHECK_TAG) for peer, buf in received.items()]
    with step_guard(plan, 0):  # a rank that skips the plan: named as for its first step
        send_recv(ops)
    return {peer: bytes(buf.cpu().numpy()) for peer, buf in received.items()}


def _text(record: bytes) -> str:
    return record[8:].rstrip(b"\0").decode(errors="replace")


def _mismatch(records: dict[int, bytes], call) -> ShapeMismatchError:
    """The same message on every rank of the plan (each has every record): who runs what."""
    by_text: dict[str, list[int]] = {}
    for r in sorted(records):
        by_text.setdefault(_text(records[r]), []).append(r)
    found = "; ".join(f"ranks {ranks}: {text}" for text, ranks in by_text.items())
    message = (
        f"{call + ': ' if call else ''}ranks disagree on the global tensor they redistribute "
        f"(dtype, layout -> target): {found}. Expected every rank to run the same global "
        f"operation on the same global shape, dtype, placement and sbp; a rank built its tensor "
        f"from other arguments (a factory's size or dtype that depends on the rank, pieces "
        f"passed with to_global(check_meta=False), an op argument that depends on the rank). "
        f"Every rank raises this error and the job's process groups are closed. Run with "
        f"GT_DEBUG=1 to find the operation where the ranks first differ.")
    failure.publish_and_close(message)
    return ShapeMismatchError(message)
