"""The launcher: environment, output prefixes, log files and every fault it handles (its options
alone: tests/core/test_launch.py).

Faults are run in-process through ``launch.main`` with a torch-free rank script (milliseconds per
process); only Ctrl-C, the two-launcher world and the environment check start real launchers.
Every run carries a --timeout or a subprocess timeout, so nothing here can hang.
"""
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys

import pytest

from globaltensor import launch
from globaltensor.launch import supervise
from globaltensor.testing import CompletedRun, run_script

from helpers import BEHAVE, ROOT, SCRIPTS


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _pids(text: str) -> list[int]:
    return [int(line.split()[-1]) for line in text.splitlines() if "] pid " in line]


def _behave(tmp_path, capsys, nproc, acting, action, timeout=30, extra=(), script=BEHAVE):
    code = launch.main(["--nproc_per_node", str(nproc), "--timeout", str(timeout), *extra,
                        script, str(tmp_path), str(nproc), str(acting), action])
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------- faults (in-process)


def test_failing_rank_stops_the_others_and_is_named(tmp_path, capsys):
    code, out, err = _behave(tmp_path, capsys, 3, acting=1, action="exit:3")
    assert code == 3
    assert "rank 1 (local rank 1 on node 0, pid" in err and "exited with code 3" in err
    assert "stopped the other ranks still running: [0, 2]" in err
    assert "  | rank 1 about to exit:3" in err  # the tail of its stderr
    pids = _pids(out)
    assert len(pids) == 3 and not any(_alive(p) for p in pids)


def test_rank_killed_by_sigkill(tmp_path, capsys):
    code, out, err = _behave(tmp_path, capsys, 2, acting=0, action="sigkill")
    assert code == 128 + signal.SIGKILL
    assert "rank 0 (local rank 0 on node 0" in err and "was killed by SIGKILL" in err
    assert "rank 0 about to sigkill" in err
    assert not any(_alive(p) for p in _pids(out))


def test_rank_hanging_past_timeout_is_stopped_and_named(tmp_path, capsys):
    code, out, err = _behave(tmp_path, capsys, 2, acting=1, action="hang", timeout=3)
    assert code == supervise.EXIT_TIMEOUT
    assert "timed out after 3s: ranks [1] were still running (ranks [0] had finished)" in err
    assert not any(_alive(p) for p in _pids(out))


