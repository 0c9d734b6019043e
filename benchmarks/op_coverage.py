"""Operator coverage: torch's OpInfo samples on global tensors, per op and layout, classified.

For every OpInfo entry (its variants apart) and its first samples (float64, so a wrong result is
not hidden in rounding), each tensor argument is laid out four ways:

    B       every tensor broadcast on 2 ranks
    S(0)    every tensor split on dim 0 on 2 ranks (uneven wherever the size is odd)
    mixed   the first tensor split on its last dim, the others B, on 2 ranks
    2x2     a 2x2 grid: the first tensor (S(0), S(last)), the others (S(0), B)

The outputs (full values) and the gradients of the inputs are compared with torch on the full
tensors (tests/ranks/ops/test_opinfo.py's oracle). Each op-layout (worst over its samples) is one of

    rule       correct, and no aten op of the call took the broadcast fallback
    data       correct; a data-dependent op (nonzero, unique, x[mask]) ran on B inputs: its
               output shape cannot be known without the values (counted apart from the rule)
    fallback   correct, but some aten op had no usable rule and ran on gathered (B) inputs
    error      a GlobalTensorError (a clear message naming the op), or (``raise``) another
               exception, or a hang

A sample whose op builds a non-scalar local tensor inside torch's own code (quantile, matrix_rank,
x[local index] in a composite) meets the contract's error outside global mode ("a global tensor
and a local tensor of shape ..."): that error is the expected one, and the user's way out is
``gt.global_mode``, so such a case is run again in global mode and classified by that run, noted
"in global mode" (a wrong result there is still wrong).
    wrong      a different value or gradient: a silent wrong result (must never happen)

"Took the fallback" is read from ``globaltensor.dispatch.decide.FALLBACKS``, a counter of the
decisions made by the broadcast fallback (decisions are cached, so the sweep empties the
decision caches before every case and runs the ranks of a case in step).

    python benchmarks/op_coverage.py                       # every op, the summary
    python benchmarks/op_coverage.py --ops add,mm -v       # some ops, per-op lines
    python benchmarks/op_coverage.py --write-docs          # regenerate the tables in docs/
    python benchmarks/op_coverage.py --families            # fallback ops, most op-layouts first
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys
import threading
import time
import types
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
# this checkout's package first: an editable install may point at another tree
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "ranks")]

import torch  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

import globaltensor as gt  # noqa: E402
import globaltensor.dispatch as _dispatch  # noqa: E402
import globaltensor.dispatch.decide  # noqa: E402,F401
_decide = sys.modules["globaltensor.dispatch.decide"]
from globaltensor.testing import RankFailed, RanksHung, run_ranks  # noqa: E402

import test_opinfo as oi  # noqa: E402  (the oracle: samples, reference, comparison)

S, B = gt.sbp.split, gt.sbp.broadcast
LAYOUTS = ("B", "S(0)", "mixed", "2x2")
G2 = gt.placement("cpu", [0, 1])
G22 = gt.placement("cpu", [[0, 1], [2, 3]])
ORDER = ("wrong", "error", "fallback", "data", "rule")  # worst first
DOC = ROOT / "docs" / "ops.md"
DETAIL = ROOT / "docs" / "op_coverage.md"
LOCAL_ERROR = "an operator got a global tensor and a local tensor of shape"
BEGIN, END = "<!-- op_coverage: begin -->", "<!-- op_coverage: end -->"


def sbp_of(t: torch.Tensor, k: int, how: str):
    """The sbp of the ``k``-th tensor argument ``t`` in layout ``how``."""
    if how == "2x2":
        if t.dim() == 0:
            return (B, B)
        return (S(0), S(t.dim() - 1)) if k == 0 else (S(0), B)
    if t.dim() == 0 or how == "B" or (how == "mixed" and k > 0):
        return (B,)
    return (S(0),) if how == "S(0)" else (S(t.dim() - 1),)


def _run_case(leaves, spec, ref, how, grid, rank, make_global, opinfo):
    layout = lambda t, n: sbp_of(t, n, how)  # noqa: E731
    glob = oi.globals_of(leaves, layout, grid, rank, make_global)
    status = oi._one_global(opinfo, glob, spec, ref)
    if status.startswith("error") and LOCAL_ERROR in status:
        # torch's own code for the op builds a local tensor (quantile's q as a tensor, a
        # composite's arange): the contract asks for global mode there, so run it as a user
        # would and classify that run (noted "global mode")
        glob = oi.globals_of(leaves, layout, grid, rank, make_global)  # fresh leaves
        def in_mode(*args, **kwargs):
            with gt.global_mode(grid):  # the forward only: the oracle's cotangents are local
                return opinfo.op(*args, **kwargs)
        status = oi._one_global(types.SimpleNamespace(op=in_mode), glob, spec, ref)
        if status == "ok":
            return "ok global mode"
    if status.startswith("WRONG"):
        return "wrong " + status[6:]
    if status.startswith("raise"):
        return "error " + status
    return status


def _statuses(opinfo, samples: int, timeout: float):
    """{layout: [case status, ...]} for ``opinfo``; a case status is one word of ORDER plus a
    note (the error, or the ops that took the fallback)."""
    if opinfo.name in oi.STORAGE_OPS:
        return None, "storage"
    cases = [c for c in oi._sample_cases(opinfo, samples) if all(
        x.layout == torch.strided for x in tree_flatten((c.input, c.args, c.kwargs))[0]
        if isinstance(x, torch.Tensor))]
    expected = []
    for sample in cases:
        leaves, spec = tree_flatten(((sample.input,) + tuple(sample.args), dict(sample.kwargs)))
        try:
            if oi._is_random(opinfo.op, leaves, spec):
                return None, "random"
            ref = oi._reference(opinfo.op, leaves, spec)
        except Exception:  # noqa: BLE001 - torch itself rejects the sample
            continue
        expected.append((leaves, spec, ref))
    if not expected:
        return None, "no samples"
    out = collections.defaultdict(list)
    for grid, hows in ((G2, LAYOUTS[:3]), (G22, LAYOUTS[3:])):
        barrier = threading.Barrier(grid.size, timeout=timeout)

        def body(rank, grid=grid, hows=hows, barrier=barrier):
            from helpers import make_global

            got = []
            for leaves, spec, ref in expected:
                for how in hows:
                    barrier.wait()
                    if rank == 0:  # decide every op of this case afresh, counting fallbacks
                        _dispatch._DECISIONS.clear()
                        _dispatch._BY_ID.clear()
                        _decide.FALLBACKS.clear()
                        _decide.LEARNT.clear()
                    barrier.wait()
                    status = _run_case(leaves, spec, ref, how, grid, rank, make_global, opinfo)
                    barrier.wait()
                    learnt = sorted(_decide.LEARNT)  # these reach the fallback first, then learn
                    fallbacks = sorted(set(_decide.FALLBACKS) - set(learnt))
                    barrier.wait()
                    mode = " in global mode" if status == "ok global mode" else ""
                    if status.startswith("ok") and fallbacks:
                        status = "fallback " + ",".join(fallbacks) + mode
                    elif status.startswith("ok") and learnt:
                        status = "data " + ",".join(learnt) + mode
                    elif status.startswith("ok"):
                        status = "rule" + mode
                    got.append((how, status))
            return got

        try:
            for how, status in run_ranks(body, grid.size, timeout=timeout)[0]:
                out[how].append(status)
        except RanksHung:
            for how in hows:
                out[how].append("error hang")
        except RankFailed as e:
            for how in hows:
                out[how].append(f"error raise {str(e).splitlines()[0][:120]}")
    return out, None


def classify(statuses) -> str:
    """The op-layout's class: the worst of its samples."""
    kinds = {s.split(" ")[0] for s in statuses}
    return next(k for k in ORDER if k in kinds)


