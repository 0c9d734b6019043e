"""What a process pays to start: ``import globaltensor`` leaves torch._dynamo (about a second of
CPU at every start of every rank) to the programs that use it, and what globaltensor needs from
dynamo is still there once they import it (torch.compile and torch.optim do)."""
import subprocess
import sys

from helpers import ROOT

_DYNAMO_LATER = """
import sys
import globaltensor as gt, globaltensor.mode as mode
assert "torch._dynamo" not in sys.modules, "import globaltensor imported torch._dynamo"
plain = mode._factory_value
import torch._dynamo
from torch._dynamo import trace_rules
assert mode._factory_value is not plain and trace_rules.is_nonstrict_trace_callable(mode._factory_value)
assert mode._factory_value.__wrapped__ is plain
print("ok")
"""


def test_dynamo_is_imported_by_the_program_not_by_globaltensor():
    run = subprocess.run([sys.executable, "-c", _DYNAMO_LATER], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout == "ok\n", run.stderr
