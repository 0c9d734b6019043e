"""In-place ops, copy_, clone/detach/.to(dtype), *_like, foreach ops and torch.optim on global
tensors; clear errors for mixed placements and local tensors; the broadcast fallback."""
import sys
import threading
import warnings

import pytest
import torch

import globaltensor as gt
from globaltensor import _cache
from globaltensor.errors import GlobalTensorError
from globaltensor.layout import Layout
from globaltensor.testing import RankFailed, run_ranks

from helpers import G2, G22, gen, make_global

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
X46, Y46 = gen(4, 6), gen(4, 6, seed=1)


def on(grid, sbp, full, rank):
    return make_global(full, Layout(grid, sbp, full.shape), rank)


@pytest.mark.parametrize("self_sbp,other_sbp", [
    ((S(0),), (B,)), ((B,), (S(1),)), ((P,), (P,)), ((P,), (B,)), ((S(1),), (P,)), ((B,), (P,)),
], ids=str)
def test_inplace_add_keeps_self_layout(self_sbp, other_sbp):
    def body(rank):
        x = on(G2, self_sbp, X46, rank)
        y = on(G2, other_sbp, Y46, rank)
        before = x._local
        out = x.add_(y, alpha=2).mul_(3)
        return out is x, x._local is before, x.sbp, x.full_tensor()

    for same, same_piece, sbp, full in run_ranks(body, 2, timeout=30):
        assert same and same_piece and sbp == self_sbp
        torch.testing.assert_close(full, (X46 + 2 * Y46) * 3)


def test_inplace_on_2d_grid_and_fill_zero():
    def body(rank):
        x = on(G22, (S(0), P), X46, rank)
        x.mul_(2)
        a = x.full_tensor()
        x.fill_(1.5)
        b = x.full_tensor()
        x.zero_()
        return a, b, x.full_tensor(), x.sbp

    for a, b, c, sbp in run_ranks(body, 4, timeout=30):
        assert sbp == (S(0), P)
        torch.testing.assert_close(a, X46 * 2)
        torch.testing.assert_close(b, torch.full((4, 6), 1.5, dtype=torch.float64))
        torch.testing.assert_close(c, torch.zeros(4, 6, dtype=torch.float64))


@pytest.mark.parametrize("dst_sbp,src_sbp", [((S(0),), (B,)), ((P,), (S(1),)), ((B,), (P,))], ids=str)
def test_copy_takes_the_value_into_the_target_layout(dst_sbp, src_sbp):
    def body(rank):
        x = on(G2, dst_sbp, X46, rank)
        x.copy_(on(G2, src_sbp, Y46, rank))
        return x.sbp, x.full_tensor()

    for sbp, full in run_ranks(body, 2, timeout=30):
        assert sbp == dst_sbp
        torch.testing.assert_close(full, Y46)


def test_clone_detach_to_dtype_and_like():
    def body(rank):
        x = on(G22, (S(1), P), X46, rank)
        c, d = x.clone(), x.detach()
        f = x.to(torch.float32)
        z, o = torch.zeros_like(x), torch.ones_like(x)
        e = torch.empty_like(x)
        return (c.sbp, d.sbp, f.dtype, f.sbp, z.sbp, o.sbp, e.shape,
                c.full_tensor(), f.full_tensor(), o.full_tensor(), z.full_tensor())

    for cs, ds, fd, fs, zs, os_, es, c, f, o, z in run_ranks(body, 4, timeout=30):
        assert cs == ds == fs == (S(1), P) and fd == torch.float32
        assert zs == os_ == (S(1), B) and es == torch.Size([4, 6])  # a *_like of P is a new full value
        torch.testing.assert_close(c, X46)
        torch.testing.assert_close(f, X46.float())
        assert torch.equal(o, torch.ones(4, 6, dtype=torch.float64)) and not z.any()


def test_to_int_of_partial_is_reduced_first():
    full = torch.tensor([[1.75, 2.5], [0.6, -3.2]], dtype=torch.float64)

    def body(rank):
        x = on(G2, (P,), full, rank)
        y = x.to(torch.int64)
        return y.sbp, y.full_tensor()

    for sbp, y in run_ranks(body, 2, timeout=30):
        assert sbp != (P,)
        assert torch.equal(y, full.to(torch.int64))


def test_rand_like_same_values_for_any_layout():
    def values(sbp):
        def body(rank):
            gt.manual_seed(1)
            x = on(G22, sbp, X46, rank)
            return torch.rand_like(x).full_tensor(), torch.randn_like(x).full_tensor()
        return run_ranks(body, 4, timeout=30)[0]

    a, b = values((B, B)), values((S(0), S(1)))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert 0 <= a[0].min() and a[0].max() < 1


