"""Unmodified HF transformers models (tiny configs, random init) trained on global tensors match
one process: loss at each of 3 AdamW steps, then every gradient and parameter (issue 12).

The model code is transformers' own: it builds position ids, causal masks and rotary tables
inside ``forward`` with torch's factories, which run in global mode because ``module.to_global``
enters it around the forward. Layouts: 1-D data parallel (parameters B, batch S(0)) and a 2x2
grid (data parallel on axis 0, Megatron tensor parallel on axis 1 with a vocabulary-split
embedding and lm_head).
"""
import copy

import pytest
import torch

import globaltensor as gt
from globaltensor.testing import run_ranks

transformers = pytest.importorskip(
    "transformers", reason="HF transformers is a test dependency (pip install -e '.[test]')")

S, B = gt.sbp.split, gt.sbp.broadcast
VOCAB, STEPS = 64, 3
IDS = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))


def llama(attn, kv_heads=2):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
        attn_implementation=attn)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()  # float64: exact comparisons


def gpt2(attn):
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, attn_implementation=attn,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).double()


# Megatron on axis 1: column-parallel projections split their output features, row-parallel
# ones their input features; the embedding and lm_head split the vocabulary
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head", "wte")
_ROW = ("o_proj", "down_proj")
_CONV1D_COLUMN = ("c_attn", "c_fc")  # GPT-2's Conv1D keeps weights as (in, out)


def megatron(name, t):
    if t.dim() != 2:
        return (B, B)
    if any(c in name for c in _CONV1D_COLUMN):
        return (B, S(1))
    if "c_proj" in name:
        return (B, S(0))
    if any(c in name for c in _COLUMN):
        return (B, S(0))
    if any(c in name for c in _ROW):
        return (B, S(1))
    return (B, B)


def train(model, ids):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
        opt.step()
    return losses


def full(t):
    return t.full_tensor() if isinstance(t, gt.GlobalTensor) else t


def check_training(make, grid: bool):
    reference = make()
    base = copy.deepcopy(reference)
    ref_losses = [loss.item() for loss in train(reference, IDS)]
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    ref_params = dict(reference.named_parameters())

    def body(rank):
        model = copy.deepcopy(base)
        if grid:
            placement = gt.placement("cpu", [[0, 1], [2, 3]])
            model.to_global(placement, megatron)
            ids = gt.tensor(IDS, placement=placement, sbp=(S(0), B))
        else:
            placement = gt.placement("cpu", [0, 1])
            model.to_global(placement, B)
            ids = gt.tensor(IDS, placement=placement, sbp=S(0))
        losses = [full(loss).item() for loss in train(model, ids)]
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        params = {n: full(p.detach()) for n, p in model.named_parameters()}
        split = [n for n, p in model.named_parameters() if any(s != B for s in p.sbp)]
        return losses, grads, params, split

    for losses, grads, params, split in run_ranks(body, 4 if grid else 2, timeout=240):
        assert losses == pytest.approx(ref_losses, rel=1e-6)  # HF takes the loss in float32
        for n, g in grads.items():
            named = lambda m, n=n: f"{n}: {m}"  # noqa: E731
            torch.testing.assert_close(g, ref_grads[n], rtol=1e-5, atol=1e-6, msg=named)
            # AdamW divides by sqrt(v): a gradient entry near 0 turns the float32 noise of the
            # loss into ~1e-6 of the parameter; a wrong update would be off by ~lr = 1e-2
            torch.testing.assert_close(params[n], ref_params[n].detach(), rtol=1e-5, atol=2e-5,
                                       msg=named)
        if grid:  # the tensor parallel layout was really used
            assert any("embed_tokens" in n or "wte" in n for n in split), split
            assert len(split) >= 8, split


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_llama_tensor_and_data_parallel_on_a_2x2_grid(attn):
    check_training(lambda: llama(attn), grid=True)


def test_llama_without_grouped_query_attention_on_a_2x2_grid():
    check_training(lambda: llama("sdpa", kv_heads=4), grid=True)


def test_llama_data_parallel():
    check_training(lambda: llama("sdpa"), grid=False)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_gpt2_tensor_and_data_parallel_on_a_2x2_grid(attn):
    check_training(lambda: gpt2(attn), grid=True)


def test_gpt2_data_parallel():
    check_training(lambda: gpt2("eager"), grid=False)


class Block(torch.nn.Module):
    """A ResNet basic block: conv-BN-ReLU-conv-BN plus the shortcut, then ReLU."""

    def __init__(self, c):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(c)
        self.conv2 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(c)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class SmallResNet(torch.nn.Module):
    def __init__(self, classes=5):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1, bias=False),
                                        torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                        torch.nn.MaxPool2d(2))
        self.blocks = torch.nn.Sequential(Block(8), Block(8))
        self.pool = torch.nn.AdaptiveAvgPool2d(1)
        self.head = torch.nn.Linear(8, classes)

    def forward(self, x):
        x = self.pool(self.blocks(self.stem(x)))
        return self.head(torch.flatten(x, 1))


def test_resnet_with_batchnorm_data_parallel_matches_one_process():
    torch.manual_seed(0)
    base = SmallResNet().double()
    images = torch.randn(7, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    labels = torch.tensor([0, 1, 2, 3, 4, 0, 2])

    def steps(model, x, y):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for _ in range(STEPS):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(full(loss).item())
        return losses

    reference = copy.deepcopy(base)
    ref_losses = steps(reference, images, labels)
    ref_state = reference.state_dict()

    def body(rank):
        model = copy.deepcopy(base)
        placement = gt.placement("cpu", [0, 1])
        model.to_global(placement, B)
        seen = []  # the sbp of every layer's output: the batch stays split, none is whole
        for name, sub in model.named_modules():
            if name and not list(sub.children()):
                sub.register_forward_hook(lambda m, i, o, name=name: seen.append((name, o.sbp)))
        x = gt.tensor(images, placement=placement, sbp=S(0))  # uneven: 4 + 3 images
        y = gt.tensor(labels, placement=placement, sbp=S(0))
        losses = steps(model, x, y)
        state = {k: full(v) for k, v in model.state_dict().items()}
        return losses, state, seen

    for losses, state, seen in run_ranks(body, 2, timeout=120):
        assert losses == pytest.approx(ref_losses, rel=1e-9)
        for k, v in state.items():  # parameters, running means and variances, batch counters
            torch.testing.assert_close(v, ref_state[k], rtol=1e-9, atol=1e-12, msg=k)
        whole = {name for name, sbp in seen if sbp != (S(0),)}
        assert not whole, f"layers that computed the whole batch: {sorted(whole)}"
