"""Start one process per rank on this node and watch over them.

    python launch.py --nproc_per_node 4 train.py --lr 0.1
    gtrun --nproc-per-node 4 train.py          # the same: installed with the package
    python -m globaltensor --nproc_per_node auto train.py
    python -m globaltensor.launch --nnodes 2 --node_rank 0 --nproc_per_node 2 \\
        --master_addr 10.0.0.1 --master_port 29500 train.py

Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK (and GROUP_RANK),
MASTER_ADDR and MASTER_PORT, so ``gt.init()`` (or torch's ``env://``) joins the world. Each rank
runs in its own session, so stopping a rank stops every process it started. Every line a rank
writes is echoed with a ``[rank R]`` prefix. When a rank fails, the others are stopped and the
launcher exits non-zero, naming the rank, how it ended and the tail of its stderr; with
``--max_restarts N`` it first starts every rank again, up to N times (as torchrun does; each
rank reads the attempt in TORCHELASTIC_RESTART_COUNT).
See docs/launcher.md for every option and what happens on each fault.

This module (the user at the shell: options and main), supervise.py (the processes) and
reporting.py (what is printed when ranks fail) use only the standard library (and
globaltensor.errors); they never call torch.
"""
from __future__ import annotations

import argparse
import errno
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass

from .._version import __version__
from ..errors import LaunchError
from .supervise import (Console, Outcome, RankProcess, Signals, finish, restart, start_ranks,
                        stop, supervise)

DEFAULT_MULTINODE_PORT = 29500
EXIT_USAGE = 2


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """What to run and where; checked on construction."""

    nproc_per_node: int
    script: str
    script_args: tuple[str, ...] = ()
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    module: bool = False
    no_python: bool = False
    redirect: bool = False
    logdir: str | None = None
    timeout: float | None = None
    ranks_filter: tuple[int, ...] | None = None  # only these ranks' output is echoed
    max_restarts: int = 0  # restarts of every local rank after a failure (torchrun's meaning)

    def __post_init__(self):
        _expect(self.nproc_per_node >= 1, f"--nproc_per_node >= 1, found {self.nproc_per_node}",
                "pass the number of processes to start on this node")
        _expect(self.nnodes >= 1, f"--nnodes >= 1, found {self.nnodes}", "pass the number of nodes")
        _expect(0 <= self.node_rank < self.nnodes,
                f"0 <= --node_rank < --nnodes, found --node_rank {self.node_rank} with "
                f"--nnodes {self.nnodes}", "number the nodes 0 .. nnodes-1")
        _expect(bool(self.master_addr.strip()) and not any(c.isspace() for c in self.master_addr),
                f"--master_addr a host name or address, found {self.master_addr!r}",
                "pass the address of the node that hosts rank 0, e.g. --master_addr 10.0.0.1 "
                "(or leave it out on one node)")
        _expect(self.master_port is None or 0 < self.master_port < 65536,
                f"--master_port in 1..65535, found {self.master_port}", "pick a free TCP port")
        _expect(not (self.module and self.no_python), "at most one of -m and --no_python",
                "use -m to run a python module, --no_python to run an executable")
        _expect(not self.redirect or self.logdir,
                "--logdir DIR with --redirect_stdout_and_stderr, found no --logdir",
                "add --logdir DIR (the per-rank files go there)")
        _expect(isinstance(self.max_restarts, int) and self.max_restarts >= 0,
                f"--max_restarts >= 0, found {self.max_restarts}",
                "pass how many times to restart the job after a rank fails (0: never)")
        _expect(self.timeout is None or self.timeout > 0,
                f"--timeout > 0 seconds, found {self.timeout}", "leave it out to wait forever")
        _expect(bool(self.script), "a script (or module / executable) to run, found none",
                "add the script and its arguments after the options")
        bad = [r for r in self.ranks_filter or () if not 0 <= r < self.world_size]
        _expect(not bad, f"--ranks_filter ranks in 0..{self.world_size - 1}, found {bad}",
                "list ranks of this job, e.g. --ranks_filter 0,2")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.nproc_per_node + local_rank


def _expect(ok: bool, expected: str, fix: str) -> None:
    if not ok:
        raise LaunchError(f"expected {expected}; {fix}")


