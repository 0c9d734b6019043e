"""Broadcasting inputs are never split along a dim they broadcast (issue 36, item 1).

Every op family whose rule has a broadcasting input (``Rule.frames``: pointwise ops, where,
masked_fill, addcmul, lerp, clamp, losses with targets or weights, addmm's bias, the attention
mask, masked_scatter) runs with inputs of broadcasting shapes (size-1 dims, missing leading
dims): the larger input split on each of its dims in turn, the smaller ones whole or split on
each of their own dims (a size-1 dim split leaves the second rank an empty piece), forward and
backward against torch on the full tensors, and forward once more under ``torch.no_grad()``.
The test also checks that every family in
``globaltensor/ops`` with a broadcasting input met a broadcasting call here.

The default run takes each op once, with one of the smaller shapes (a different one for each op
in turn: every shape and every op is met), on every layout; ``pytest -m slow`` runs every op with
every shape.
"""
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import globaltensor as gt
from globaltensor.ops import registry as signature
from globaltensor.testing import run_ranks
from helpers import G2, G22, gen, reference, run_global, run_no_grad

S, B = gt.sbp.split, gt.sbp.broadcast
ATEN = torch.ops.aten

BIG = (3, 4, 5)
SMALL = [(1, 4, 5), (3, 1, 5), (3, 4, 1), (4, 5), (5,), (1, 1, 1), (4, 1)]
QKV = (2, 4, 3, 5)
MASKS = [(2, 1, 3, 3), (3, 3), (1, 1, 3, 3), (1, 4, 1, 3), (2, 4, 3, 3)]


def _positive(t):
    return t.abs() + 0.5


def _probability(t):
    return torch.sigmoid(t)


# name -> (fn, input shapes (the first the larger), per input how to make its values)
def _cases():
    cases = []
    for small in SMALL:
        cases += [
            ("add", lambda a, b: a + b, (BIG, small), None),
            ("mul", lambda a, b: b * a, (BIG, small), None),
            ("maximum", torch.maximum, (BIG, small), None),
            ("atan2", torch.atan2, (BIG, small), None),
            ("pow", lambda a, b: torch.pow(_positive(a), b), (BIG, small), None),
            ("rsub", lambda a, b: torch.rsub(a, b), (BIG, small), None),
            ("where", lambda a, b: torch.where(b > 0, a, b), (BIG, small), None),
            ("masked_fill", lambda a, b: a.masked_fill(b > 0, 0.5), (BIG, small), None),
            ("masked_fill.Tensor", lambda a, b: a.masked_fill(b > 0, torch.tensor(0.5)),
             (BIG, small), None),
            ("addcmul", lambda a, b, c: torch.addcmul(a, b, c, value=0.5), (BIG, small, small),
             None),
            ("lerp", lambda a, b, c: torch.lerp(a, b, c), (BIG, small, small), None),
            ("clamp", lambda a, b: torch.clamp(a, min=b, max=b + 1), (BIG, small), None),
            ("mse_loss", lambda a, b: F.mse_loss(a, b, reduction="none"), (BIG, small), None),
            # torch's Python expands the target; aten's losses broadcast it themselves
            ("aten mse_loss", lambda a, b: ATEN.mse_loss.default(a, b.detach(), 0),
             (BIG, small), None),
            ("aten smooth_l1_loss mean", lambda a, b: ATEN.smooth_l1_loss.default(
                a, b.detach(), 1, 0.5), (BIG, small), None),
            ("aten bce", lambda a, t, w: ATEN.binary_cross_entropy.default(
                _probability(a), _probability(t).detach(), _probability(w).detach(), 1),
             (BIG, BIG, small), None),
            ("bce", lambda a, t, w: F.binary_cross_entropy(_probability(a), _probability(t),
                                                             weight=_probability(w).detach()),
             (BIG, BIG, small), None),
            ("bce_logits", lambda a, t, w: F.binary_cross_entropy_with_logits(
                a, _probability(t), weight=w.detach(), pos_weight=_positive(w).detach(),
                reduction="sum"),
             (BIG, BIG, small), None),
            ("masked_scatter", lambda a, m, s: a.masked_scatter(m > 0, s),
             (BIG, small, (60,)), None),
        ]
    for bias in [(3,), (1, 3), (6, 1), (1, 1), (6, 3)]:
        cases.append(("addmm", lambda b, x, w: torch.addmm(b, x, w), (bias, (6, 4), (4, 3)),
                      None))
    for mask in MASKS:
        cases.append(("sdpa bool", lambda m, q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=m > -1.5), (mask, QKV, QKV, QKV), None))
        cases.append(("sdpa float", lambda m, q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=m), (mask, QKV, QKV, QKV), None))
    return cases


