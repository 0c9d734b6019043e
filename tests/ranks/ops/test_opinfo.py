"""torch's OpInfo samples on global tensors against the full-tensor oracle (a slow sweep).

For every op of torch's OpInfo database and its first samples (float64), each tensor argument is
laid out three ways on 2 thread-ranks: all B, all S(0) (uneven wherever the sample's sizes are
odd), and a mix (the first tensor split on its last dim, the others B). The outputs (full values)
and the gradients of the inputs are compared with torch on the full tensors, and the outputs
once more under ``torch.no_grad()`` (where layouts are chosen with no backward to price). Each
case ends as

    ok      the same values and gradients
    error   a clear GlobalTensorError (an unsupported case, said so)
    raise   another exception (an unsupported case, not said clearly)
    hang    a rank raised alone and the other waited (run_ranks' timeout)
    WRONG   a different value or gradient: a silent wrong result
    random  the op draws random values (torch's, seeded by OpInfo, and ours cannot agree)
    skip    the result depends on storage (as_strided of a partial view, empty_*); sparse
            samples are left out (to_global rejects sparse tensors with a clear error)

Run it by its marker (not part of the default suite):

    pytest -m slow tests/ranks/ops/test_opinfo.py           # fails on any WRONG
    python tests/ranks/ops/test_opinfo.py [--ops add,mm] [--samples 3]   # the table, per op
"""
from __future__ import annotations

import argparse
import collections
import sys
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

import globaltensor as gt
from globaltensor.errors import GlobalTensorError
from globaltensor.layout import Layout
from globaltensor.testing import RankFailed, RanksHung, run_ranks

from helpers import op_db, opinfo_samples

S, B = gt.sbp.split, gt.sbp.broadcast
GRID = gt.placement("cpu", [0, 1])
LAYOUTS = ("B", "S(0)", "mixed")


def _reference(fn, leaves, spec):
    args, kwargs = tree_unflatten(leaves, spec)
    out = fn(*args, **kwargs)
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    grads = None
    diff = [o for o in outs if o.requires_grad and o.is_floating_point()]
    tensors = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
    if diff and tensors:
        loss = sum((o * _cotangent(o)).sum() for o in diff)
        grads = torch.autograd.grad(loss, tensors, allow_unused=True)
    return [o.detach() for o in outs], grads


def _cotangent(o):
    """A fixed random cotangent for output ``o`` (broadcast on ``o``'s placement if global)."""
    g = torch.Generator().manual_seed(o.numel())
    c = torch.randn(o.shape, generator=g, dtype=o.dtype)
    if o.is_global:
        return gt.tensor(c, placement=o.placement, sbp=[B] * o.placement.ndim)
    return c


# results that depend on the storage, which a global tensor (contiguous by definition) has not:
# uninitialised memory, and strides into a partial view's storage
STORAGE_OPS = ("as_strided", "empty", "empty_like", "new_empty", "new_empty_strided",
               "empty_strided", "empty_permuted", "as_strided_scatter")


class _SeenRandom(TorchDispatchMode):
    """Notes whether any aten op it sees draws random values (torch's nondeterministic_seeded)."""

    def __init__(self):
        super().__init__()
        self.seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen = self.seen or torch.Tag.nondeterministic_seeded in func.tags
        return func(*args, **(kwargs or {}))


def _is_random(fn, leaves, spec) -> bool:
    """Whether the op draws random values: torch's (seeded by OpInfo) and ours cannot agree."""
    copies = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in leaves]
    args, kwargs = tree_unflatten(copies, spec)
    with torch.no_grad(), _SeenRandom() as mode:
        fn(*args, **kwargs)
    return mode.seen


def sweep(opinfo, samples: int = 2) -> list[tuple[str, str, str]]:
    """(sample index, layout, status) for ``opinfo``'s first samples on every layout."""
    if opinfo.name in STORAGE_OPS:
        return [("*", "*", "skip")]
    cases = [c for c in opinfo_samples(opinfo, samples) if all(
        x.layout == torch.strided for x in tree_flatten((c.input, c.args, c.kwargs))[0]
        if isinstance(x, torch.Tensor))]  # sparse inputs: to_global says they are unsupported
    expected = []
    for sample in cases:
        leaves, spec = tree_flatten(((sample.input,) + tuple(sample.args), dict(sample.kwargs)))
        try:
            if _is_random(opinfo.op, leaves, spec):
                return [("*", "*", "random")]
            ref = _reference(opinfo.op, leaves, spec)
        except Exception:  # noqa: BLE001 - torch itself rejects the sample
            ref = None
        expected.append((leaves, spec, ref))

    def body(rank):
        from helpers import make_global

        statuses = []
        for i, (leaves, spec, ref) in enumerate(expected):
            if ref is None:
                continue
            for how in LAYOUTS:
                statuses.append((str(i), how, _one(opinfo, leaves, spec, ref, how, rank, make_global)))
        return statuses

    try:
        return run_ranks(body, 2, timeout=60)[0]
    except RanksHung:
        return [("*", "*", "hang")]
    except RankFailed as e:
        return [("*", "*", f"raise {str(e).splitlines()[0][:120]}")]


