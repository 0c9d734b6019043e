"""A small transformer block (embedding, attention, layer_norm, MLP, cross_entropy) with global
parameters on a 2x2 grid (data parallel x tensor parallel) matches one process, forward and
backward."""
import math

import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.testing import run_ranks

S, B = gt.sbp.split, gt.sbp.broadcast
VOCAB, DIM, HEADS, SEQ, BATCH = 16, 8, 2, 4, 4


class Block(torch.nn.Module):
    def __init__(self, gen: torch.Generator):
        super().__init__()

        def param(*shape):
            return torch.nn.Parameter(torch.randn(*shape, generator=gen, dtype=torch.float64)
                                      / math.sqrt(shape[0]))
        self.embed = param(VOCAB, DIM)
        self.pos = param(SEQ, DIM)
        self.ln1 = torch.nn.LayerNorm(DIM, dtype=torch.float64)
        self.wq, self.wk, self.wv, self.wo = (param(DIM, DIM) for _ in range(4))
        self.ln2 = torch.nn.LayerNorm(DIM, dtype=torch.float64)
        self.w1, self.w2 = param(DIM, 4 * DIM), param(4 * DIM, DIM)
        self.head = param(DIM, VOCAB)
        self.register_buffer("causal", torch.ones(SEQ, SEQ, dtype=torch.bool).tril())

    def attention(self, x):
        b, t, d = x.shape
        def heads(w):
            return (x @ w).view(b, t, HEADS, d // HEADS).transpose(1, 2)
        q, k, v = heads(self.wq), heads(self.wk), heads(self.wv)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // HEADS)
        scores = scores.masked_fill(~self.causal, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return out.transpose(1, 2).reshape(b, t, d) @ self.wo

    def forward(self, tokens, targets):
        x = F.embedding(tokens, self.embed) + self.pos
        x = x + self.attention(self.ln1(x))
        x = x + F.gelu(self.ln2(x) @ self.w1) @ self.w2
        logits = x @ self.head
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


TP = {  # Megatron-style on placement axis 1; every parameter broadcast on axis 0 (data parallel)
    "embed": S(0),          # vocabulary split: the lookup gives partial sums
    "wq": S(1), "wk": S(1), "wv": S(1), "wo": S(0),
    "w1": S(1), "w2": S(0),
    "head": S(1),
}


def layout_of(name, tensor):
    return (B, TP.get(name, B))


def data():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return tokens, targets


def reference():
    model = Block(torch.Generator().manual_seed(1))
    loss = model(*data())
    loss.backward()
    return model, loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("grid_ranks,sbp_fn,data_sbp", [
    ([[0, 1], [2, 3]], layout_of, (S(0), B)),
    ([0, 1], lambda name, t: TP.get(name), (B,)),
    ([0, 1], None, (S(0),)),
], ids=["dp x tp", "tp", "dp"])
def test_transformer_block_matches_one_process(grid_ranks, sbp_fn, data_sbp):
    _, ref_loss, ref_grads = reference()
    grid = gt.placement("cpu", grid_ranks)

    def body(rank):
        model = Block(torch.Generator().manual_seed(1)).to_global(grid, sbp_fn)
        tokens, targets = (gt.tensor(t, placement=grid, sbp=data_sbp) for t in data())
        loss = model(tokens, targets)
        loss.backward()
        grads = {n: (p.grad.sbp == p.sbp, p.grad.full_tensor()) for n, p in model.named_parameters()}
        return loss.item(), grads, model.embed.sbp

    for value, grads, embed_sbp in run_ranks(body, grid.size, timeout=120):
        assert abs(value - ref_loss) < 1e-10
        assert set(grads) == set(ref_grads)
        for name, (same_layout, grad) in grads.items():
            assert same_layout, f"{name}'s grad should have the parameter's layout"
            torch.testing.assert_close(grad, ref_grads[name], msg=name)
