"""Tensor parallel + data parallel training of a 2-layer MLP with global tensors.

    python launch.py --nproc_per_node 4 examples/quickstart.py

Four ranks form a 2x2 grid. Placement axis 0 is data parallel: the batch is split(0) along it
and the weights are broadcast, so their gradients are summed across it. Axis 1 is Megatron-style
tensor parallel: W1 (in, hidden) is split(1) by columns, W2 (hidden, out) is split(0) by rows, so
``relu(x @ W1)`` stays split by hidden units and ``@ W2`` gives partial sums -- the only
communication of the forward pass is reducing them. No wrapper, no hand-written collective: the
layouts say it all. The script also trains the same model in one process and prints the largest
difference between the two loss curves.
"""
import torch
import torch.nn.functional as F

import globaltensor as gt

S, B = gt.sbp.split, gt.sbp.broadcast
STEPS, BATCH, IN, HIDDEN, OUT = 20, 32, 16, 64, 4


class MLP(torch.nn.Module):
    def __init__(self, gen: torch.Generator):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(IN, HIDDEN, generator=gen) / IN ** 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(HIDDEN, OUT, generator=gen) / HIDDEN ** 0.5)

    def forward(self, x):
        return torch.relu(x @ self.w1) @ self.w2


def layout_of(name, tensor):
    """(data-parallel axis, tensor-parallel axis) for each parameter."""
    return {"w1": (B, S(1)), "w2": (B, S(0))}[name]


def train(model, x, y):
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for _ in range(STEPS):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())  # collective on global tensors: every rank gets the value
    return losses


def run():
    """Train on the 2x2 grid and in one process; returns both loss curves and the model."""
    grid = gt.placement("cpu", ranks=[[0, 1], [2, 3]])   # axis 0: data parallel, axis 1: tensor parallel
    gen = torch.Generator().manual_seed(0)               # the same full values on every rank
    x, y = torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, OUT, generator=gen)
    model = MLP(gen)
    reference = MLP(gen)
    reference.load_state_dict(model.state_dict())

    model.to_global(grid, layout_of)                     # full values -> laid out by layout_of
    gx = gt.tensor(x, placement=grid, sbp=(S(0), B))     # batch split across data parallel
    gy = gt.tensor(y, placement=grid, sbp=(S(0), B))
    losses = train(model, gx, gy)
    single = train(reference, x, y)                      # the same training in one process
    return losses, single, model


def main():
    gt.init()
    if gt.env.get_world_size() != 4:
        raise SystemExit("run me on 4 ranks: python launch.py --nproc_per_node 4 examples/quickstart.py")
    losses, single, model = run()
    if gt.env.get_rank() == 0:
        print(f"W1 {gt.sbp.format_sbp(model.w1.sbp)}: local piece {tuple(model.w1.to_local().shape)} "
              f"of {tuple(model.w1.shape)}")
        print(f"W2 {gt.sbp.format_sbp(model.w2.sbp)}: local piece {tuple(model.w2.to_local().shape)} "
              f"of {tuple(model.w2.shape)}")
        print("step  global loss   single-process loss")
        for step, (a, b) in enumerate(zip(losses, single)):
            print(f"{step:4d}  {a:.8f}  {b:.8f}")
        diff = max(abs(a - b) for a, b in zip(losses, single))
        print(f"max |difference| over {STEPS} steps: {diff:.2e}  ({'OK' if diff < 1e-5 else 'MISMATCH'})")


if __name__ == "__main__":
    main()