def op_key(opinfo) -> str:
    return opinfo.name + (f".{opinfo.variant_test_name}" if opinfo.variant_test_name else "")


def sweep(names=(), samples: int = 2, timeout: float = 120, verbose=False):
    results = {}
    for opinfo in oi._op_db():
        key = op_key(opinfo)
        if names and opinfo.name not in names and key not in names:
            continue
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            per, skipped = _statuses(opinfo, samples, timeout)
        if per is None:
            results[key] = {"skip": skipped}
            continue
        results[key] = {how: {"class": classify(per[how]), "cases": per[how]} for how in per}
        if verbose:
            cells = " ".join(f"{how}={results[key][how]['class']}" for how in per)
            notes = sorted({s for how in per for s in per[how] if not s.startswith("rule")})
            print(f"{key:40} {cells}  ({time.perf_counter() - start:.1f}s)"
                  + (f"  {notes[:3]}" if notes else ""), flush=True)
    return results


def totals(results):
    table = {how: collections.Counter() for how in LAYOUTS}
    for r in results.values():
        for how in LAYOUTS:
            if how in r:
                table[how][r[how]["class"]] += 1
    return table


def fallback_ops(results):
    """aten op -> op-layouts that took the fallback because of it (what a rule would move)."""
    count = collections.Counter()
    for r in results.values():
        for how in LAYOUTS:
            if how in r and r[how]["class"] == "fallback":
                ops = set()
                for s in r[how]["cases"]:
                    if s.startswith("fallback "):
                        ops.update(s.split(" ", 1)[1].split(","))
                count.update(ops)
    return count


