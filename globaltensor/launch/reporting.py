"""What the launcher says when a job fails: the first failing rank's error in full, one line
for each other rank, and a hint only where it helps (docs/launcher.md, "When a rank fails").
Only the standard library; a rank here is a ``supervise.RankProcess``."""
from __future__ import annotations

import re
import signal

__all__ = ["failure_report", "first_failure", "last_error", "restart_note", "stderr_tail",
           "describe_exit", "DIFFERENT_COLLECTIVES_HINT"]

STDERR_TAIL_LINES = 20  # how much of a failed rank's stderr the report shows (no traceback)
TRACEBACK_LINES = 80  # the most of a traceback the report shows (its end)


def describe_exit(code: int) -> str:
    """'exited with code 3' / 'was killed by SIGKILL' for a Popen-style return code."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"



DIFFERENT_COLLECTIVES_HINT = (
    "hint: ranks may have run different collectives (x.item() or print(x) under `if rank == 0:` "
    "is the usual one: use gt.print0): rerun with GT_DEBUG=1 to name the operation and rank")
# words in a rank's error that say its peers ran something else or left: the hint helps only
# where the ranks failed differently (an error every rank raised alike, such as to_global's
# ShapeMismatchError on bad pieces, is bad input, not a collective run by some ranks only)
_MISMATCH_WORDS = ("mismatch", "disagree", "connection closed by peer",
                   "connection reset by peer")
# words of a rank that waited in vain: the hint always helps (as on SIGABRT, gloo's abort)
_TIMEOUT_WORDS = ("timed out", "timeout")
# words of errors the hint does not help with: a node that never joined, a rank that finished
_NO_HINT_WORDS = ("never joined", "to finish gt.init", "finished (exit 0)")
# how another rank's error names the rank that caused it (runtime/failure.py, world/stalls.py)
# a rank named as having raised (not one named as having finished: a rank that finished early
# and was stopped while exiting did not fail; the rank that waited for it reports the error)
_CAUSE = re.compile(r"rank (\d+) left the job|failed on rank (\d+)")


def first_failure(ranks: list[RankProcess], seen_first: int) -> RankProcess:
    """The rank whose failure came first: the one the others' errors name as the cause (a
    rank's program raising reports itself to the others, runtime/failure.py), else the failed
    rank the supervisor saw end first."""
    failed = [r for r in ranks if r.proc.returncode not in (None, 0)]
    by_rank = {r.rank: r for r in failed}
    for r in failed:
        for m in _CAUSE.finditer(last_error(r)):
            cause = int(next(g for g in m.groups() if g is not None))
            if cause in by_rank:
                return by_rank[cause]
    ended = [r for r in failed if r.ended is not None]
    return min(ended, key=lambda r: r.ended) if ended else by_rank[seen_first]


def last_error(r: RankProcess) -> str:
    """A rank's error in one line: the last line of its stderr's last traceback (or its last
    line)."""
    tail, _ = stderr_tail(list(r.stderr_tail))
    lines = [line.strip() for line in tail if line.strip()]
    return lines[-1] if lines else ""


def restart_note(failed: RankProcess, attempt: int, attempts: int) -> str:
    """The line the launcher prints when ``--max_restarts`` restarts the job: the attempt that
    starts now (1-based, of ``attempts``), and the first failing rank of the one that ended
    with its error in one line (its full output: --logdir)."""
    error = last_error(failed)[:300]
    how = describe_exit(failed.proc.returncode)
    return (f"restarting the job (attempt {attempt} of {attempts}) after rank {failed.rank} "
            f"failed: " + (f"{error} ({how})" if error else how))


def failure_report(failed: RankProcess, config, port: int,
                   stopped: list[int], others=(), after=None) -> str:
    """The lines the launcher prints when a rank fails: its error in full, one line for each
    other rank that failed or finished early (the full text: --logdir). ``after``: the rank
    whose exit the launcher saw first, when ``failed`` (named by the others' errors as the
    cause) was still exiting and was stopped."""
    how = describe_exit(failed.proc.returncode)
    if after is not None:
        how = (f"raised the first error and was stopped while exiting, after rank {after.rank} "
               f"{describe_exit(after.proc.returncode)}")
    still = f"; stopped the other ranks still running: {stopped}" if stopped else ""
    lines = [f"rank {failed.rank} (local rank {failed.local_rank} on node {config.node_rank}, "
             f"pid {failed.pid}) {how}{still}"]
    tail, what = stderr_tail(list(failed.stderr_tail))
    if tail:
        lines.append(f"{what} of rank {failed.rank}'s stderr:")
        lines += ["  | " + line.rstrip("\n") for line in tail]
    else:
        lines.append(f"rank {failed.rank} wrote nothing to stderr")
    lines += _other_ranks(failed, others, stopped, config)
    text = "".join(tail).lower()
    if "address already in use" in text:
        lines.append(f"hint: master port {port} looks taken; pass "
                     f"another --master_port (or leave it out on a single node)")
    elif "gt_debug:" not in text and not any(w in text for w in _NO_HINT_WORDS) and \
            _collectives_may_differ(failed, others, text):
        lines.append(DIFFERENT_COLLECTIVES_HINT)  # (GT_DEBUG's own message names them already)
    return "\n".join(lines)


def _collectives_may_differ(failed: RankProcess, others, text: str) -> bool:
    """Whether the hint helps: the rank timed out or gloo aborted it, or its error speaks of a
    mismatch or a lost peer while the other ranks failed differently (or not at all)."""
    if failed.proc.returncode == -signal.SIGABRT or any(w in text for w in _TIMEOUT_WORDS):
        return True
    if not any(w in text for w in _MISMATCH_WORDS):
        return False
    error = last_error(failed)
    return not error or any(last_error(r) != error for r in others if r is not failed)


def _other_ranks(failed: RankProcess, others, stopped: list[int], config) -> list[str]:
    """One line per other rank that failed on its own, or finished while the others ran."""
    lines, errors = [], False
    for r in others:
        code = r.proc.returncode
        if r is failed or r.rank in stopped or code is None:
            continue
        if code == 0:
            if r.ended is not None and failed.ended is not None and r.ended < failed.ended:
                lines.append(f"rank {r.rank} finished (exit 0) while the others still ran")
            continue
        error, errors = last_error(r), True
        lines.append(f"rank {r.rank} {describe_exit(code)}" + (f": {error[:300]}" if error else ""))
    if errors:
        where = (f"every rank's output is in {config.logdir}" if config.logdir else
                 "rerun with --logdir DIR to keep every rank's full output")
        lines.append(f"(the other ranks' errors in one line each; {where})")
    return lines


def stderr_tail(kept: list[str]) -> tuple[list[str], str]:
    """What the report shows of a rank's stderr: from its last ``Traceback`` on (at most
    TRACEBACK_LINES, the end), else its last STDERR_TAIL_LINES lines; and how to title it."""
    starts = [i for i, line in enumerate(kept) if line.startswith("Traceback (most recent call")]
    if not starts:
        tail = kept[-STDERR_TAIL_LINES:]
        return tail, f"last {len(tail)} line{'s' * (len(tail) > 1)}"
    tail = kept[starts[-1]:]
    if len(tail) > TRACEBACK_LINES:
        return tail[-TRACEBACK_LINES:], f"the last {TRACEBACK_LINES} lines of the last traceback"
    return tail, "the last traceback"
