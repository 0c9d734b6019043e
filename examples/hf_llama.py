"""An unmodified HF transformers Llama, trained on a 2x2 grid: data parallel x tensor parallel.

    python launch.py --nproc_per_node 4 examples/hf_llama.py

The model is transformers' own ``LlamaForCausalLM`` (a tiny config, random init: nothing is
downloaded). Its code builds position ids, the causal mask and the rotary tables inside
``forward`` with torch's factories; ``model.to_global`` runs that forward in ``gt.global_mode``,
so they become global tensors and the code runs unchanged. The layout is the whole
parallelisation:

- placement axis 0 is data parallel: the batch is split(0), weights are broadcast along it;
- axis 1 is Megatron tensor parallel: q/k/v, gate and up projections split their output
  features (split(0) of the (out, in) weight), o and down projections their input features
  (split(1)), and the embedding and lm_head split the vocabulary.

Rank 0 also trains the same model in one process and prints both loss curves side by side.
"""
import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import globaltensor as gt

S, B = gt.sbp.split, gt.sbp.broadcast
STEPS = 8
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROW = ("o_proj", "down_proj")


def layout_of(name, tensor):
    """(data-parallel axis, tensor-parallel axis) for each parameter and buffer."""
    if tensor.dim() == 2 and any(c in name for c in COLUMN):
        return (B, S(0))
    if tensor.dim() == 2 and any(c in name for c in ROW):
        return (B, S(1))
    return (B, B)  # norms, rotary inv_freq


def train(model, ids):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())  # collective on a global loss: every rank gets the value
    return losses


def main():
    gt.init()
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(0)                                   # the same model on every rank
    model = LlamaForCausalLM(config)
    single = copy.deepcopy(model)
    ids = torch.randint(0, config.vocab_size, (8, 16), generator=torch.Generator().manual_seed(1))

    grid = gt.placement("cpu", ranks=[[0, 1], [2, 3]])   # axis 0: data, axis 1: tensor parallel
    model.to_global(grid, layout_of)
    losses = train(model, gt.tensor(ids, placement=grid, sbp=(S(0), B)))

    if gt.env.get_rank() == 0:
        reference = train(single, ids)
        print("step  2x2 grid   one process")
        for step, (a, b) in enumerate(zip(losses, reference), 1):
            print(f"{step:4d}  {a:9.6f}  {b:11.6f}")
        print(f"largest difference: {max(abs(a - b) for a, b in zip(losses, reference)):.2e}")


if __name__ == "__main__":
    main()
