"""A head-tail split (``S(d, head_tail)``) beyond attention, on 4 thread-ranks: factories and
random draws give each rank its own positions' values (the same global value as any layout),
a checkpoint saves it in order and refuses to load into it (nothing written), a pipeline hands
it between its stages, and gt.visualize draws its two ranges (docs/sbp.md, "The head-tail
split")."""
import pytest
import torch

import globaltensor as gt
from globaltensor.testing import run_ranks
from helpers import two_stage_losses

S, B = gt.sbp.S, gt.sbp.broadcast
HT = S(0, "head_tail")
LINE = gt.placement("cpu", [0, 1, 2, 3])


def test_factories_and_random_draws_hold_their_positions_values():
    def body(rank):
        gt.manual_seed(3)
        a = gt.randn(13, placement=LINE, sbp=HT)
        gt.manual_seed(3)
        b = gt.randn(13, placement=LINE, sbp=S(0))
        gt.manual_seed(5)
        p = gt.randperm(13, placement=LINE, sbp=HT).full_tensor()
        gt.manual_seed(5)
        q = gt.randperm(13, placement=LINE, sbp=B).full_tensor()
        r = gt.arange(13, placement=LINE, sbp=HT)
        t = gt.tensor(torch.arange(10.0), placement=LINE, sbp=HT)
        e = gt.eye(5, placement=LINE, sbp=HT).full_tensor()
        return (torch.equal(a.full_tensor(), b.full_tensor()), torch.equal(p, q),
                r.to_local().tolist(), t.to_local().tolist(), torch.equal(e, torch.eye(5)),
                gt.visualize(r))
    results = run_ranks(body, 4, timeout=60)
    # 13 over 4: pieces of 4, 3, 3, 3; heads 2, 2, 2, 2 from the start, tails 2, 1, 1, 1 from
    # the end; 10 over 4: pieces 3, 3, 2, 2
    assert [r[2] for r in results] == [[0, 1, 11, 12], [2, 3, 10], [4, 5, 9], [6, 7, 8]]
    assert [r[3] for r in results] == [[0.0, 1.0, 9.0], [2.0, 3.0, 8.0], [4.0, 7.0], [5.0, 6.0]]
    for same_draw, same_perm, _, _, eye, picture in results:
        assert same_draw and same_perm and eye
        assert "rank 0 at (0,): [0:2+11:13]" in picture


def test_a_checkpoint_saves_a_head_tail_tensor_in_order_and_refuses_to_load_into_one(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    where = str(tmp_path / "ckpt")

    def body(rank):
        x = gt.tensor(torch.arange(26.0).reshape(13, 2), placement=LINE, sbp=HT)
        dcp.save({"x": x}, checkpoint_id=where)
        y = gt.zeros(13, 2, placement=LINE, sbp=S(0))
        dcp.load({"x": y}, checkpoint_id=where)
        z = gt.zeros(13, 2, placement=LINE, sbp=HT)
        with pytest.raises(CheckpointException):  # (DCP rewords our ValueError as its own)
            dcp.load({"x": z}, checkpoint_id=where)
        assert not z.full_tensor().any()  # untouched
        return y.full_tensor()
    for got in run_ranks(body, 4, timeout=60):
        assert torch.equal(got, torch.arange(26.0).reshape(13, 2))


def test_a_pipeline_hands_head_tail_activations_between_its_stages():
    """Two stages on [0, 1] and [2, 3], the sequence of every micro-batch head-tail split on
    both (the stages' point-to-point exchange moves the permuted pieces as they are): three
    AdamW steps, the losses of one process."""
    import copy
    import torch.nn as nn
    import torch.nn.functional as F
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Sequential(nn.Linear(16, 8))]
    x, y = torch.randn(4, 10, 8), torch.randn(4, 10, 8)
    want = two_stage_losses(stages, x, y)

    def body(rank):
        gt.init()
        first, second = copy.deepcopy(stages)
        left, right = gt.placement("cpu", [0, 1]), gt.placement("cpu", [2, 3])
        first.to_global(left)
        second.to_global(right)
        pipe = gt.nn.Pipeline([first, second], microbatches=2, schedule="1f1b")
        opt = torch.optim.AdamW(list(pipe.parameters()), lr=0.01)
        gx = gt.tensor(x, placement=left, sbp=S(1, "head_tail"))
        gy = gt.tensor(y, placement=right, sbp=S(1, "head_tail"))
        got = []
        for _ in range(3):
            opt.zero_grad()
            got.append(pipe.step(gx, target=gy, loss_fn=F.mse_loss))
            opt.step()
        return got
    for got in run_ranks(body, 4, timeout=60):
        assert got == pytest.approx(want, rel=1e-5)
