"""gt.comm on real gloo thread-worlds: torch style (in place), value style, built ops, barriers."""
import functools

import pytest
import torch

import globaltensor as gt
from globaltensor.comm import ReduceOp
from globaltensor.comm import collectives as C
from globaltensor.errors import CollectiveTimeoutError, GlobalTensorError
from globaltensor.testing import RankFailed, run_ranks

T = 30  # seconds before a world counts as hung


def rank_values(rank, dtype=torch.float64):
    """A small tensor that differs per rank, with values where every reduce op is exact."""
    return torch.tensor([rank + 1, 2 * rank + 3, 7 - rank], dtype=dtype)


LOCAL = {  # the expected reduction of rank_values over n ranks, computed locally
    "SUM": lambda xs: functools.reduce(torch.add, xs),
    "PRODUCT": lambda xs: functools.reduce(torch.mul, xs),
    "MIN": lambda xs: functools.reduce(torch.minimum, xs),
    "MAX": lambda xs: functools.reduce(torch.maximum, xs),
    "BAND": lambda xs: functools.reduce(torch.bitwise_and, xs),
    "BOR": lambda xs: functools.reduce(torch.bitwise_or, xs),
    "BXOR": lambda xs: functools.reduce(torch.bitwise_xor, xs),
    "AVG": lambda xs: functools.reduce(torch.add, xs) / len(xs),
}


@pytest.mark.parametrize("n", [1, 3])
def test_torch_style_all_reduce_every_op_in_place(n):
    ops = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG"]

    def body(rank):
        out = {}
        for name in ops:
            dtype = torch.int64 if name.startswith("B") else torch.float64
            t = rank_values(rank, dtype)
            returned = gt.comm.all_reduce(t, op=getattr(ReduceOp, name))
            assert returned is t
            out[name] = t
        return out

    results = run_ranks(body, n, timeout=T)
    for name in ops:
        dtype = torch.int64 if name.startswith("B") else torch.float64
        want = LOCAL[name]([rank_values(r, dtype) for r in range(n)])
        for r in range(n):
            torch.testing.assert_close(results[r][name], want.to(dtype), rtol=0, atol=0)


def test_integer_avg_and_premul_sum_are_built_on_gloo():
    def body(rank):
        a = torch.tensor([3 * rank + 1, 7, -rank])
        gt.comm.all_reduce(a, op=ReduceOp.AVG)  # gloo lacks integer AVG: SUM then truncate
        p = torch.ones(2) * (rank + 1)
        gt.comm.all_reduce(p, op=torch.distributed._make_nccl_premul_sum(2.0))  # gloo lacks it
        w = torch.tensor([5, 6]) * (rank + 1)
        work = gt.comm.all_reduce(w, op="avg", async_op=True)
        work.wait()
        return a.tolist(), p.tolist(), w.tolist()

    out = run_ranks(body, 3, timeout=T)
    assert out == [([4, 7, -1], [12.0, 12.0], [10, 12])] * 3


def test_what_each_op_needs_from_a_backend():
    assert ("gloo", "avg_integer") in C._LACKS and ("nccl", "bitwise") in C._LACKS
    assert C._need(ReduceOp.SUM, torch.int64) is None
    assert C._need(ReduceOp.AVG, torch.float32) is None
    assert C._need(ReduceOp.AVG, torch.int64) == "avg_integer"
    assert C._need(ReduceOp.BXOR, torch.int64) == "bitwise"


def test_reduce_by_gather_for_backends_without_an_op():
    def body(rank):
        t = rank_values(rank, torch.int64)
        C._combine_gathered(t, ReduceOp.BXOR, None)  # how bitwise ops run on NCCL
        return t

    out = run_ranks(body, 3, timeout=T)
    want = LOCAL["BXOR"]([rank_values(r, torch.int64) for r in range(3)])
    assert all(torch.equal(o, want) for o in out)


