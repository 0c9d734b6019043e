"""A fingerprint of the planner's answers: every plan between every pair of layouts on grids [2],
[4], [2,2], [2,2,2] for a few shapes (and a few placement changes), every signature choice on a
seeded sample of calls. Run at two commits and compare the hashes: a move of code that changes
no plan and no choice prints the same lines. The planner prices with the default cost figures
(gt.costs(): alpha 10 us, beta 0.1 ns per byte) unless ``--costs`` gives others.

``--against FIGURES`` documents which answers the figures change: it prints, per section, how
many plans and choices take other steps or signatures (costs aside) under FIGURES than under
the ones in use, and the first few of them.

    PYTHONPATH=. python benchmarks/fingerprint.py [--out answers.txt] [--costs alpha=1e-4,beta=1e-9]
    PYTHONPATH=. python benchmarks/fingerprint.py --against alpha=2e-4,beta=3e-9
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import pathlib
import random
import sys

_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
if sys.path[:1] != [_ROOT]:
    sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402

import globaltensor as gt  # noqa: E402
from globaltensor.layout import Layout  # noqa: E402
from globaltensor.ops import Call, Ref, choose  # noqa: E402
from globaltensor.plan import plan  # noqa: E402

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
GRIDS = {"[2]": [0, 1], "[4]": [0, 1, 2, 3], "[2,2]": [[0, 1], [2, 3]],
         "[2,2,2]": np.arange(8).reshape(2, 2, 2).tolist()}
SHAPES = {"[2]": [(4, 4), (5, 7), (3, 5, 6)], "[4]": [(4, 4), (5, 7), (3, 5, 6)],
          "[2,2]": [(4, 4), (5, 7), (3, 5, 6)], "[2,2,2]": [(4, 6), (5, 7), (3, 5, 6)]}
MOVES = [([0, 1], [2, 3]), ([0, 1, 2, 3], [[0, 1], [2, 3]]), ([[0, 1], [2, 3]], [0, 1, 2]),
         ([0, 1], [[0, 1], [2, 3]])]
POINTWISE = frozenset({"pointwise"})
CALLS = [
    Call("mm.default", ((8, 6), (6, 10)), (Ref(0), Ref(1))),
    Call("mm.default", ((1024, 512), (512, 2048)), (Ref(0), Ref(1))),
    Call("add.Tensor", ((8, 6), (8, 6)), (Ref(0), Ref(1)), (), POINTWISE),
    Call("add.Tensor", ((8, 6), (6,)), (Ref(0), Ref(1)), (), POINTWISE),
    Call("bmm.default", ((4, 6, 8), (4, 8, 2)), (Ref(0), Ref(1))),
    Call("sum.dim_IntList", ((8, 6),), (Ref(0), (1,), True)),
    Call("view.default", ((4, 6),), (Ref(0), (2, 2, 6))),
    Call("embedding.default", ((50, 8), (4, 6)), (Ref(0), Ref(1))),
    Call("max.dim", ((8, 6),), (Ref(0), 1, False)),
]


def layouts(placement, shape):
    values = [S(d) for d in range(len(shape))] + [B, P]
    return [Layout(placement, sbp, shape) for sbp in itertools.product(values, repeat=placement.ndim)]


def describe_plan(p, priced: bool = True) -> str:
    parts = []
    for s in p.steps:
        facts = [type(s).__name__, str(s.after.sbp)]
        for name in ("axis", "dim", "src_dim", "dst_dim"):
            if hasattr(s, name):
                facts.append(f"{name}={getattr(s, name)}")
        if hasattr(s, "moves"):
            facts.append(repr(s.moves))
        parts.append(" ".join(facts))
    cost = f" {p.cost()!r}" if priced else ""
    return f"{p.src.sbp}->{p.dst.sbp} {p.src.shape}{cost} | " + " ; ".join(parts)


def plans(priced: bool = True):
    for name, ranks in GRIDS.items():
        placement = gt.placement("cpu", ranks)
        for shape in SHAPES[name]:
            lines = [describe_plan(plan(a, b), priced) for a in layouts(placement, shape)
                     for b in layouts(placement, shape)]
            yield f"plans {name} {shape}", lines
    for src, dst in MOVES:
        ps, pd = gt.placement("cpu", src), gt.placement("cpu", dst)
        for shape in [(4, 4), (5, 7)]:
            lines = [describe_plan(plan(a, b), priced) for a in layouts(ps, shape)
                     for b in layouts(pd, shape)]
            yield f"plans {src}->{dst} {shape}", lines


def random_layout(rng, placement, shape):
    values = [S(d) for d in range(len(shape))] + [B, P]
    return Layout(placement, tuple(rng.choice(values) for _ in range(placement.ndim)), shape)


def choices(priced: bool = True):
    for name, ranks in GRIDS.items():
        rng = random.Random(name)
        placement = gt.placement("cpu", ranks)
        lines = []
        for call in CALLS:
            for _ in range(25):
                ins = tuple(random_layout(rng, placement, s) for s in call.shapes)
                itemsizes = tuple(rng.choice([2, 4, 8]) for _ in ins)
                grads = tuple(rng.random() < 0.5 for _ in ins) if rng.random() < 0.6 else ()
                free = ()
                if rng.random() < 0.3:
                    free = tuple(frozenset({random_layout(rng, placement, x.shape)})
                                 if rng.random() < 0.5 else frozenset() for x in ins)
                for tolerance in (None, 0.0):
                    kw = {} if tolerance is None else {"tolerance": tolerance}
                    c = choose(call, ins, itemsizes, grads=grads, free=free, **kw)
                    what = None if c is None else (tuple(x.sbp for x in c.ins), c.outs, c.kernel,
                                                   repr(c.cost) if priced else "")
                    lines.append(f"{call.op} {[x.sbp for x in ins]} {itemsizes} {grads} -> {what}")
        yield f"choices {name}", lines


def answers(priced: bool) -> dict:
    return dict(itertools.chain(plans(priced), choices(priced)))


def against(figures, shown: int = 3) -> None:
    """Print how many answers ``figures`` change, per section, with the first ``shown``."""
    now = answers(priced=False)
    before = gt.set_costs(costs=figures)
    try:
        then = answers(priced=False)
    finally:
        gt.set_costs(costs=before)
    print(f"answers under {before} -> under {figures}")
    total = changed = 0
    for label, lines in now.items():
        differ = [(a, b) for a, b in zip(lines, then[label]) if a != b]
        total, changed = total + len(lines), changed + len(differ)
        print(f"{label:<45} {len(differ):>6} of {len(lines):>6} change")
        for a, b in differ[:shown]:
            print(f"    {a}\n    -> {b.split(' | ')[-1] if label.startswith('plans') else b.split(' -> ')[-1]}")
    print(f"all: {changed} of {total} answers change")


def main(argv=None):
    from globaltensor.plan import DEFAULT
    from globaltensor.runtime.costs import parse

    def figures(text):
        found = parse(text)
        return found if isinstance(found, type(DEFAULT)) else DEFAULT

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--costs", type=figures, default=None, help="alpha=SECONDS,beta=SECONDS")
    parser.add_argument("--against", type=figures, default=None, help="alpha=SECONDS,beta=SECONDS")
    args = parser.parse_args(argv)
    if args.costs is not None:
        gt.set_costs(costs=args.costs)
    if args.against is not None:
        return against(args.against)
    everything = []
    for label, lines in itertools.chain(plans(), choices()):
        digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
        print(f"{label:<45} {len(lines):>6} {digest}", flush=True)
        everything += [label] + lines
    print("all", hashlib.sha256("\n".join(everything).encode()).hexdigest())
    if args.out:
        pathlib.Path(args.out).write_text("\n".join(everything))


if __name__ == "__main__":
    main()
