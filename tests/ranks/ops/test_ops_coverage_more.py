"""Issue 17, the last pieces: tensor_split with a global tensor of indices, embedding_bag,
masked_scatter, _conj, pixel_shuffle / pixel_unshuffle, max_unpool, and the clear errors
left in the coverage sweep. Every rule against the full-tensor oracle on [2] and [2, 2]
(helpers.check: every sbp of every input, uneven shapes, forward and gradients)."""
import pytest
import torch

import globaltensor as gt
from globaltensor.testing import run_ranks
from helpers import G2, G22, check, gen

F = torch.nn.functional
S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


# ----------------------------------------------------------------------------- tensor_split

@pytest.mark.parametrize("part", [0, 1, 2])
def test_tensor_split_takes_a_global_tensor_of_indices(part):
    # torch's C++ reads the indices' memory above dispatch: the whole value is passed instead
    check(lambda x, i: torch.tensor_split(x, i, dim=1)[part], [gen(3, 5, 2), torch.tensor([1, 3])])
    check(lambda x, i: x.tensor_split(i)[part], [gen(5, 2), torch.tensor(3)])


def test_tensor_split_of_a_local_tensor_by_global_indices():
    def body(rank):
        i = gt.tensor(torch.tensor([2, 3]), placement=G2, sbp=S(0))
        x = torch.arange(6.0)
        return [p.tolist() for p in torch.tensor_split(x, tensor_indices_or_sections=i)]
    for parts in run_ranks(body, 2, timeout=60):
        assert parts == [[0.0, 1.0], [2.0], [3.0, 4.0, 5.0]]


# ----------------------------------------------------------------------------- clear errors

def _errors_on_ranks(fn, size=2):
    """The GlobalTensorError message ``fn(rank)`` raises on each rank."""
    def body(rank):
        with pytest.raises(gt.GlobalTensorError) as info:
            fn(rank)
        return str(info.value)
    return run_ranks(body, size, timeout=60)


def test_to_sparse_names_the_op_and_the_way_out():
    def fn(rank):
        x = gt.tensor(gen(5, 5), placement=G2, sbp=S(0))
        x.to_sparse()
    for message in _errors_on_ranks(fn):
        assert message.startswith("_to_sparse.default: expected an op whose result is dense")
        assert "x.full_tensor()" in message


def test_a_stride_check_says_global_tensors_are_contiguous():
    # torch's _grouped_mm wants 16-byte row strides: one process passes a padded (12, 6) view, a
    # global tensor of that shape is laid out contiguously (24-byte rows) and its real kernel
    # refuses it too (dispatch tried the stand-ins: issue 36)
    a = torch.zeros(12, 8)[:, :6].copy_(torch.randn(12, 6))
    w, offs = torch.randn(2, 6, 8), torch.tensor([5, 12], dtype=torch.int32)
    assert torch._grouped_mm(a, w, offs=offs).shape == (12, 8)

    def fn(rank):
        ga, gw, go = (gt.tensor(t.contiguous(), placement=G2, sbp=B) for t in (a, w, offs))
        torch._grouped_mm(ga, gw, offs=go)
    for message in _errors_on_ranks(fn):
        assert message.startswith("_grouped_mm.default on global tensors: strides should be")
        assert "laid out contiguously" in message and "x.to_local()" in message


def test_scaled_mm_whose_meta_kernel_is_stricter_than_the_cpu_one_runs():
    # _scaled_mm's meta kernel wants a column-major mat2, the CPU kernel does not: the output is
    # learnt from a run on stand-ins (issue 36) and the values are one process's
    a = torch.randn(16, 16).to(torch.float8_e4m3fn)
    b = torch.randn(32, 16).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    expected = torch._scaled_mm(a, b.t(), one, one)

    def body(rank):
        ga, s = (gt.tensor(t, placement=G2, sbp=B) for t in (a, one))
        gb = gt.tensor(b, placement=G2, sbp=S(0))
        return torch._scaled_mm(ga, gb.t(), s, s).full_tensor()
    for full in run_ranks(body, 2, timeout=60):
        assert full.dtype == expected.dtype and torch.equal(full.float(), expected.float())


# ----------------------------------------------------------------------------- embedding_bag

_IDX = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 0, 7, 7])
_OFF = torch.tensor([0, 2, 2, 5, 9])  # an empty bag, uneven bags


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_splits_bags_and_the_embedding_dim(mode):
    check(lambda w, i, o: F.embedding_bag(i, w, o, mode=mode, padding_idx=2),
          [gen(10, 3), _IDX, _OFF])


@pytest.mark.slow  # a long case: run with pytest -m slow (suite time)
def test_embedding_bag_per_sample_weights_and_last_offset():
    check(lambda w, i, o, s: F.embedding_bag(i, w, o, mode="sum", per_sample_weights=s),
          [gen(10, 3), _IDX, _OFF, gen(11, seed=1)])
    check(lambda w, i, o: F.embedding_bag(i, w, o, mode="mean", include_last_offset=True),
          [gen(10, 5), _IDX, torch.tensor([0, 3, 3, 8, 11])])