def test_async_op_returns_work_and_op_names():
    def body(rank):
        t = torch.tensor([float(rank)])
        work = gt.comm.all_reduce(t, op="MAX", async_op=True)
        work.wait()
        s = torch.tensor([1, 2]) + rank
        gt.comm.all_reduce(s, "SUM")  # Ignite's spelling, positional
        return t.item(), s.tolist()

    assert run_ranks(body, 2, timeout=T) == [(1.0, [3, 5])] * 2


def test_value_style_all_reduce_leaves_the_callers_data_alone():
    def body(rank):
        t = torch.tensor([1.0, 2.0]) * (rank + 1)
        mean = gt.comm.all_reduce(t, reduce_op="mean")
        coll = {"loss": torch.tensor(float(rank)), "acc": [torch.tensor([rank, 1]), 2.5], "n": 3}
        summed = gt.comm.all_reduce(coll)  # not one tensor: value style, default sum
        meaned = gt.comm.all_reduce(coll, reduce_op="mean")
        return t, mean, summed, meaned, coll["acc"][0]

    out = run_ranks(body, 4, timeout=T)
    for rank, (t, mean, summed, meaned, int_leaf) in enumerate(out):
        assert t.tolist() == [rank + 1.0, 2.0 * (rank + 1)]          # untouched
        assert mean.tolist() == [2.5, 5.0]
        assert summed["loss"].item() == 6.0 and summed["acc"][0].tolist() == [6, 4]
        assert summed["acc"][1] == 10.0 and summed["n"] == 12 and isinstance(summed["n"], int)
        assert meaned["acc"][0].dtype == torch.get_default_dtype()   # mean of integers is float
        assert meaned["acc"][0].tolist() == [1.5, 1.0] and meaned["n"] == 3.0
        assert isinstance(meaned["acc"], list) and int_leaf.tolist() == [rank, 1]


@pytest.mark.parametrize("op,want", [("sum", 10), ("mean", 2.5), ("max", 4), ("min", 1),
                                     ("prod", 24)])
def test_value_style_numbers(op, want):
    out = run_ranks(lambda r: gt.comm.all_reduce(r + 1, reduce_op=op), 4, timeout=T)
    assert out == [want] * 4 and type(out[0]) is type(want)


def test_value_style_errors_are_clear():
    def body(rank):
        with pytest.raises(GlobalTensorError, match=r"found str at \['name'\]"):
            gt.comm.all_reduce({"name": "x", "v": torch.ones(1)})
        with pytest.raises(GlobalTensorError, match="either op= or reduce_op="):
            gt.comm.all_reduce(torch.ones(1), op=ReduceOp.MAX, reduce_op="sum")
        with pytest.raises(GlobalTensorError, match="async_op=False for value-style"):
            gt.comm.all_reduce(1.0, async_op=True)
        with pytest.raises(GlobalTensorError, match="expected a reduce op"):
            gt.comm.all_reduce(torch.ones(1), reduce_op="median")
        return True

    assert run_ranks(body, 2, timeout=T) == [True, True]


def test_value_style_all_gather():
    def body(rank):
        return (gt.comm.all_gather(torch.tensor(10 * rank)),
                gt.comm.all_gather(torch.full((2, 3), float(rank))),
                gt.comm.all_gather(torch.arange(rank + 1)),
                gt.comm.all_gather(2.0 * rank),
                gt.comm.all_gather({"k": rank}),
                gt.comm.all_gather({"x": torch.ones(2) * rank, "tag": f"r{rank}",
                                    "pair": (torch.arange(rank), torch.tensor([rank]))}))

    out = run_ranks(body, 3, timeout=T)
    for scalars, blocks, uneven, nums, objs, coll in out:
        assert scalars.tolist() == [0, 10, 20]
        assert blocks.shape == (3, 2, 3) and blocks[:, 0, 0].tolist() == [0.0, 1.0, 2.0]
        assert isinstance(uneven, list) and [u.tolist() for u in uneven] == [[0], [0, 1], [0, 1, 2]]
        assert nums == [0.0, 2.0, 4.0] and objs == [{"k": 0}, {"k": 1}, {"k": 2}]
        assert coll["x"].tolist() == [[0, 0], [1, 1], [2, 2]] and coll["tag"] == ["r0", "r1", "r2"]
        assert [p.tolist() for p in coll["pair"][0]] == [[], [0], [0, 1]]
        assert isinstance(coll["pair"], tuple) and coll["pair"][1].tolist() == [[0], [1], [2]]


