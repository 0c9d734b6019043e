"""The classic trap: ``if rank == 0: print(loss.item())``. ``item()`` is collective, so rank 0
waits in it for rank 1, which has gone on to the next step's global operation."""
import globaltensor as gt

gt.init()
p = gt.placement.all("cpu")
w = gt.ones(4, 3, placement=p, sbp=gt.sbp.broadcast)
for step in range(3):
    x = gt.ones(8, 4, placement=p, sbp=gt.sbp.split(0)) * (step + 1)
    loss = (x @ w).sum()
    if gt.env.get_rank() == 0:
        print(f"step {step}: loss {loss.item()}", flush=True)
print("done", flush=True)
