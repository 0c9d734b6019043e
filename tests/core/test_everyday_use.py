"""Everyday use, in one process: rank-0 output, GT_TIMEOUT, TORCH_DISTRIBUTED_DEBUG, SLURM's
variables, one spelling of sbp, the version (real processes: tests/processes/test_launcher_everyday_use.py;
thread-ranks: tests/ranks/tools/test_comm_trace_ranks.py)."""
import datetime
import pathlib
import tomllib

import pytest

import globaltensor as gt
from globaltensor import debug
from globaltensor.world import world
from globaltensor.errors import GlobalTensorError

from helpers import ROOT


@pytest.mark.parametrize("rank, printed", [("0", "a 1 b!"), ("1", "")])
def test_print0_and_rank_zero_only_follow_the_rank(rank, printed, monkeypatch, capsys):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    gt.print0("a", 1, "b", end="!")

    @gt.env.rank_zero_only
    def save(path):
        """Writes a file."""
        return f"saved {path}"

    assert capsys.readouterr().out == printed
    assert save("ckpt") == ("saved ckpt" if rank == "0" else None)
    assert save.__name__ == "save" and save.__doc__ == "Writes a file."


def test_gt_timeout_sets_the_default_and_cpu_jobs_wait_five_minutes(monkeypatch):
    monkeypatch.delenv("GT_TIMEOUT", raising=False)
    assert world.default_timeout("gloo") == datetime.timedelta(seconds=300)
    assert world.default_timeout("cpu:gloo,cuda:nccl") is None  # torch's own NCCL default
    monkeypatch.setenv("GT_TIMEOUT", "7.5")
    assert world.default_timeout("gloo") == datetime.timedelta(seconds=7.5)
    assert world.default_timeout("nccl") == datetime.timedelta(seconds=7.5)
    for bad in ("soon", "0", "-3"):
        monkeypatch.setenv("GT_TIMEOUT", bad)
        with pytest.raises(GlobalTensorError, match=f"expected GT_TIMEOUT to be a number of "
                                                    f"seconds > 0, found '{bad}'"):
            world.default_timeout("gloo")


@pytest.mark.parametrize("gt_debug, torch_debug, on", [
    ("", "DETAIL", True), ("", "INFO", False), ("0", "DETAIL", False), ("1", "", True),
    ("", "", False)])
def test_torch_distributed_debug_detail_turns_checks_on(gt_debug, torch_debug, on, monkeypatch):
    monkeypatch.setenv("GT_DEBUG", gt_debug)
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", torch_debug)
    assert debug._env_flag() is on


def test_slurm_variables_give_the_world_as_lightning_reads_them():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_JOB_NODELIST": "gpu[017-020,031],login1", "SLURM_JOB_ID": "4812345",
           "SLURM_NTASKS_PER_NODE": "2"}
    assert world.slurm_env(env) == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "NODE_RANK": "2",
        "MASTER_ADDR": "gpu017", "MASTER_PORT": str(15000 + 2345), "LOCAL_WORLD_SIZE": "2"}
    kept = world.slurm_env({**env, "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "29400"})
    assert (kept["MASTER_ADDR"], kept["MASTER_PORT"]) == ("10.1.1.1", "29400")
    assert world.slurm_env({"SLURM_JOB_ID": "1"}) == {}  # salloc / sbatch without srun
    assert [world.first_node(n) for n in ("node[7]", "a,b", "host1", "n[1-2],m[3-4]")] == \
        ["node7", "a", "host1", "n1"]
    with pytest.raises(GlobalTensorError, match="SLURM variables behind RANK to be integers"):
        world.slurm_env({"SLURM_PROCID": "x", "SLURM_NTASKS": "2"})


def test_one_spelling_of_sbp_in_messages():
    S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
    assert gt.sbp.format_sbp((S(0),)) == "(S(0),)"
    assert gt.sbp.format_sbp((S(0), B)) == "(S(0), B)"
    assert debug.fact_text((P,)) == "(P,)"
    layout = gt.Layout(gt.placement("cpu", [0, 1]), (S(0),), (4,))
    assert repr(layout) == "Layout(placement('cpu', ranks=[0, 1]), (S(0),), [4])"
    with pytest.raises(GlobalTensorError, match=r"sbp \(S\(3\),\)"):
        gt.Layout(gt.placement("cpu", [0, 1]), (S(3),), (4,))


def test_version_is_one_value_everywhere():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["dynamic"] == ["version"] and meta["scripts"] == {"gtrun": "globaltensor.launch:main"}
    assert gt.__version__ == "0.1.0"
    assert pathlib.Path(gt.__file__).with_name("__main__.py").is_file()
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
