"""The launcher and gt.spawn: start one process per rank, watch over them, report what failed.

One audience per file: ``cli.py`` (the user at the shell: the options and ``main`` of
``python launch.py``, ``gtrun``, ``python -m globaltensor``), ``supervise.py`` (the launcher's
processes: start, pump output, watch, stop), ``reporting.py`` (what the launcher prints when ranks
fail), ``spawn.py`` (``gt.spawn``, the Python API); ``__main__.py`` makes ``python -m
globaltensor.launch`` the launcher. See docs/launcher.md. This module only re-exports.
"""
from .cli import (LaunchConfig, LaunchError, auto_nproc, free_port, main, parse_args, program_name,
                  run)

__all__ = ["main", "run", "parse_args", "LaunchConfig", "free_port", "auto_nproc"]
