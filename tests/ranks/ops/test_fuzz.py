"""Differential fuzzing: random short programs on global tensors against the same programs on
full tensors (the oracle), element by element, forward and gradients.

A program is drawn from a seed: inputs of random shapes and layouts (every sbp, [2] and [2, 2]
grids, even and uneven), then steps: pointwise ops with tensors, Python scalars and 0-dim local
tensors, with partners that broadcast (size-1 dims, fewer dims; split or not), masked_fill with a
broadcasting mask, scaled_dot_product_attention (grouped-query too) with a broadcasting bool or
float mask, matmul, reductions, views and in-place writes through them, indexing, casts,
to_global to random layouts; at the end the backward of a random scalar loss. Every program runs
twice: with autograd (values and gradients) and under ``torch.no_grad()`` (values), since the
layouts chosen differ between the two (a backward has a price) while the values must not. The default run takes the
first seeds of each world (``PROGRAMS``), ``pytest -m slow`` the next ones (``SLOW_PROGRAMS`` in
all); more on demand, printing the seed and program of any mismatch::

    python tests/ranks/ops/test_fuzz.py --count 2000 [--start 0] [--world 2|4]
"""
from __future__ import annotations

import argparse
import random
import sys

import pytest
import torch

import globaltensor as gt
from globaltensor.layout import Layout
from globaltensor.testing import run_ranks

S, B, P = gt.sbp.S, gt.sbp.broadcast, gt.sbp.partial_sum
Split = gt.sbp.Split
# seeds per world: 2 ranks ([2]) from 0, 4 ranks ([2, 2]) from 10_000. The default run takes
# the first PROGRAMS (a 2x2 program costs about 2.5x a [2] one), -m slow the rest of SLOW_PROGRAMS
PROGRAMS = {2: 60, 4: 20}
SLOW_PROGRAMS = 300
HEAD_TAIL_PROGRAMS = 20  # on [2], the default run's programs with half their splits head-tail
FIRST_SEED = {2: 0, 4: 10_000}


# --------------------------------------------------------------------------- drawing programs


def _layout(rng, ndim: int, axes: int, floating: bool) -> tuple:
    options = [S(d) for d in range(ndim)] + [B] + ([P] if floating else [])
    return tuple(rng.choice(options) for _ in range(axes))


