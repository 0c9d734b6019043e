"""``torch.compile(model)`` of HF Llama over a split sequence (issue 55, item 4), in real gloo
processes, plain and head-tail splits: the loss and every gradient equal one process. Slow
(about 50 s of compiling each on a 2-core machine): ``pytest -m slow``."""
import pytest
import torch

import globaltensor as gt

S, B = gt.sbp.split, gt.sbp.broadcast


def _rank(local_rank, balance=None):
    import transformers
    torch.set_num_threads(1)
    gt.init()
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(1))
    loss = ref(ids, labels=ids).loss
    loss.backward()
    line = gt.placement("cpu", [0, 1, 2, 3], axes=("cp",))
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(ref.state_dict())
    model.to_global(line)
    compiled = torch.compile(model)
    x = ids.to_global(line, B).to_global(sbp=gt.sbp.S(1, balance))
    got = compiled(x, labels=x).loss
    got.backward()
    worst = max((p.grad.full_tensor() - q.grad).abs().max().item()
                for p, q in zip(model.parameters(), ref.parameters()))
    return loss.item(), got.full_tensor().item(), worst


@pytest.mark.slow
@pytest.mark.parametrize("balance", [None, "head_tail"])
def test_compiled_hf_llama_over_a_split_sequence_equals_one_process(balance):
    pytest.importorskip("transformers")
    for want, got, worst in gt.spawn(_rank, args=(balance,), nproc_per_node=4, timeout=600):
        assert abs(got - want) < 1e-5, (got, want)
        assert worst < 1e-5, worst
