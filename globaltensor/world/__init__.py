"""The job: joining it, this process's place in it, and leaving it cleanly.

    world.py   gt.init: the process group of the world (launch.py / torchrun / SLURM / a world
               of 1), this rank (cached), the world's size and collective timeout
    exits.py   gt.init's closing rendezvous; at exit every rank closes its groups and rank 0
               (the store host) waits for the others
    simulated.py  gt.simulate's world: torch's fake process group, nothing sent
    threads.py work a rank hands to a thread of its own: the world carried there
    stalls.py  what each rank waits in, published to the store by a daemon thread; the stall
               report (GT_STALL_REPORT) naming the ranks and lines that do not progress

Effects: one of the packages that call torch.distributed (with runtime/, comm/, checkpoint/
and launch/).
"""
