"""The cost probe: a world started by gt.init measures α and β on its group (every rank
agrees on the figures), or takes them from GT_COSTS, or from a cache file written by an
earlier run. The rest of the suite pins GT_COSTS=default (tests/conftest.py)."""
import json
import os

import pytest

from globaltensor.testing import run_script

SCRIPT = """
import time
start = time.perf_counter()
import globaltensor as gt
gt.init()
c = gt.costs()
print(f"{c.alpha!r} {c.beta!r} {c.source} {time.perf_counter() - start:.3f}")
"""


def _env(**values):
    env = {k: v for k, v in os.environ.items() if k not in ("GT_COSTS", "GT_COSTS_CACHE")}
    env.update(values)
    return env


def _figures(run, nproc):
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [run.rank_lines(r)[-1].split() for r in range(nproc)]
    return [(float(a), float(b), source) for a, b, source, _ in lines]


def test_the_world_measures_its_costs_and_every_rank_agrees(tmp_path):
    cache = tmp_path / "costs.json"
    first = _figures(run_script(SCRIPT, 2, timeout=90, env=_env(GT_COSTS_CACHE=str(cache))), 2)
    alpha, beta, source = first[0]
    assert first == [first[0]] * 2 and source == "measured"
    # loopback gloo on a busy machine: a collective takes microseconds to milliseconds, a
    # byte well under a microsecond
    assert 1e-6 < alpha < 0.1 and 1e-13 <= beta < 1e-6
    table = json.loads(cache.read_text())
    assert list(table.values()) == [{"alpha": alpha, "beta": beta}]
    assert list(table)[0].startswith("gloo/cpu/2 ranks/")
    again = _figures(run_script(SCRIPT, 2, timeout=90, env=_env(GT_COSTS_CACHE=str(cache))), 2)
    assert again == [(alpha, beta, "cache")] * 2


@pytest.mark.slow  # the parse and its errors are tests/core/test_costs.py's; this is the launch
def test_given_costs_skip_the_probe_and_bad_ones_stop_the_job():
    given = _figures(run_script(SCRIPT, 2, timeout=60, env=_env(GT_COSTS="alpha=2e-4,beta=1e-9")), 2)
    assert given == [(2e-4, 1e-9, "given")] * 2
    bad = run_script(SCRIPT, 2, timeout=60, env=_env(GT_COSTS="fast"))
    # read before the world is joined: the first rank to fail stops the job, nothing waits
    assert bad.returncode == 1
    assert ("GlobalTensorError: expected GT_COSTS to be 'measure', 'default' or "
            "'alpha=SECONDS,beta=SECONDS', found 'fast'") in bad.stderr, bad.stderr
