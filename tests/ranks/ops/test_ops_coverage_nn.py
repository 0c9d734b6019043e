"""Issue 17, continued: group norm, losses with a mean over a split batch, transposed
convolution, and the clear errors of the coverage sweep. Every rule against the full-tensor
oracle on [2] and [2, 2] (helpers.check: every sbp of every input, uneven shapes, forward and
gradients)."""
import pytest
import torch

import globaltensor as gt
from globaltensor.ops import Call, Ref, rows_for
from globaltensor.ops.losses import loss_count
from globaltensor.sbp import Split
from globaltensor.testing import run_ranks
from helpers import check, gen

F = torch.nn.functional
S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


def _rows(op, shapes, args=(), kwargs=()):
    refs = tuple(Ref(i) for i in range(len(shapes)))
    return [r.ins for r in rows_for(Call(op, tuple(shapes), refs + tuple(args),
                                         tuple(kwargs))).rows]


# ----------------------------------------------------------------------------- group norm

@pytest.mark.slow  # a long case: run with pytest -m slow (suite time)
def test_group_norm_keeps_a_batch_split():
    w, b = gen(4, seed=1), gen(4, seed=2)
    check(lambda x, w, b: F.group_norm(x, 2, w, b), [gen(3, 4, 5), w, b])
    check(lambda x: F.group_norm(x, 4), [gen(5, 4)])
    assert (S(0), B, B) in _rows("native_group_norm.default", [(3, 4, 5), (4,), (4,)],
                                 (3, 4, 5, 2, 1e-5))


# ----------------------------------------------------------------------------- losses

@pytest.mark.slow  # a long case: run with pytest -m slow (suite time)
def test_elementwise_losses_over_a_split_batch():
    # each reduction once: none -> S(d), sum -> P, mean -> P over the global element count
    x, t = torch.sigmoid(gen(3, 5)), torch.sigmoid(gen(3, 5, seed=1))
    check(lambda x, t, w: F.binary_cross_entropy(x, t, w.detach()), [x, t, gen(5, seed=2).abs()])
    check(lambda x, t, pw: F.binary_cross_entropy_with_logits(
        x, t, pos_weight=pw.detach(), reduction="none"), [gen(3, 5), t, gen(5, seed=3).abs()])
    check(lambda x, t: F.soft_margin_loss(x, t.detach(), reduction="sum"),
          [gen(5, 3), torch.sign(gen(5, 3, seed=4))])


@pytest.mark.parametrize("reduction", [pytest.param("none", marks=pytest.mark.slow),
                                       pytest.param("sum", marks=pytest.mark.slow), "mean"])
def test_margin_losses_divide_a_mean_by_the_samples(reduction):
    # uneven batches of 3 and 5: on [2, 2] a piece can hold no sample (torch's kernels give
    # uninitialised memory for its sum: the rows' kernels give zeros)
    target = torch.tensor([1, 0, 3, 2, 1])
    x = gen(5, 4) if reduction != "sum" else gen(3, 4)
    check(lambda x, t, w: F.multi_margin_loss(x, t, weight=w.detach(), reduction=reduction),
          [x, target[:len(x)], gen(4, seed=1).abs()])
    labels = torch.tensor([[1, 3, -1, 0], [0, -1, 2, 2], [2, 1, 0, -1]])
    check(lambda x, t: F.multilabel_margin_loss(x, t, reduction=reduction), [gen(3, 4), labels])


def test_loss_counts():
    # a mean over the samples for margin losses, over every element otherwise
    assert loss_count(Call("multi_margin_loss.default", ((5, 4), (5,)))) == 5
    assert loss_count(Call("multi_margin_loss_backward.default", ((), (5, 4), (5,)))) == 5
    assert loss_count(Call("multilabel_margin_loss_forward.default", ((4,), (4,)))) == 1
    assert loss_count(Call("mse_loss.default", ((5, 4), (5, 4)))) == 20
    assert loss_count(Call("soft_margin_loss_backward.default", ((), (5, 4), (5, 4)))) == 20


# ----------------------------------------------------------------------------- convolution

@pytest.mark.slow  # a long case: run with pytest -m slow (suite time)
def test_transposed_convolution_splits_batch_and_output_channels():
    check(lambda x, w, b: F.conv_transpose1d(x, w, b, stride=2), [gen(3, 2, 4), gen(2, 3, 2, seed=1),
                                                                  gen(3, seed=2)])
    assert (B, S(1), S(0)) in _rows("convolution.default", [(3, 2, 4), (2, 3, 2), (3,)],
                                    ([1], [0], [1], True, [0], 1))


@pytest.mark.slow  # the rule of conv_transpose1d (the default run), with groups
def test_grouped_transposed_convolution_2d():
    check(lambda x, w: F.conv_transpose2d(x, w, groups=2), [gen(3, 4, 2, 3), gen(4, 1, 2, 2, seed=1)])


# ----------------------------------------------------------------------------- clear errors, 0-dim

def test_a_local_tensor_outside_global_mode_names_the_op():
    grid = gt.placement("cpu", [0, 1])

    def body(rank):
        x = gt.tensor(gen(4, 3), placement=grid, sbp=[S(0)])
        with pytest.raises(gt.GlobalTensorError) as info:
            x + torch.ones(3, dtype=torch.float64)
        return str(info.value)
    for message in run_ranks(body, 2, timeout=60):
        assert message.startswith("aten.add.Tensor: ") and "a local tensor of shape [3]" in message


def test_zero_dim_index_select_and_squeeze():
    check(lambda x, i: torch.index_select(x, 0, i), [gen(), torch.tensor([0])])
    check(lambda x: torch.squeeze(x * 2, 0), [gen()])
    rows = rows_for(Call("index_select.default", ((), (1,)), (Ref(0), 0, Ref(1)))).rows
    assert all(not any(isinstance(v, Split) for v in r.ins) for r in rows)


def test_one_hot_keeps_a_split_in_global_mode():
    # torch's one_hot compares with a local arange: global mode (outside it, the error names
    # aten.eq.Tensor); the result keeps the indices' split, no op gathers
    grid = gt.placement("cpu", [0, 1])
    idx = torch.tensor([0, 3, 1, 2, 2])

    def body(rank):
        i = gt.tensor(idx, placement=grid, sbp=[S(0)])
        with pytest.raises(gt.GlobalTensorError, match="aten.eq.Tensor: "):
            F.one_hot(i, 4)
        with gt.global_mode(grid):
            a, b = F.one_hot(i, 4), F.one_hot(i)
        return a.sbp, a.full_tensor(), b.full_tensor()
    for sbp, a, b in run_ranks(body, 2, timeout=60):
        assert sbp == (S(0),)
        assert torch.equal(a, F.one_hot(idx, 4)) and torch.equal(b, F.one_hot(idx))
