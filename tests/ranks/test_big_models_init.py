"""Initialisation by pieces is layout-free (issue 53, item 3): a torchtitan-shaped Llama (fused
or separate qkv, RMSNorm, SwiGLU, its own ``init_weights`` with trunc_normal_ and per-layer
stds), a CNN (Conv2d fans from the global shape, BatchNorm) and HF's Llama built on meta, laid
out, ``to_empty``'d and initialised give bitwise the full values of one rank on a line of 2
(fully_shard), a 2x2 grid (TP x fully_shard) and a 2-stage pipeline; ``orthogonal_`` and
``eye_`` on split tensors give one rank's values too."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.testing import run_ranks
from test_big_models import _LLAMA_TP, _llama_config

S, B = gt.sbp.split, gt.sbp.broadcast
TIMEOUT = 90
DIM, HEADS, LAYERS, VOCAB, HIDDEN = 16, 4, 2, 32, 24


# --------------------------------------------------------------------------- a torchtitan Llama


class Attention(nn.Module):
    def __init__(self, fused):
        super().__init__()
        self.fused = fused
        if fused:
            self.wqkv = nn.Linear(DIM, 3 * DIM, bias=False)
        else:
            self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def init_weights(self, std):
        for w in ([self.wqkv] if self.fused else [self.wq, self.wk, self.wv]):
            nn.init.trunc_normal_(w.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=std)

    def forward(self, x, freqs):
        b, t, _ = x.shape
        if self.fused:
            q, k, v = self.wqkv(x).chunk(3, dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q, k, v = (y.view(b, t, HEADS, -1).transpose(1, 2) for y in (q, k, v))
        q, k = q * freqs, k * freqs
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(a.transpose(1, 2).reshape(b, t, DIM))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def init_weights(self, std):
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for w in (self.w2, self.w3):
            nn.init.trunc_normal_(w.weight, mean=0.0, std=std)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, layer_id, fused):
        super().__init__()
        self.attention = Attention(fused)
        self.feed_forward = FeedForward()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.std = 0.02 / (2 * (layer_id + 1)) ** 0.5  # torchtitan's depth init

    def init_weights(self):
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.std)
        self.feed_forward.init_weights(self.std)

    def forward(self, x, freqs):
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


class Titan(nn.Module):
    """torchtitan's Llama shape: tok_embeddings, layers (a ModuleDict), norm, output, a buffer
    computed in __init__ and again in init_weights (torchtitan's freqs_cis)."""

    def __init__(self, fused=False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block(i, fused) for i in range(LAYERS)})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("freqs", self._freqs(), persistent=False)

    @staticmethod
    def _freqs():
        return torch.cos(torch.arange(8.0)).repeat(DIM // HEADS // 8 + 1)[: DIM // HEADS]

    def init_weights(self):
        with torch.device(self.freqs.device if not self.freqs.is_meta else "cpu"):
            self.freqs = self._freqs()
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        std = DIM ** -0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, ids):
        h = self.tok_embeddings(ids)
        for layer in self.layers.values():
            h = layer(h, self.freqs)
        return self.output(self.norm(h))


_TITAN_TP = gt.nn.sbp_plan({
    "layers.*.attention.w[qkv]": gt.nn.colwise("tp"), "layers.*.attention.wqkv": gt.nn.colwise("tp"),
    "layers.*.attention.wo": gt.nn.rowwise("tp"), "layers.*.feed_forward.w[13]": gt.nn.colwise("tp"),
    "layers.*.feed_forward.w2": gt.nn.rowwise("tp")})


# --------------------------------------------------------------------------- a CNN


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 6, 3, groups=2)
        self.fc = nn.Linear(6 * 4 * 4, 10)

    def init_weights(self):
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        return self.fc(F.relu(self.conv2(x)).flatten(1))


_CNN_SPLIT = lambda name, t: (B, S(0)) if t.ndim > 1 else None  # noqa: E731 - out channels on "tp"


# --------------------------------------------------------------------------- the layouts


def _pieces_of(modules, placement, axis="dp"):
    for module in modules:
        gt.nn.fully_shard(module, placement, axis)


def _lay_out(model, how, tp_plan, stages):
    """``one``: 1 rank; ``line``: fully_shard on 2; ``2x2``: TP on "tp" then fully_shard on
    "dp"; ``pipeline``: stages [first half, second half] on [0, 1] and [2, 3], each sharded."""
    blocks = _blocks(model)
    if how in ("one", "line"):
        p = gt.placement("cpu", [0] if how == "one" else [0, 1], axes=("dp",))
        _pieces_of(blocks + [model], p)
    elif how == "2x2":
        grid = gt.placement("cpu", [[0, 1], [2, 3]], axes=("dp", "tp"))
        model.to_global(grid, tp_plan)
        _pieces_of(blocks + [model], grid)
    else:
        for stage, ranks in zip(stages(model), ([0, 1], [2, 3])):
            p = gt.placement("cpu", ranks, axes=("dp",))
            stage.to_global(p)
            gt.nn.fully_shard(stage, p)
    return model


