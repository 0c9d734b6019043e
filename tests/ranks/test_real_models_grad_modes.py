"""Unmodified HF models give one process's loss with autograd on and under ``torch.no_grad()``,
whatever the layout of their parameters.

The layouts chosen for an op differ between the two modes (with autograd, the backward has a
price), so a rule that is wrong for some inputs can hide behind one mode: a grouped-query
attention split on heads whose key heads did not divide over the ranks gave a grad-mode loss
4e-3 off while the no_grad loss was exact (Qwen2 and Llama with the embeddings and attention
weights split). Each model runs, in one world, every layout of ``LAYOUTS`` (per parameter
family: embeddings and head, attention, MLP, each B, S(0) or S(1); ZeRO-3; a 2x2 data x tensor
grid) forward in both modes, against one process.
"""
import copy

import pytest
import torch

import globaltensor as gt
from globaltensor.testing import run_ranks

transformers = pytest.importorskip(
    "transformers", reason="HF transformers is a test dependency (pip install -e '.[test]')")

S, B = gt.sbp.split, gt.sbp.broadcast
VOCAB = 96
IDS = torch.randint(0, VOCAB, (8, 12), generator=torch.Generator().manual_seed(1))
LINE = gt.placement("cpu", [0, 1, 2, 3])
GRID = gt.placement("cpu", [[0, 1], [2, 3]])


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))


def _qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
        tie_word_embeddings=False))


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=32,
        attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, max_position_embeddings=32, attn_implementation="sdpa",
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


MODELS = {"llama": _llama, "qwen2": _qwen2, "gpt2": _gpt2, "bert": _bert}


def family(name: str) -> str:
    """The parameter family of ``name``: embed (embeddings and the head), attn, mlp or other."""
    if any(k in name for k in ("embed", "wte", "wpe", "lm_head", "decoder")):
        return "embed"
    if "attn" in name or "attention" in name:
        return "attn"
    if any(k in name for k in ("mlp", "intermediate", "output.dense")):
        return "mlp"
    return "other"


def by_family(**sbps):
    """An sbp_fn on the line: a 2-D parameter of a family named in ``sbps`` gets its value,
    everything else B."""
    def sbp_fn(name, t):
        return sbps.get(family(name), B) if t.dim() == 2 else B
    return sbp_fn


def zero3(name, t):
    return S(0)


def grid_tp(name, t):
    """2x2: data parallel on axis 0, the 2-D weights split on axis 1 by rows (S(0)), the
    embeddings by vocabulary."""
    return (B, S(0)) if t.dim() == 2 else (B, B)


LAYOUTS = {
    "embed+attn S(0)": (LINE, by_family(embed=S(0), attn=S(0))),
    "embed S(1), attn S(0)": (LINE, by_family(embed=S(1), attn=S(0))),
    "attn S(1)": (LINE, by_family(attn=S(1))),
    "mlp S(0), attn S(1)": (LINE, by_family(mlp=S(0), attn=S(1))),
    "all 2-D S(1)": (LINE, by_family(embed=S(1), attn=S(1), mlp=S(1), other=S(1))),
    "zero3": (LINE, zero3),
    "2x2 dp x tp": (GRID, grid_tp),
}


def _loss(model, ids):
    return model(ids, labels=ids).loss


@pytest.mark.parametrize("name", ["llama", "qwen2", pytest.param("gpt2", marks=pytest.mark.slow),
                                  pytest.param("bert", marks=pytest.mark.slow)])
def test_hf_models_give_one_process_loss_with_and_without_grad_in_every_layout(name):
    torch.manual_seed(0)
    ref = MODELS[name]().double().eval()
    with torch.no_grad():
        want = _loss(ref, IDS).item()

    def body(rank):
        found = {}
        for title, (place, sbp_fn) in LAYOUTS.items():
            model = copy.deepcopy(ref)
            gt.nn.to_global(model, place, sbp_fn)
            batch = [S(0)] + [B] * (place.ndim - 1)
            ids = gt.tensor(IDS, placement=place, sbp=batch)
            with torch.no_grad():
                plain = _loss(model, ids).item()
            graded = _loss(model, ids)
            found[title] = (plain, graded.item(), graded.requires_grad)
        return found

    found = run_ranks(body, 4, timeout=300)[0]
    wrong = {title: (plain - want, graded - want)
             for title, (plain, graded, _) in found.items()
             if abs(plain - want) > 1e-5 or abs(graded - want) > 1e-5}
    assert not wrong, f"{name}: one process {want:.6f}; (no_grad, grad) errors: {wrong}"
    assert all(tracked for _, _, tracked in found.values())
