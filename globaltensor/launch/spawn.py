"""gt.spawn: run a function on N fresh processes of this node, each a rank of one world.

    def work(local_rank, scale):
        gt.init()                       # joins the world spawn set up
        t = torch.ones(1) * scale
        gt.comm.all_reduce(t)
        return t.item()

    if __name__ == "__main__":
        print(gt.spawn(work, args=(2.0,), nproc_per_node=4))   # [8.0, 8.0, 8.0, 8.0]

``fn`` must be picklable (a module-level function): processes import ``fn``'s module afresh.
They fork from a server that imported torch and globaltensor once (multiprocessing's
``forkserver``, preloaded: a job starts in a fraction of a second instead of each process
importing torch), or are started with ``spawn`` where there is no forkserver or when asked.
Returns the values ``fn`` returned, by local rank.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time
import traceback

from ..errors import GlobalTensorError

_POLL_S = 0.05
_STOP_GRACE_S = 5.0
_EXIT_S = 60.0  # how long processes that returned their results get to exit


class SpawnError(GlobalTensorError):
    """A spawned process failed (or the job timed out); the message names the rank."""


def spawn(fn, args=(), nproc_per_node: int = 1, *, nnodes: int = 1, node_rank: int = 0,
          master_addr: str = "127.0.0.1", master_port: int | None = None,
          timeout: float | None = None, start_method: str | None = None,
          backend: str | None = None) -> list:
    """Run ``fn(local_rank, *args)`` in ``nproc_per_node`` processes; return their results.

    Each process gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR
    and MASTER_PORT before ``fn``'s module is imported, so ``gt.init()`` inside ``fn`` joins
    the world. With ``backend=`` ("gloo", "nccl", "cpu:gloo,cuda:nccl"), each process joins
    the world with it before ``fn`` runs, as Ignite's ``idist.spawn`` does (``gt.init()`` in
    ``fn`` is then a no-op). A process that raises (or dies) stops the others and raises ``SpawnError`` here
    with its rank and traceback; so does a job still running after ``timeout`` seconds.
    """
    from . import cli, supervise  # the launcher's config checks, environment and process tree

    try:
        config = cli.LaunchConfig(nproc_per_node=nproc_per_node, script="<gt.spawn>",
                                  nnodes=nnodes, node_rank=node_rank, master_addr=master_addr,
                                  master_port=master_port, timeout=timeout)
    except cli.LaunchError as e:  # the launcher's checks, told with spawn's argument names
        raise SpawnError(str(e).replace("--", "")) from None
    _check_backend(backend)
    payload = _pickle_payload(fn, args)
    port = cli.choose_port(config)
    ctx = _context(start_method)
    # a forkserver's children inherit the server's environment, from when it started: each gets
    # this process's environment now, as a spawned one would
    inherited = dict(os.environ) if ctx.get_start_method() == "forkserver" else \
        {k: os.environ[k] for k in ("OMP_NUM_THREADS",) if k in os.environ}
    procs, conns = [], []
    try:
        for local_rank in range(nproc_per_node):
            env = supervise.rank_env(inherited, rank=config.global_rank(local_rank), local_rank=local_rank,
                                  world_size=config.world_size, local_world_size=nproc_per_node,
                                  node_rank=node_rank, master_addr=master_addr, master_port=port)
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(payload, local_rank, env, send, backend),
                            name=f"gt-spawn-{local_rank}", daemon=False)
            p.start()
            send.close()
            procs.append(p)
            conns.append(recv)
        results = _wait(config, procs, conns)
        _wait_exits(config, procs)
        return results
    finally:
        _stop(procs)


def _context(start_method: str | None):
    """``forkserver`` preloaded with globaltensor (and so torch) by default where there is one;
    ``spawn`` elsewhere; the method asked for otherwise."""
    if start_method is None:
        start_method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() \
            else "spawn"
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["globaltensor"])  # read when the server first starts
    return ctx


def _pickle_payload(fn, args) -> bytes:
    try:
        return pickle.dumps((fn, tuple(args)))
    except Exception as e:  # noqa: BLE001 - pickling raises many types
        raise SpawnError(
            f"expected fn and args that can be pickled (fn a module-level function), found "
            f"{fn!r}: {type(e).__name__}: {e}; move fn to the top level of a module") from e


_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")


def _check_backend(backend) -> None:
    if backend is None:
        return
    names = [part.split(":")[-1].strip() for part in str(backend).split(",")] \
        if isinstance(backend, str) else []
    if not names or any(n not in _BACKENDS for n in names):
        raise SpawnError(
            f"expected backend= one of {list(_BACKENDS)} (or 'cpu:gloo,cuda:nccl'), found "
            f"{backend!r}; leave it out to choose gloo on CPU (plus NCCL with a GPU)")


def _child(payload: bytes, local_rank: int, env: dict, conn, backend=None) -> None:
    """Body of a spawned process: own session, environment, then fn; report through ``conn``."""
    os.setsid()  # a group of its own, so stopping this rank stops everything it started
    os.environ.update(env)
    _set_threads(env.get("OMP_NUM_THREADS"))
    failed = False
    try:
        fn, args = pickle.loads(payload)
        if backend is not None:
            from .. import env  # the world first, with the backend asked for (Ignite's way)

            env.init(backend=backend)
        message = ("ok", fn(local_rank, *args))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        message = ("error", f"{type(e).__name__}: {e}", traceback.format_exc())
        failed = True
    finally:
        _leave_world(failed)
    try:
        # plain pickle, by value: multiprocessing's own would share a tensor's memory through
        # a file descriptor that dies with this process before the parent reads it
        conn.send_bytes(pickle.dumps(message))
    except Exception as e:  # noqa: BLE001 - e.g. an unpicklable result
        conn.send_bytes(pickle.dumps(
            ("error", f"could not send the result back: {type(e).__name__}: {e}", "")))
        failed = True
    conn.close()
    _end(1 if failed else 0)


def _end(code: int) -> None:
    """End the process as the interpreter would, short of its finalization: multiprocessing's
    finalizers and the atexit hooks (the user's too) run, then ``os._exit``. In finalization a
    gloo group something still held (a traced graph's functional collectives find theirs by
    name) is destroyed by C++'s static destructors, which can abort the finished process
    ("terminate called without an active exception")."""
    import atexit
    from multiprocessing import util

    util._exit_function()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _set_threads(omp: str | None) -> None:
    # torch may already be imported (by fn's module or this package) before the variable was set
    if omp and omp.isdigit() and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(omp))


def _leave_world(failed: bool) -> None:
    """Leave as gt.init's atexit hook would (a forked process never runs atexit): close the
    groups; rank 0 waits for the others to leave unless ``fn`` failed here."""
    if "torch" in sys.modules:
        from ..world import exits  # only once torch is imported: spawn itself does not import it

        try:
            exits.leave_world(failed)
        except Exception:  # noqa: BLE001 - a broken world is being left anyway
            pass


def _wait(config, procs, conns) -> list:
    """Collect every result; raise SpawnError on the first failure or at the deadline."""
    results: dict[int, object] = {}
    deadline = time.monotonic() + config.timeout if config.timeout else None
    while len(results) < len(procs):
        for local_rank, conn in enumerate(conns):
            if local_rank in results or not conn.poll():
                continue
            message = _receive(conn)
            if message is not None and message[0] == "ok":
                results[local_rank] = message[1]
            else:
                procs[local_rank].join(1.0)
                raise SpawnError(_failure(config, local_rank, procs[local_rank], message))
        for local_rank, p in enumerate(procs):
            if local_rank not in results and p.exitcode is not None and not conns[local_rank].poll():
                raise SpawnError(_failure(config, local_rank, p, None))
        if deadline is not None and time.monotonic() > deadline:
            running = [config.global_rank(r) for r in range(len(procs)) if r not in results]
            raise SpawnError(
                f"expected the spawned job to finish within {config.timeout:g}s, found ranks "
                f"{running} still running; stopped every process. Raise timeout= or look for a "
                f"rank stuck in a collective")
        pending = [r for r in range(len(procs)) if r not in results]
        multiprocessing.connection.wait([conns[r] for r in pending]
                                        + [procs[r].sentinel for r in pending], timeout=_POLL_S)
    return [results[r] for r in range(len(procs))]


def _wait_exits(config, procs) -> None:
    """Every process returned its result: each must now leave the world and exit 0 by itself
    (rank 0 last: it hosts the store); one that crashes or hangs on the way out is an error."""
    deadline = time.monotonic() + _EXIT_S
    while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
        multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None],
                                        timeout=_POLL_S)
    for local_rank, p in enumerate(procs):
        if p.exitcode != 0:
            rank = config.global_rank(local_rank)
            how = (f"was still running {_EXIT_S:g}s later (stopped)" if p.exitcode is None
                   else _how_it_ended(p.exitcode))
            raise SpawnError(
                f"expected every process to exit 0 after returning its result, found rank {rank} "
                f"(local rank {local_rank}, pid {p.pid}) {how} while leaving the world; its "
                f"result was computed but the job did not end cleanly")


def _receive(conn):
    try:
        return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return None


def _failure(config, local_rank: int, proc, message) -> str:
    rank = config.global_rank(local_rank)
    where = f"rank {rank} (local rank {local_rank}, pid {proc.pid})"
    if message is not None:
        return f"{where} raised {message[1]}\n--- traceback of rank {rank} ---\n{message[2]}"
    return f"{where} {_how_it_ended(proc.exitcode)} without reporting a result or an error"


def _how_it_ended(code) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _stop(procs) -> None:
    """Stop every spawned process tree still running: SIGTERM, a grace period, then SIGKILL."""
    from .supervise import signal_tree

    for p in procs:
        if p.exitcode is None:
            signal_tree(p.pid, signal.SIGTERM)
    end = time.monotonic() + _STOP_GRACE_S
    while time.monotonic() < end and any(p.exitcode is None for p in procs):
        time.sleep(_POLL_S)
    for p in procs:
        signal_tree(p.pid, signal.SIGKILL)
        p.join(5.0)

__all__ = ["spawn", "SpawnError"]