def test_all_gather_dtype_mismatch_names_the_ranks():
    def body(rank):
        gt.comm.all_gather(torch.ones(2, dtype=torch.float32 if rank else torch.float64))

    with pytest.raises(RankFailed, match=r"same dtype, found \{0: 'torch.float64', 1: 'torch.float32'"):
        run_ranks(body, 2, timeout=T)


def test_torch_style_all_gather_even_uneven_and_into_tensor():
    def body(rank):
        even = [torch.empty(2) for _ in range(3)]
        assert gt.comm.all_gather(even, torch.ones(2) * rank) is even
        uneven = [torch.empty(r + 1, dtype=torch.int64) for r in range(3)]
        gt.comm.all_gather(uneven, torch.arange(rank + 1) * 10)
        into = torch.empty(6)
        gt.comm.all_gather_into_tensor(into, torch.ones(2) * rank)
        return [e.tolist() for e in even], [u.tolist() for u in uneven], into.tolist()

    out = run_ranks(body, 3, timeout=T)
    assert out == [([[0, 0], [1, 1], [2, 2]], [[0], [0, 10], [0, 10, 20]],
                    [0, 0, 1, 1, 2, 2])] * 3


def test_broadcast_tensors_in_place_and_values():
    def body(rank):
        t = torch.tensor([float(rank), 1.0])
        returned = gt.comm.broadcast(t, src=2)
        return (returned is t, t.tolist(), gt.comm.broadcast(f"hello from rank {rank}", src=0),
                gt.comm.broadcast({"lr": 0.1 * rank, "t": torch.arange(rank + 1)}, src=1),
                gt.comm.broadcast(rank * 1.5, src=3))

    out = run_ranks(body, 4, timeout=T)
    for same, t, msg, obj, num in out:
        assert same and t == [2.0, 1.0] and msg == "hello from rank 0" and num == 4.5
        assert obj["lr"] == 0.1 and obj["t"].tolist() == [0, 1]


def test_subgroups_and_group_relative_roots():
    def body(rank):
        group = gt.comm.group_of_ranks((1, 3))  # every rank creates it
        if rank not in (1, 3):
            return None
        s = torch.tensor([float(rank)])
        gt.comm.all_reduce(s, group=group)
        b = torch.tensor([float(rank)])
        gt.comm.broadcast(b, src=3, group=group)        # src is a global rank, as in torch
        b2 = torch.tensor([float(rank)])
        gt.comm.broadcast(b2, group=group, group_src=0)  # group_src is a group rank
        return s.item(), b.item(), b2.item(), gt.comm.all_gather(rank, group=group)

    out = run_ranks(body, 4, timeout=T)
    assert out[1] == out[3] == (4.0, 3.0, 1.0, [1, 3]) and out[0] is None


