"""After dist.destroy_process_group(), globaltensor keeps no process group alive: a gloo group
freed at interpreter exit instead can abort a finished rank ("terminate called without an
active exception", exit code 134)."""
import gc
import weakref

import torch
import torch.distributed as dist

import globaltensor as gt
from globaltensor.testing import run_ranks

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


def test_destroyed_world_and_its_groups_are_freed():
    def body(rank):
        grid = gt.placement("cpu", [[0, 1], [2, 3]])
        x = gt.randn(8, 8, placement=grid, sbp=(S(0), S(1)))
        values = [
            (x @ x).to_global(sbp=(B, B)),
            x.to_global(sbp=(S(0), S(0))),                        # all_to_all: subgroups
            x.to_global(sbp=(P, B)).to_global(sbp=(S(1), S(0))),
            x.to_global(placement=gt.placement("cpu", [0, 1, 2, 3]), sbp=S(0)).to_global(sbp=P)
             .to_global(sbp=B),                                  # the world's own group
        ]
        total = gt.comm.all_reduce(torch.ones(2))
        assert gt.env.get_rank() == rank and total.tolist() == [4.0, 4.0]
        del x, values
        c10d = dist.distributed_c10d
        groups = [weakref.ref(pg) for pg in c10d._world.pg_map]
        assert len(groups) >= 2  # the world, and the group of the all_to_all (axis 1)
        dist.destroy_process_group()
        gc.collect()
        return [g() is None for g in groups]

    for freed in run_ranks(body, 4, timeout=60):
        assert all(freed), freed