def _blocks(model):
    if isinstance(model, Titan):
        return list(model.layers.values())
    if isinstance(model, CNN):
        return [model.conv1, model.conv2]
    return list(model.model.layers)


def _stages(model):
    """Two stage modules that hold every parameter and buffer of ``model`` between them."""
    children = list(model.named_children())
    half = (len(children) + 1) // 2
    return [nn.ModuleDict(dict(children[:half])), nn.ModuleDict(dict(children[half:]))]


def _titan_stages(model):
    return [nn.ModuleDict({"tok_embeddings": model.tok_embeddings, "l0": model.layers["0"]}),
            nn.ModuleDict({"l1": model.layers["1"], "norm": model.norm, "output": model.output})]


def _full_state(model):
    out = {}
    for name, t in model.state_dict().items():
        if isinstance(t, gt.GlobalTensor):
            t = t.to_global(placement=t.placement, sbp=[B] * t.placement.ndim)
            t = t.to_local() if gt.env.get_rank() in t.placement.flat_ranks else None
        out[name] = t
    return out


def _run(build, tp_plan, init, stages=_stages):
    def body(rank, how):
        with torch.device("meta"):
            model = build()
        _lay_out(model, how, tp_plan, stages)
        model.to_empty(device="cpu")
        gt.manual_seed(0)
        init(model)
        return _full_state(model)
    one = run_ranks(body, 1, "one", timeout=TIMEOUT)[0]
    for how, world in (("line", 2), ("2x2", 4), ("pipeline", 4)):
        for rank, state in enumerate(run_ranks(body, world, how, timeout=TIMEOUT)):
            assert state.keys() == one.keys(), how
            for name, value in state.items():
                if value is not None:  # a pipeline rank holds its stage's tensors only
                    assert torch.equal(value, one[name]), (how, rank, name)
            if how == "pipeline":
                held = [n for n, v in state.items() if v is not None]
                assert 0 < len(held) < len(state), (rank, held)
    return one


@pytest.mark.parametrize("fused", [False, True], ids=["separate-qkv", "fused-qkv"])
def test_a_torchtitan_llama_initialises_bitwise_alike_in_every_layout(fused):
    one = _run(lambda: Titan(fused), _TITAN_TP, lambda m: m.init_weights(), stages=_titan_stages)
    out = one["output.weight"]
    std = DIM ** -0.5
    assert out.abs().max() <= 3 * std and out.std() == pytest.approx(0.88 * std, rel=0.25)
    assert torch.equal(one["norm.weight"], torch.ones(DIM))
    wo = one["layers.1.attention.wo.weight"]
    assert wo.std() == pytest.approx(0.02 / 2, rel=0.3)  # the depth init: 0.02 / sqrt(2 * 2)


def test_a_cnn_initialises_bitwise_alike_in_every_layout():
    one = _run(CNN, _CNN_SPLIT, lambda m: m.init_weights())
    bound = 1 / math.sqrt(3 * 3 * 3)  # kaiming_uniform_(a=sqrt(5)): 1/sqrt(fan_in), global fan_in
    w = one["conv1.weight"]
    assert w.abs().max() <= bound and w.abs().max() > 0.8 * bound
    assert one["conv2.weight"].abs().max() <= 1 / math.sqrt(4 * 3 * 3)  # groups: fan_in 4 * 9
    assert torch.equal(one["bn1.weight"], torch.ones(8))
    assert torch.equal(one["bn1.running_var"], torch.ones(8))


def test_an_hf_llama_initialises_bitwise_alike_in_every_layout():
    transformers, config = _llama_config()

    def stages(model):
        layers = model.model.layers
        return [nn.ModuleDict({"embed": model.model.embed_tokens, "l0": layers[0]}),
                nn.ModuleDict({"l1": layers[1], "norm": model.model.norm, "head": model.lm_head,
                               "rotary": model.model.rotary_emb})]
    one = _run(lambda: transformers.LlamaForCausalLM(config), _LLAMA_TP, lambda m: m.init_weights(),
               stages=stages)
    assert one["model.layers.0.self_attn.q_proj.weight"].std() == pytest.approx(0.02, rel=0.2)


# --------------------------------------------------------------------------- orthogonal_, eye_


@pytest.mark.parametrize("init", ["orthogonal_", "eye_"])
def test_orthogonal_and_eye_on_split_tensors_give_one_ranks_values(init):
    def body(rank, sbp):
        world = gt.env.get_world_size()
        p = gt.placement("cpu", list(range(world)))
        w = gt.zeros(6, 4, placement=p, sbp=sbp)
        gt.manual_seed(0)
        getattr(nn.init, init)(w)
        return w.full_tensor()
    one = run_ranks(body, 1, B, timeout=TIMEOUT)[0]
    for sbp in (S(0), S(1)):
        for full in run_ranks(body, 2, sbp, timeout=TIMEOUT):
            assert torch.equal(full, one), sbp
    if init == "eye_":
        assert torch.equal(one, torch.eye(6, 4))
    else:
        torch.testing.assert_close(one.T @ one, torch.eye(4), atol=1e-5, rtol=0)
