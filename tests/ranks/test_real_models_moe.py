"""Unmodified HF mixture-of-experts models (Qwen3-MoE and Mixtral, tiny configs, random init) on
a 2x2 grid match one process: loss, logits and every gradient of a forward and backward (issue
36, item 3).

Their experts run transformers' default implementation, "grouped_mm": tokens sorted by expert
(``sort``, ``histc``, ``cumsum`` give the offsets), then ``torch._grouped_mm`` with the stacked
expert weights (float32: its CPU kernel has no float64; its meta kernel demands bf16, so dispatch
learns its output from a run on stand-ins). Layouts: data parallel on axis 0 and Megatron on axis
1 (each expert's features split), and expert parallel (the stacked experts split on axis 0).
"""
import copy

import pytest
import torch

import globaltensor as gt
from globaltensor.testing import run_ranks

transformers = pytest.importorskip(
    "transformers", reason="HF transformers is a test dependency (pip install -e '.[test]')")

S, B = gt.sbp.split, gt.sbp.broadcast
VOCAB = 64
IDS = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))
GRID = [[0, 1], [2, 3]]


def qwen3_moe():
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config)


def mixtral():
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config)


MODELS = {"qwen3_moe": qwen3_moe, "mixtral": mixtral}


_COLUMN = ("q_proj", "k_proj", "v_proj", "embed_tokens", "lm_head")
_ROW = ("o_proj",)


def megatron_2d(name, t):
    """Axis 1 of the attention and vocabulary: column-parallel projections split their output
    features, row-parallel ones their input features; the router stays whole."""
    if t.dim() != 2 or "mlp.gate" in name:
        return B
    if any(c in name for c in _COLUMN):
        return S(0)
    return S(1) if any(c in name for c in _ROW) else B


def experts_megatron(name):
    """Each expert's Megatron split: gate_up_proj (E, 2I, H) on its outputs, down_proj
    (E, H, I) on its inputs."""
    return S(1) if "gate_up_proj" in name else S(2)


def tensor_parallel(name, t):
    """Data parallel on axis 0, Megatron on axis 1 (the experts' features too)."""
    if t.dim() == 3:
        return (B, experts_megatron(name))
    return (B, megatron_2d(name, t))


def expert_parallel(name, t):
    """The stacked experts split on axis 0 (expert parallel), each expert's features on axis 1;
    the rest as tensor_parallel."""
    if t.dim() == 3:
        return (S(0), experts_megatron(name))
    return (B, megatron_2d(name, t))


def full(t):
    return t.full_tensor() if isinstance(t, gt.GlobalTensor) else t


def check_forward_backward(make, sbp_fn):
    reference = make()
    assert reference.config._experts_implementation == "grouped_mm"
    base = copy.deepcopy(reference)
    out = reference(IDS, labels=IDS)
    out.loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}

    def body(rank):
        model = copy.deepcopy(base)
        placement = gt.placement("cpu", GRID)
        model.to_global(placement, sbp_fn)
        ids = gt.tensor(IDS, placement=placement, sbp=(S(0), B))
        result = model(ids, labels=ids)
        result.loss.backward()
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        sbps = {n: p.sbp for n, p in model.named_parameters()}
        return full(result.loss).item(), full(result.logits), grads, sbps

    for loss, logits, grads, sbps in run_ranks(body, 4, timeout=300):
        assert loss == pytest.approx(out.loss.item(), rel=1e-5)
        torch.testing.assert_close(logits, out.logits.detach(), rtol=1e-4, atol=1e-5)
        assert grads.keys() == ref_grads.keys()
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=n: f"{n}: {m}")
    return sbps


@pytest.mark.parametrize("model", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_moe_tensor_parallel_on_a_2x2_grid(model):
    sbps = check_forward_backward(MODELS[model], tensor_parallel)
    assert sbps["model.layers.0.mlp.experts.gate_up_proj"] == (B, S(1))
    assert sbps["model.layers.1.mlp.experts.down_proj"] == (B, S(2))


@pytest.mark.parametrize("model", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_moe_expert_parallel_on_a_2x2_grid(model):
    sbps = check_forward_backward(MODELS[model], expert_parallel)
    assert sbps["model.layers.0.mlp.experts.gate_up_proj"] == (S(0), S(1))
    assert sbps["model.layers.1.mlp.experts.down_proj"] == (S(0), S(2))