def globals_of(leaves, sbp_of, grid, rank, make_global) -> list:
    """``leaves`` with their n-th tensor as a global tensor laid out ``sbp_of(t, n)`` on
    ``grid`` (requiring grad where the sample's does)."""
    glob = list(leaves)
    tensor_ks = [k for k, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    for n, k in enumerate(tensor_ks):
        t = leaves[k].detach()
        g = make_global(t, Layout(grid, sbp_of(t, n), t.shape), rank)
        if leaves[k].requires_grad:
            g.requires_grad_()
        glob[k] = g
    return glob


def _one(opinfo, leaves, spec, ref, how, rank, make_global) -> str:
    glob = globals_of(leaves, lambda t, n: _sbp(t, n, how), GRID, rank, make_global)
    return _one_global(opinfo, glob, spec, ref)


def _one_global(opinfo, glob, spec, ref) -> str:
    """Run ``opinfo.op`` on the leaves ``glob`` (global tensors laid out) and compare with
    ``ref`` (outputs and gradients on the full tensors): "ok", "error ...", "raise ..." or
    "WRONG ..."."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got, grads = _reference(opinfo.op, glob, spec)
            got = [o.full_tensor() if o.is_global else o for o in got]
            grads = None if grads is None else [
                None if g is None else (g.full_tensor() if g.is_global else g) for g in grads]
    except GlobalTensorError as e:
        return f"error {str(e).splitlines()[0][:150]}"
    except Exception as e:  # noqa: BLE001
        return f"raise {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
    want, want_grads = ref
    if len(got) != len(want) or any(not _close(g, w) for g, w in zip(got, want)):
        return "WRONG value"
    try:  # without autograd the layouts are chosen with no backward to price
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            plain, _ = _reference(opinfo.op, glob, spec)
            plain = [o.full_tensor() if o.is_global else o for o in plain]
    except Exception as e:  # noqa: BLE001
        return f"raise under no_grad {type(e).__name__}: {str(e).splitlines()[0][:100]}"
    if len(plain) != len(want) or any(not _close(g, w) for g, w in zip(plain, want)):
        return "WRONG value under no_grad"
    if (want_grads is None) != (grads is None):
        return "WRONG gradient presence"
    if want_grads is not None:
        for g, w in zip(grads, want_grads):
            if (g is None) != (w is None) or (w is not None and not _close(g, w)):
                return "WRONG gradient"
    return "ok"


def _close(a, b) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == torch.bool or not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    if a.is_floating_point() and a.dtype.itemsize == 1:  # float8: allclose has no CPU kernel
        a, b = a.float(), b.float()
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.slow
def test_no_opinfo_sample_gives_a_silent_wrong_result():
    wrong = []
    for opinfo in op_db():
        for i, how, status in sweep(opinfo):
            if status.startswith("WRONG"):
                wrong.append(f"{opinfo.name} sample {i} {how}: {status}")
    assert not wrong, f"{len(wrong)} silent wrong results:\n" + "\n".join(wrong)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="", help="op names separated by commas (default: all)")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--verbose", action="store_true", help="show the clear errors too")
    args = ap.parse_args()
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    names = set(filter(None, args.ops.split(",")))
    totals = collections.Counter()
    for opinfo in op_db():
        if names and opinfo.name not in names:
            continue
        results = sweep(opinfo, args.samples)
        kinds = collections.Counter(s.split(" ")[0] for _, _, s in results)
        totals.update(kinds)
        bad = [f"{i}/{how}: {s}" for i, how, s in results if not s.startswith("ok")
               and (args.verbose or not s.startswith("error"))]
        print(f"{opinfo.name:32} {dict(kinds)}" + (f"  {bad[:3]}" if bad else ""), flush=True)
    print("total:", dict(totals))
    return 1 if totals["WRONG"] else 0


if __name__ == "__main__":
    sys.exit(main())
