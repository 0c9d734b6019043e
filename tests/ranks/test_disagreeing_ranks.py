"""On thread-ranks with real gloo groups: ranks that disagree
on a tensor never crash gloo nor read garbage, gt.comm's torch-style calls on views, rank-valued
arguments checked at the call."""
import pytest
import torch

import globaltensor as gt
from globaltensor.runtime import layoutcheck
from globaltensor.testing import run_ranks

from helpers import error_or_none

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
P3 = lambda: gt.placement("cpu", [0, 1, 2])  # noqa: E731


# --- 1. ranks that disagree on shape or dtype, GT_DEBUG off ----------------------------------


def _disagreeing(rank, case):
    p = P3()
    if case == "dtype":
        x = gt.ones(8, dtype=torch.float64 if rank == 1 else torch.float32, placement=p, sbp=S(0))
        return x.to_global(sbp=B)
    if case == "shape":
        return gt.arange(7 if rank == 0 else 6, placement=p, sbp=S(0)).to_global(sbp=B)
    if case == "P->B":  # an all_reduce: pieces of 5 or 4 elements
        return gt.ones(5 if rank == 2 else 4, placement=p, sbp=P).to_global(sbp=B)
    if case == "S->S":  # an all_to_all through gloo's collective
        x = gt.ones(6, 6 if rank == 1 else 3, placement=p, sbp=S(0))
        return x.to_global(sbp=S(1))
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["dtype", "shape", "P->B", "S->S"])
def test_ranks_that_disagree_get_the_same_error_never_a_crash_or_garbage(case):
    def body(rank):
        return error_or_none(lambda: _disagreeing(rank, case))

    out = run_ranks(body, 3, timeout=60)
    assert all(o is not None and o[0] == "ShapeMismatchError" for o in out), out
    assert len({o[1] for o in out}) == 1, out  # the same text on every rank
    msg = out[0][1]
    assert msg.startswith("to_global: ranks disagree on the global tensor they redistribute")
    if case == "dtype":
        assert "ranks [0, 2]: float32 Layout(" in msg and "ranks [1]: float64 Layout(" in msg
    if case == "shape":
        assert "ranks [0]: int64 Layout(placement('cpu', ranks=[0, 1, 2]), (S(0),), [7])" in msg
        assert "ranks [1, 2]: int64 Layout(placement('cpu', ranks=[0, 1, 2]), (S(0),), [6])" in msg


def test_disagreeing_ranks_twenty_times_in_a_row():
    """The serious case 20 times (a fresh world each time, as a fresh job): never a value."""
    def body(rank, case):
        return error_or_none(lambda: _disagreeing(rank, case))

    for i in range(20):
        case = ("dtype", "shape")[i % 2]
        out = run_ranks(body, 3, case, timeout=60)
        assert [o[0] for o in out] == ["ShapeMismatchError"] * 3, (i, out)


def test_agreeing_ranks_check_a_plan_once_and_values_stay_right():
    """A correct program: the first run of a plan exchanges records, later runs none; values
    are the full tensor's."""
    def body(rank):
        p = P3()
        x = gt.arange(7, placement=p, sbp=S(0))
        before = len(layoutcheck._seen_in_world())
        values = [x.to_global(sbp=B).to_local().tolist() for _ in range(3)]
        y = x.double().to_global(sbp=B)  # another dtype: its own first use
        return values, y.to_local().tolist(), len(layoutcheck._seen_in_world()) - before

    for values, y, added in run_ranks(body, 3, timeout=60):
        assert values == [list(range(7))] * 3
        assert y == [float(v) for v in range(7)]
        assert added == 2  # (plan, int64) and (plan, float64): once each


def test_data_tags_differ_per_dtype_and_layout():
    from globaltensor.layout import Layout
    from globaltensor.plan import plan
    p = gt.placement("cpu", [0, 1])
    a = plan(Layout(p, (S(0),), (8,)), Layout(p, (B,), (8,)))
    b = plan(Layout(p, (S(0),), (6,)), Layout(p, (B,), (6,)))
    tags = {layoutcheck.data_tag(a, torch.float32), layoutcheck.data_tag(a, torch.float64),
            layoutcheck.data_tag(b, torch.float32)}
    assert len(tags) == 3
    assert all(t % 2 == 0 and 2 <= t < layoutcheck.CHECK_TAG - 1 for t in tags)


# --- 2. torch-style in-place calls on non-contiguous views -------------------------------------


def test_torch_style_calls_on_views_write_only_the_view_with_the_right_values():
    def body(rank):
        out = {}
        base = torch.arange(8.0) + rank
        view = base[::2]
        returned = gt.comm.all_reduce(view)
        out["all_reduce"] = (returned is view, base.tolist())
        base = torch.arange(8.0) * (rank + 1)
        gt.comm.broadcast(base[1::2], src=1)
        out["broadcast"] = base.tolist()
        base = torch.zeros(3, 4)
        gt.comm.all_gather_into_tensor(base[:, ::2], torch.full((1, 2), rank + 1.0))
        out["all_gather_into_tensor"] = base.tolist()
        base = torch.full((6,), -1.0)
        work = gt.comm.all_reduce(base[1::2], async_op=True)
        work.wait()
        out["async"] = base.tolist()
        base = torch.zeros(2, 2)
        gt.comm.reduce_scatter_tensor(base[:, 1], torch.arange(6.0) * (rank + 1))
        out["reduce_scatter_tensor"] = base.tolist()
        return out

    for rank, out in enumerate(run_ranks(body, 3, timeout=60)):
        assert out["all_reduce"] == (True, [3.0, 1 + rank, 9.0, 3 + rank, 15.0, 5 + rank, 21.0,
                                            7 + rank])
        assert out["broadcast"] == [0.0 * (rank + 1), 2, 2.0 * (rank + 1), 6,
                                    4.0 * (rank + 1), 10, 6.0 * (rank + 1), 14]
        assert out["all_gather_into_tensor"] == [[1.0, 0, 1, 0], [2.0, 0, 2, 0], [3.0, 0, 3, 0]]
        assert out["async"] == [-1.0, -3.0] * 3
        assert out["reduce_scatter_tensor"] == [[0.0, 12.0 * rank], [0.0, 12.0 * rank + 6]]