def _layouts(shapes, grid):
    """Every split of the larger input on a [2] grid (the inputs of its shape alike), each
    smaller input B or split on each of its own dims; on a 2x2 grid, pairs of the larger
    input's dims (S(d), S(e)) with the smaller ones B."""
    big = max(shapes, key=len)
    if grid.ndim == 2:
        return [tuple((S(d), S(e)) if s == big else (B, B) for s in shapes)
                for d in range(len(big)) for e in range(len(big)) if d != e]
    out = []
    for d in range(len(big)):
        smaller = [i for i, s in enumerate(shapes) if s != big]
        out.append(tuple((S(d),) if s == big else (B,) for s in shapes))
        for i in smaller:
            for k in range(len(shapes[i])):
                out.append(tuple((S(d),) if s == big else (S(k),) if j == i else (B,)
                                 for j, s in enumerate(shapes)))
    return out


class _Recorder(TorchDispatchMode):
    """The aten ops that met inputs of more than one shape (a broadcasting call)."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        shapes = {tuple(a.shape) for a in [*args, *kwargs.values()]
                  if isinstance(a, torch.Tensor) and a.dim() > 0}
        if len(shapes) > 1:
            self.ops.add(func.name().split("::")[1])
        return func(*args, **kwargs)


def _families() -> dict:
    """Rule functions whose rows have a broadcasting input -> the op names registered with them
    (``pointwise`` for the tag rule)."""
    rules = {name: e.rule for name, e in signature.OPS.items() if e.rule}
    rules.update({f"tag:{k}": v for k, v in signature.TAG_RULES.items()})
    families = {}
    for name, fn in rules.items():
        source = inspect.getsource(fn)
        if "broadcasting(" in source or "pointwise(call)" in source:
            families.setdefault(fn.__qualname__, set()).add(name)
    return families


# families whose broadcasting frame only ever meets inputs of one shape
ONE_SHAPE = {
    "to_copy": "one input (.to(dtype))",
    "backward": "activation backward ops: grad and x have one shape",
    # no torch oracle for a draw (the counter-based stream): test_sampling.py draws with a
    # broadcasting std and p on every layout against one process
    "random_pointwise": "random draws with broadcasting parameters: tests/ranks/test_sampling.py",
}


def _inputs(shapes, seed):
    return [gen(*s, seed=seed + i) for i, s in enumerate(shapes)]


def _run_cases(grid, cases, timeout):
    plans = []
    recorder = _Recorder()
    for name, fn, shapes, _ in cases:
        inputs = _inputs(shapes, seed=len(plans))
        with warnings.catch_warnings(), recorder:
            warnings.simplefilter("ignore")  # mse_loss warns about broadcasting targets
            want, cot, grads = reference(fn, inputs)
        plans.append((name, fn, inputs, want, cot, grads, _layouts(shapes, grid)))

    def body(rank):
        errors = []
        for name, fn, inputs, want, cot, grads, layouts in plans:
            for sbps in layouts:
                what = f"{name} {[tuple(t.shape) for t in inputs]} {sbps}"
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        full, got, _ = run_global(fn, inputs, grid, sbps, cot, rank)
                except Exception as e:  # noqa: BLE001 - reported with the case
                    errors.append(f"{what}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                if not torch.allclose(full, want, atol=1e-9, rtol=1e-7):
                    err = (full - want).abs().max().item() if full.shape == want.shape else "shape"
                    errors.append(f"{what}: forward differs (max error {err})")
                elif grads is not None and not torch.allclose(
                        run_no_grad(fn, inputs, grid, sbps, rank), want, atol=1e-9, rtol=1e-7):
                    errors.append(f"{what}: forward under no_grad differs")
                for i, (g, r) in enumerate(zip(got or [], grads or [])):
                    if r is not None and (g is None or not torch.allclose(g, r, atol=1e-9,
                                                                          rtol=1e-7)):
                        errors.append(f"{what}: gradient of input {i} differs")
        return errors

    return run_ranks(body, grid.ranks.size, timeout=timeout)[0], recorder.ops


def _one_shape_per_op(cases):
    """Each op once: the k-th op (in order of first appearance) with its k-th shapes (cycling),
    so the ops take the smaller shapes in turn. Deterministic."""
    by_name: dict = {}
    for case in cases:
        by_name.setdefault(case[0], []).append(case)
    return [shapes[k % len(shapes)] for k, shapes in enumerate(by_name.values())]


def test_every_broadcasting_op_keeps_its_size_1_dims_whole_on_2_ranks():
    cases = _one_shape_per_op(_cases())
    assert {c[0] for c in cases} == {c[0] for c in _cases()}
    assert {shape for c in cases for shape in c[2] if shape in SMALL} == set(SMALL)
    errors, met = _run_cases(G2, cases, timeout=300)
    assert not errors, f"{len(errors)} cases differ:\n" + "\n".join(errors[:10])
    _assert_every_family_met(met)


@pytest.mark.slow
def test_every_broadcasting_op_with_every_shape_on_2_ranks():
    errors, met = _run_cases(G2, _cases(), timeout=600)
    assert not errors, f"{len(errors)} cases differ:\n" + "\n".join(errors[:10])
    _assert_every_family_met(met)


def _assert_every_family_met(met) -> None:
    missing = {}
    for family, names in _families().items():
        short = family.split(".")[0]
        if short in ONE_SHAPE:
            continue
        packets = {n.split(".")[0] for n in names} | {n for n in names}
        if not any(op in packets or op.split(".")[0] in packets or "tag:pointwise" in names
                   for op in met):
            missing[family] = sorted(names)
    assert not missing, f"families with a broadcasting input that no case here met: {missing}"


@pytest.mark.parametrize("name", ["sdpa bool"] + [pytest.param(n, marks=pytest.mark.slow)
                                                 for n in ("add", "where", "addcmul", "bce")])
def test_broadcasting_ops_on_a_2x2_grid(name):
    cases = [c for c in _cases() if c[0] == name]
    errors, _ = _run_cases(G22, cases, timeout=300)
    assert not errors, f"{len(errors)} cases differ:\n" + "\n".join(errors[:10])


def test_the_padded_attention_of_the_issue_matches_the_full_tensors():
    """Issue 36's report: q, k, v (2, 4, 6, 8) split on heads, a bool (2, 1, 6, 6) padding mask:
    the mask stays whole on the head split (it was split: rank 1 read an empty mask as none)."""
    q, k, v = (gen(2, 4, 6, 8, seed=s) for s in range(3))
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    mask[1, :, :, 4:] = False
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def body(rank):
        g = [t.to_global(G2, B).to_global(sbp=S(1)) for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*g, attn_mask=mask.to_global(G2, B))
        return out.sbp, (out.full_tensor() - want).abs().max().item()

    for sbp, err in run_ranks(body, 2, timeout=60):
        assert sbp == (S(1),) and err < 1e-12


def test_a_partial_sum_divided_by_zero_follows_ieee_per_part():
    """docs/sbp.md, "Partial sums divided by zero": P / B stays P, so a zero divisor gives each
    part's infinity (2/0 + -1/0 = nan where one device gives 1/0 = inf); finite divisors agree,
    and reducing first gives the one-device value."""
    parts = [torch.tensor([3.0, 1.0]), torch.tensor([-1.0, 0.0])]  # the value [2, 1]
    divisor = torch.tensor([0.0, 2.0])

    def body(rank):
        x = parts[rank].to_global(G2, gt.sbp.partial_sum)
        d = divisor.to_global(G2, B)
        kept = x / d
        reduced = x.to_global(sbp=B) / d
        return kept.sbp, kept.full_tensor(), reduced.full_tensor()

    for sbp, kept, reduced in run_ranks(body, 2, timeout=60):
        assert sbp == (gt.sbp.partial_sum,)
        assert torch.isnan(kept[0]) and kept[1] == 0.5
        assert torch.equal(reduced, torch.tensor([2.0, 1.0]) / divisor)  # [inf, 0.5]
