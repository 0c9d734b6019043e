"""Rank 1 runs one step more than rank 0 (a loop whose length differs by rank): its extra
``.item()`` waits for rank 0, which has finished (tests/processes/test_launcher_everyday_use.py)."""
import globaltensor as gt

gt.init()
p = gt.placement("cpu", [0, 1])
x = gt.ones(4, placement=p, sbp=gt.sbp.split(0))
steps = 3 if gt.env.get_rank() == 0 else 4
for s in range(steps):
    v = (x * s).sum().item()
print("rank", gt.env.get_rank(), "done", flush=True)
