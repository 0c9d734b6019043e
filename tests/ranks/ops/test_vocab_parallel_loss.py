"""Cross-entropy over logits split on the classes (vocab-parallel logits, DTensor's
``loss_parallel``) by rule, without gathering the logits: softmax / log_softmax along a split
dim, nll_loss with split classes, and their backwards, against one process; a Llama with a
vocab-split lm_head sends the loss's row statistics instead of its logits."""
import copy

import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.testing import run_ranks

S, B = gt.sbp.split, gt.sbp.broadcast
X = torch.randn(6, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
T = torch.tensor([0, 3, 9, 5, -100, 7])  # an ignored row (HF's label padding)
LINE2, LINE3 = gt.placement("cpu", [0, 1]), gt.placement("cpu", [0, 1, 2])
GRID = gt.placement("cpu", [[0, 1], [2, 3]])


def _one_process(fn):
    x = X.clone().requires_grad_()
    out = fn(x)
    out.sum().backward()
    return out.detach(), x.grad


def _split_classes(fn, grid, sbp, tsbp):
    def body(rank):
        x = gt.tensor(X, placement=grid, sbp=sbp).requires_grad_()
        t = gt.tensor(T, placement=grid, sbp=tsbp)
        with gt.comm_trace() as trace:
            out = fn(x, t)
        out.sum().backward()
        gathered = [r for r in trace if r.source is not None and list(r.source.shape) == list(X.shape)]
        return out.full_tensor(), x.grad.full_tensor(), gathered, trace.bytes_per_rank
    return run_ranks(body, grid.size, timeout=60)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("grid,sbp,tsbp", [(LINE2, S(1), B), (LINE3, S(1), B),  # 10 over 3: uneven
                                           (GRID, (S(0), S(1)), (S(0), B))],
                         ids=["2", "3-uneven", "2x2-batch-and-classes"])
def test_cross_entropy_over_split_classes_equals_one_process_without_moving_the_logits(
        grid, sbp, tsbp, reduction):
    want, want_grad = _one_process(lambda x: F.cross_entropy(x, T, reduction=reduction))
    for rank, (out, grad, gathered, sent) in enumerate(
            _split_classes(lambda x, t: F.cross_entropy(x, t, reduction=reduction), grid, sbp, tsbp)):
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(grad, want_grad)
        assert gathered == [], (rank, gathered)  # the logits never move
        assert sent < X.numel() * X.element_size() / 2, (rank, sent)  # two numbers per row


@pytest.mark.parametrize("op", [torch.softmax, torch.log_softmax])
def test_softmax_along_a_split_dim_stays_split(op):
    weights = torch.randn(6, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    want, want_grad = _one_process(lambda x: op(x, -1) * weights)

    def fn(x, t):
        out = op(x, -1)
        assert out.sbp == (S(1),)
        return out * gt.tensor(weights, placement=LINE3, sbp=S(1))

    for out, grad, gathered, _ in _split_classes(fn, LINE3, S(1), B):
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(grad, want_grad)
        assert gathered == []


def test_fewer_classes_than_ranks_and_a_class_index_that_is_ignored_elsewhere():
    x = torch.randn(4, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    t = torch.tensor([1, 0, 1, -100])
    ref = x.clone().requires_grad_()
    F.cross_entropy(ref, t).backward()

    def body(rank):
        gx = gt.tensor(x, placement=LINE3, sbp=S(1)).requires_grad_()  # rank 2 holds no class
        loss = F.cross_entropy(gx, gt.tensor(t, placement=LINE3, sbp=B))
        loss.backward()
        return loss.full_tensor(), gx.grad.full_tensor()

    for loss, grad in run_ranks(body, 3, timeout=60):
        torch.testing.assert_close(loss, F.cross_entropy(x, t))
        torch.testing.assert_close(grad, ref.grad)


def test_llama_with_a_vocab_split_lm_head_sends_row_statistics_not_logits():
    transformers = pytest.importorskip("transformers")
    vocab = 256
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).double()
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    reference = copy.deepcopy(base)
    ref_loss = reference(ids, labels=ids).loss
    ref_loss.backward()
    logits_bytes = 2 * 16 * vocab * 8

    def body(rank):
        model = copy.deepcopy(base)
        tp = gt.nn.sbp_plan({"lm_head": gt.nn.colwise(), "*.q_proj": gt.nn.colwise(),
                             "*.k_proj": gt.nn.colwise(), "*.v_proj": gt.nn.colwise(),
                             "*.o_proj": gt.nn.rowwise(), "*.gate_proj": gt.nn.colwise(),
                             "*.up_proj": gt.nn.colwise(), "*.down_proj": gt.nn.rowwise()})
        place = gt.placement("cpu", [0, 1], axes=("tp",))
        model.to_global(place, tp)
        tokens = gt.tensor(ids, placement=place, sbp=B)
        with gt.comm_trace() as trace:
            loss = model(tokens, labels=tokens).loss
            loss.backward()
        big = [r for r in trace if r.source is not None and (r.bytes_per_rank or 0) >= logits_bytes // 4]
        return loss.full_tensor().item(), model.lm_head.weight.grad.full_tensor(), big

    for loss, grad, big in run_ranks(body, 2, timeout=120):
        assert loss == pytest.approx(ref_loss.item(), rel=1e-6)
        torch.testing.assert_close(grad, reference.lm_head.weight.grad)
        assert big == [], [(r.op, r.layouts(), r.bytes_per_rank) for r in big]
