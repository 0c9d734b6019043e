"""Tensor parallel + data parallel training of a 2-layer MLP with global tensors.

    python launch.py --nproc_per_node 4 examples/quickstart.py      # any number of ranks works

The ranks form a grid with named axes ("dp", "tp"): 2x2 on 4 ranks (N/2 x 2 on an even N, N x 1
on an odd one). Axis "dp" is data parallel: gt.data.loader splits each batch of samples along it
(S(0)) and the weights are broadcast, so their gradients are summed across it. Axis "tp" is
Megatron-style tensor parallel: W1 (in, hidden) is S(1) by columns, W2 (hidden, out) is S(0) by
rows, so ``relu(x @ W1)`` stays split by hidden units and ``@ W2`` gives partial sums -- the only
communication of the forward pass is reducing them. No wrapper, no hand-written collective: the
layouts say it all. The script also trains the same model in one process on the same batches
(the loader's order depends on the seed only) and prints the largest difference between the two
loss curves.
"""
import torch
import torch.nn.functional as F

import globaltensor as gt

S, B = gt.sbp.S, gt.sbp.B
STEPS, BATCH, SAMPLES, IN, HIDDEN, OUT = 20, 32, 128, 16, 64, 4


class MLP(torch.nn.Module):
    def __init__(self, gen: torch.Generator):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(IN, HIDDEN, generator=gen) / IN ** 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(HIDDEN, OUT, generator=gen) / HIDDEN ** 0.5)

    def forward(self, x):
        return torch.relu(x @ self.w1) @ self.w2


def layout_of(name, tensor):
    """The sbp of each parameter on the "tp" axis (broadcast on "dp": not named)."""
    return {"w1": {"tp": S(1)}, "w2": {"tp": S(0)}}[name]


def batches(loader):
    """``STEPS`` batches, epoch after epoch."""
    while True:
        for batch in loader:
            yield batch


def train(model, data):
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for _, (x, y) in zip(range(STEPS), data):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())  # collective on global tensors: every rank gets the value
    return losses


def grid_for(world_size):
    tp = 2 if world_size % 2 == 0 else 1
    return gt.placement("cpu", torch.arange(world_size).reshape(-1, tp).tolist(), axes=("dp", "tp"))


def run():
    """Train on the grid and in one process; returns both loss curves and the model."""
    grid = grid_for(gt.env.get_world_size())
    gen = torch.Generator().manual_seed(0)               # the same full values on every rank
    dataset = torch.utils.data.TensorDataset(torch.randn(SAMPLES, IN, generator=gen),
                                             torch.randn(SAMPLES, OUT, generator=gen))
    model = MLP(gen)
    reference = MLP(gen)
    reference.load_state_dict(model.state_dict())

    model.to_global(grid, layout_of)                     # full values -> laid out by layout_of
    loader = gt.data.loader(dataset, grid, BATCH, sbp={"dp": S(0)}, seed=0)  # batch split on dp
    losses = train(model, batches(loader))
    # the same batches in one process: the loader's order depends on the seed and epoch only
    one = torch.utils.data.DataLoader(dataset, batch_sampler=[
        gt.data.sample_order(SAMPLES, True, 0, epoch)[i:i + BATCH]
        for epoch in range(-(-STEPS * BATCH // SAMPLES)) for i in range(0, SAMPLES, BATCH)])
    single = train(reference, iter(one))
    return losses, single, model


def main():
    gt.init()
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