def summary_md(results) -> str:
    table = totals(results)
    n_ops = sum(1 for r in results.values() if "skip" not in r)
    skipped = collections.Counter(r["skip"] for r in results.values() if "skip" in r)
    lines = [f"Generated by `python benchmarks/op_coverage.py --write-docs`: {n_ops} OpInfo "
             f"entries with samples (float64, the first 2 samples each; skipped: "
             + ", ".join(f"{v} {k}" for k, v in sorted(skipped.items())) + "), "
             "each on four layouts (B, S(0) and mixed on 2 ranks; a 2x2 grid), forward and "
             "gradients against the full-tensor result. An op-layout counts its worst sample. "
             "Per op: [op_coverage.md](op_coverage.md).", "",
             "| layout | " + " | ".join(ORDER) + " | total |",
             "| --- |" + " ---: |" * (len(ORDER) + 1)]
    grand = collections.Counter()
    in_mode = sum(1 for r in results.values() if "skip" not in r for how in LAYOUTS
                  if how in r and r[how]["class"] != "error"
                  and any(c.endswith("in global mode") for c in r[how]["cases"]))
    for how in LAYOUTS:
        grand.update(table[how])
        lines.append(f"| {how} | " + " | ".join(str(table[how][k]) for k in ORDER)
                     + f" | {sum(table[how].values())} |")
    lines.append("| **all** | " + " | ".join(f"**{grand[k]}**" for k in ORDER)
                 + f" | **{sum(grand.values())}** |")
    lines += ["", "*rule*: correct with no op gathering its inputs through the broadcast fallback; "
              "*data*: correct, a data-dependent op (`nonzero`, `unique`, `x[mask]`) ran on B "
              "inputs; *fallback*: correct, some aten op ran on gathered inputs; *error*: a "
              "clear error (or another exception); *wrong*: a silent wrong result. "
              f"{in_mode} op-layouts count the run in `gt.global_mode` of a sample whose op "
              "builds a local tensor inside (outside global mode: the expected error naming "
              "the op)."]
    return "\n".join(lines)


def detail_md(results) -> str:
    lines = ["# Operator coverage, per OpInfo entry", "",
             "Generated by `python benchmarks/op_coverage.py --write-docs` (see the summary in "
             "[ops.md](ops.md#coverage)). One row per OpInfo entry, one cell per layout: "
             "`rule`, `data`, `fallback (aten ops that took it)`, `error (message)`, `wrong`.",
             "", "| op | " + " | ".join(LAYOUTS) + " |", "| --- |" + " --- |" * len(LAYOUTS)]
    for key in sorted(results):
        r = results[key]
        if "skip" in r:
            lines.append(f"| `{key}` | " + " | ".join([f"skip ({r['skip']})"] * len(LAYOUTS))
                         + " |")
            continue
        cells = []
        for how in LAYOUTS:
            if how not in r:
                cells.append("")
                continue
            c = r[how]["class"]
            note = next((s.split(" ", 1)[1] for s in r[how]["cases"]
                         if s.split(" ")[0] == c and " " in s), "")
            note = note.replace("|", "/")[:90]
            cells.append(f"{c} ({note})" if note else c)
        lines.append(f"| `{key}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_docs(results):
    text = DOC.read_text()
    block = f"{BEGIN}\n{summary_md(results)}\n{END}"
    if BEGIN in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n## Coverage\n\n" + block + "\n"
    DOC.write_text(text)
    DETAIL.write_text(detail_md(results))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="", help="OpInfo names separated by commas (default: all)")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("-v", "--verbose", action="store_true", help="one line per op")
    ap.add_argument("--json", help="write the per-case results to this file")
    ap.add_argument("--load", help="read results from a --json file instead of sweeping")
    ap.add_argument("--write-docs", action="store_true", help="regenerate the tables in docs/")
    ap.add_argument("--families", action="store_true",
                    help="the aten ops that took the fallback, by op-layouts")
    args = ap.parse_args()
    if args.load:
        results = json.loads(pathlib.Path(args.load).read_text())
    else:
        results = sweep(set(filter(None, args.ops.split(","))), args.samples, args.timeout,
                        args.verbose)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    print(summary_md(results))
    if args.families:
        for op, n in fallback_ops(results).most_common():
            print(f"{n:5}  {op}")
    if args.write_docs:
        write_docs(results)
    return 1 if any(t["wrong"] for t in totals(results).values()) else 0


if __name__ == "__main__":
    sys.exit(main())