def test_rooted_and_scattering_collectives():
    def body(rank):
        n = 3
        g = [torch.empty(2) for _ in range(n)] if rank == 1 else None
        gt.comm.gather(torch.ones(2) * rank, g, dst=1)
        sc = torch.empty(2)
        gt.comm.scatter(sc, [torch.ones(2) * 10 * r for r in range(n)] if rank == 0 else None, src=0)
        red = torch.tensor([3 * rank + 1, 2])
        gt.comm.reduce(red, dst=2, op=ReduceOp.AVG)     # integer AVG, built on gloo
        rs = torch.empty(2)
        gt.comm.reduce_scatter(rs, [torch.ones(2) * (r + rank) for r in range(n)])
        rst = torch.empty(2, dtype=torch.int64)
        gt.comm.reduce_scatter_tensor(rst, torch.arange(6) + rank, op=ReduceOp.BOR)
        a2a = [torch.empty(1) for _ in range(n)]
        gt.comm.all_to_all(a2a, [torch.tensor([10.0 * rank + r]) for r in range(n)])
        single = torch.empty(3)
        gt.comm.all_to_all_single(single, torch.arange(3.0) + 10 * rank)
        return (g and [x.tolist() for x in g], sc.tolist(), red.tolist() if rank == 2 else None,
                rs.tolist(), rst.tolist(), [x.item() for x in a2a], single.tolist())

    out = run_ranks(body, 3, timeout=T)
    assert out[1][0] == [[0, 0], [1, 1], [2, 2]] and out[0][0] is None
    assert [o[1] for o in out] == [[0, 0], [10, 10], [20, 20]]
    assert out[2][2] == [4, 2]
    assert [o[3] for o in out] == [[3, 3], [6, 6], [9, 9]]
    bor = [functools.reduce(lambda a, b: a | b, [2 * r + k + q for q in range(3)])
           for r in range(3) for k in range(2)]
    assert [o[4] for o in out] == [bor[0:2], bor[2:4], bor[4:6]]
    assert [o[5] for o in out] == [[0, 10, 20], [1, 11, 21], [2, 12, 22]]
    assert [o[6] for o in out] == [[0, 10, 20], [1, 11, 21], [2, 12, 22]]


def test_reduce_scatter_of_ops_the_backend_lacks():
    def body(rank):
        out = torch.empty(2)
        gt.comm.reduce_scatter_tensor(out, torch.ones(4) * (rank + 1),
                                      op=torch.distributed._make_nccl_premul_sum(3.0))
        bx = torch.empty(1, dtype=torch.int64)
        stacked = torch.tensor([[rank + 1], [rank + 5]])
        low = C._Lowered(ReduceOp.BXOR, by_gather=True)      # the NCCL route, run on gloo
        C._reduce_scatter_built(bx, stacked, low, None, False)
        return out.tolist(), bx.item()

    out = run_ranks(body, 2, timeout=T)
    assert out == [([9.0, 9.0], 1 ^ 2), ([9.0, 9.0], 5 ^ 6)]


def test_gather_and_scatter_built_from_send_recv():
    def body(rank):
        g = [torch.empty(2) for _ in range(3)] if rank == 2 else None
        C._gather_by_p2p(torch.ones(2) * rank, g, 2, None)
        s = torch.empty(1)
        C._scatter_by_p2p(s, [torch.tensor([5.0 * r]) for r in range(3)] if rank == 0 else None,
                          0, None)
        return g and [x.tolist() for x in g], s.item()

    out = run_ranks(body, 3, timeout=T)
    assert out[2][0] == [[0, 0], [1, 1], [2, 2]] and [o[1] for o in out] == [0.0, 5.0, 10.0]


def test_send_recv_tensors_and_objects():
    def body(rank):
        if rank == 0:
            gt.comm.send(torch.tensor([7.0]), dst=1)
            gt.comm.send({"epoch": 3, "name": "ckpt"}, dst=1)
            work = gt.comm.isend(torch.tensor([8.0]), dst=1)
            work.wait()
            return None
        t = torch.empty(1)
        sender = gt.comm.recv(t, src=0)
        obj = gt.comm.recv(src=0)
        t2 = torch.empty(1)
        gt.comm.irecv(t2, src=0).wait()
        return sender, t.item(), obj, t2.item()

    assert run_ranks(body, 2, timeout=T)[1] == (0, 7.0, {"epoch": 3, "name": "ckpt"}, 8.0)


def test_world_of_one_returns_what_it_was_given():
    def body(rank):
        t = torch.tensor([1.0, 2.0])
        return (gt.comm.all_reduce(t.clone(), reduce_op="mean"), gt.comm.all_gather(t),
                gt.comm.all_gather(3.0), gt.comm.broadcast("s"), gt.comm.all_reduce({"a": 2}),
                gt.comm.all_gather({"x": t}))

    mean, gathered, nums, s, coll, gcoll = run_ranks(body, 1, timeout=T)[0]
    assert mean.tolist() == [1.0, 2.0] and gathered.shape == (1, 2) and nums == [3.0]
    assert s == "s" and coll == {"a": 2} and gcoll["x"].tolist() == [[1.0, 2.0]]


