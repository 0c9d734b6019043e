"""GlobalTensor from local pieces and the factories (pieces checked without the planner)."""
import pytest
import torch

import globaltensor as gt
from globaltensor.errors import GlobalTensorError
from globaltensor.layout import Layout
from globaltensor.testing import RankFailed, run_ranks

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
P4 = gt.placement("cpu", [0, 1, 2, 3])
G22 = gt.placement("cpu", [[0, 1], [2, 3]])


def assemble(pieces, layout: Layout):
    """The logical value from every rank's piece (sum over partial replicas)."""
    full = torch.zeros(layout.shape, dtype=pieces[0].dtype)
    seen = set()
    for coord in layout.placement.coords():
        rank = layout.placement.rank_at(coord)
        key = tuple(c if layout.sbp[a] != B else 0 for a, c in enumerate(coord))
        if key in seen:
            continue
        seen.add(key)
        full[layout.slices(coord)] += pieces[rank]
    return full


def test_split_pieces_concatenate_uneven():
    def body(rank):
        piece = torch.full(([3, 3, 2, 2][rank], 2), float(rank))
        x = piece.to_global(placement=P4, sbp=S(0))
        return (x.shape, x.sbp, x.placement, x.to_local().clone(), x.is_global, piece.is_global,
                x.is_local, piece.is_local)

    out = run_ranks(body, 4, timeout=30)
    assert all(o[0] == torch.Size([10, 2]) and o[1] == (S(0),) and o[2] == P4 for o in out)
    assert [o[3][:, 0].tolist() for o in out] == [[0, 0, 0], [1, 1, 1], [2, 2], [3, 3]]
    assert all(o[4] is True and o[5] is False and o[6] is False and o[7] is True for o in out)


def test_check_meta_error_names_rank_and_sizes():
    def body(rank):
        torch.ones(3 if rank == 2 else 2, 2).to_global(placement=P4, sbp=S(0))

    with pytest.raises(RankFailed, match=r"found: \{0: \[2, 2\], 1: \[2, 2\], 2: \[3, 2\]"):
        run_ranks(body, 4, timeout=30)


def test_mismatched_ndim_and_dtype_are_errors():
    def ndim(rank):
        (torch.ones(2) if rank else torch.ones(2, 1)).to_global(placement=P4, sbp=S(0))

    def dtype(rank):
        torch.ones(2, dtype=torch.float64 if rank == 1 else torch.float32).to_global(
            placement=P4, sbp=S(0))

    with pytest.raises(RankFailed, match="ShapeMismatchError.*dims"):
        run_ranks(ndim, 4, timeout=30)
    with pytest.raises(RankFailed, match="ShapeMismatchError.*dtype"):
        run_ranks(dtype, 4, timeout=30)


def test_without_check_meta_pieces_are_assumed_equal():
    def body(rank):
        x = torch.ones(2, 3).to_global(placement=G22, sbp=(S(0), S(1)), check_meta=False)
        return x.shape

    assert run_ranks(body, 4, timeout=30) == [torch.Size([4, 6])] * 4


def test_broadcast_syncs_first_rank_of_each_group_and_leaves_caller_alone():
    def body(rank):
        mine = torch.full((2,), float(rank))
        x = mine.to_global(placement=G22, sbp=(B, S(0)))
        y = torch.full((2,), float(rank)).to_global(placement=G22, sbp=(B, S(0)), sync_data=False)
        return x.to_local().tolist(), mine.tolist(), y.to_local().tolist()

    out = run_ranks(body, 4, timeout=30)
    assert [o[0] for o in out] == [[0, 0], [1, 1], [0, 0], [1, 1]]
    assert [o[1] for o in out] == [[r, r] for r in range(4)]       # the caller's tensor is untouched
    assert [o[2] for o in out] == [[r, r] for r in range(4)]       # sync_data=False trusts the caller


def test_partial_needs_no_communication_and_copy_flag():
    def body(rank):
        mine = torch.full((2,), float(rank))
        x = mine.to_global(placement=P4, sbp=P)
        c = mine.to_global(placement=P4, sbp=P, copy=True)
        return (x.to_local().data_ptr() == mine.data_ptr(), c.to_local().data_ptr() != mine.data_ptr(),
                x.shape)

    assert run_ranks(body, 4, timeout=30) == [(True, True, torch.Size([2]))] * 4


def test_ranks_outside_placement_hold_empty_pieces_but_know_shape():
    def body(rank):
        p = gt.placement("cpu", [1, 3])
        x = torch.ones(2, 5).to_global(placement=p, sbp=S(1))
        return x.shape, tuple(x.to_local().shape), x.dtype

    out = run_ranks(body, 4, timeout=30)
    assert [o[0] for o in out] == [torch.Size([2, 10])] * 4
    assert [o[1] for o in out] == [(0, 0), (2, 5), (0, 0), (2, 5)]


