"""GT_DEBUG consistency checks: every rank agrees on each global operation, or all of them raise.
(The flag, descriptors and messages alone are checked in tests/core/test_debug.py.)"""
import re

import torch
import torch.distributed.distributed_c10d as c10d

import globaltensor as gt
from globaltensor.runtime.agreement import check
from globaltensor.testing import run_ranks

from helpers import error_or_none


# --- multi-rank: real store, thread ranks --------------------------------------------------------


def test_agreeing_ranks_pass_and_store_stays_small():
    def body(rank):
        gt.set_debug(True, timeout=10)
        for i in range(5):
            check("step", i=i)
        store = c10d._get_default_store()
        return [store.check([f"gt_debug/w/{s}/{rank}"]) for s in range(5)]

    # a passed check deletes the previous one's key: only the last remains
    assert run_ranks(body, 3, timeout=30) == [[False, False, False, False, True]] * 3


def test_off_by_default_costs_no_store_traffic(monkeypatch):
    monkeypatch.delenv("GT_DEBUG", raising=False)

    def body(rank):
        check("step", rank=rank)  # would disagree if it ran
        return c10d._get_default_store().check(["gt_debug/w/0/0"])

    assert run_ranks(body, 2, timeout=30) == [False, False]


def test_differing_facts_raise_on_every_rank():
    def body(rank):
        gt.set_debug(True, timeout=10)
        check("warmup")
        return error_or_none(lambda: check("to_global", sbp=(gt.sbp.split(rank % 2),)))

    out = run_ranks(body, 3, timeout=30)
    for kind, msg in out:
        assert kind == "RankMismatchError"
        assert "ranks [0, 2]: #1 to_global(sbp=(S(0),))" in msg
        assert "rank 1 differs: sbp: (S(1),) instead of (S(0),)" in msg
        # the user's line, under each group (issue 41: the messages named no line)
        code = '(`return error_or_none(lambda: check("to_global", sbp=(gt.sbp.split(rank % 2),)))`)'
        assert len(re.findall(rf"\n    at {re.escape(__file__)}:\d+ {re.escape(code)}", msg)) == 2


def test_rank_skipping_a_to_global_is_named_not_a_hang():
    """A rank that skips a global operation: the others raise naming it, within the timeout."""
    def body(rank):
        gt.set_debug(True, timeout=1.5)
        p = gt.placement("cpu", [0, 1, 2])
        x = gt.ones(3, 4, placement=p, sbp=gt.sbp.split(0))
        if rank == 1:
            return None  # skips the redistribution below
        return error_or_none(lambda: x.to_global(sbp=gt.sbp.broadcast))

    out = run_ranks(body, 3, timeout=30)
    assert out[1] is None
    for kind, msg in (out[0], out[2]):
        assert kind == "CollectiveTimeoutError"
        assert "global operation #1 to_global(" in msg
        assert "rank 1 of the world did not arrive (rank 1 last checked in at #0 gt.ones)" in msg
        assert re.search(rf"rank {0 if msg is out[0][1] else 2} is at {re.escape(__file__)}:\d+ "
                         r"\(`return error_or_none\(lambda: x.to_global\(sbp=", msg)
        assert re.search(rf"rank 1 checked in last from {re.escape(__file__)}:\d+ "
                         r"\(`x = gt.ones\(3, 4, placement=p, ", msg)


def test_rank_running_another_operation_is_named():
    def body(rank):
        gt.set_debug(True, timeout=10)
        p = gt.placement("cpu", [0, 1])
        x = gt.ones(4, placement=p, sbp=gt.sbp.split(0))
        if rank == 0:
            return error_or_none(lambda: x.full_tensor())
        return error_or_none(lambda: x.to_global(sbp=gt.sbp.broadcast))

    out = run_ranks(body, 2, timeout=30)
    assert out[0][0] == out[1][0] == "RankMismatchError"
    assert out[0][1] == out[1][1]
    assert "op: to_global instead of full_tensor()" in out[0][1]  # the user's call, by name


