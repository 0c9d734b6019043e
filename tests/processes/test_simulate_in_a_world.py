"""gt.simulate inside a process that has joined a real world (issue 54, item 4): a notebook
after gt.init(), or rank 0 of a real job asking "and on 64 ranks?". The real world is set aside
for the block and comes back after it, also after an exception: its collectives, its groups
(found by name, as functional collectives find them) and its rank are those from before."""
import torch
import torch.distributed as dist

import globaltensor as gt

S, B = gt.sbp.split, gt.sbp.broadcast


def _simulate_inside(local_rank):
    gt.init()
    p = gt.placement("cpu", [0, 1])
    before = gt.ones(4, 4, placement=p, sbp=S(0)).sum().item()
    with gt.simulate(64) as sim:
        grid = gt.placement("cpu", [list(range(32)), list(range(32, 64))], axes=("dp", "tp"))
        model = torch.nn.Linear(256, 256).to_global(grid, gt.nn.colwise("tp"))
        x = torch.randn(64, 256).to_global(grid, (S(0), B))
        model(x).sum().backward()
        inside = (gt.env.get_world_size(), gt.env.get_rank())
    try:
        with gt.simulate(8):
            raise KeyError("inside the block")
    except KeyError:
        pass
    after = gt.ones(4, 4, placement=p, sbp=S(0)).sum().item()  # the real world's all-reduce
    t = torch.full((1,), float(local_rank + 1))
    dist.all_reduce(t)
    name = dist.distributed_c10d._get_default_group().group_name
    resolved = torch._C._distributed_c10d._resolve_process_group(name)
    return (before, after, inside, sim.peak_bytes(5, "parameters"), t.item(),
            dist.get_world_size(), resolved is dist.distributed_c10d._get_default_group())


def test_a_simulation_inside_a_joined_world_sets_it_aside_and_gives_it_back():
    for rank, (before, after, inside, params, summed, world, same_group) in enumerate(
            gt.spawn(_simulate_inside, nproc_per_node=2, timeout=120)):
        assert before == after == 16.0
        assert inside == (64, 0)
        assert params == (256 * 256 + 256) * 4 // 32  # colwise over 32 tp ranks
        assert summed == 3.0 and world == 2 and same_group, rank
