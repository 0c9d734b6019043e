"""The launcher's --max_restarts (issue 52.7): a failed attempt stops every rank and starts them
all again, TORCHELASTIC_RESTART_COUNT counting the restarts; a job resumes from its last
gt.checkpoint and ends as an uninterrupted one; once the restarts are used up the first failure
of the last attempt is reported as without restarts (docs/launcher.md, "Restarts and resuming").

Jobs run in-process through ``launch.main``, each with a --timeout, so nothing here can hang.
The torch job (two runs of 2 ranks) is the slow part; the others use torch-free rank scripts.
"""
import re

import pytest
import torch

from globaltensor import launch
from globaltensor.launch import LaunchError, parse_args

from helpers import BEHAVE, SCRIPTS

RESUME = str(SCRIPTS / "resume_train.py")
FAIL_ALWAYS = str(SCRIPTS / "fail_always.py")


def _launch(capsys, *argv):
    code = launch.main(["--nproc_per_node", "2", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def _rank0(out: str) -> list[str]:
    return [line[len("[rank 0] "):] for line in out.splitlines() if line.startswith("[rank 0] ")]


# --------------------------------------------------------------------------- resuming


def test_a_restarted_job_resumes_from_its_checkpoint_and_ends_as_an_uninterrupted_one(
        tmp_path, capsys):
    code, out, err = _launch(capsys, "--timeout", 90, RESUME, tmp_path / "plain", tmp_path / "plain.pt")
    assert code == 0, err[-3000:]
    plain = _rank0(out)
    assert plain[0] == "attempt 0: resuming after step 0" and len(plain) == 6
    assert "restarting" not in err

    code, out, err = _launch(capsys, "--max-restarts", 1, "--timeout", 90, RESUME,
                             tmp_path / "restarted", tmp_path / "restarted.pt", 1, 3)
    assert code == 0, err[-3000:]
    restarted = _rank0(out)
    # attempt 0 ran steps 1-2 and failed at step 3; attempt 1 loaded step 2 and went on
    assert restarted == plain[:3] + ["attempt 1: resuming after step 2"] + plain[3:]
    notes = [line for line in err.splitlines() if line.startswith("[launch] ")]
    assert notes == ["[launch] restarting the job (attempt 2 of 2) after rank 1 failed: "
                     "RuntimeError: rank 1 fails at step 3 on attempt 0 (exited with code 1)"]
    want, got = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "restarted.pt")
    assert sorted(got) == sorted(want) == ["w1", "w2"]
    for name in want:  # the same values, bit for bit: the resumed run is the same computation
        assert torch.equal(got[name], want[name]), name
    assert not torch.equal(want["w1"], torch.zeros_like(want["w1"]))


# --------------------------------------------------------------------------- restarts used up


def _report(err: str) -> list[str]:
    """The failure report's lines, with the pid and the attempt in the error masked."""
    lines = [line for line in err.splitlines()
             if line.startswith("[launch] ") and "restarting the job" not in line]
    return [re.sub(r"attempt \d+", "attempt A", re.sub(r"pid \d+", "pid P", line))
            for line in lines]


def test_a_rank_failing_every_time_uses_up_the_restarts_and_is_reported_as_without(
        tmp_path, capsys):
    once, again = tmp_path / "once", tmp_path / "again"
    once.mkdir()
    again.mkdir()
    code0, _, err0 = _launch(capsys, "--timeout", 30, FAIL_ALWAYS, once)
    assert code0 == 1
    assert sorted(p.name for p in once.iterdir()) == ["attempt_0_rank_0", "attempt_0_rank_1"]
    assert (once / "attempt_0_rank_1").read_text().split()[1] == "0"  # MAX_RESTARTS, no restarts

    logs = tmp_path / "logs"
    code, out, err = _launch(capsys, "--max_restarts", 2, "--timeout", 30, "--logdir", logs,
                             FAIL_ALWAYS, again)
    assert code == 1
    assert sorted(p.name for p in again.iterdir()) == [
        f"attempt_{a}_rank_{r}" for a in range(3) for r in range(2)]  # 3 attempts, no 4th
    assert {(again / f"attempt_{a}_rank_1").read_text().split()[1] for a in range(3)} == {"2"}
    restarts = [line for line in err.splitlines() if "restarting the job" in line]
    assert restarts == [
        f"[launch] restarting the job (attempt {a + 2} of 3) after rank 1 failed: "
        f"RuntimeError: rank 1 fails on attempt {a} (exited with code 1)" for a in range(2)]
    report = _report(err)
    assert report == _report(err0)  # the last attempt's failure, told as today
    assert report[0] == ("[launch] rank 1 (local rank 1 on node 0, pid P) exited with code 1; "
                         "stopped the other ranks still running: [0]")
    assert "[launch]   | RuntimeError: rank 1 fails on attempt 2" in err  # the last attempt's
    stderr = (logs / "rank_1.stderr").read_text()  # a restart appends to the log files
    assert [int(a) for a in re.findall(r"fails on attempt (\d)", stderr)] == [0, 1, 2]


def test_a_timeout_ends_the_job_whatever_restarts_are_left(tmp_path, capsys):
    code, _, err = _launch(capsys, "--max-restarts", 3, "--timeout", 1, BEHAVE, tmp_path, 2, 1,
                           "hang")
    assert code == 124 and "timed out after 1s" in err and "restarting" not in err


# --------------------------------------------------------------------------- the option


@pytest.mark.parametrize("flag", ["--max-restarts", "--max_restarts"])
def test_max_restarts_takes_both_spellings(flag):
    assert parse_args([flag, "3", "--nproc_per_node", "2", "t.py"]).max_restarts == 3
    assert parse_args(["--nproc_per_node", "2", "t.py"]).max_restarts == 0


def test_a_negative_count_is_a_clear_error(capsys):
    with pytest.raises(LaunchError, match=r"expected --max_restarts >= 0, found -1"):
        parse_args(["--max-restarts", "-1", "--nproc_per_node", "2", "t.py"])
    assert launch.main(["--max-restarts", "-1", "--nproc_per_node", "2", "t.py"]) == 2
    assert capsys.readouterr().err == (
        "launch.py: error: expected --max_restarts >= 0, found -1; pass how many times to "
        "restart the job after a rank fails (0: never)\n")


@pytest.mark.parametrize("value", ["two", "1.5", ""])
def test_a_count_that_is_not_a_whole_number_is_a_clear_error(value, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--max_restarts", value, "--nproc_per_node", "2", "t.py"])
    assert e.value.code == 2
    assert ("error: argument --max_restarts/--max-restarts: expected a number of restarts "
            f"(0, 1, 2, ...), found {value!r}") in capsys.readouterr().err
