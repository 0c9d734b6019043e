"""What a process pays to start: ``import globaltensor`` leaves torch._dynamo (about a second of
CPU at every start of every rank) to the programs that use it, and what globaltensor needs from
dynamo is still there once they import it (torch.compile and torch.optim do); the launcher's own
process imports no torch at all (globaltensor/_startup.py), while a program's gets the whole
package, even one that ``python -m`` runs."""
import subprocess
import sys

import pytest

from helpers import ROOT

# a package imported while `python -m prog.main -m globaltensor` looks for prog.main (sys.argv[0]
# is "-m" then), whose main module then imports torch._dynamo
_PROG_INIT = "import globaltensor\n"
_PROG_MAIN = """
import sys
import torch
import globaltensor as gt, globaltensor.mode.global_mode as mode
assert hasattr(torch.Tensor, "to_global") and gt.GlobalTensor.__name__ == "GlobalTensor"
assert "torch._dynamo" not in sys.modules, "import globaltensor imported torch._dynamo"
import globaltensor.convert as convert
for wrapper in (mode._factory_value, convert._piece_as_global):
    assert wrapper.target() is wrapper.__wrapped__  # plain until dynamo is imported
import torch._dynamo
from torch._dynamo import trace_rules
for wrapper in (mode._factory_value, convert._piece_as_global):
    assert trace_rules.is_nonstrict_trace_callable(wrapper.target())
print("ok")
"""


def test_a_program_gets_the_whole_package_and_imports_dynamo_itself(tmp_path):
    (tmp_path / "prog").mkdir()
    (tmp_path / "prog" / "__init__.py").write_text(_PROG_INIT)
    (tmp_path / "prog" / "main.py").write_text(_PROG_MAIN)
    env = {"PYTHONPATH": f"{ROOT}:{tmp_path}", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "prog.main", "-m", "globaltensor"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0 and run.stdout == "ok\n", run.stderr


@pytest.mark.parametrize("entry", [["launch.py"], ["-m", "globaltensor.launch"],
                                   ["-m", "globaltensor"]])
def test_the_launcher_imports_no_torch(entry):
    run = subprocess.run([sys.executable, "-X", "importtime", *entry, "--version"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout == "globaltensor 0.1.0\n", run.stderr
    imported = [line.split("|")[-1].strip() for line in run.stderr.splitlines()]
    assert "globaltensor.launch.cli" in imported
    assert not [name for name in imported if name.split(".")[0] in ("torch", "numpy")]


def test_the_gtrun_console_script_imports_no_torch(tmp_path):
    """issue 41: pip's ``gtrun`` script (``from globaltensor.launch import main``) ran as its own
    __main__ and imported the whole package, torch included."""
    script = tmp_path / "gtrun"
    script.write_text("import re\nimport sys\nfrom globaltensor.launch import main\n"
                      "if __name__ == '__main__':\n"
                      "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
                      "    sys.exit(main())\n")
    run = subprocess.run([sys.executable, "-X", "importtime", str(script), "--version"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0 and run.stdout == "globaltensor 0.1.0\n", run.stderr
    imported = [line.split("|")[-1].strip() for line in run.stderr.splitlines()]
    assert "globaltensor.launch.cli" in imported
    assert not [name for name in imported if name.split(".")[0] in ("torch", "numpy")]