def draw(seed: int, axes: int) -> list[tuple]:
    """A program: a list of steps, each naming the values (by index) it reads. Shapes are
    tracked on the fly so every step is valid for torch."""
    rng = random.Random(seed)
    shapes: list[tuple] = []
    steps: list[tuple] = []

    def new_input(shape):
        steps.append(("input", shape, _layout(rng, len(shape), axes, True), rng.randrange(10**6)))
        shapes.append(shape)
        return len(shapes) - 1

    for _ in range(2):
        new_input((rng.randint(1, 5), rng.randint(1, 5)))
    for _ in range(rng.randint(3, 7)):
        i = rng.choice([j for j, s in enumerate(shapes) if len(s) == 2])  # the matrices
        shape = shapes[i]
        kind = rng.choice(["binary", "scalar", "unary", "matmul", "reduce", "view", "write",
                           "index", "cast", "to_global", "softmax", "cat", "where", "inplace",
                           "put", "broadcast", "mask", "attend"])
        if kind == "binary":
            same = [j for j, s in enumerate(shapes) if s == shape and j != i]
            j = rng.choice(same) if same else new_input(shape)
            out = ("binary", rng.choice(["add", "sub", "mul"]), i, j)
        elif kind == "scalar":
            out = ("scalar", rng.choice(["add", "mul", "div", "rsub"]), i,
                   round(rng.uniform(0.5, 2.0), 2), rng.random() < 0.5)  # Python float or 0-dim
        elif kind == "unary":
            out = ("unary", rng.choice(["relu", "tanh", "neg", "abs", "sigmoid"]), i)
        elif kind == "matmul":
            j = new_input((shape[-1], rng.randint(1, 4)))
            shape = (shape[0], shapes[j][1])
            out = ("matmul", i, j)
        elif kind == "reduce":
            dim = rng.randrange(2)  # keepdim: values stay matrices for the steps after
            shape = tuple(1 if d == dim else n for d, n in enumerate(shape))
            out = ("reduce", rng.choice(["sum", "mean", "amax"]), i, dim)
        elif kind == "view":
            how = rng.choice(["t", "flat", "slice"])
            if how == "t":
                shape = shape[::-1]
                out = ("view", "t", i)
            elif how == "flat":
                out = ("view", "flat", i)  # reshape(-1) then back
            else:
                lo = rng.randrange(shape[1])
                hi = rng.randint(lo + 1, shape[1])
                shape = (shape[0], hi - lo)
                out = ("view", "slice", i, lo, hi)
        elif kind == "write":
            how = rng.choice(["row_fill", "rows_mul", "col_copy", "narrow_add"])
            out = ("write", how, i, rng.randrange(shape[0]), rng.randrange(shape[1]),
                   round(rng.uniform(-2, 2), 2))
        elif kind == "index":
            idx = [rng.randrange(shape[0]) for _ in range(rng.randint(1, 4))]
            shape = (len(idx), shape[1])
            out = ("index", i, tuple(idx), rng.random() < 0.5)  # index_select or x[idx]
        elif kind == "cast":
            out = ("cast", i)
        elif kind == "softmax":
            out = ("softmax", rng.choice(["softmax", "log_softmax"]), i, rng.randrange(2))
        elif kind == "cat":
            same = [j for j, s in enumerate(shapes) if s == shape]
            j, dim = rng.choice(same), rng.randrange(2)
            shape = tuple(n * 2 if d == dim else n for d, n in enumerate(shape))
            out = ("cat", "cat", i, j, dim)
        elif kind == "where":
            same = [j for j, s in enumerate(shapes) if s == shape and j != i]
            j = rng.choice(same) if same else new_input(shape)
            out = ("where", "where", i, j)  # where(x > y, x, y): the larger of the two
        elif kind == "inplace":
            same = [j for j, s in enumerate(shapes) if s == shape and j != i]
            j = rng.choice(same) if same else new_input(shape)
            out = ("inplace", rng.choice(["add_", "mul_", "sub_"]), i, j)
        elif kind == "put":
            idx = sorted({rng.randrange(shape[0]) for _ in range(rng.randint(1, 3))})
            out = ("put", "put", i, tuple(idx), round(rng.uniform(-2, 2), 2))
        elif kind == "broadcast":  # a partner with size-1 or missing dims
            j = new_input(rng.choice(_broadcasting(shape)))
            out = ("broadcast", rng.choice(["add", "sub", "mul", "maximum"]), i, j,
                   rng.random() < 0.5)  # the partner first or second
        elif kind == "mask":
            j = new_input(rng.choice(_broadcasting(shape)))
            out = ("mask", "masked_fill", i, j, round(rng.uniform(-2, 2), 2))
        elif kind == "attend":
            out, shape = _attend(rng, new_input)
        else:
            out = ("to_global", i, _layout(rng, 2, axes, True))
        steps.append(out)
        shapes.append(shape)
    steps.append(("loss", tuple(round(rng.uniform(-1, 1), 2) for _ in shapes)))
    return steps


def _broadcasting(shape) -> list[tuple]:
    """Shapes that broadcast against the matrix ``shape``: size-1 dims, or fewer dims."""
    m, n = shape
    return [(1, n), (m, 1), (n,), (1, 1), (1,)]


def _attend(rng, new_input) -> tuple[tuple, tuple]:
    """scaled_dot_product_attention on new (batch, heads, L, E) inputs with a mask of a
    broadcasting shape (bool: the float input > -3, so no row is all masked; or additive);
    the result summed over batch and heads (an (L, E) matrix for the steps after)."""
    b, kv_heads, length, e = (rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 4),
                              rng.randint(1, 4))
    h = kv_heads * rng.choice([1, 1, 2])  # grouped-query attention: 2 query heads per key head
    q = new_input((b, h, length, e))
    k, v = (new_input((b, kv_heads, length, e)) for _ in range(2))
    masks = [(b, 1, length, length), (length, length), (1, 1, length, length),
             (b, h, length, length), (1, h, 1, length)]
    mask = new_input(rng.choice(masks))
    return ("attend", q, k, v, mask, rng.random() < 0.5), (length, e)


# --------------------------------------------------------------------------- running them


