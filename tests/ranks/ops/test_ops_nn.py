"""nn operators on global tensors against torch: layer_norm, embedding, cross_entropy, conv2d,
dropout (same mask on broadcast replicas), attention pieces."""
import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.layout import Layout
from globaltensor.testing import run_ranks

from helpers import G2, G22, check, gen, make_global

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


def bcast(t, x):
    return t.to_global(placement=x.placement, sbp=(B,) * x.placement.ndim)


def test_layer_norm():
    check(lambda x, w, b: F.layer_norm(x, (6,), w, b), [gen(4, 6), gen(6, seed=1), gen(6, seed=2)],
          atol=1e-5)


def test_layer_norm_3d_without_affine():
    check(lambda x: F.layer_norm(x, (6,)), [gen(2, 4, 6)], atol=1e-5)


def test_embedding():
    ids = torch.tensor([[1, 9], [0, 3], [9, 9]])

    def fn(w):
        return F.embedding(bcast(ids, w) if w.is_global else ids, w) * 2
    check(fn, [gen(10, 4)])


def test_embedding_with_split_indices():
    ids = torch.tensor([[1, 9], [0, 3], [9, 9], [2, 2]])
    w = gen(10, 4)

    def body(rank):
        i = make_global(ids, Layout(G2, (S(0),), ids.shape), rank)
        wg = make_global(w, Layout(G2, (B,), w.shape), rank).requires_grad_()
        out = F.embedding(i, wg)
        out.sum().backward()
        return out.sbp, out.full_tensor(), wg.grad.full_tensor()

    ref = w.clone().requires_grad_()
    F.embedding(ids, ref).sum().backward()
    for sbp, out, grad in run_ranks(body, 2, timeout=30):
        assert sbp == (S(0),)
        torch.testing.assert_close(out, F.embedding(ids, w))
        torch.testing.assert_close(grad, ref.grad)


def test_vocab_split_embedding_gives_partial_sum():
    ids = torch.tensor([[1, 9], [0, 3], [5, 4]])
    w = gen(10, 4)

    def body(rank):
        wg = make_global(w, Layout(G2, (S(0),), w.shape), rank).requires_grad_()
        out = F.embedding(bcast(ids, wg), wg)
        (out * out).sum().backward()
        return out.sbp, out.full_tensor(), wg.grad.full_tensor()

    ref = w.clone().requires_grad_()
    r = F.embedding(ids, ref)
    (r * r).sum().backward()
    for sbp, out, grad in run_ranks(body, 2, timeout=30):
        assert sbp == (P,)
        torch.testing.assert_close(out, r.detach())
        torch.testing.assert_close(grad, ref.grad)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy(reduction):
    target = torch.tensor([0, 4, 2, 1, 3])

    def fn(x):
        t = bcast(target, x) if x.is_global else target
        return F.cross_entropy(x, t, reduction=reduction)
    check(fn, [gen(5, 5)], atol=1e-6)


def test_cross_entropy_with_batch_split_target_and_ignore_index():
    target = torch.tensor([0, -100, 2, 1, 3, 4])
    x = gen(6, 5)

    def body(rank):
        xg = make_global(x, Layout(G22, (S(0), B), x.shape), rank).requires_grad_()
        t = make_global(target, Layout(G22, (S(0), B), target.shape), rank)
        loss = F.cross_entropy(xg, t)
        loss.backward()
        return loss.sbp, loss.full_tensor(), xg.grad.full_tensor()

    ref = x.clone().requires_grad_()
    r = F.cross_entropy(ref, target)
    r.backward()
    for sbp, loss, grad in run_ranks(body, 4, timeout=30):
        assert sbp == (P, B)  # the batch split made the mean a partial sum: no communication
        torch.testing.assert_close(loss, r.detach())
        torch.testing.assert_close(grad, ref.grad)


