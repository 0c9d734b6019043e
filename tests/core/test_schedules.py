"""Pipeline schedules as tables (gt.nn.Pipeline's schedules.py): every task once, dependencies
kept, the activations each schedule keeps, and the refusals."""
import pytest

from globaltensor.errors import GlobalTensorError
from globaltensor.nn.schedules import SCHEDULES, Task, check, clock, needs, orders, peak_in_flight, render

CASES = [("gpipe", 4, 4, 8), ("1f1b", 4, 4, 8), ("1f1b", 2, 2, 3), ("1f1b", 4, 4, 2),
         ("interleaved-1f1b", 4, 2, 8), ("interleaved-1f1b", 8, 4, 4), ("interleaved-1f1b", 6, 2, 4),
         ("interleaved-1f1b", 2, 2, 4), ("gpipe", 1, 1, 3), ("1f1b", 3, 3, 1)]


@pytest.mark.parametrize("schedule,stages,places,mb", CASES)
def test_each_task_runs_once_on_its_placement_after_what_it_needs(schedule, stages, places, mb):
    lists = orders(schedule, stages, places, mb)
    every = [t for tasks in lists for t in tasks]
    assert sorted(every) == sorted({Task(k, s, m) for k in "FB" for s in range(stages) for m in range(mb)})
    assert len(every) == 2 * stages * mb
    for p, tasks in enumerate(lists):
        assert all(t.stage % places == p for t in tasks)
    table = clock(lists, stages)
    when = {t: i for i, row in enumerate(table) for t in row if t is not None}
    for t in every:
        assert all(when[n] < when[t] for n in needs(t, stages)), t
    # no placement sits idle while its next task could run: the table is as short as the lists allow
    assert len(table) >= max(len(tasks) for tasks in lists)


def test_one_f_one_b_keeps_as_many_micro_batches_as_stages_after_it_and_gpipe_all():
    stages, mb = 4, 8
    for s, tasks in enumerate(orders("1f1b", stages, stages, mb)):
        assert peak_in_flight(tasks) == {s: stages - s}
    for s, tasks in enumerate(orders("gpipe", stages, stages, mb)):
        assert peak_in_flight(tasks) == {s: mb}


def test_time_steps_of_the_classic_schedules():
    # GPipe and 1F1B with S stages and M micro-batches take 2 (M + S - 1) ticks of one task each
    for schedule in ("gpipe", "1f1b"):
        assert len(clock(orders(schedule, 4, 4, 8), 4)) == 2 * (8 + 4 - 1)
    # interleaving 2 stages per placement shortens the bubble: fewer ticks per unit of work
    plain = clock(orders("1f1b", 2, 2, 4), 2)
    interleaved = clock(orders("interleaved-1f1b", 4, 2, 4), 4)
    assert len(interleaved) / 2 < len(plain)


def test_forward_only_runs_forwards_in_micro_batch_order():
    lists = orders("1f1b", 2, 2, 3, backward=False)
    assert lists == [[Task("F", 0, m) for m in range(3)], [Task("F", 1, m) for m in range(3)]]
    assert len(clock(lists, 2)) == 4


def test_render_shows_each_stage_as_a_row_of_time_steps():
    text = render(clock(orders("1f1b", 2, 2, 2), 2), 2, 2)
    assert text.splitlines()[0] == "stage 0 (placement 0): F0 F1  . B0  . B1"
    assert text.splitlines()[1] == "stage 1 (placement 1):  . F0 B0 F1 B1  ."
    assert "6 time steps, 8 tasks, bubble 33%" in text


@pytest.mark.parametrize("args,words", [
    (("zb", 2, 2, 4), "expected schedule to be one of"),
    (("1f1b", 2, 2, 0), "expected microbatches to be an int >= 1"),
    (("1f1b", 4, 2, 4), "use schedule='interleaved-1f1b'"),
    (("interleaved-1f1b", 5, 2, 4), "expected a multiple of 2 stages"),
    (("interleaved-1f1b", 4, 2, 3), "expected a multiple of 2 micro-batches")])
def test_bad_schedules_are_refused_with_what_to_do(args, words):
    with pytest.raises(GlobalTensorError, match=words):
        check(*args)
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved-1f1b"}


def test_what_crosses_a_stage_boundary_keeps_its_splits_and_sends_whole_values():
    import globaltensor as gt
    from globaltensor.nn.stages import sbp_on
    S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
    grid, line = gt.placement("cpu", [[0, 1], [2, 3]]), gt.placement("cpu", [4, 5])
    assert sbp_on((S(0), P), grid) == (S(0), B)        # as many axes: kept, partial sums reduced
    assert sbp_on((S(0),), grid) == (S(0), B)          # the batch split onto the first axis
    assert sbp_on((B, S(1)), line) == (S(1),)
    assert sbp_on((S(0), S(0)), line) == (S(0),)       # a dim split on two axes: once
    assert sbp_on((P,), grid) == (B, B)