def _full(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def run(steps, make, scalar, backward: bool = True) -> tuple[list, list]:
    """Interpret ``steps``: ``make(full, sbp)`` builds an input (a leaf that requires grad),
    ``scalar(v)`` a 0-dim local tensor; the final loss's backward unless ``backward`` is
    False. Returns (every value, the inputs)."""
    values, inputs = [], []
    for step in steps:
        kind = step[0]
        if kind == "input":
            x = make(_full(step[1], step[3]), step[2])
            inputs.append(x)
            values.append(x)
            continue
        if kind == "loss":
            if backward:
                loss = sum((w * v.sum() for w, v in zip(step[1], values)), start=0.0)
                loss.backward()
            break
        x = values[step[2] if kind in ("binary", "scalar", "unary", "reduce", "view", "write",
                                       "softmax", "cat", "where", "inplace", "put",
                                       "broadcast", "mask")
                   else step[1]]
        if kind == "binary":
            y = getattr(torch, step[1])(x, values[step[3]])
        elif kind == "scalar":
            c = scalar(step[3]) if step[4] else step[3]
            y = {"add": lambda: x + c, "mul": lambda: x * c, "div": lambda: x / c,
                 "rsub": lambda: c - x}[step[1]]()
        elif kind == "unary":
            y = getattr(torch, step[1])(x)
        elif kind == "matmul":
            y = x @ values[step[2]]
        elif kind == "reduce":
            y = getattr(x, step[1])(step[3], keepdim=True)
        elif kind == "view":
            if step[1] == "t":
                y = x.t()
            elif step[1] == "flat":
                y = x.reshape(-1).reshape(x.shape)
            else:
                y = x[:, step[3]:step[4]]
        elif kind == "write":
            y = x.clone()  # writes go into a copy: the inputs are leaves
            _, how, _, r, c, v = step
            if how == "row_fill":
                y[r] = v
            elif how == "rows_mul":
                y[: r + 1].mul_(v)
            elif how == "col_copy":
                y[:, c] = y[:, c] * v + 1
            else:
                y.narrow(1, c, 1).add_(v)
        elif kind == "index":
            idx = scalar_index(x, step[2])
            y = x.index_select(0, idx) if step[3] else x[idx]
        elif kind == "cast":
            y = x.float().double()
        elif kind == "softmax":
            y = getattr(torch, step[1])(x, step[3])
        elif kind == "cat":
            y = torch.cat([x, values[step[3]]], step[4])
        elif kind == "where":
            other = values[step[3]]
            y = torch.where(x > other, x, other)
        elif kind == "inplace":
            y = x.clone()
            getattr(y, step[1])(values[step[3]])
        elif kind == "put":
            y = x.clone()
            y[scalar_index(x, step[3])] = step[4]
        elif kind == "broadcast":
            a, b = (values[step[3]], x) if step[4] else (x, values[step[3]])
            y = getattr(torch, step[1])(a, b)
        elif kind == "mask":
            y = x.masked_fill(values[step[3]] > 0, step[4])
        elif kind == "attend":
            mask = values[step[4]]
            k = values[step[2]]
            y = torch.nn.functional.scaled_dot_product_attention(
                x, k, values[step[3]], attn_mask=mask > -3 if step[5] else mask,
                enable_gqa=x.shape[1] != k.shape[1])
            y = y.sum((0, 1))
        else:  # to_global
            y = x.to_global(sbp=step[2]) if x.is_global else x
        values.append(y)
    return values, inputs


def scalar_index(x, idx):
    """The index tensor, global (broadcast) when ``x`` is global."""
    t = torch.tensor(idx)
    if x.is_global:
        return gt.tensor(t, placement=x.placement, sbp=[B] * x.placement.ndim)
    return t


def describe(steps) -> str:
    return "\n".join(f"  {k}: {s}" for k, s in enumerate(steps))


def head_tail(steps, seed: int, grid) -> list[tuple]:
    """The program with about half of its splits head-tail (where no other axis splits that
    dim): the same ops on pieces that hold their dims permuted (ops/choice/balanced.py)."""
    rng = random.Random(seed + 7_000_000)

    def balanced(sbp):
        out = list(sbp)
        for a, v in enumerate(sbp):
            if (isinstance(v, Split) and rng.random() < 0.5 and not any(
                    b != a and isinstance(w, Split) and w.dim == v.dim for b, w in enumerate(sbp))):
                out[a] = S(v.dim, "head_tail")
        return tuple(out)

    return [(s[0], s[1], balanced(s[2]), s[3]) if s[0] == "input"
            else (s[0], s[1], balanced(s[2])) if s[0] == "to_global" else s for s in steps]


def check_programs(seeds, world: int, balanced: bool = False) -> list[str]:
    """Run the programs of ``seeds`` on ``world`` thread-ranks; the mismatches, described. With
    ``balanced``, about half of every program's splits are head-tail."""
    grid = gt.placement("cpu", [0, 1]) if world == 2 else gt.placement("cpu", [[0, 1], [2, 3]])
    programs = {seed: draw(seed, grid.ndim) for seed in seeds}
    if balanced:
        programs = {seed: head_tail(steps, seed, grid) for seed, steps in programs.items()}
    expected = {}
    for seed, steps in programs.items():
        values, inputs = run(steps, lambda t, sbp: t.clone().requires_grad_(),
                             lambda v: torch.tensor(v, dtype=torch.float64))
        expected[seed] = ([v.detach() for v in values], [x.grad for x in inputs])

    def body(rank):
        from helpers import make_global  # the pieces of a full value, P parts unequal

        bad = []
        for seed, steps in programs.items():
            def make(full, sbp):
                return make_global(full, Layout(grid, sbp, full.shape), rank).requires_grad_()
            try:
                values, inputs = run(steps, make, lambda v: torch.tensor(v, dtype=torch.float64))
                got = ([v.full_tensor().detach() for v in values],
                       [x.grad.full_tensor() if x.grad is not None else None for x in inputs])
            except Exception as e:  # noqa: BLE001 - reported with the program
                bad.append(f"seed {seed}: {type(e).__name__}: {str(e)[:300]}\n{describe(steps)}")
                continue
            try:  # the same program without autograd: the choice of layouts differs (no
                with torch.no_grad():  # backward to price), the values must not
                    values, _ = run(steps, make, lambda v: torch.tensor(v, dtype=torch.float64),
                                    backward=False)
                    plain = [v.full_tensor() for v in values]
            except Exception as e:  # noqa: BLE001 - reported with the program
                bad.append(f"seed {seed} under no_grad: {type(e).__name__}: {str(e)[:300]}\n"
                           f"{describe(steps)}")
                continue
            want = expected[seed]
            for what, gs, ws in (("value", got[0], want[0]), ("grad of input", got[1], want[1]),
                                 ("value under no_grad", plain, want[0])):
                for k, (g, w) in enumerate(zip(gs, ws)):
                    if (g is None) != (w is None) or (
                            w is not None and not torch.allclose(g, w, rtol=1e-5, atol=1e-6)):
                        bad.append(f"seed {seed}: {what} {k} differs\n{describe(steps)}")
                        break
        return bad

    return run_ranks(body, world, timeout=600)[0]


def _check(world: int, first: int, last: int) -> None:
    seeds = range(FIRST_SEED[world] + first, FIRST_SEED[world] + last)
    bad = check_programs(seeds, world)
    assert not bad, f"{len(bad)} of {len(seeds)} programs differ:\n" + "\n".join(bad[:5])


@pytest.mark.slow  # suite time: the 2x2 grid's programs stay in the default run
def test_random_programs_match_the_full_tensor_oracle_on_2_ranks():
    _check(2, 0, PROGRAMS[2])


def test_random_programs_match_the_full_tensor_oracle_on_a_2x2_grid():
    _check(4, 0, PROGRAMS[4])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_more_random_programs_match_the_full_tensor_oracle(world):
    _check(world, PROGRAMS[world], SLOW_PROGRAMS)


def test_random_programs_over_head_tail_splits_match_the_full_tensor_oracle():
    seeds = range(FIRST_SEED[2], FIRST_SEED[2] + HEAD_TAIL_PROGRAMS)
    bad = check_programs(seeds, 2, balanced=True)
    assert not bad, f"{len(bad)} of {len(seeds)} programs differ:\n" + "\n".join(bad[:5])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_more_random_programs_over_head_tail_splits_match_the_full_tensor_oracle(world):
    first = FIRST_SEED[world] + (HEAD_TAIL_PROGRAMS if world == 2 else 0)
    seeds = range(first, FIRST_SEED[world] + SLOW_PROGRAMS // 2)
    bad = check_programs(seeds, world, balanced=True)
    assert not bad, f"{len(bad)} of {len(seeds)} programs differ:\n" + "\n".join(bad[:5])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=1000, help="how many programs")
    ap.add_argument("--start", type=int, default=0, help="the first seed")
    ap.add_argument("--world", type=int, choices=(2, 4), default=2, help="2: [2]; 4: [2, 2]")
    ap.add_argument("--head-tail", action="store_true", help="half the splits head-tail")
    args = ap.parse_args()
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    bad = check_programs(range(args.start, args.start + args.count), args.world, args.head_tail)
    for line in bad:
        print(line, "\n")
    print(f"{len(bad)} of {args.count} programs differ (seeds {args.start}.."
          f"{args.start + args.count - 1}, world {args.world})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
