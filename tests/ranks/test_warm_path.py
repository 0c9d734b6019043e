"""The warm path of ``x.to_global(sbp=...)`` (convert._MOVES): a repeated redistribution skips the
argument handling but must behave exactly as the full path does."""
import pytest
import torch

import globaltensor as gt
from globaltensor import convert
from globaltensor._cache import ById, clear_all
from globaltensor.errors import GlobalTensorError
from globaltensor.testing import RankFailed, run_ranks

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
P4 = gt.placement("cpu", [0, 1, 2, 3])
G22 = gt.placement("cpu", [[0, 1], [2, 3]])


def _full(shape):
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape)


@pytest.mark.parametrize("placement,src,dst", [
    (P4, (B,), (S(0),)),
    (P4, (B,), (S(1),)),
    (P4, (S(0),), (B,)),
    (P4, (S(0),), (S(1),)),
    (P4, (P,), (S(0),)),
    (G22, (S(0), S(1)), (B, B)),
    (G22, (B, B), (S(1), S(0))),
])
def test_repeated_calls_give_the_value_and_fresh_pieces(placement, src, dst):
    def body(rank):
        full = _full((6, 9))
        x = gt.tensor(full, placement=placement, sbp=(B,) * placement.ndim).to_global(sbp=src)
        before = x.to_local().clone()
        outs = [x.to_global(sbp=dst) for _ in range(3)]
        assert (id(x._layout), dst) in convert._MOVES  # the later calls took the warm path
        for y in outs:
            assert y.sbp == dst and y.placement == placement and y.shape == full.shape
            assert torch.equal(y.full_tensor(), full)
            # a fresh piece: writing to the result leaves the source alone
            if y.to_local().numel():
                y.to_local().add_(100)
        assert torch.equal(x.to_local(), before)
        return [y.to_local().data_ptr() for y in outs]

    ptrs = run_ranks(body, 4, timeout=60)
    for rank_ptrs in ptrs:  # three results alive at once: three different buffers
        assert len(set(p for p in rank_ptrs if p)) == len([p for p in rank_ptrs if p])


def test_same_layout_still_returns_the_same_object_and_copy_still_copies():
    def body(rank):
        x = gt.ones(4, 4, placement=P4, sbp=S(0))
        same = [x.to_global(sbp=S(0)) is x for _ in range(3)]
        copies = [x.to_global(sbp=S(0), copy=True) for _ in range(2)]
        return same, [c is x or c.to_local().data_ptr() == x.to_local().data_ptr() for c in copies]

    for same, aliased in run_ranks(body, 4, timeout=30):
        assert same == [True, True, True]
        assert aliased == [False, False]


def test_autograd_after_warm_calls_records_the_graph():
    def body(rank):
        x = gt.tensor(_full((4, 3)), placement=P4, sbp=B)
        for _ in range(2):
            x.to_global(sbp=S(0))  # warm, no graph
        w = x.detach().requires_grad_()
        y = w.to_global(sbp=S(0))
        assert y.grad_fn is not None
        (y * 2).sum().backward()
        g = w.grad
        return g.sbp, g.full_tensor()

    for sbp, grad in run_ranks(body, 4, timeout=30):
        assert sbp == (B,)  # the leaf's own sbp (SPEC): the arriving P gradient is summed
        assert torch.equal(grad, torch.full((4, 3), 2.0))


def test_debug_turned_on_after_warm_calls_still_checks_every_rank():
    def body(rank):
        x = gt.ones(4, 8, placement=P4, sbp=B)
        for _ in range(2):
            x.to_global(sbp=S(0))
            x.to_global(sbp=S(1))
        gt.set_debug(True, timeout=10)
        try:
            x.to_global(sbp=S(rank % 2))  # ranks disagree: must be caught, not run
        except GlobalTensorError as e:
            return type(e).__name__, str(e)
        finally:
            gt.set_debug(False)
        return None

    for kind, msg in run_ranks(body, 4, timeout=60):
        assert kind == "RankMismatchError"
        assert "sbp" in msg