def test_recv_into_a_view_and_the_views_twenty_times():
    def body(rank):
        got = []
        for i in range(20):
            buf = torch.zeros(6)
            if rank == 0:
                gt.comm.send(torch.tensor([1.0, 2.0, 3.0]) + i, dst=1)
            elif rank == 1:
                gt.comm.recv(buf[::2], src=0)
            base = torch.arange(6.0) + rank
            gt.comm.all_reduce(base[::3])
            got.append((buf.tolist(), base.tolist()))
        return got

    for rank, got in enumerate(run_ranks(body, 2, timeout=60)):
        for i, (buf, base) in enumerate(got):
            assert buf == ([1.0 + i, 0, 2.0 + i, 0, 3.0 + i, 0] if rank == 1 else [0.0] * 6)
            assert base == [1.0, 1 + rank, 2 + rank, 7.0, 4 + rank, 5 + rank]


# --- 3. rank-valued arguments checked at the call -----------------------------------------------


@pytest.mark.parametrize("call,words", [
    (lambda r: gt.comm.send(torch.ones(2), dst=99), "expected dst in [0, 3) (the world size), found dst=99"),
    (lambda r: gt.comm.send(torch.ones(2), dst=-1), "found dst=-1"),
    (lambda r: gt.comm.recv(torch.ones(2), src=-1), "expected src in [0, 3)"),
    (lambda r: gt.comm.isend(torch.ones(2), dst=99), "found dst=99"),
    (lambda r: gt.comm.irecv(torch.ones(2), src=99), "found src=99"),
    (lambda r: gt.comm.isend(torch.ones(2), dst=r), "another rank than this one"),
    (lambda r: gt.comm.send("obj", dst=7), "found dst=7"),
    (lambda r: gt.comm.recv(src=5), "found src=5"),
    (lambda r: gt.comm.broadcast({"a": 1}, src=-1), "found src=-1"),
    (lambda r: gt.comm.broadcast(torch.ones(2), src=3), "found src=3"),
    (lambda r: gt.comm.reduce(torch.ones(2), dst=1.5), "expected dst to be an int, found 1.5"),
    (lambda r: gt.comm.gather(torch.ones(2), dst=9), "found dst=9"),
    (lambda r: gt.comm.scatter(torch.ones(2), src=True), "expected src to be an int, found True"),
    (lambda r: gt.comm.send(torch.ones(2), group_dst=4), "expected group_dst in [0, 3)"),
    (lambda r: gt.comm.send(torch.ones(2), dst=(r + 1) % 3, tag=-1), "expected tag in [0, 2147483648)"),
], ids=["send 99", "send -1", "recv -1", "isend", "irecv", "self", "send obj", "recv obj",
        "broadcast obj", "broadcast", "reduce", "gather", "scatter", "group_dst", "tag"])
def test_rank_arguments_are_checked_at_once_on_every_rank(call, words):
    import time

    def body(rank):
        start = time.monotonic()
        return error_or_none(lambda: call(rank)), time.monotonic() - start

    for (err, took) in run_ranks(body, 3, timeout=60):
        assert err is not None and err[0] == "GlobalTensorError" and words in err[1], err
        assert took < 5


def test_a_rank_outside_a_subgroup_is_named():
    def body(rank):
        group = torch.distributed.new_group([0, 1])
        if rank == 2:
            return None
        return error_or_none(lambda: gt.comm.reduce(torch.ones(2), dst=2, group=group))

    out = run_ranks(body, 3, timeout=60)
    for err in out[:2]:
        assert "expected dst to be the global rank of a member of the group [0, 1], found dst=2" \
            in err[1]


# --- 4. GT_DEBUG: numbers take part in the agreement where an input is B or P --------------------


@pytest.mark.parametrize("sbp", [B, P], ids=["B", "P"])
def test_debug_names_a_per_rank_float_on_a_replicated_input(sbp):
    def body(rank):
        gt.set_debug(True, timeout=20)
        x = gt.ones(4, placement=P3(), sbp=sbp)
        return error_or_none(lambda: x * (3.0 if rank == 1 else 2.0))

    out = run_ranks(body, 3, timeout=60)
    assert [o[0] for o in out] == ["RankMismatchError"] * 3, out
    assert len({o[1] for o in out}) == 1
    assert "aten.mul.Tensor(" in out[0][1] and "rank 1 differs" in out[0][1]
    assert "3.0" in out[0][1] and "2.0" in out[0][1]


def test_debug_still_lets_a_split_input_take_a_per_rank_float_and_agreeing_floats_pass():
    def body(rank):
        gt.set_debug(True, timeout=20)
        y = gt.ones(6, placement=P3(), sbp=S(0)) * (rank + 1.0)  # per-rank scale on pieces
        z = gt.ones(3, placement=P3(), sbp=B) * 2.5  # the same on every rank
        return y.full_tensor().tolist(), z.full_tensor().tolist()

    for _ in range(20):
        for y, z in run_ranks(body, 3, timeout=60):
            assert y == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0] and z == [2.5] * 3