EPILOG = """\
every rank gets these environment variables:
  RANK, WORLD_SIZE          this rank and the number of ranks in the job
  LOCAL_RANK, LOCAL_WORLD_SIZE   this rank and the number of ranks on this node
  NODE_RANK (and GROUP_RANK)     this node, 0 .. nnodes-1
  MASTER_ADDR, MASTER_PORT  where the ranks meet (gt.init() and torch's env:// read them)
  OMP_NUM_THREADS=1         when several ranks share a node and it is not set already
  TORCHELASTIC_RESTART_COUNT   restarts of the job so far (0 on the first attempt), and
  TORCHELASTIC_MAX_RESTARTS    --max_restarts, as torchrun sets them

exit codes:
  0        every rank succeeded
  N        the first rank that failed exited with N (128+S when killed by signal S);
           its stderr from its last traceback is shown, and the other ranks are stopped
           (with --max_restarts: of the last attempt, once the restarts are used up)
  2        bad options, a missing script or an unusable --logdir (no rank was started)
  124      --timeout passed; 130 / 143 Ctrl-C / SIGTERM stopped the job

seeing what goes wrong:
  GT_DEBUG=1        every global operation checks that all ranks agree on it, and names the
                    ranks and the operation that differ instead of hanging
                    (TORCH_DISTRIBUTED_DEBUG=DETAIL turns it on too)
  GT_TIMEOUT=SECS   how long a collective waits before it fails (default 300 on CPU)

Every option also takes torchrun's spelling (--nproc-per-node, --master-port, ...).
"""


def program_name(argv0: str | None = None) -> str:
    """How the user started the launcher, for its usage line: ``gtrun``, ``python -m
    globaltensor`` or ``launch.py`` (``python -m globaltensor.launch`` too, as before it was a
    package)."""
    path = sys.argv[0] if argv0 is None else argv0
    name = os.path.basename(path)
    if name.startswith("gtrun"):
        return "gtrun"
    in_launch = os.path.basename(os.path.dirname(path)) == "launch"  # launch/__main__.py
    return "python -m globaltensor" if name == "__main__.py" and not in_launch else "launch.py"


