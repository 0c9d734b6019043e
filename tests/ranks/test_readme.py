"""The README's ten lines run as written (2 thread-ranks, real gloo) and print what they claim."""
import io
import re

import torch

import globaltensor as gt
from globaltensor.testing import run_ranks

from helpers import ROOT

README = ROOT / "README.md"


def _example() -> str:
    text = README.read_text()
    block = re.search(r"## Ten lines\s+```python\n(.*?)```", text, re.S)
    assert block, "README lost its ten-line example"
    return block.group(1)


def test_readme_example_runs_and_infers_sbp():
    source = _example()

    def body(rank):
        # redirect_stdout is process-wide and the ranks are threads: give each rank its own print
        out = io.StringIO()
        scope = {"print": lambda *a, **k: print(*a, **k, file=out)}
        exec(compile(source, "README.md", "exec"), scope)
        return out.getvalue(), scope["out"].sbp, scope["out"].shape, scope["y"].sbp

    results = run_ranks(body, 2, timeout=60)
    for rank, (printed, out_sbp, out_shape, y_sbp) in enumerate(results):
        assert out_sbp == (gt.sbp.split(0),) and out_shape == torch.Size([4, 3])
        assert y_sbp == (gt.sbp.broadcast,)
        assert "all_to_all" in printed and "torch.Size([2, 3])" in printed
