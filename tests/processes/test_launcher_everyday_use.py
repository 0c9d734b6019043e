"""Everyday use of the launcher and of gt.init / gt.spawn, in real processes: the .item() trap
and its hint, torchrun's spellings, gtrun and python -m globaltensor, --ranks_filter, partial
lines, the failure report's traceback, errors before any rank starts, --help / --version, SLURM.

Torch-free rank scripts (tests/scripts/chatty.py) keep most runs to milliseconds; every run has a
--timeout and a subprocess timeout."""
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from globaltensor import launch
from globaltensor.testing import run_script

from helpers import ROOT, SCRIPTS

CHATTY = str(SCRIPTS / "chatty.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _cli(*args, timeout=60, env=ENV):
    return subprocess.run(list(args), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env=env)


@pytest.mark.slow  # a long case: run with pytest -m slow (suite time)
def test_item_under_rank_zero_gets_a_hint_and_gt_debug_names_it():
    trap = SCRIPTS / "item_trap.py"
    plain = run_script(trap, 2, timeout=60, env=dict(ENV, GT_TIMEOUT="10"))
    assert plain.returncode == 1
    assert "GlobalTensorError: item(): redistribution Layout(placement('cpu', ranks=[0, 1]), " \
           "(P,), []) -> " in plain.stderr
    # rank 1 finished while rank 0 waits in item(): the error says so, and names the trap
    assert "rank 1 finished (exit 0) after its collective #" in plain.stderr
    assert "under `if rank == 0:` the other ranks never join it (use gt.print0" in plain.stderr
    checked = run_script(trap, 2, timeout=60, env=dict(ENV, GT_TIMEOUT="10", GT_DEBUG="1"))
    assert checked.returncode == 1
    assert "rank 0: #5 item()(dtype=torch.float32, source=Layout(placement('cpu', ranks=[0, 1]), " \
           "(P,), [])" in checked.stderr
    assert "rank 1 differs: op: gt.ones instead of item()" in checked.stderr
    # and each rank's line of the script (issue 41)
    assert "item_trap.py:12 (`print(f\"step {step}: loss {loss.item()}\", flush=True)`)" \
        in checked.stderr
    assert "item_trap.py:9 (`x = gt.ones(8, 4, placement=p, sbp=gt.sbp.split(0)) * (step + 1)`)" \
        in checked.stderr
    assert "[launch] hint" not in checked.stderr  # GT_DEBUG already named them


def test_a_rank_past_rank_0s_last_step_fails_within_seconds_not_at_the_timeout():
    """Rank 1 runs one step more: its collective waits for rank 0, which waits at exit for rank
    1 to leave (it hosts the store). Rank 1 asks rank 0 to leave, and fails at once with the
    error naming rank 0's last collective, well before the 120 s world timeout."""
    start = time.monotonic()
    run = run_script(SCRIPTS / "one_step_more.py", 2, timeout=110, env=dict(ENV, GT_TIMEOUT="120"))
    took = time.monotonic() - start
    assert run.returncode == 1, run.stderr
    assert "rank 0 finished (exit 0) after its collective #4 while rank 1 still runs (rank 1 " \
           "waits here, its collective #5)" in run.stderr
    assert "under `if rank == 0:` the other ranks never join it" in run.stderr
    assert took < 60, f"took {took:.0f}s"


def test_gtrun_and_python_m_globaltensor_with_torchrun_spellings():
    run = _cli("gtrun", "--nproc-per-node", "2", "--master-port", str(launch.free_port()),
               "--ranks-filter", "1", "--timeout", "30", CHATTY, "hello")
    assert run.returncode == 0, run.stderr
    assert run.stdout == "[rank 1] rank 1 of 2 says hello\n"  # rank 0 filtered out
    run = _cli(sys.executable, "-m", "globaltensor", "--nproc_per_node", "2", "--log-dir",
               str(ROOT / "README.md"), CHATTY, "x")
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == (f"launch.py: error: expected --logdir '{ROOT / 'README.md'}' to be a "
                          f"directory, found a file; pass a directory (it is created if missing)\n")


def test_help_epilog_and_version():
    run = _cli(sys.executable, "launch.py", "--help")
    assert run.returncode == 0
    for words in ("every rank gets these environment variables:", "LOCAL_WORLD_SIZE",
                  "MASTER_ADDR, MASTER_PORT", "exit codes:", "124      --timeout passed",
                  "GT_DEBUG=1", "GT_TIMEOUT=SECS", "--nproc-per-node"):
        assert words in run.stdout, words
    run = _cli(sys.executable, "launch.py", "--version")
    assert run.returncode == 0 and run.stdout == "globaltensor 0.1.0\n"


def test_missing_script_is_one_line_before_any_rank(tmp_path, capsys):
    code = launch.main(["--nproc_per_node", "2", str(tmp_path / "nope.py")])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err == (f"launch.py: error: expected the script '{tmp_path / 'nope.py'}' to exist, "
                   f"found no such file (from {os.getcwd()}); check the path, or pass -m to run "
                   f"a module\n")


def test_auto_counts_gpus_else_cpu_cores(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,3")
    assert launch.auto_nproc() == (2, "GPUs in CUDA_VISIBLE_DEVICES")
    assert launch.parse_args(["--nproc_per_node", "auto", "s.py"]).nproc_per_node == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert launch.auto_nproc() == (len(os.sched_getaffinity(0)), "CPU cores (no GPU found)")
    with pytest.raises(SystemExit):
        launch.parse_args(["--nproc_per_node", "many", "s.py"])


def test_torchrun_spellings_parse_the_same():
    ours = launch.parse_args(["--nproc_per_node", "2", "--nnodes", "2", "--node_rank", "1",
                              "--master_addr", "h", "--master_port", "5", "--no_python",
                              "--logdir", "d", "--redirect_stdout_and_stderr",
                              "--ranks_filter", "2,0", "s"])
    torchrun = launch.parse_args(["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1",
                                  "--master-addr", "h", "--master-port", "5", "--no-python",
                                  "--log-dir", "d", "--redirect-stdout-and-stderr",
                                  "--ranks-filter", "0,2", "s"])
    assert ours == torchrun and ours.ranks_filter == (0, 2)
    with pytest.raises(launch.LaunchError, match=r"--ranks_filter ranks in 0\.\.1, found \[5\]"):
        launch.parse_args(["--nproc_per_node", "2", "--ranks_filter", "5", "s"])


def test_partial_line_is_shown_within_a_fraction_of_a_second():
    proc = subprocess.Popen([sys.executable, "launch.py", "--nproc_per_node", "1", "--timeout",
                             "30", CHATTY, "progress"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=ENV)
    seen = {}

    def read():
        data = b""
        while not re.fullmatch(rb"\[rank 0\] tick \d+\.\d+", data):  # shown open: no end
            chunk = os.read(proc.stdout.fileno(), 1024)
            if not chunk:
                return
            data += chunk
        seen["at"], seen["text"] = time.time(), data.decode()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        reader.join(30)
        rest, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    written = float(seen["text"].split()[-1])
    assert seen["at"] - written < 1.0  # the rank holds the line for 3 s: shown long before
    pad = " " * (len(seen["text"]) - len("[rank 0] done"))  # the open line rewritten in place
    assert rest.decode() == "\r[rank 0] done" + pad + "\n" and proc.returncode == 0


def test_progress_bars_update_in_place_once_per_update():
    done = subprocess.run([sys.executable, "launch.py", "--nproc_per_node", "1", "--timeout", "30",
                           CHATTY, "bars"], cwd=ROOT, capture_output=True, env=ENV, timeout=60)
    err, out = done.stderr.decode(), done.stdout.decode()
    assert done.returncode == 0 and out == "[rank 0] between\n"
    bar_lines = err.split("\n")[:-2]  # the bar's lines (a print in between ends one), "after"
    assert err.endswith("[rank 0] after\n")
    for line in bar_lines:
        updates = line.split("\r")  # each update rewrites the line: the prefix, once
        assert all(u.startswith("[rank 0] ") and u.count("[rank") == 1 for u in updates), line
    assert sum(u.rstrip().endswith("it/s]") and "100%" in u
               for line in bar_lines for u in line.split("\r")) >= 1
    assert sum(line.count("\n") for line in bar_lines) == 0 and len(bar_lines) <= 3
    assert "100%" in bar_lines[-1].split("\r")[-1]  # the finished bar ends the last line


def test_failure_report_starts_at_the_last_traceback_without_torch_prefixes(capsys):
    code = launch.main(["--nproc_per_node", "1", "--timeout", "30", CHATTY, "traceback"])
    _, err = capsys.readouterr()
    assert code == 1
    report = err[err.index("[launch]"):].splitlines()
    assert report[1:] == ["[launch] the last traceback of rank 0's stderr:",
                          "[launch]   | Traceback (most recent call last):",
                          '[launch]   |   File "train.py", line 3, in <module>',
                          "[launch]   | RuntimeError: boom"]
    # the traceback is held back from the live output: shown once, in the report
    assert err.count("RuntimeError: boom") == 1 and "[rank0]:" not in err
    assert "[rank 0] noise 29\n" in err


def test_sigabrt_gets_the_different_collectives_hint(capsys):
    code = launch.main(["--nproc_per_node", "2", "--timeout", "30", CHATTY, "abort"])
    _, err = capsys.readouterr()
    assert code == 128 + 6 and "was killed by SIGABRT" in err
    assert ("[launch] hint: ranks may have run different collectives (x.item() or print(x) under "
            "`if rank == 0:` is the usual one: use gt.print0): rerun with GT_DEBUG=1 to name the "
            "operation and rank") in err


_RAISES = """
import torch, globaltensor as gt
gt.init()
x = torch.ones(6).to_global(gt.placement("cpu", [0, 1]), gt.sbp.split(0))
if gt.env.get_rank() == 1:
    raise ValueError("bad value on rank 1")
for i in range(100):
    x = (x + 1).to_global(sbp=gt.sbp.broadcast).to_global(sbp=gt.sbp.split(0))
"""


def test_one_rank_raising_shows_its_error_first_in_full_and_no_hint(tmp_path):
    run = run_script(_RAISES, 2, timeout=60, env=dict(ENV, GT_TIMEOUT="30"),
                     launcher_args=["--logdir", str(tmp_path)])
    assert run.returncode == 1
    report = run.stderr[run.stderr.index("[launch] rank 1 (local rank 1"):].splitlines()
    assert report[1] == "[launch] the last traceback of rank 1's stderr:"
    last = report.index("[launch]   | ValueError: bad value on rank 1")  # its traceback in full
    others = report[last + 1:]  # then one line per other rank, naming the cause, and the logs
    assert all(line.startswith("[launch] ") and "|" not in line for line in others), others
    if others:
        assert "rank 0 exited" in others[0] and "rank 1 left the job" in others[0], others
        assert str(tmp_path) in others[-1], others
    assert run.stderr.count("Traceback") == 1 and "hint" not in run.stderr
    assert ": []" not in run.stderr
    assert "ValueError: bad value" in (tmp_path / "rank_1.stderr").read_text()


_EARLY = """
import torch, globaltensor as gt
gt.init()
x = torch.ones(4).to_global(gt.placement("cpu", [0, 1]), gt.sbp.split(0))
for i in range(3 if gt.env.get_rank() == 1 else 1000):  # rank 1 runs out of data
    x = (x + 1).to_global(sbp=gt.sbp.broadcast).to_global(sbp=gt.sbp.split(0))
"""


@pytest.mark.slow  # suite time: a rank past rank 0's last step stays in the default run
def test_a_rank_finishing_early_under_gt_debug_is_named_at_once():
    start = time.monotonic()
    run = run_script(_EARLY, 2, timeout=60, env=dict(ENV, GT_DEBUG="1", GT_TIMEOUT="60"))
    assert time.monotonic() - start < 30  # the debug check's timeout is 60 s: nobody waited
    assert run.returncode == 1
    assert re.search(r"GT_DEBUG: global operation #\d+ .*: rank 1 finished \(exit 0\) after its "
                     r"collective #\d+ while rank 0 still runs", run.stderr), run.stderr
    # the launcher says so too when it saw rank 1 leave before it stopped the job (under load
    # rank 1 may still be exiting then); it never blames rank 1 for the failure
    assert not re.search(r"rank 1 \(local rank 1[^\n]*exited with code [1-9]", run.stderr)
    assert "hint" not in run.stderr


_SLURM_RANK = """
import os, torch, globaltensor as gt
gt.init()
t = torch.tensor([float(gt.env.get_rank() + 1)])
gt.comm.all_reduce(t)
print(gt.env.get_rank(), gt.env.get_world_size(), gt.env.get_local_rank(), os.environ["MASTER_ADDR"],
      t.item(), flush=True)
"""


def test_gt_init_under_srun_variables(tmp_path):
    """Two processes started as srun starts them: only SLURM_* variables, no RANK/WORLD_SIZE."""
    script = tmp_path / "slurm_rank.py"
    script.write_text(_SLURM_RANK)
    base = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                       "MASTER_ADDR", "MASTER_PORT")}
    base.update(SLURM_NTASKS="2", SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="77",
                MASTER_PORT=str(launch.free_port()), GT_TIMEOUT="30")
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=dict(base, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)))
             for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [o.split() for o, _ in outs] == [["0", "2", "0", "localhost", "3.0"],
                                            ["1", "2", "1", "localhost", "3.0"]]
