"""On thread-ranks with real gloo groups:
dtypes gloo cannot move by type, random factories with integer dtypes, grad_sbp's placement,
exact integer sums in value style, fill with a global 0-dim value, the gradient of an empty
leaf, and the raw errors that became GlobalTensorErrors."""
import math

import pytest
import torch

import globaltensor as gt
from globaltensor.testing import run_ranks

from helpers import error_or_none

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
P2 = lambda: gt.placement("cpu", [0, 1])  # noqa: E731

ODD = [torch.int16, torch.uint16, torch.uint32, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("collectives", ["p2p", "gloo"])
def test_dtypes_gloo_rejects_are_moved_as_bytes(collectives, monkeypatch):
    monkeypatch.setenv("GT_CPU_COLLECTIVES", collectives)
    full = torch.arange(16.0).view(4, 4)

    def body(rank):
        out = {}
        for dt in ODD:
            x = gt.tensor(full.to(dt), placement=P2(), sbp=S(0))
            out[str(dt)] = (x.to_global(sbp=S(1)).full_tensor().float().tolist(),  # all_to_all
                            x.to_global(sbp=B).to_local().float().tolist(),  # gather
                            full.to(dt).to_global(placement=P2(), sbp=B).to_local().float().tolist())
        return out

    for out in run_ranks(body, 2, timeout=60):
        for dt in ODD:
            assert out[str(dt)] == (full.to(dt).float().tolist(),) * 3, dt


def test_partial_sums_of_dtypes_torch_cannot_add_are_named_and_int16_sums():
    def body(rank):
        x = gt.ones(4, dtype=torch.uint16, placement=P2(), sbp=P)
        err = error_or_none(lambda: x.to_global(sbp=B))
        y = gt.ones(4, dtype=torch.int16, placement=P2(), sbp=P).to_global(sbp=S(0))
        return err, y.full_tensor().tolist()

    for err, y in run_ranks(body, 2, timeout=60):
        assert err[0] == "GlobalTensorError" and "torch cannot add torch.uint16" in err[1]
        assert "cast first" in err[1]
        assert y == [1, 1, 1, 1]  # P of ones on 2 ranks: rank 0 holds the value, rank 1 zeros


@pytest.mark.parametrize("fn", ["rand", "randn"])
def test_random_factories_refuse_integer_dtypes_as_torch_does(fn):
    with pytest.raises(RuntimeError):
        getattr(torch, fn)(3, dtype=torch.int64)

    def body(rank):
        return error_or_none(lambda: getattr(gt, fn)(3, dtype=torch.int64, placement=P2(), sbp=B))

    for err in run_ranks(body, 2, timeout=60):
        assert err[0] == "GlobalTensorError" and "expects a floating point dtype" in err[1]


def test_grad_sbp_is_checked_on_the_input_placement_where_backward_applies_it():
    grid = lambda: gt.placement("cpu", [[0, 1]])  # noqa: E731

    def body(rank):
        x = gt.ones(4, placement=P2(), sbp=S(0), requires_grad=True)
        seen = []
        x.register_hook(lambda g: seen.append(g.sbp))  # the gradient as backward made it
        y = x.to_global(placement=grid(), sbp=(B, B), grad_sbp=B)  # one value: x's placement
        (y * 3).sum().backward()
        bad = error_or_none(lambda: x.to_global(placement=grid(), sbp=(B, B), grad_sbp=(B, B)))
        return seen[0], x.grad.full_tensor().tolist(), bad

    for sbp, grad, bad in run_ranks(body, 2, timeout=60):
        assert sbp == (B,) and grad == [3.0] * 4
        assert bad[0] == "SbpError" and "on the input's placement placement('cpu', ranks=[0, 1])" \
            in bad[1]


def test_value_style_all_reduce_of_python_ints_is_exact_above_2_53():
    big = 2 ** 53 + 1

    def body(rank):
        return (gt.comm.all_reduce(big, reduce_op="sum"),
                gt.comm.all_reduce({"a": big + rank, "b": 1.5}, reduce_op="max"),
                gt.comm.all_reduce(big - 2 * rank, reduce_op="min"),
                gt.comm.all_reduce(3 if rank else 2.5, reduce_op="sum"),  # an int and a float
                gt.comm.all_reduce(torch.tensor(big), reduce_op="sum").item())

    for rank, out in enumerate(run_ranks(body, 3, timeout=60)):
        assert out[0] == 3 * big and isinstance(out[0], int)
        assert out[1] == {"a": big + 2, "b": 1.5}
        assert out[2] == big - 4
        assert out[3] == (8.5 if rank == 0 else 8)  # the caller's own type
        assert out[4] == 3 * big


@pytest.mark.parametrize("value_sbp", [B, P], ids=["B", "P"])
def test_fill_and_slice_assignment_with_a_global_0_dim_value(value_sbp):
    def body(rank):
        v = gt.tensor(3.0, placement=P2(), sbp=value_sbp)
        y = gt.zeros(4, placement=P2(), sbp=S(0))
        y.fill_(v)
        z = gt.zeros(5, placement=P2(), sbp=S(0))
        z[1:3] = v
        return y.full_tensor().tolist(), z.full_tensor().tolist()

    for y, z in run_ranks(body, 2, timeout=60):
        assert y == [3.0] * 4 and z == [0.0, 3.0, 3.0, 0.0, 0.0]


@pytest.mark.parametrize("sbp", [S(0), B], ids=["S0", "B"])
def test_the_gradient_of_an_empty_global_leaf_is_global(sbp):
    def body(rank):
        w = gt.zeros(0, placement=gt.placement.all("cpu"), sbp=sbp, requires_grad=True)
        (w * 2).sum().backward()
        return type(w.grad).__name__, w.grad.sbp, tuple(w.grad.shape)

    for out in run_ranks(body, 3, timeout=60):
        assert out == ("GlobalTensor", (sbp,), (0,))


@pytest.mark.parametrize("sbp", [S(0), B, P], ids=["S0", "B", "P"])
def test_the_gradient_of_an_empty_leaf_skipped_by_cat_is_global(sbp):
    """torch's cat skips a 1-D empty input and its backward builds that input's gradient with
    no global input (zeros({0})): it is still global, in the leaf's own layout (issue 41)."""
    def body(rank):
        placement = gt.placement.all("cpu")
        e = gt.zeros(0, placement=placement, sbp=sbp, requires_grad=True)
        x = gt.ones(4, placement=placement, sbp=S(0), requires_grad=True)
        (torch.cat([e, x]) * 3).sum().backward()
        return (type(e.grad).__name__, e.grad.sbp, tuple(e.grad.shape),
                x.grad.full_tensor().tolist())

    for out in run_ranks(body, 2, timeout=60):
        assert out == ("GlobalTensor", (sbp,), (0,), [3.0] * 4)


_RAW = [
    ("placement 2**70", lambda p, x: gt.placement("cpu", [2 ** 70]), "expected ranks below"),
    ("full 2**70", lambda p, x: gt.full((2,), 2 ** 70, placement=p, sbp=B), "to fit in torch.int64"),
    ("arange inf", lambda p, x: gt.arange(0, math.inf, placement=p, sbp=B), "finite"),
    ("arange nan", lambda p, x: gt.arange(0, math.nan, placement=p, sbp=B), "finite"),
    ("randint 2**70", lambda p, x: gt.randint(0, 2 ** 70, (3,), placement=p, sbp=B), "int64"),
    ("manual_seed", lambda p, x: gt.manual_seed(2 ** 70), "manual_seed expects a seed in"),
    ("requires_grad", lambda p, x: gt.ones(3, placement=p, sbp=B, requires_grad="yes"),
     "expected requires_grad to be True or False, found 'yes'"),
    ("broadcast src", lambda p, x: gt.comm.broadcast(3, src=-1), "found src=-1"),
    ("monitored -1", lambda p, x: gt.comm.monitored_barrier(timeout=-1), "seconds > 0"),
    ("monitored x", lambda p, x: gt.comm.monitored_barrier(timeout="x"), "found 'x' (str)"),
    ("barrier x", lambda p, x: gt.comm.barrier(timeout="x"), "found 'x' (str)"),
    ("ddp None", lambda p, x: gt.nn.parallel.DistributedDataParallel(None), "torch.nn.Module"),
    ("ddp str", lambda p, x: gt.nn.parallel.DistributedDataParallel("str"), "torch.nn.Module"),
    ("bucket -1", lambda p, x: gt.nn.parallel.DistributedDataParallel(
        torch.nn.Linear(2, 2), bucket_cap_mb=-1), "bucket_cap_mb to be a number of MiB > 0"),
    ("bucket 1 MB", lambda p, x: gt.nn.parallel.DistributedDataParallel(
        torch.nn.Linear(2, 2), bucket_cap_mb="x" * 1_000_000), "bucket_cap_mb"),
    ("visualize rows", lambda p, x: gt.visualize(x, rows="a"), "found ['rows']"),
    ("visualize max_rows", lambda p, x: gt.visualize(x, max_rows="a"), "max_rows"),
]


def test_raw_errors_became_global_tensor_errors_on_every_rank_with_short_messages():
    def body(rank):
        p = P2()
        x = gt.ones(4, placement=p, sbp=S(0))
        return [error_or_none(lambda: fn(p, x)) for _, fn, _ in _RAW]

    out = run_ranks(body, 2, timeout=60)
    assert out[0] == out[1]
    for (name, _, words), err in zip(_RAW, out[0]):
        assert err is not None and words in err[1], (name, err)
        assert len(err[1]) < 600, name  # a 1 MB argument does not land in the message


def test_byte_views_of_one_element_with_any_stride_are_views():
    """A contiguous one-element tensor may keep any stride (a slice [::3][:1]); a dtype view
    refuses it, which made the root of a placement change's broadcast raise alone (the fuzzer's
    2x2 programs then hung). byte_view restrides it, still a view."""
    from globaltensor.runtime.groups import byte_view
    base = torch.arange(6.0)
    one = base[3::3][:1]
    assert one.is_contiguous() and one.stride() == (3,)
    view = byte_view(one)
    view.zero_()
    assert view.shape == (4,) and base.tolist() == [0.0, 1, 2, 0, 4, 5]  # float32: 4 bytes
    assert byte_view(torch.zeros(0)).shape == (0,)
    assert byte_view(torch.tensor(2.0, dtype=torch.float16)).shape == (2,)