def test_sbp_given_as_list_or_single_value_works_repeatedly():
    def body(rank):
        x = gt.tensor(_full((8, 2)), placement=P4, sbp=B)
        a = [x.to_global(sbp=[S(0)]).to_local().clone() for _ in range(2)]
        b = [x.to_global(sbp=S(0)).to_local().clone() for _ in range(2)]
        return a + b

    for rank, pieces in enumerate(run_ranks(body, 4, timeout=30)):
        want = _full((8, 2))[2 * rank: 2 * rank + 2]
        assert all(torch.equal(p, want) for p in pieces)


def test_placement_argument_is_checked_every_time():
    """The warm path is only for sbp-only calls: a placement is checked against the world."""
    def body(rank):
        x = gt.ones(4, placement=gt.placement("cpu", [0, 1]), sbp=B)
        for _ in range(2):
            x.to_global(placement=gt.placement("cpu", [0, 1]), sbp=S(0))
        x.to_global(placement=gt.placement("cpu", [0, 1, 2]), sbp=S(0))

    with pytest.raises(RankFailed, match="world"):
        run_ranks(body, 2, timeout=30)


def test_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(convert, "_MOVES", ById(3))

    def body(rank):
        values = []
        for n in range(2, 10):
            x = gt.tensor(_full((n, 4)), placement=P4, sbp=B)
            for _ in range(2):
                values.append(x.to_global(sbp=S(0)).full_tensor().sum().item())
        return values

    expected = [_full((n, 4)).sum().item() for n in range(2, 10) for _ in range(2)]
    assert run_ranks(body, 4, timeout=60) == [expected] * 4
    assert len(convert._MOVES) <= 3


def test_kept_meta_results_tell_scalar_types_shapes_and_dtypes_apart():
    """dispatch.outputs keeps each op's meta result per (op, arguments' shapes, dtypes and
    values): arguments equal as Python values but promoting differently (1, 1.0, True), or
    tensors differing only in shape or dtype, must not share one. Rank 2 is outside the
    placement: its results are made from the meta result alone."""
    from globaltensor.dispatch import outputs

    pair = gt.placement("cpu", [0, 1])

    def body(rank):
        ints = gt.tensor(torch.arange(8).reshape(4, 2), placement=pair, sbp=S(0))
        results = [ints + 1, ints + 1.0, ints + True, ints * 2, ints * 2.5]
        floats = gt.tensor(torch.ones(4, 2), placement=pair, sbp=S(0))
        wide = gt.tensor(torch.ones(4, 3), placement=pair, sbp=S(0))
        halves = gt.tensor(torch.ones(4, 2, dtype=torch.float16), placement=pair, sbp=S(0))
        results += [floats + 1, wide + 1, halves + 1, floats.sum(0), floats.sum(1),
                    floats.sum(1, keepdim=True)]
        return ([(r.dtype, tuple(r.shape), r.to_local().dtype, r.to_local().dim())
                 for r in results], len(outputs._RESULTS))

    expect = [(torch.int64, (4, 2)), (torch.float32, (4, 2)), (torch.int64, (4, 2)),
              (torch.int64, (4, 2)), (torch.float32, (4, 2)), (torch.float32, (4, 2)),
              (torch.float32, (4, 3)), (torch.float16, (4, 2)), (torch.float32, (2,)),
              (torch.float32, (4,)), (torch.float32, (4, 1))]
    clear_all()  # decisions cached by earlier tests would skip the meta runs (thread-ranks share it)
    for got, kept in run_ranks(body, 3, timeout=60):
        assert [g[:2] for g in got] == expect
        assert [(g[2], g[3]) for g in got] == [(d, len(s)) for d, s in expect]  # the pieces too
        assert kept > 0  # the results were kept, and still told apart
