"""torch.compile of a model gt.nn.fully_shard sharded, as users spell it (``torch.compile(model)``),
in real processes (a compiled graph is this rank's own: thread-ranks would share dynamo's cache):
the same losses and parameters as one process, on a line of 2 and on a 2x2 grid with tensor
parallelism on "tp" first. The units' gathers and reduce-scatters run between graphs, as
FSDP2's hooks do (docs/fully_shard.md)."""
import copy

import pytest
import torch

import globaltensor as gt

from helpers import REF_NET, X_NET, assert_matches, full_state, one_process, shard

S, B = gt.sbp.split, gt.sbp.broadcast


def _train_compiled(local_rank, grid):
    gt.init()
    if grid == "line":
        placement, axis, sbp = gt.placement("cpu", [0, 1]), None, S(0)
        m = copy.deepcopy(REF_NET)
    else:
        placement = gt.placement("cpu", [[0, 1], [2, 3]], axes=("dp", "tp"))
        axis, sbp = "dp", (S(0), B)
        m = copy.deepcopy(REF_NET)
        m.to_global(placement, gt.nn.sbp_plan({"layers.*.up": gt.nn.colwise("tp"),
                                               "layers.*.down": gt.nn.rowwise("tp")}))
    m = shard(m, placement, axis)
    compiled = torch.compile(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        loss = compiled(X_NET.to_global(placement, sbp)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, full_state(m)


# both behind -m slow (suite time): the default run compiles a sharded HF Llama per block
# (test_fully_shard_compile_hf.py), the same mechanism on a model users have
@pytest.mark.slow
@pytest.mark.parametrize("grid", ["line", "2x2"])
def test_torch_compile_of_a_sharded_model_equals_one_process(grid):
    expected = one_process(REF_NET)
    world = 2 if grid == "line" else 4
    for got in gt.spawn(_train_compiled, args=(grid,), nproc_per_node=world, timeout=600):
        assert_matches(expected, got)