def _parser(prog: str | None = None) -> argparse.ArgumentParser:
    prog = prog or program_name()
    example = (f"example:\n  {prog} --nproc_per_node 4 train.py --lr 0.1"
               f"      # 4 ranks; train.py calls gt.init()\n\n")
    p = argparse.ArgumentParser(
        prog=prog, epilog=example + EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start one process per rank of a globaltensor / torch.distributed job "
                    "(also: gtrun, python -m globaltensor).")
    p.add_argument("--version", action="version", version=f"globaltensor {__version__}")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node_rank", "--node-rank", type=int, default=0,
                   help="this node's rank, 0 .. nnodes-1")
    p.add_argument("--nproc_per_node", "--nproc-per-node", required=True, type=_nproc,
                   help="processes on this node, or 'auto': one per GPU (per CPU core without)")
    p.add_argument("--master_addr", "--master-addr", default="127.0.0.1",
                   help="address of node 0")
    p.add_argument("--master_port", "--master-port", type=int, default=None,
                   help="free port on node 0 (default: a free port when nnodes=1, else "
                        f"{DEFAULT_MULTINODE_PORT})")
    p.add_argument("-m", "--module", action="store_true", help="run the script as `python -m`")
    p.add_argument("--no_python", "--no-python", action="store_true",
                   help="exec the script, not with python")
    p.add_argument("--redirect_stdout_and_stderr", "--redirect-stdout-and-stderr",
                   action="store_true", help="write each rank's output only to files in --logdir")
    p.add_argument("--logdir", "--log_dir", "--log-dir", default=None,
                   help="directory for rank_<R>.stdout / rank_<R>.stderr (created if needed)")
    p.add_argument("--ranks_filter", "--ranks-filter", type=_ranks, default=None, metavar="RANKS",
                   help="show only these ranks' output, e.g. 0,2 (all are still logged)")
    p.add_argument("--max_restarts", "--max-restarts", type=_restarts, default=0, metavar="N",
                   help="when a rank fails, stop every rank and start them all again, up to N "
                        "times (default 0); scripts resume from their checkpoint")
    p.add_argument("--timeout", type=float, default=None,
                   help="stop the job and fail if it still runs after this many seconds "
                        "(all attempts together)")
    p.add_argument("script", help="the script (module with -m, executable with --no_python)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def _nproc(text: str):
    if text == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of processes or 'auto', found {text!r}") from None


def _restarts(text: str) -> int:
    try:
        return int(text)  # a negative count is refused with the other checks (LaunchConfig)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of restarts (0, 1, 2, ...), found {text!r}") from None


def _ranks(text: str) -> tuple[int, ...]:
    try:
        return tuple(sorted({int(r) for r in text.split(",") if r.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected ranks separated by commas (e.g. 0,2), found {text!r}") from None


def auto_nproc(environ=os.environ) -> tuple[int, str]:
    """(processes, what was counted) for ``--nproc_per_node auto``: the visible GPUs, else the
    CPU cores this process may use. Counted without importing torch."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = [d for d in visible.split(",") if d.strip() and d.strip() != "-1"]
        if gpus and visible.strip() != "-1":
            return len(gpus), "GPUs in CUDA_VISIBLE_DEVICES"
    else:
        try:
            gpus = os.listdir("/proc/driver/nvidia/gpus")
        except OSError:
            gpus = []
        if gpus:
            return len(gpus), "GPUs"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return cores, "CPU cores (no GPU found)"


def parse_args(argv: list[str] | None = None) -> LaunchConfig:
    """Command line -> LaunchConfig. argparse exits on malformed options; LaunchError otherwise."""
    ns = _parser().parse_args(argv)
    nproc = ns.nproc_per_node if ns.nproc_per_node != "auto" else auto_nproc()[0]
    return LaunchConfig(
        nproc_per_node=nproc, script=ns.script, script_args=tuple(ns.script_args),
        nnodes=ns.nnodes, node_rank=ns.node_rank, master_addr=ns.master_addr,
        master_port=ns.master_port, module=ns.module, no_python=ns.no_python,
        redirect=ns.redirect_stdout_and_stderr, logdir=ns.logdir, timeout=ns.timeout,
        ranks_filter=ns.ranks_filter, max_restarts=ns.max_restarts)


def check_paths(config: LaunchConfig) -> None:
    """The script exists and --logdir can hold the logs: checked before any rank starts."""
    if config.no_python:
        _expect(shutil.which(config.script) is not None,
                f"an executable {config.script!r}, found none (not a file, not on PATH)",
                "check the path, or drop --no_python to run a python script")
    elif not config.module:
        _expect(os.path.isfile(config.script),
                f"the script {config.script!r} to exist, found no such file (from {os.getcwd()})",
                "check the path, or pass -m to run a module")
    if config.logdir:
        _expect(not os.path.exists(config.logdir) or os.path.isdir(config.logdir),
                f"--logdir {config.logdir!r} to be a directory, found a file",
                "pass a directory (it is created if missing)")
        try:
            os.makedirs(config.logdir, exist_ok=True)
        except OSError as e:
            _expect(False, f"--logdir {config.logdir!r} to be creatable, found {e.strerror}",
                    "pass a directory you can write to")
        _expect(os.access(config.logdir, os.W_OK | os.X_OK),
                f"--logdir {config.logdir!r} to be writable, found it is not",
                "pass a directory you can write to")


# --------------------------------------------------------------------------- ports


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    """True when no socket listens on ``port`` (TIME_WAIT leftovers do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False
            raise
        return True


def choose_port(config: LaunchConfig) -> int:
    """The master port: the given one (checked free on node 0), or a free one on a single node."""
    if config.master_port is None:
        return free_port() if config.nnodes == 1 else DEFAULT_MULTINODE_PORT
    if config.node_rank == 0 and not port_is_free(config.master_port):
        raise LaunchError(
            f"expected --master_port {config.master_port} to be free on node 0, found another "
            f"process listening on it; pick another port"
            + (", or leave --master_port out to get a free one" if config.nnodes == 1 else ""))
    return config.master_port


def run(config: LaunchConfig, out=None, err=None) -> int:
    """Run the job described by ``config``; returns the launcher's exit status.

    A job is up to ``1 + max_restarts`` attempts: when a rank of an attempt fails and restarts
    are left, every rank still running is stopped and all are started again (with a fresh port
    when the launcher picks it), TORCHELASTIC_RESTART_COUNT counting the restarts. The last
    attempt's end is reported as a job without restarts reports it. ``--timeout`` and Ctrl-C
    end the job, whatever restarts are left."""
    console = Console(out or sys.stdout, err or sys.stderr)
    check_paths(config)
    port = choose_port(config)
    signals = Signals()
    signals.install()
    ranks: list[RankProcess] = []
    attempts = config.max_restarts + 1
    try:
        deadline = time.monotonic() + config.timeout if config.timeout else None
        for attempt in range(1, attempts + 1):
            if attempt > 1:  # the port of the attempt before may linger in TIME_WAIT
                port = choose_port(config)
            ranks = start_ranks(config, port, console, restart=attempt - 1)
            if config.nnodes > 1:
                first = config.global_rank(0)
                console.note(f"node {config.node_rank} of {config.nnodes}: started ranks "
                             f"{first}..{first + config.nproc_per_node - 1}; waiting for "
                             f"{config.nnodes} nodes to meet at {config.master_addr}:{port} (the "
                             f"job starts when every node's launcher has started its ranks)")
            outcome = supervise(ranks, deadline, signals)
            if outcome.kind != "failed" or attempt == attempts:
                break
            if not restart(ranks, outcome, signals, console, attempt + 1, attempts):
                outcome = Outcome("signal", signum=signals.received[0])  # Ctrl-C meanwhile
                break
        return finish(ranks, outcome, signals, console, config, port)
    except BaseException:
        stop(ranks, signal.SIGKILL, grace=0)  # never leave ranks behind, whatever went wrong
        raise
    finally:
        signals.restore()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python launch.py``, ``gtrun``, ``python -m globaltensor`` and
    ``python -m globaltensor.launch``."""
    try:
        return run(parse_args(argv))
    except LaunchError as e:
        print(f"launch.py: error: {e}", file=sys.stderr)
        return EXIT_USAGE


__all__ = ["main", "run", "parse_args", "LaunchConfig", "free_port", "auto_nproc"]
