"""Checkpoints across real processes: a job started by the launcher saves global tensors with
gt.checkpoint (each process writes its own file), then this process (no world) loads them into
plain tensors; the job itself loads them back on another layout. One launch: a process start
costs seconds here."""
import os

import torch

import globaltensor as gt
from globaltensor.testing import run_script

SCRIPT = r'''
import sys
import torch
import globaltensor as gt

S, B = gt.sbp.split, gt.sbp.broadcast
gt.init()
path = sys.argv[1]
full = torch.arange(7 * 5, dtype=torch.float64).reshape(7, 5)


def model(w, b):
    m = torch.nn.Module()
    m.w, m.b = torch.nn.Parameter(w), torch.nn.Parameter(b)
    return m


saved = model(full.clone(), torch.arange(3.0))
saved.to_global(gt.placement("cpu", [0, 1]), lambda n, t: S(0) if n == "w" else B)
gt.checkpoint.save(path, model=saved, extra={"job": "first"})
print("piece", tuple(saved.w.to_local().shape))

other = model(torch.zeros(7, 5, dtype=torch.float64), torch.zeros(3))
other.to_global(gt.placement("cpu", [1, 0]), lambda n, t: S(1) if n == "w" else S(0))
extra = gt.checkpoint.load(path, model=other)
print("loaded", extra["job"], torch.equal(other.w.full_tensor(), full),
      other.b.full_tensor().tolist(), tuple(other.w.to_local().shape))
'''


def test_a_launched_job_saves_its_pieces_and_loads_them_resharded_and_so_does_one_process(tmp_path):
    path = str(tmp_path / "ckpt")
    run = run_script(SCRIPT, 2, args=[path], timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    for rank, rows, cols in ((0, 4, 2), (1, 3, 3)):  # rank 1 is coordinate 0 of [1, 0]
        assert run.rank_lines(rank) == [f"piece ({rows}, 5)",
                                        f"loaded first True [0.0, 1.0, 2.0] (7, {cols})"]
    files = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))
    assert files == ["__0_0.distcp", "__1_0.distcp"]  # one file per process

    model = torch.nn.Module()  # this process: no world, plain tensors
    model.w = torch.nn.Parameter(torch.zeros(7, 5, dtype=torch.float64))
    model.b = torch.nn.Parameter(torch.zeros(3))
    assert gt.checkpoint.load(path, model=model) == {"job": "first"}
    assert torch.equal(model.w, torch.arange(35, dtype=torch.float64).reshape(7, 5))
    assert model.b.tolist() == [0.0, 1.0, 2.0]
