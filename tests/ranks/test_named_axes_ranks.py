"""Named axes on real ranks: p["tp"] is this rank's row, sbp by name in to_global and factories,
and a Megatron MLP laid out with gt.nn.sbp_plan(colwise, rowwise) matching one process."""
import torch

import globaltensor as gt
from globaltensor.testing import run_ranks

S, B, P = gt.sbp.S, gt.sbp.B, gt.sbp.P
TIMEOUT = 60


def grid():
    return gt.placement("cpu", [[0, 1], [2, 3]], axes=("dp", "tp"))


def test_sub_placement_and_sbp_by_name():
    def body(rank):
        p = grid()
        x = gt.arange(8.0, placement=p, sbp={"tp": S(0)})
        y = torch.ones(2).to_global(placement=p, sbp={"dp": S(0), "tp": S(0)})
        z = x.to_global(sbp={"dp": S(0)})
        return (p["tp"].ranks.tolist(), p["dp"].ranks.tolist(), x.sbp, x.to_local().tolist(),
                y.shape, z.sbp, z.to_local().tolist(), repr(z.sbp))
    results = run_ranks(body, 4, timeout=TIMEOUT)
    rows = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    cols = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    for rank, (tp, dp, sbp, local, shape, zsbp, zlocal, shown) in enumerate(results):
        assert tp == rows[rank] and dp == cols[rank]
        assert sbp == (B, S(0)) and local == [[0., 1., 2., 3.], [4., 5., 6., 7.]][rank % 2]
        assert shape == torch.Size([8]) and zsbp == (S(0), B) and shown == "(S(0), B)"
        assert zlocal == [[0., 1., 2., 3.], [4., 5., 6., 7.]][rank // 2]


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.up = torch.nn.Linear(6, 8)
        self.down = torch.nn.Linear(8, 3)
        for t in self.parameters():
            t.data = torch.randn(t.shape, generator=g)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_colwise_rowwise_mlp_matches_one_process():
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    reference = MLP()
    reference(x).square().mean().backward()

    def body(rank):
        model = MLP().to_global(grid(), gt.nn.sbp_plan({"up": gt.nn.colwise("tp"),
                                                        "down": gt.nn.rowwise("tp")}))
        gx = gt.tensor(x, placement=grid(), sbp={"dp": S(0)})
        out = model(gx)
        out.square().mean().backward()
        return (out.full_tensor(), model.up.weight.sbp, model.up.bias.sbp, model.down.weight.sbp,
                model.down.bias.sbp, model.up.weight.grad.full_tensor())
    for out, up_w, up_b, down_w, down_b, grad in run_ranks(body, 4, timeout=TIMEOUT):
        assert torch.allclose(out, reference(x), atol=1e-5)
        assert up_w == up_b == (B, S(0)) and down_w == (B, S(1)) and down_b == (B, B)
        assert torch.allclose(grad, reference.up.weight.grad, atol=1e-5)