def test_local_to_global_with_different_sbp_is_caught_before_communicating():
    def body(rank):
        gt.set_debug(True, timeout=10)
        p = gt.placement("cpu", [0, 1])
        sbp = gt.sbp.split(0) if rank == 0 else gt.sbp.broadcast
        return error_or_none(lambda: torch.ones(2, 3).to_global(placement=p, sbp=sbp))

    out = run_ranks(body, 2, timeout=30)
    assert {o[0] for o in out} == {"RankMismatchError"}
    assert "sbp: (B,) instead of (S(0),)" in out[0][1]


def test_factory_with_different_dtype_is_named():
    def body(rank):
        gt.set_debug(True, timeout=10)
        p = gt.placement("cpu", [0, 1])
        dtype = torch.float32 if rank == 0 else torch.float64
        return error_or_none(lambda: gt.zeros(2, placement=p, sbp=gt.sbp.broadcast, dtype=dtype))

    out = run_ranks(body, 2, timeout=30)
    assert "op: gt.zeros" not in out[0][1]  # same op: only the dtype differs
    assert "dtype: torch.float64 instead of torch.float32" in out[0][1]
    assert "#0 gt.zeros(" in out[0][1]


def test_checks_pass_for_a_correct_program_and_results_match():
    def body(rank):
        gt.set_debug(True, timeout=10)
        q = gt.placement("cpu", [[0, 1], [2, 3]])
        x = gt.arange(12, placement=q, sbp=(gt.sbp.split(0), gt.sbp.broadcast))
        y = torch.full((2,), float(rank)).to_global(placement=q, sbp=(gt.sbp.split(0),) * 2)
        z = torch.full((2,), float(rank)).to_global(placement=q, sbp=(gt.sbp.broadcast,) * 2)
        return x.to_local().tolist(), list(y.shape), z.to_local().tolist()

    out = run_ranks(body, 4, timeout=30)
    assert out == [([0, 1, 2, 3, 4, 5], [8], [0.0, 0.0])] * 2 + [([6, 7, 8, 9, 10, 11], [8],
                                                                   [0.0, 0.0])] * 2


def test_group_scope_checks_only_its_ranks():
    def body(rank):
        gt.set_debug(True, timeout=1.5)
        if rank in (0, 1):
            check("pair op", ranks=[0, 1], n=1)
            return "pair ok"
        # rank 2 is outside the group: returns at once, without waiting for anybody
        check("pair op", ranks=[0, 1], n=1)
        return error_or_none(lambda: check("lonely", ranks=[1, 2]))

    out = run_ranks(body, 3, timeout=30)
    assert out[:2] == ["pair ok", "pair ok"]
    assert out[2][0] == "CollectiveTimeoutError"
    assert "rank 1 of group [1, 2] did not arrive" in out[2][1]
    assert "has not checked in at any global operation yet" in out[2][1]


def test_operators_with_different_arguments_are_named():
    def body(rank):
        gt.set_debug(True, timeout=10)
        p = gt.placement("cpu", [0, 1])
        x = gt.ones(4, 6, placement=p, sbp=gt.sbp.split(0))
        return error_or_none(lambda: x.sum(dim=rank))

    out = run_ranks(body, 2, timeout=30)
    assert out[0] == out[1] and out[0][0] == "RankMismatchError"
    assert "#1 aten.sum.dim_IntList(" in out[0][1]
    assert "rank 1 differs: args: (global Layout(placement('cpu', ranks=[0, 1]), (S(0),), [4, 6]) " \
           "torch.float32, [1]) instead of " in out[0][1]


def test_operators_under_debug_give_the_same_values():
    def body(rank):
        gt.set_debug(True, timeout=10)
        p = gt.placement("cpu", [0, 1])
        x = gt.arange(12, placement=p, sbp=gt.sbp.split(0), dtype=torch.float64).view(4, 3)
        w = gt.ones(3, 2, placement=p, sbp=gt.sbp.broadcast, dtype=torch.float64)
        y = torch.relu(x @ w - 5.0 * (rank + 1))  # a float may differ per rank: not compared
        return y.sbp, (x @ w).full_tensor().tolist()

    out = run_ranks(body, 2, timeout=30)
    expect = (torch.arange(12.0).view(4, 3) @ torch.ones(3, 2)).tolist()
    assert out == [((gt.sbp.split(0),), expect)] * 2
