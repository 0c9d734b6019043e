"""The launcher's options, environment, commands and reports, in one process: nothing here starts
a rank (faults and real launchers: tests/processes/test_launch_processes.py)."""
import pathlib
import signal
import sys

import pytest

from globaltensor import launch
from globaltensor.launch import supervise
from globaltensor.launch import LaunchConfig, LaunchError, parse_args
from globaltensor.testing import CompletedRun

from helpers import BEHAVE


# --------------------------------------------------------------------------- options (pure)


def test_parse_args_passes_script_options_through():
    c = parse_args(["--nproc_per_node", "4", "train.py", "--lr", "0.1", "-m", "--timeout", "3"])
    assert c == LaunchConfig(nproc_per_node=4, script="train.py",
                             script_args=("--lr", "0.1", "-m", "--timeout", "3"))
    assert c.world_size == 4 and c.master_port is None and c.timeout is None


@pytest.mark.parametrize("argv, message", [
    (["--nproc_per_node", "0", "s.py"], "--nproc_per_node >= 1, found 0"),
    (["--nnodes", "2", "--node_rank", "2", "--nproc_per_node", "1", "s.py"],
     "found --node_rank 2 with --nnodes 2"),
    (["--nproc_per_node", "1", "-m", "--no_python", "s"], "at most one of -m and --no_python"),
    (["--nproc_per_node", "1", "--redirect_stdout_and_stderr", "s.py"], "found no --logdir"),
    (["--nproc_per_node", "1", "--master_port", "70000", "s.py"], "found 70000"),
    (["--nproc_per_node", "1", "--timeout", "0", "s.py"], "--timeout > 0 seconds"),
    (["--nproc_per_node", "1", "--master_addr", "", "s.py"], "a host name or address, found ''"),
])
def test_bad_options_are_clear_errors(argv, message, capsys):
    with pytest.raises(LaunchError, match="expected .*" + message.replace("-", r"\-")):
        parse_args(argv)
    assert launch.main(argv) == 2
    assert message in capsys.readouterr().err


def test_rank_env_places_each_rank_in_the_world():
    c = LaunchConfig(nproc_per_node=2, script="s.py", nnodes=2, node_rank=1)
    env = supervise.rank_env({"KEEP": "x"}, rank=c.global_rank(1), local_rank=1,
                          world_size=c.world_size, local_world_size=2, node_rank=1,
                          master_addr="10.0.0.1", master_port=1234)
    assert env == {"KEEP": "x", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
                   "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1", "GROUP_RANK": "1",
                   "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234", "OMP_NUM_THREADS": "1"}
    kept = supervise.rank_env({"OMP_NUM_THREADS": "4"}, rank=0, local_rank=0, world_size=2,
                           local_world_size=2, node_rank=0, master_addr="a", master_port=1)
    alone = supervise.rank_env({}, rank=0, local_rank=0, world_size=2, local_world_size=1,
                            node_rank=0, master_addr="a", master_port=1)
    assert kept["OMP_NUM_THREADS"] == "4" and "OMP_NUM_THREADS" not in alone


def test_command_for_script_module_and_executable():
    base = dict(nproc_per_node=1, script_args=("a",))
    assert supervise.command(LaunchConfig(script="t.py", **base)) == [sys.executable, "-u", "t.py", "a"]
    assert supervise.command(LaunchConfig(script="pkg.mod", module=True, **base)) == \
        [sys.executable, "-u", "-m", "pkg.mod", "a"]
    assert supervise.command(LaunchConfig(script="/bin/tool", no_python=True, **base)) == \
        ["/bin/tool", "a"]


def test_exit_descriptions():
    assert supervise.describe_exit(3) == "exited with code 3"
    assert supervise.describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"
    assert supervise.exit_status(-signal.SIGKILL) == 137 and supervise.exit_status(3) == 3


def test_run_script_takes_a_path_or_source(tmp_path):
    from globaltensor.testing import _script_path

    assert _script_path(BEHAVE, str(tmp_path)) == BEHAVE
    assert _script_path(pathlib.Path(BEHAVE), str(tmp_path)) == BEHAVE
    written = _script_path("print('hi')", str(tmp_path))
    assert pathlib.Path(written).read_text() == "print('hi')"


def test_failure_report_hints_at_a_taken_port():
    from types import SimpleNamespace

    failed = supervise.RankProcess(0, 0, SimpleNamespace(pid=42, returncode=1))
    failed.stderr_tail.extend(["Traceback ...\n", "RuntimeError: Address already in use\n"])
    report = supervise.failure_report(failed, LaunchConfig(nproc_per_node=2, script="s"), 4321, [1])
    assert report.splitlines() == [
        "rank 0 (local rank 0 on node 0, pid 42) exited with code 1; stopped the other ranks "
        "still running: [1]",
        "last 2 lines of rank 0's stderr:",
        "  | Traceback ...",
        "  | RuntimeError: Address already in use",
        "hint: master port 4321 looks taken; pass another --master_port (or leave it out on a "
        "single node)"]


def _failed_rank(rank, error, code=1):
    from types import SimpleNamespace

    r = supervise.RankProcess(rank, rank, SimpleNamespace(pid=40 + rank, returncode=code))
    r.stderr_tail.extend(["Traceback (most recent call last):\n", f"{error}\n"])
    return r


_SHAPES = ("globaltensor.errors.ShapeMismatchError: to_global with sbp (S(0),): rank 1 passed a "
           "piece of shape [3], expected [2]")


def test_the_different_collectives_hint_only_where_ranks_failed_differently_or_timed_out():
    config = LaunchConfig(nproc_per_node=2, script="s")
    hint = supervise.DIFFERENT_COLLECTIVES_HINT

    def report(*ranks):
        return supervise.failure_report(ranks[0], config, 1, [], others=ranks)

    # bad input every rank raised alike (issue 41): no hint
    assert hint not in report(_failed_rank(0, _SHAPES), _failed_rank(1, _SHAPES))
    # the same words, but one rank only raised it (the other waited, or failed otherwise)
    assert hint in report(_failed_rank(0, _SHAPES), _failed_rank(1, "", code=-15))
    assert hint in report(_failed_rank(0, _SHAPES), _failed_rank(1, "RuntimeError: other"))
    timeout = "globaltensor.errors.CollectiveTimeoutError: all_reduce timed out after 30s"
    assert hint in report(_failed_rank(0, timeout), _failed_rank(1, timeout))  # a timeout
    assert hint in report(_failed_rank(0, "", code=-6), _failed_rank(1, "", code=-6))  # SIGABRT
    assert hint not in report(_failed_rank(0, "ValueError: bad"), _failed_rank(1, "", code=-15))


def test_completed_run_splits_output_by_rank():
    run = CompletedRun(0, "[rank 0] a\n[rank 1] b\n[rank 0] c\n", "[rank 1] e\n")
    assert run.rank_lines(0) == ["a", "c"] and run.rank_lines(1, "stderr") == ["e"]
