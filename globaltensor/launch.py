"""Start one process per rank on this node and watch over them.

    python launch.py --nproc_per_node 4 train.py --lr 0.1
    python -m globaltensor.launch --nnodes 2 --node_rank 0 --nproc_per_node 2 \\
        --master_addr 10.0.0.1 --master_port 29500 train.py

Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK (and GROUP_RANK),
MASTER_ADDR and MASTER_PORT, so ``gt.init()`` (or torch's ``env://``) joins the world. Each rank
runs in its own session, so stopping a rank stops every process it started. Every line a rank
writes is echoed with a ``[rank R]`` prefix. When a rank fails, the others are stopped and the
launcher exits non-zero, naming the rank, how it ended and the tail of its stderr.
See docs/launcher.md for every option and what happens on each fault.

This module and supervise.py (the processes) use only the standard library (and
globaltensor.errors); they never call torch.
"""
from __future__ import annotations

import argparse
import errno
import signal
import socket
import sys
import time
from dataclasses import dataclass

from .errors import LaunchError
from .supervise import Console, RankProcess, Signals, finish, start_ranks, stop, supervise

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

    def __post_init__(self):
        _expect(self.nproc_per_node >= 1, f"--nproc_per_node >= 1, found {self.nproc_per_node}",
                "pass the number of processes to start on this node")
        _expect(self.nnodes >= 1, f"--nnodes >= 1, found {self.nnodes}", "pass the number of nodes")
        _expect(0 <= self.node_rank < self.nnodes,
                f"0 <= --node_rank < --nnodes, found --node_rank {self.node_rank} with "
                f"--nnodes {self.nnodes}", "number the nodes 0 .. nnodes-1")
        _expect(self.master_port is None or 0 < self.master_port < 65536,
                f"--master_port in 1..65535, found {self.master_port}", "pick a free TCP port")
        _expect(not (self.module and self.no_python), "at most one of -m and --no_python",
                "use -m to run a python module, --no_python to run an executable")
        _expect(not self.redirect or self.logdir,
                "--logdir DIR with --redirect_stdout_and_stderr, found no --logdir",
                "add --logdir DIR (the per-rank files go there)")
        _expect(self.timeout is None or self.timeout > 0,
                f"--timeout > 0 seconds, found {self.timeout}", "leave it out to wait forever")
        _expect(bool(self.script), "a script (or module / executable) to run, found none",
                "add the script and its arguments after the options")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.nproc_per_node + local_rank


def _expect(ok: bool, expected: str, fix: str) -> None:
    if not ok:
        raise LaunchError(f"expected {expected}; {fix}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch.py",
        description="Start one process per rank of a globaltensor / torch.distributed job.")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node_rank", type=int, default=0, help="this node's rank, 0 .. nnodes-1")
    p.add_argument("--nproc_per_node", type=int, required=True, help="processes on this node")
    p.add_argument("--master_addr", default="127.0.0.1", help="address of node 0")
    p.add_argument("--master_port", type=int, default=None,
                   help="free port on node 0 (default: a free port when nnodes=1, else "
                        f"{DEFAULT_MULTINODE_PORT})")
    p.add_argument("-m", "--module", action="store_true", help="run the script as `python -m`")
    p.add_argument("--no_python", action="store_true", help="exec the script, not with python")
    p.add_argument("--redirect_stdout_and_stderr", action="store_true",
                   help="write each rank's output only to files in --logdir")
    p.add_argument("--logdir", default=None,
                   help="directory for rank_<R>.stdout / rank_<R>.stderr (created if needed)")
    p.add_argument("--timeout", type=float, default=None,
                   help="stop the job and fail if it still runs after this many seconds")
    p.add_argument("script", help="the script (module with -m, executable with --no_python)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def parse_args(argv: list[str] | None = None) -> LaunchConfig:
    """Command line -> LaunchConfig. argparse exits on malformed options; LaunchError otherwise."""
    ns = _parser().parse_args(argv)
    return LaunchConfig(
        nproc_per_node=ns.nproc_per_node, script=ns.script, script_args=tuple(ns.script_args),
        nnodes=ns.nnodes, node_rank=ns.node_rank, master_addr=ns.master_addr,
        master_port=ns.master_port, module=ns.module, no_python=ns.no_python,
        redirect=ns.redirect_stdout_and_stderr, logdir=ns.logdir, timeout=ns.timeout)


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
    """Run the job described by ``config``; returns the launcher's exit status."""
    console = Console(out or sys.stdout, err or sys.stderr)
    port = choose_port(config)
    signals = Signals()
    signals.install()
    ranks: list[RankProcess] = []
    try:
        ranks = start_ranks(config, port, console)
        deadline = time.monotonic() + config.timeout if config.timeout else None
        outcome = supervise(ranks, deadline, signals)
        return finish(ranks, outcome, signals, console, config, port)
    except BaseException:
        stop(ranks, signal.SIGKILL, grace=0)  # never leave ranks behind, whatever went wrong
        raise
    finally:
        signals.restore()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python launch.py`` and ``python -m globaltensor.launch``."""
    try:
        return run(parse_args(argv))
    except LaunchError as e:
        print(f"launch.py: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