def test_embedding_bag_of_a_batch_split_input_keeps_the_split():
    # an (N, L) input split by rows: its bags are the rows, each rank runs its own
    def body(rank):
        x = gt.tensor(torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]]), placement=G2, sbp=S(0))
        w = gt.tensor(gen(10, 3), placement=G2, sbp=B)
        with gt.global_mode(G2):
            out = F.embedding_bag(x, w, mode="sum")
        return out.sbp, out.full_tensor()
    want = F.embedding_bag(torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]]), gen(10, 3), mode="sum")
    for sbp, out in run_ranks(body, 2, timeout=60):
        assert sbp == (S(0),) and torch.allclose(out, want)


# ----------------------------------------------------------------------------- masked_scatter

def _mask(*shape, seed=0):
    return gen(*shape, seed=seed) > 0


@pytest.mark.slow  # a long case: run with pytest -m slow (suite time)
def test_masked_scatter_numbers_the_whole_mask():
    # source is consumed in order over the masked positions: a split of x, either dim, takes
    # the elements its positions' numbers name (mask and source whole)
    check(lambda x, m, s: torch.masked_scatter(x, m, s), [gen(5, 3), _mask(5, 3), gen(4, 5, seed=1)])
    check(lambda x, m, s: x.masked_scatter(m, s), [gen(3, 5), _mask(5, seed=2), gen(16, seed=3)])


@pytest.mark.slow  # a long case: run with pytest -m slow (suite time)
def test_masked_scatter_broadcasts_x_against_the_mask():
    check(lambda x, m, s: torch.masked_scatter(x, m, s), [gen(4), _mask(3, 4, seed=4), gen(3, 4, seed=5)])
    check(lambda x, m, s: (x * 1).masked_scatter_(m, s), [gen(5, 3), _mask(5, 3), gen(15, seed=6)])


# ----------------------------------------------------------------------------- _conj

def test_conj_keeps_the_split_and_the_conjugate_bit():
    # the piece is a conjugate view (its bit kept on the wrapper); moves resolve the bit, since
    # no collective sends it
    def conj(a, b):
        y = torch.complex(a, b).conj()
        assert y.is_conj()
        return torch.view_as_real((y @ y.mT) * 2 + y.sum(0))
    check(conj, [gen(3, 3), gen(3, 3, seed=1)])


def test_a_write_through_a_conjugate_view_reaches_its_base():
    def write(a, b):
        z = torch.complex(a, b) * 1
        y = z.conj()
        y.mul_(torch.tensor(2j))
        y[0] = 1 + 1j
        return torch.view_as_real(z)
    check(write, [gen(3, 4), gen(3, 4, seed=1)])


# ----------------------------------------------------------------------------- pixel_shuffle

@pytest.mark.parametrize("shuffle", [True, False])
def test_pixel_shuffle_splits_whole_blocks(shuffle):
    # batch 3 on a 2x2 grid leaves a piece with no sample (torch gives it back in its own shape);
    # channels, height, width split only in whole r x r blocks (else moved first)
    if shuffle:
        check(lambda x: F.pixel_shuffle(x, 2), [gen(3, 8, 2, 3)])
    else:
        check(lambda x: F.pixel_unshuffle(x, 2), [gen(3, 2, 4, 6)])


def test_pixel_shuffle_rows_need_whole_blocks():
    from globaltensor.ops import Call, Ref, choose
    from globaltensor.layout import Layout

    def chosen(shape, sbp, grid=G2):
        call = Call("pixel_shuffle.default", (shape,), (Ref(0), 2))
        return choose(call, (Layout(grid, sbp, shape),), (8,)).ins[0].sbp
    assert chosen((3, 8, 2, 3), (S(1),)) == (S(1),)      # 2 output channels over 2 ranks
    assert chosen((3, 12, 2, 3), (S(1),)) != (S(1),)     # 3 over 2: pieces of 8 and 4 inputs
    assert chosen((3, 8, 3, 2), (S(2),)) != (S(2),)      # height 3 over 2
    assert chosen((3, 8, 2, 3), (S(1), S(1)), G22) != (S(1), S(1))


# ----------------------------------------------------------------------------- max_unpool

@pytest.mark.slow  # a long case: run with pytest -m slow (suite time)
def test_max_unpool_keeps_batch_and_channel_splits():
    # uneven batch and channels: on [2, 2] some piece holds no channel (torch refuses it)
    _, idx = F.max_pool2d(gen(3, 3, 4, 4), 2, return_indices=True)
    check(lambda v, i: F.max_unpool2d(v, i, 2), [gen(3, 3, 2, 2, seed=1), idx])
    _, idx = F.max_pool1d(gen(3, 6), 2, return_indices=True)  # unbatched (C, L)
    check(lambda v, i: F.max_unpool1d(v, i, 2), [gen(3, 3, seed=3), idx])


@pytest.mark.slow  # the same rule as max_unpool2d (the default run)
def test_max_unpool3d_keeps_batch_and_channel_splits():
    _, idx = F.max_pool3d(gen(3, 2, 4, 2, 2), 2, return_indices=True)
    check(lambda v, i: F.max_unpool3d(v, i, 2), [gen(3, 2, 2, 1, 1, seed=2), idx])