def test_rank_zero_first_runs_rank_zero_before_the_others():
    import threading
    import time

    events, lock = [], threading.Lock()

    def body(rank):
        with gt.comm.rank_zero_first():
            with lock:
                events.append(("enter", rank))
            if rank == 0:
                time.sleep(0.05)  # a slow download: the others must still wait for it
            with lock:
                events.append(("leave", rank))

    run_ranks(body, 3, timeout=T)
    assert events[:2] == [("enter", 0), ("leave", 0)] and len(events) == 6


def test_monitored_barrier_passes_repeatedly():
    def body(rank):
        for _ in range(3):
            gt.comm.monitored_barrier(timeout=10)
        pair = gt.comm.group_of_ranks((1, 2))
        gt.comm.monitored_barrier(timeout=10, group=pair)  # rank 0 is outside: returns at once
        return True

    assert run_ranks(body, 3, timeout=T) == [True] * 3


def test_monitored_barrier_names_the_ranks_that_did_not_arrive():
    def body(rank):
        if rank == 2:
            return "skipped"
        with pytest.raises(CollectiveTimeoutError, match=r"ranks \[2\] missing") as info:
            gt.comm.monitored_barrier(timeout=0.5)
        return str(info.value)

    out = run_ranks(body, 3, timeout=T)
    assert out[2] == "skipped" and "within 0.5s" in out[0] and "ranks [2] missing" in out[1]


def test_monitored_barrier_coordinator_missing():
    def body(rank):
        if rank == 0:
            return None
        with pytest.raises(CollectiveTimeoutError, match="rank 0 .*coordinates"):
            gt.comm.monitored_barrier(timeout=0.2)
        return True

    assert run_ranks(body, 2, timeout=T) == [None, True]


def test_debug_checks_name_ranks_that_call_a_different_collective():
    def body(rank):
        gt.set_debug(True, timeout=10)
        gt.comm.all_gather(torch.ones(rank + 1))        # differently sized pieces are fine
        if rank == 1:
            gt.comm.broadcast(torch.ones(2))
        else:
            gt.comm.all_reduce(torch.ones(3 if rank == 2 else 2))

    with pytest.raises(RankFailed, match=r"(?s)RankMismatchError.*rank 1 differs: op: "
                                         r"gt.comm.broadcast instead of gt.comm.all_reduce.*"
                                         r"rank 2 differs: tensor: 'tensor\(\[3\]"):
        run_ranks(body, 3, timeout=T)


def test_debug_checks_compare_the_structure_of_values():
    def body(rank):
        gt.set_debug(True, timeout=10)
        gt.comm.all_reduce({"loss": torch.ones(1), ("n" if rank == 0 else "count"): 2})

    with pytest.raises(RankFailed, match=r"rank 1 differs: value: .*'count': int"):
        run_ranks(body, 2, timeout=T)


@pytest.mark.parametrize("call", ["all_gather", "all_reduce"])
def test_structures_that_differ_by_rank_are_an_error_on_every_rank_without_gt_debug(call):
    """Issue 52.8: a dict with a key one rank lacks made collectives of different sizes, and
    gloo killed a rank with SIGABRT unless GT_DEBUG=1. One all-gather of 8 bytes first: every
    rank raises, naming each rank's structure; equal structures still work."""
    def body(rank):
        fn = getattr(gt.comm, call)
        same = fn({"loss": torch.tensor([float(rank)]), "n": torch.tensor([2.0])})
        data = {"loss": torch.tensor([1.0])}
        if rank == 1:
            data["extra"] = torch.tensor([2.0, 3.0])
        try:
            fn(data)
        except GlobalTensorError as e:
            return same["n"].tolist(), str(e)
        return same["n"].tolist(), None
    for n, message in run_ranks(body, 2, timeout=60):
        assert message is not None and "expected every rank to pass data of the same structure" \
            in message and "rank 1: {'loss': " in message and "'extra'" in message
        assert n in ([[2.0], [2.0]], [4.0])
