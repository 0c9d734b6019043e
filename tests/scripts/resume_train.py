"""A tiny job that resumes from its last checkpoint when the launcher restarts it (the pattern of
docs/launcher.md, "Restarts and resuming"): a 2-layer MLP, tensor parallel on 2 ranks, trained
STEPS steps with AdamW; every step is saved with gt.checkpoint to CKPT/step_<N>, and a start loads
the latest one.

    resume_train.py CKPT OUT [FAIL_RANK FAIL_STEP]

With FAIL_RANK and FAIL_STEP, that rank raises at the start of step FAIL_STEP of the first attempt
only (TORCHELASTIC_RESTART_COUNT 0). Rank 0 prints what it resumed from and each step's loss,
and saves the final parameters (full values) to OUT.
"""
import os
import sys

import torch
import torch.nn.functional as F

import globaltensor as gt

S, B = gt.sbp.split, gt.sbp.broadcast
STEPS = 5
ckpt, out = sys.argv[1], sys.argv[2]
fail_rank, fail_step = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (-1, -1)
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])

gt.init()
rank = gt.env.get_rank()
grid = gt.placement("cpu", [0, 1])
gen = torch.Generator().manual_seed(0)
model = torch.nn.Module()
model.w1 = torch.nn.Parameter(torch.randn(4, 8, generator=gen) / 2)
model.w2 = torch.nn.Parameter(torch.randn(8, 2, generator=gen) / 3)
model.to_global(grid, lambda name, t: S(1) if name == "w1" else S(0))
opt = torch.optim.AdamW(model.parameters(), lr=0.05)


def latest_step(folder):
    """The last step saved in ``folder`` (0: none). gt.checkpoint moves a checkpoint to its
    path only once complete, so a save cut short (``step_3.saving``) does not count."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return max((int(n[5:]) for n in names if n.startswith("step_") and n[5:].isdigit()), default=0)


start = latest_step(ckpt)
if start:
    gt.checkpoint.load(f"{ckpt}/step_{start}", model=model, optimizer=opt)
gt.print0(f"attempt {attempt}: resuming after step {start}")
for step in range(start + 1, STEPS + 1):
    if rank == fail_rank and step == fail_step and attempt == 0:
        raise RuntimeError(f"rank {rank} fails at step {step} on attempt {attempt}")
    g = torch.Generator().manual_seed(100 + step)  # the batch of a step, whatever the attempt
    x = gt.tensor(torch.randn(8, 4, generator=g), placement=grid, sbp=B)
    y = gt.tensor(torch.randn(8, 2, generator=g), placement=grid, sbp=B)
    loss = F.mse_loss(torch.relu(x @ model.w1) @ model.w2, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    value = loss.item()  # collective: every rank calls it
    gt.checkpoint.save(f"{ckpt}/step_{step}", model=model, optimizer=opt, extra={"step": step})
    gt.print0(f"step {step} loss {value!r}")
final = {name: p.full_tensor() for name, p in model.named_parameters()}  # collective
if rank == 0:
    torch.save(final, out)