def test_uniform_and_normal_inplace_are_consistent_on_replicas():
    def body(rank):
        gt.manual_seed(2)
        x = on(G22, (B, S(0)), X46, rank)
        x.uniform_(-1, 1)
        y = on(G22, (B, S(0)), X46, rank).normal_(2.0, 0.5)
        return x.to_local().clone(), x.full_tensor(), y.full_tensor()

    out = run_ranks(body, 4, timeout=30)
    assert torch.equal(out[0][0], out[2][0]) and torch.equal(out[1][0], out[3][0])  # B replicas
    assert -1 <= out[0][1].min() and out[0][1].max() < 1
    assert abs(out[0][2].mean().item() - 2.0) < 0.5


@pytest.mark.parametrize("opt", ["SGD", "Adam", "AdamW"])
@pytest.mark.parametrize("foreach", [False, True])
def test_optimizers_match_local_training(opt, foreach):
    w0, g = gen(4, 6), gen(4, 6, seed=9)
    kwargs = {"lr": 0.1, "foreach": foreach}
    if opt == "SGD":
        kwargs["momentum"] = 0.9
    else:
        kwargs["weight_decay"] = 0.01

    ref = w0.clone().requires_grad_()
    ref_opt = getattr(torch.optim, opt)([ref], **kwargs)
    for step in range(3):
        ref.grad = g * (step + 1)
        ref_opt.step()

    def body(rank):
        w = on(G22, (S(0), B), w0, rank).requires_grad_()
        o = getattr(torch.optim, opt)([w], **kwargs)
        for step in range(3):
            w.grad = on(G22, (S(0), B), g * (step + 1), rank)
            o.step()
        return w.sbp, w.detach().full_tensor()

    for sbp, w in run_ranks(body, 4, timeout=60):
        assert sbp == (S(0), B)
        torch.testing.assert_close(w, ref.detach())


def test_foreach_ops_directly():
    def body(rank):
        xs = [on(G2, (S(0),), X46, rank), on(G2, (B,), Y46, rank)]
        ys = [on(G2, (B,), Y46, rank), on(G2, (S(1),), X46, rank)]
        torch._foreach_add_(xs, ys, alpha=2)
        torch._foreach_mul_(xs, 0.5)
        s = torch._foreach_sqrt([x.abs() for x in xs])
        return [x.sbp for x in xs], [x.full_tensor() for x in xs], [t.full_tensor() for t in s]

    for sbps, xs, s in run_ranks(body, 2, timeout=30):
        assert sbps == [(S(0),), (B,)]
        torch.testing.assert_close(xs[0], (X46 + 2 * Y46) * 0.5)
        torch.testing.assert_close(xs[1], (Y46 + 2 * X46) * 0.5)
        torch.testing.assert_close(s[0], xs[0].abs().sqrt())


def test_foreach_on_alike_layouts_runs_once_on_the_pieces():
    """An optimizer-style foreach call (each element's tensors laid out alike, no partial sum)
    runs one local foreach kernel, not one dispatch per element; a partial-sum element sends
    the call through the per-element path. Values match the full tensors either way."""
    import collections
    import threading
    from unittest import mock

    from globaltensor.dispatch import special

    X5, Y5 = gen(5, 6, seed=3), gen(5, 6, seed=4)  # uneven rows on 2 ranks
    per_element = collections.Counter()  # thread -> runs of the per-element path
    original = special._foreach_base

    def counting(func):
        per_element[threading.get_ident()] += 1
        return original(func)

    def body(rank):
        me = threading.get_ident()
        runs = []
        for _ in range(2):  # the second call finds the decision cached
            xs = [on(G2, (S(0),), X5, rank), on(G2, (B,), X46, rank)]
            ys = [on(G2, (S(0),), Y5, rank), on(G2, (B,), Y46, rank)]
            before = per_element[me]
            torch._foreach_addcmul_(xs, ys, ys, value=0.5)
            torch._foreach_lerp_(xs, ys, 0.25)
            out = torch._foreach_mul(xs, 3.0)
            runs.append(per_element[me] - before)
        ps = [on(G2, (P,), X46, rank)]
        before = per_element[me]
        torch._foreach_mul_(ps, 2.0)  # linear: right either way, but through each element
        torch._foreach_mul_(ps, 2.0)
        return (runs, per_element[me] - before, [x.sbp for x in xs], [o.sbp for o in out],
                [x.full_tensor() for x in xs], [o.full_tensor() for o in out], ps[0].full_tensor())

    with mock.patch.object(special, "_foreach_base", counting):
        results = run_ranks(body, 2, timeout=30)
    for runs, partial_runs, sbps, out_sbps, xs, out, p in results:
        assert runs[1] == 0 and partial_runs >= 2
        assert sbps == out_sbps == [(S(0),), (B,)]
        for x, y, got, got_out in ((X5, Y5, xs[0], out[0]), (X46, Y46, xs[1], out[1])):
            want = torch.lerp(x + 0.5 * y * y, y, 0.25)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(got_out, want * 3.0)
        torch.testing.assert_close(p, X46 * 4)


