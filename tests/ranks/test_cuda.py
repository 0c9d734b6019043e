"""One rank on one GPU (NCCL cannot put two ranks on one GPU, so multi-rank NCCL needs a
machine with several): a global model on ``placement("cuda", [0])`` gives the CPU's numbers,
eager and compiled with ``mode="reduce-overhead"`` (CUDA graphs). Marked ``cuda`` and skipped
without a GPU; ``benchmarks/gpu.py`` runs them and prints the single-GPU figures."""
import copy

import pytest
import torch

import globaltensor as gt
from globaltensor.testing import run_ranks

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
transformers = pytest.importorskip("transformers")


def _gpt2():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa"))
    model.loss_type = "ForCausalLM"
    return model


IDS = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))


def _cpu_reference(steps: int):
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(IDS, labels=IDS).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_a_global_gpt2_on_one_gpu_trains_as_on_the_cpu(mode):
    want = _cpu_reference(3)
    base = _gpt2()

    def body(rank):
        gpu = gt.placement("cuda", [0])
        model = copy.deepcopy(base).to_global(gpu, gt.sbp.broadcast)
        assert all(p.to_local().is_cuda for p in model.parameters())
        ids = gt.tensor(IDS, placement=gpu, sbp=gt.sbp.split(0))
        loss_of = (lambda m, x: m(x, labels=x).loss)
        if mode is not None:
            loss_of = torch.compile(loss_of, mode=mode)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = loss_of(model, ids)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    found = run_ranks(body, 1, timeout=600, backend="cpu:gloo,cuda:nccl")[0]
    assert found == pytest.approx(want, rel=1e-4, abs=1e-5)
