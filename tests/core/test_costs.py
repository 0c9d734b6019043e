"""The planner's cost figures: given by ``gt.set_costs`` or ``GT_COSTS`` (the probe that measures
them runs in tests/processes/test_cost_probe.py), read by every plan and choice, and a change of
figures forgets the plans made under the old ones."""
import pytest

import globaltensor as gt
from globaltensor.layout import Layout
from globaltensor.plan import DEFAULT, cost, lower_bound, plan
from globaltensor.runtime.costs import parse

P, B = gt.sbp.partial_sum, gt.sbp.broadcast
GRID = gt.placement("cpu", [[0, 1], [2, 3]])


@pytest.fixture
def restore():
    before = gt.costs()
    yield
    gt.set_costs(costs=before)


def _both_partial(shape=(256, 256)):
    return Layout(GRID, (P, P), shape), Layout(GRID, (B, B), shape)


def test_the_suite_prices_with_the_defaults():
    assert gt.costs() == DEFAULT and gt.costs().source == "default"
    assert (cost.ALPHA, cost.BETA) == (1e-5, 1e-10)


def test_a_plan_follows_the_figures_and_a_change_forgets_the_old_plans(restore):
    # (P, P) -> (B, B) on a 2x2 grid: an all_reduce on each axis sends 2x the tensor in two
    # collectives; reduce_scatter on one axis, all_reduce of the half on the other, all_gather
    # send 1.5x in three. Latency decides which is cheaper.
    src, dst = _both_partial()
    before = gt.set_costs(alpha=1e-3, beta=1e-10)
    assert before == DEFAULT
    slow = plan(src, dst)
    assert [s.kind for s in slow.steps] == ["all_reduce", "all_reduce"]
    gt.set_costs(alpha=1e-8, beta=1e-10)
    fast = plan(src, dst)
    assert [s.kind for s in fast.steps] == ["reduce_scatter", "all_reduce", "all_gather"]
    assert fast.bytes_per_rank(4) < slow.bytes_per_rank(4)
    # each plan is the cheapest under its own figures: the other costs more there
    assert fast.cost() < slow.cost()
    gt.set_costs(alpha=1e-3, beta=1e-10)
    assert plan(src, dst) == slow and slow.cost() < fast.cost()
    assert lower_bound(src, dst) <= slow.cost()
    assert gt.set_costs().source == "given" and gt.costs() == DEFAULT


def test_set_costs_keeps_the_figure_not_given_and_says_where_they_came_from(restore):
    gt.set_costs(alpha=2e-4)
    assert (gt.costs().alpha, gt.costs().beta, gt.costs().source) == (2e-4, 1e-10, "given")
    gt.set_costs(beta=5e-10)
    assert (gt.costs().alpha, gt.costs().beta) == (2e-4, 5e-10)
    assert str(gt.costs()) == "alpha 200 us per collective, beta 0.5 ns per byte (2 GB/s), given"


@pytest.mark.parametrize("bad, words", [
    (dict(alpha=-1.0), "expected alpha as a finite number of seconds > 0, found -1.0"),
    (dict(beta=float("nan")), "expected beta as a finite number of seconds > 0, found nan"),
    (dict(alpha="1e-4"), "found '1e-4'"),
    (dict(beta=True), "expected beta as a finite number of seconds > 0, found True"),
    (dict(costs=(1e-4, 1e-9)), "expected costs= to be figures returned by gt.costs()"),
])
def test_bad_figures_are_refused_and_change_nothing(restore, bad, words):
    with pytest.raises(gt.GlobalTensorError, match=words.replace("(", r"\(").replace(")", r"\)")):
        gt.set_costs(**bad)
    assert gt.costs() == DEFAULT


def test_the_environment_variable():
    assert parse("measure") == "measure" and parse("") == "measure" and parse(" default ") == "default"
    given = parse("alpha=1e-4, beta=2e-9")
    assert (given.alpha, given.beta, given.source) == (1e-4, 2e-9, "given")
    for text in ("fast", "alpha=1e-4", "alpha=x,beta=1e-9", "alpha=1e-4,gamma=1", "alpha=1,alpha=2",
                 "alpha=0,beta=1e-9"):
        with pytest.raises(gt.GlobalTensorError, match="GT_COSTS|alpha"):
            parse(text)

