"""Whether this process imports globaltensor only to run its launcher.

``python -m globaltensor``, ``python -m globaltensor.launch``, the repository's ``launch.py`` and
the ``gtrun`` console script (pip's generated ``__main__``) import the package on their way to ``globaltensor/launch``, which uses the standard library only
(its ranks import torch, the launcher never does). Skipping the rest of the package there (torch,
and the methods it installs on torch's classes) saves seconds of CPU at every start of the
launcher (``--help`` included). Every other import of the package is complete.
"""
from __future__ import annotations

import os
import re
import sys

_LAUNCHERS = frozenset({"globaltensor", "globaltensor.__main__", "globaltensor.launch",
                        "globaltensor.launch.__main__"})
MARK = "__globaltensor_launcher__"  # launch.py sets it in its own globals before importing us


def launcher_only() -> bool:
    """True in the launcher's own process, while Python finds the launcher's module."""
    main = sys.modules.get("__main__")
    if getattr(main, MARK, False) is True:
        return True
    if _console_script(main):
        return True
    # ``python -m NAME args``: sys.argv[0] is "-m" only while Python looks for NAME (it is the
    # module's path when its code runs), and sys.orig_argv ends with NAME (or -mNAME) and args
    if sys.argv[:1] != ["-m"]:
        return False
    original = getattr(sys, "orig_argv", [])
    if len(original) < len(sys.argv) + 1:
        return False
    named = original[len(original) - len(sys.argv)]
    return named in _LAUNCHERS or (named.startswith("-m") and named[2:] in _LAUNCHERS)


def _console_script(main) -> bool:
    """Whether ``__main__`` is the ``gtrun`` script pip generated (it imports
    ``globaltensor.launch`` at its top, so its own file is the program: ``gtrun``,
    ``gtrun.exe`` or ``gtrun-script.py`` on Windows)."""
    path = getattr(main, "__file__", None) or ""
    name = re.sub(r"(-script\.pyw?|\.exe)$", "", os.path.basename(path))
    return name == "gtrun" and bool(sys.argv) and os.path.basename(sys.argv[0]).startswith("gtrun")