@pytest.mark.parametrize("kwargs, match", [
    (dict(placement=None, sbp=S(0)), "needs both placement and sbp"),
    (dict(placement=P4, sbp=None), "needs both placement and sbp"),
    (dict(placement=[0, 1], sbp=S(0)), "expected placement=gt.placement"),
    (dict(placement=gt.placement("cpu", [0, 7]), sbp=S(0)), "world size 4"),
    (dict(placement=P4, sbp=S(2)), "split\\(2\\)"),
    (dict(placement=G22, sbp=S(0)), "found one split, S\\(0\\), which does not say"),
])
def test_bad_to_global_arguments(kwargs, match):
    def body(rank):
        with pytest.raises(GlobalTensorError, match=match):
            torch.ones(2, 2).to_global(**kwargs)
        return True

    assert run_ranks(body, 4, timeout=30) == [True] * 4


LAYOUTS = [(P4, (S(0),)), (P4, (S(1),)), (P4, (B,)), (G22, (S(0), S(1))), (G22, (S(1), S(0))),
           (G22, (B, S(0))), (G22, (S(0), S(0)))]


@pytest.mark.parametrize("factory", ["rand", "randn", "randint"])
def test_random_factories_same_values_whatever_the_layout(factory):
    def body(rank):
        pieces = []
        for placement, sbp in LAYOUTS:
            gt.manual_seed(1234)
            if factory == "randint":
                x = gt.randint(0, 100, (5, 7), placement=placement, sbp=sbp)
            else:
                x = getattr(gt, factory)(5, 7, placement=placement, sbp=sbp)
            pieces.append(x.to_local().clone())
        return pieces

    out = run_ranks(body, 4, timeout=30)
    fulls = [assemble([out[r][i] for r in range(4)], Layout(p, s, (5, 7)))
             for i, (p, s) in enumerate(LAYOUTS)]
    for f in fulls[1:]:
        assert torch.equal(f, fulls[0])
    assert fulls[0].float().std() > 0


def test_partial_factories_sum_to_the_value():
    def body(rank):
        gt.manual_seed(7)
        x = gt.ones(3, 2, placement=G22, sbp=(P, S(1)))
        y = gt.arange(10, placement=P4, sbp=P)
        z = gt.randn(3, 2, placement=G22, sbp=(P, S(1)))
        return x.to_local().clone(), y.to_local().clone(), z.to_local().clone()

    out = run_ranks(body, 4, timeout=30)
    assert torch.equal(assemble([o[0] for o in out], Layout(G22, (P, S(1)), (3, 2))), torch.ones(3, 2))
    assert torch.equal(assemble([o[1] for o in out], Layout(P4, (P,), (10,))), torch.arange(10))


def test_deterministic_factories_and_tensor():
    data = torch.arange(20.).reshape(4, 5)

    def body(rank):
        return (gt.arange(1, 11, 2, placement=P4, sbp=S(0)).to_local().tolist(),
                gt.tensor(data, placement=G22, sbp=(S(0), S(1))).to_local().clone(),
                gt.full((3, 3), 2.5, placement=P4, sbp=S(1)).to_local().clone(),
                gt.zeros_like(gt.ones(4, 2, placement=P4, sbp=S(0))).to_local().shape)

    out = run_ranks(body, 4, timeout=30)
    assert [o[0] for o in out] == [[1, 3], [5], [7], [9]]
    assert torch.equal(assemble([o[1] for o in out], Layout(G22, (S(0), S(1)), (4, 5))), data)
    assert [tuple(o[2].shape) for o in out] == [(3, 1), (3, 1), (3, 1), (3, 0)]
    assert all(torch.all(o[2] == 2.5) for o in out)
    assert [tuple(o[3]) for o in out] == [(1, 2)] * 4


def test_factory_errors():
    with pytest.raises(GlobalTensorError, match="placement= and sbp="):
        gt.zeros(2, 2)
    with pytest.raises(GlobalTensorError, match="non-negative ints"):
        gt.zeros(-1, 2, placement=gt.placement("cpu", [0]), sbp=B)
    with pytest.raises(GlobalTensorError, match="low < high"):
        gt.randint(5, 5, (2,), placement=gt.placement("cpu", [0]), sbp=B)


@pytest.mark.parametrize("shape", [(4, 6), (0, 3, 0, 2), (4, 0), (), (5,)])
def test_global_strides_are_the_contiguous_strides_of_the_global_shape(shape):
    def body(rank):
        x = gt.zeros(*shape, placement=P4, sbp=B)
        y = gt.zeros(*shape, placement=P4, sbp=B).requires_grad_()
        return x.stride(), y.stride(), x.is_contiguous(), y.requires_grad, x.requires_grad

    for got in run_ranks(body, 4, timeout=30):
        assert got == (torch.empty(shape).stride(), torch.empty(shape).stride(), True, True, False)
