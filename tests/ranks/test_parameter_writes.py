"""Every way a user writes values into a global model's parameters, followed by grad-mode
training, gives the numbers of one process: a checkpoint saved from one layout and resumed into
another (DCP, gt.checkpoint with the optimizer), ``param.data = ...``, ``copy_`` under no_grad,
writes into ``to_local()``, and ``load_state_dict``.

The scenario that found a silent wrong result (issue 41): HF Qwen2 trained on a 2x2 data x
tensor grid, saved, loaded into ZeRO-3 on a line of 4 and trained on. The loss was off from the
first step; the checkpoint was innocent (a grouped-query attention rule was wrong in grad mode
only), so each write path here is followed by training steps with autograd, not only a check
of the values written.
"""
import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp

import globaltensor as gt
from globaltensor.errors import GlobalTensorError
from globaltensor.testing import run_ranks

transformers = pytest.importorskip(
    "transformers", reason="HF transformers is a test dependency (pip install -e '.[test]')")

S, B = gt.sbp.split, gt.sbp.broadcast
VOCAB, FIRST, THEN = 96, 2, 2
IDS = torch.randint(0, VOCAB, (8, 12), generator=torch.Generator().manual_seed(1))
GRID = gt.placement("cpu", [[0, 1], [2, 3]])
LINE = gt.placement("cpu", [0, 1, 2, 3])
PATHS = ("dcp", "gt.checkpoint", "data", "copy_", "to_local", "load_state_dict")


def qwen2(seed):
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
        tie_word_embeddings=False)).double()


def tp(name, t):
    """2x2: data parallel on axis 0, 2-D weights split by rows on axis 1."""
    return (B, S(0)) if t.dim() == 2 else (B, B)


def zero3(name, t):
    return S(0)


def train(model, opt, ids, steps):
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def write(path, dst, src, src_opt, dst_opt, folder):
    """Put ``src``'s parameter values into ``dst`` (another layout) by ``path``."""
    if path == "dcp":
        dcp.save(src.state_dict(), checkpoint_id=folder)
        state = dst.state_dict()
        dcp.load(state, checkpoint_id=folder)
    elif path == "gt.checkpoint":
        gt.checkpoint.save(folder, model=src, optimizer=src_opt)
        gt.checkpoint.load(folder, model=dst, optimizer=dst_opt)
    elif path == "load_state_dict":
        dst.load_state_dict({k: v.full_tensor() for k, v in src.state_dict().items()})
    else:
        mine = dict(dst.named_parameters())
        for name, value in src.named_parameters():
            p = mine[name]
            moved = value.detach().to_global(placement=p.placement, sbp=p.sbp)
            if path == "data":
                p.data = moved
            with torch.no_grad():
                if path == "copy_":
                    p.copy_(value.detach().to_global(placement=p.placement, sbp=B))
                elif path == "to_local":
                    p.to_local().copy_(moved.to_local())


@pytest.fixture(scope="module")
def expected():
    """One process: FIRST steps, then THEN more with the same optimizer (a resume), and THEN
    steps from the FIRST-step weights with a fresh optimizer (a write of the weights only)."""
    model = qwen2(0)
    opt = adamw(model)
    first = train(model, opt, IDS, FIRST)
    fresh = copy.deepcopy(model)
    resumed = train(model, opt, IDS, THEN)
    return first, resumed, train(fresh, adamw(fresh), IDS, THEN)


@pytest.mark.slow  # a long case: run with pytest -m slow (suite time)
def test_every_write_path_then_grad_mode_training_equals_one_process(expected, tmp_path):
    first, resumed, fresh = expected
    base = qwen2(0)
    other = qwen2(7)  # the destination's own values: every one must be overwritten

    def body(rank):
        src = copy.deepcopy(base)
        gt.nn.to_global(src, GRID, tp)
        src_opt = adamw(src)
        got = {"source": train(src, src_opt, gt.tensor(IDS, placement=GRID, sbp=(S(0), B)),
                               FIRST)}
        ids = gt.tensor(IDS, placement=LINE, sbp=S(0))
        for path in PATHS:
            dst = copy.deepcopy(other)
            gt.nn.to_global(dst, LINE, zero3)
            dst_opt = adamw(dst)
            write(path, dst, src, src_opt, dst_opt, str(tmp_path / path))
            got[path] = train(dst, dst_opt, ids, THEN)
        return got

    got = run_ranks(body, 4, timeout=300)[0]
    assert got["source"] == pytest.approx(first, rel=1e-6)
    for path in PATHS:
        want = resumed if path == "gt.checkpoint" else fresh
        assert got[path] == pytest.approx(want, rel=1e-6), f"{path}: {got[path]} vs {want}"


@pytest.mark.parametrize("how", ["to_global", "fully_shard", "to_local"])
def test_an_optimizer_built_before_the_layout_is_refused_at_its_first_step(how):
    """FSDP2's documented trap, refused: the optimizer holds the parameters module.to_global /
    fully_shard / to_local replaced, so its step would update the old tensors and train
    nothing. Every rank gets the error at the first step (no communication needed)."""
    def body(rank):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        if how == "to_local":
            model.to_global(gt.placement("cpu", [0, 1]), gt.sbp.broadcast)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        placement = gt.placement("cpu", [0, 1])
        if how == "to_global":
            model.to_global(placement, gt.sbp.broadcast)
        elif how == "fully_shard":
            gt.nn.fully_shard(model, placement)
        else:
            model.to_local()
        try:
            opt.step()
        except GlobalTensorError as e:
            return str(e)
        return None
    for message in run_ranks(body, 2, timeout=60):
        assert message is not None and "built before" in message and "'0.weight'" in message
        assert "opt = torch.optim.AdamW(model.parameters())" in message


def test_an_optimizer_built_after_the_layout_steps_and_the_old_one_is_forgotten():
    def body(rank):
        placement = gt.placement("cpu", [0, 1])
        model = torch.nn.Linear(4, 2).to_global(placement, gt.sbp.broadcast)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model(gt.ones(3, 4, placement=placement, sbp=gt.sbp.split(0))).sum().backward()
        before = model.weight.detach().full_tensor().clone()
        opt.step()
        return (model.weight.detach().full_tensor() - before).abs().sum().item()
    assert all(moved > 0 for moved in run_ranks(body, 2, timeout=60))