def test_busy_master_port_is_reported_before_any_rank_starts(tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out, err = _behave(tmp_path, capsys, 2, acting=0, action="ok",
                                 extra=["--master_port", str(port)])
    assert code == 2
    assert f"expected --master_port {port} to be free on node 0" in err
    assert out == "" and not list(tmp_path.iterdir())  # no rank was started


def test_prefixes_and_logdir_copies(tmp_path, capsys):
    logs = tmp_path / "logs"
    code, out, err = _behave(tmp_path, capsys, 2, acting=1, action="ok",
                             extra=["--logdir", str(logs)])
    assert code == 0
    assert sorted(p.name for p in logs.iterdir()) == [
        "rank_0.stderr", "rank_0.stdout", "rank_1.stderr", "rank_1.stdout"]
    for rank in (0, 1):
        pid_line = (logs / f"rank_{rank}.stdout").read_text()
        assert pid_line.startswith("pid ") and f"[rank {rank}] {pid_line}" in out
    assert (logs / "rank_1.stderr").read_text() == "rank 1 about to ok\n"
    assert "[rank 1] rank 1 about to ok\n" in err


def test_redirect_writes_only_the_files(tmp_path, capsys):
    logs = tmp_path / "logs"
    code, out, err = _behave(tmp_path, capsys, 2, acting=0, action="exit:5",
                             extra=["--logdir", str(logs), "--redirect_stdout_and_stderr"])
    assert code == 5 and "[rank" not in out
    assert (logs / "rank_0.stderr").read_text() == "rank 0 about to exit:5\n"
    assert "  | rank 0 about to exit:5" in err  # the failure report still shows the tail


def test_module_mode_and_no_python(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(SCRIPTS))
    code, out, _ = _behave(tmp_path, capsys, 1, acting=0, action="ok", extra=["-m"],
                           script="behave")
    assert code == 0 and out.startswith("[rank 0] pid ")
    code = launch.main(["--nproc_per_node", "2", "--timeout", "30", "--no_python", "/bin/sh",
                        "-c", "echo rank=$RANK of $WORLD_SIZE; echo oops >&2"])
    out, err = capsys.readouterr()
    assert code == 0
    assert sorted(out.splitlines()) == ["[rank 0] rank=0 of 2", "[rank 1] rank=1 of 2"]
    assert sorted(err.splitlines()) == ["[rank 0] oops", "[rank 1] oops"]


def test_missing_executable_is_a_clear_error(capsys):
    code = launch.main(["--nproc_per_node", "2", "--no_python", "/nonexistent/tool"])
    err = capsys.readouterr().err
    assert code == 2 and err == ("launch.py: error: expected an executable '/nonexistent/tool', "
                                 "found none (not a file, not on PATH); check the path, or drop "
                                 "--no_python to run a python script\n")


# --------------------------------------------------------------------------- real launchers


def test_env_vars_prefixes_and_a_real_world_via_python_m():
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    run = run_script(SCRIPTS / "env_report.py", 2, args=["x", "--y"], timeout=60, env=env)
    assert run.returncode == 0, run.stderr
    for rank in (0, 1):
        [line] = [x for x in run.rank_lines(rank) if x.startswith("REPORT ")]
        r = json.loads(line[len("REPORT "):])
        assert r["env"]["RANK"] == str(rank) and r["env"]["LOCAL_RANK"] == str(rank)
        assert r["env"]["WORLD_SIZE"] == "2" and r["env"]["LOCAL_WORLD_SIZE"] == "2"
        assert r["env"]["NODE_RANK"] == "0" and r["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert int(r["env"]["MASTER_PORT"]) > 0 and r["env"]["OMP_NUM_THREADS"] == "1"
        assert (r["rank"], r["world_size"], r["local_rank"], r["node_rank"]) == (rank, 2, rank, 0)
        assert r["all_reduce"] == 3.0 and r["unbuffered"] and r["argv"] == ["x", "--y"]
        assert run.rank_lines(rank, "stderr") == [f"stderr of rank {rank}"]


def test_two_launchers_form_one_world_of_four():
    port = launch.free_port()
    procs = [subprocess.Popen(
        [sys.executable, *entry, "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node",
         "2", "--master_addr", "127.0.0.1", "--master_port", str(port), "--timeout", "90",
         str(SCRIPTS / "env_report.py")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node, entry in ((0, ["launch.py"]), (1, ["-m", "globaltensor.launch"]))]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    for node, (_, err) in enumerate(outs):
        assert (f"[launch] node {node} of 2: started ranks {2 * node}..{2 * node + 1}; waiting "
                f"for 2 nodes to meet at 127.0.0.1:{port}") in err
    reports = {}
    for node, (out, _) in enumerate(outs):
        for rank in (2 * node, 2 * node + 1):
            [line] = CompletedRun(0, out, "").rank_lines(rank)
            reports[rank] = json.loads(line[len("REPORT "):])
    assert sorted(reports) == [0, 1, 2, 3]
    for rank, r in reports.items():
        assert (r["rank"], r["world_size"], r["local_rank"], r["node_rank"]) == \
            (rank, 4, rank % 2, rank // 2)
        assert r["env"]["GROUP_RANK"] == str(rank // 2) and r["env"]["MASTER_PORT"] == str(port)
        assert r["all_reduce"] == 10.0  # 1 + 2 + 3 + 4 over all four ranks


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_to_launcher_stops_every_rank_and_child(sig):
    launcher = subprocess.Popen(
        [sys.executable, "launch.py", "--nproc_per_node", "2", "--timeout", "60",
         str(SCRIPTS / "tree.py")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = []
        while len(pids) < 4:  # each rank reports itself and its child
            line = launcher.stdout.readline()
            assert line, "launcher ended before both ranks started: " + launcher.stderr.read()
            pids += [int(p) for p in line.split()[3:]] if "] pids " in line else []
        assert all(_alive(p) for p in pids)
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=30)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + sig
    assert f"received {signal.Signals(sig).name}: stopping ranks [0, 1]" in err
    assert not [p for p in pids if _alive(p)]
