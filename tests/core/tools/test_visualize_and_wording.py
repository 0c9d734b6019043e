"""gt.visualize draws blocks at any size, gtrun names itself, messages
pluralise. (The no-rule warning: tests/ranks/ops/test_ops_misc.py; pytest's summary: pyproject.)"""
import pytest

import globaltensor as gt
from globaltensor.errors import SbpError
from globaltensor.launch.cli import _parser, program_name
from globaltensor.layout import Layout
from globaltensor.tools.visualize import draw

S, B, P = gt.sbp.S, gt.sbp.B, gt.sbp.P
G22 = gt.placement("cpu", [[0, 1], [2, 3]])


def test_visualize_collapses_equal_cells_into_blocks_at_any_size():
    lines = draw(Layout(G22, (S(0), S(1)), (1000, 6))).splitlines()
    assert lines[1:4] == ["          0:3 3:6", "   0:500    0   1", "500:1000    2   3"]
    assert lines[4] == "pieces:"
    small = draw(Layout(G22, (B, S(0)), (3, 5))).splitlines()
    assert small[1:4] == ["     0:5", "0:2  0,2", "  2  1,3"]


def test_visualize_caps_the_blocks_drawn():
    text = draw(Layout(gt.placement("cpu", list(range(20))), (S(0),), (40,)), max_rows=4)
    assert "(the first 4x1 of 20x1 blocks)" in text and "rank 19 at (19,): [38:40]" in text


@pytest.mark.parametrize("argv0, prog", [("/venv/bin/gtrun", "gtrun"),
                                         ("/x/globaltensor/__main__.py", "python -m globaltensor"),
                                         ("/x/globaltensor/launch/__main__.py", "launch.py"),
                                         ("launch.py", "launch.py")])
def test_launcher_names_itself_and_shows_an_example(argv0, prog):
    assert program_name(argv0) == prog
    text = _parser(prog).format_help()
    assert text.startswith(f"usage: {prog} ")
    assert f"example:\n  {prog} --nproc_per_node 4 train.py" in text


def test_messages_pluralise():
    with pytest.raises(SbpError) as one:
        gt.sbp.normalize((B, B), 1)
    assert "expected 1 sbp value, one per" in str(one.value)
    assert "tuple like (gt.sbp.broadcast,)" in str(one.value)
    with pytest.raises(SbpError) as two:
        gt.sbp.normalize((B,), 2)
    assert "expected 2 sbp values" in str(two.value)
    assert "(gt.sbp.broadcast, gt.sbp.broadcast)" in str(two.value)