def test_clip_grad_norm_takes_the_foreach_path_and_matches():
    """Global tensors are among torch's foreach-supported types (as DTensor): clip_grad_norm_
    runs _foreach_norm and a _foreach_mul_ by a global scalar, and matches one process."""
    W, Gr = [gen(5, 4, seed=5), gen(3, seed=6)], [gen(5, 4, seed=7), gen(3, seed=8)]
    ref = [w.clone().requires_grad_() for w in W]
    for r, g in zip(ref, Gr):
        r.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    from torch.utils._foreach_utils import _foreach_supported_types
    assert gt.GlobalTensor in _foreach_supported_types

    def body(rank):
        ws = []
        for w, g, sbp in zip(W, Gr, ((S(0),), (B,))):
            x = on(G2, sbp, w, rank).requires_grad_()
            x.grad = on(G2, sbp, g, rank)
            ws.append(x)
        n = torch.nn.utils.clip_grad_norm_(ws, 1.0)
        return n.full_tensor(), [w.grad.full_tensor() for w in ws]

    for n, grads in run_ranks(body, 2, timeout=30):
        torch.testing.assert_close(n, norm)
        for g, r in zip(grads, ref):
            torch.testing.assert_close(g, r.grad)


def test_mixing_placements_is_a_clear_error():
    def body(rank):
        x = on(G2, (B,), X46, rank)
        y = on(gt.placement("cpu", [1, 0]), (B,), Y46, rank)
        return x + y

    with pytest.raises(RankFailed, match="expected global tensors of one placement, found 2"):
        run_ranks(body, 2, timeout=30)


def test_a_non_scalar_local_tensor_is_a_clear_error_and_a_scalar_is_fine():
    def body(rank):
        x = on(G2, (S(0),), X46, rank)
        ok = (x * torch.tensor(2.0, dtype=torch.float64)).full_tensor()
        try:
            x + Y46
        except GlobalTensorError as e:
            return ok, str(e)
        return ok, None

    for ok, msg in run_ranks(body, 2, timeout=30):
        torch.testing.assert_close(ok, X46 * 2)
        assert msg is not None and "local tensor of shape [4, 6]" in msg and "to_global" in msg


def test_op_without_rule_runs_on_broadcast():
    full = torch.tensor([3.0, 1.0, 2.0, 5.0, 4.0])

    def body(rank):
        x = on(G2, (S(0),), full, rank)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a = torch.flip(x, [0])
        return a.sbp, a.full_tensor()

    for sbp, a in run_ranks(body, 2, timeout=30):
        assert sbp == (B,) and torch.equal(a, full.flip(0))


@torch.library.custom_op("gt_tests::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    """An op no rule will ever cover (ops of torch's own get rules over time)."""
    return x * 2


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


def test_op_without_rule_warns_once_naming_the_op_at_the_users_line():
    two = gt.placement("cpu", [1, 0])
    line = {}
    decided = threading.Event()

    def body(rank):
        x = on(two, (B,), torch.arange(4.0), rank)
        if rank == 0:  # thread-ranks share the process's decisions: rank 1 makes this one, and
            decided.wait(30)  # rank 0 (the placement's first rank) still warns, at its own call
        line["call"] = sys._getframe().f_lineno + 1
        first = _twice(x)
        decided.set()
        _twice(x * 2)
        return first.full_tensor()

    _cache.clear_all()
    with warnings.catch_warnings(record=True) as caught:  # the ranks' threads warn here
        warnings.simplefilter("always")
        values = run_ranks(body, 2, timeout=30)
    twice = [w for w in caught if "twice" in str(w.message)]
    assert len(twice) == 1  # once, by the placement's first rank (0), not once per rank
    msg = str(twice[0].message)
    assert "no SBP rule for gt_tests.twice.default" in msg and "by rank 0" in msg
    assert "gt.ops.register('gt_tests::twice.default', rule=...)" in msg  # a key that matches
    assert (twice[0].filename, twice[0].lineno) == (__file__, line["call"])
    for value in values:
        torch.testing.assert_close(value, torch.arange(4.0) * 2)


def test_no_communication_for_matching_layouts():
    def body(rank):
        x = on(G22, (S(0), S(1)), X46, rank)
        w = on(G22, (B, S(0)), gen(6, 3, seed=2), rank)
        y = x @ w
        return y.sbp, y._local.shape

    out = run_ranks(body, 4, timeout=30)
    assert out[0][0] == (S(0), P) and out[0][1] == torch.Size([2, 3])


def test_ranks_outside_the_placement_hold_empty_pieces():
    sub = gt.placement("cpu", [0, 1])

    def body(rank):
        x = on(sub, (S(0),), X46, rank)
        w = on(sub, (B,), gen(6, 3, seed=2), rank)
        y = torch.relu(x @ w).reshape(-1).sum()
        return y.shape, y.to_local().shape, y.full_tensor()

    out = run_ranks(body, 3, timeout=30)
    expected = torch.relu(X46 @ gen(6, 3, seed=2)).sum()
    for rank, (shape, local, full) in enumerate(out):
        assert shape == torch.Size([])
        torch.testing.assert_close(full, expected)
    assert out[2][1] == torch.Size([])
