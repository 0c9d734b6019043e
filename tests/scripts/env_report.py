"""Join the world with gt.init(), report what this rank sees as one JSON line, all_reduce once."""
import json
import os
import sys

import torch
import torch.distributed as dist

import globaltensor as gt

gt.init()
t = torch.tensor([float(gt.env.get_rank() + 1)])
dist.all_reduce(t)
names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
         "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"]
report = {
    "env": {n: os.environ.get(n) for n in names},
    "rank": gt.env.get_rank(),
    "world_size": gt.env.get_world_size(),
    "local_rank": gt.env.get_local_rank(),
    "local_world_size": gt.env.get_local_world_size(),
    "node_rank": gt.env.get_node_rank(),
    "all_reduce": t.item(),
    "unbuffered": sys.stdout.write_through,
    "argv": sys.argv[1:],
}
print("REPORT " + json.dumps(report))
print(f"stderr of rank {gt.env.get_rank()}", file=sys.stderr)
dist.destroy_process_group()