def test_conv2d_batch_split():
    x, w, b = gen(4, 3, 5, 5), gen(2, 3, 3, 3, seed=1), gen(2, seed=2)

    def body(rank):
        xg = make_global(x, Layout(G2, (S(0),), x.shape), rank).requires_grad_()
        wg = make_global(w, Layout(G2, (B,), w.shape), rank).requires_grad_()
        bg = make_global(b, Layout(G2, (B,), b.shape), rank).requires_grad_()
        out = F.conv2d(xg, wg, bg, padding=1)
        out.sum().backward()
        return (out.sbp, out.full_tensor(), xg.grad.full_tensor(), wg.grad.sbp,
                wg.grad.full_tensor(), bg.grad.full_tensor())

    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    ref = F.conv2d(*leaves, padding=1)
    ref.sum().backward()
    for sbp, out, gx, gw_sbp, gw, gb in run_ranks(body, 2, timeout=30):
        assert sbp == (S(0),) and gw_sbp == (B,)  # a leaf's .grad has the leaf's sbp (SPEC)
        torch.testing.assert_close(out, ref.detach())
        for got, leaf in zip((gx, gw, gb), leaves):
            torch.testing.assert_close(got, leaf.grad)


def test_conv2d_every_layout():
    check(lambda x, w: F.conv2d(x, w, padding=1), [gen(2, 3, 4, 4), gen(2, 3, 3, 3, seed=1)],
          grids=[G2], atol=1e-5)


@pytest.mark.parametrize("sbp", [(B, B), (S(0), B), (B, S(1)), (S(0), S(1)), (P, B)],
                         ids=lambda s: gt.sbp.format_sbp(s))
def test_dropout_mask_depends_on_global_position_only(sbp):
    x = torch.ones(4, 6)

    def body(rank):
        gt.manual_seed(3)
        xg = make_global(x, Layout(G22, sbp, x.shape), rank)
        y = F.dropout(xg, p=0.5, training=True)
        kept = (y.full_tensor() != 0)
        return y.to_local().clone(), kept, y.sbp

    out = run_ranks(body, 4, timeout=30)
    kept = out[0][1]
    assert all(torch.equal(o[1], kept) for o in out)          # one mask, whatever rank
    assert 0.2 < kept.float().mean() < 0.8
    if sbp == (B, B):
        assert all(torch.equal(o[0], out[0][0]) for o in out)  # replicas hold the same values
    full = out[0][0] if sbp == (B, B) else None
    if full is not None:
        torch.testing.assert_close(full[kept], torch.full((int(kept.sum()),), 2.0))


def test_dropout_same_mask_for_any_layout():
    def mask_for(sbp):
        def body(rank):
            gt.manual_seed(11)
            xg = make_global(torch.ones(4, 6), Layout(G22, sbp, (4, 6)), rank)
            return (F.dropout(xg, p=0.3) != 0).full_tensor()
        return run_ranks(body, 4, timeout=30)[0]

    assert torch.equal(mask_for((B, B)), mask_for((S(1), S(0))))


def test_dropout_backward_uses_the_mask():
    def body(rank):
        gt.manual_seed(5)
        xg = make_global(gen(4, 6), Layout(G2, (S(0),), (4, 6)), rank).requires_grad_()
        y = F.dropout(xg, p=0.5)
        y.sum().backward()
        return (y.full_tensor() != 0), xg.grad.full_tensor()

    for kept, grad in run_ranks(body, 2, timeout=30):
        torch.testing.assert_close(grad, kept.double() * 2)


def test_attention_block_pieces():
    def attn(q, k, v):
        scores = q @ k.transpose(-2, -1) / 2.0
        mask = torch.ones(4, 4, dtype=torch.bool).tril()
        if q.is_global:
            mask = bcast(mask, q)
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v

    check(attn, [gen(2, 4, 3), gen(2, 4, 3, seed=1), gen(2, 4, 3, seed=2)], grids=[G2], atol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("loss", ["mse_loss", "smooth_l1_loss", "huber_loss"])
def test_pointwise_losses(loss, reduction):
    check(lambda x, y: getattr(F, loss)(x, y, reduction=reduction), [gen(4, 6), gen(4, 6, seed=1)],
          atol=1e-6)
