"""Process-level helpers shared by every worker process (frontends and shards)."""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when the node that spawned it dies.

    A `kill -9` of the node must not leave orphan frontends holding the AMQP port
    or orphan shards writing to the data dir the next node will open.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    # The parent may have died between fork and prctl.
    if os.getppid() == 1:
        os._exit(1)


def raise_nofile_limit() -> int:
    """Lift the soft RLIMIT_NOFILE to the hard limit and return the soft limit in effect.

    Every client connection is a descriptor: at a distribution's default soft limit (1024) a node
    refuses connections long before memory runs short. The hard limit is the administrator's
    ceiling (systemd's LimitNOFILE, docker's --ulimit); workers inherit what the node set.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # e.g. an unlimited hard limit the kernel caps (nr_open)
            pass
    return soft


def install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a hard dependency, but keep the node up
        return
    uvloop.install()


def run_worker(role: str, argv: list[str] | None, load_worker) -> int:
    """Common entry point of a worker process: `python -m <role>.main --index N --run-dir DIR`.

    ``load_worker()`` returns the worker class (imported late so the process has set up logging
    and uvloop first); it is built as ``cls(index, run_dir, loop)`` and must provide ``start()``,
    ``stop()`` and a ``stopped`` event.
    """
    return run_workers(f"shardmq-{role}", role, argv, [(role, load_worker)])


def run_workers(prog: str, label: str, argv: list[str] | None, loaders: list, before=None) -> int:
    """One process running the workers ``loaders`` names, ``[(role, load_worker), ...]``, with the
    same ``--index`` on one event loop (``run_worker``: one; shard/pair_main.py: a frontend and its
    shard). They start in reverse order (a pair's shard binds its data socket first) and SIGTERM
    stops them in order, each after the one before it has stopped (a pair: frontend, then shard, as
    the node orders a stop). The process ends when every worker has stopped. ``before(index)`` runs
    before any worker is built (shard/pair_main.py: the in-process link). Process-wide set-up
    (parent death signal, descriptor limit, uvloop, logging, signal handlers) is done once here.
    """
    import argparse
    import asyncio

    from broker import turn_probe
    from broker.logs import setup_logging

    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    die_with_parent()
    raise_nofile_limit()
    install_uvloop()
    setup_logging(args.log_level, f"{label}-{args.index}")
    if before is not None:
        before(args.index)

    async def serve() -> int:
        loop = asyncio.get_running_loop()
        workers = [(role, load()(args.index, args.run_dir, loop)) for role, load in loaders]
        turn_probe.install(loop, f"{label}-{args.index}")  # debug aid, off unless SHARDMQ_TEST_TURN_PROBE

        async def stop_in_order() -> None:
            for _role, worker in workers:
                await worker.stop()

        # The node stops workers with STOP; SIGTERM from outside does the same. Ctrl-C in a
        # terminal reaches the whole process group: the node decides, not us.
        loop.add_signal_handler(signal.SIGTERM, lambda: loop.create_task(stop_in_order()))
        loop.add_signal_handler(signal.SIGINT, lambda: None)
        # SIGUSR1 logs the workers' internal state (flow control, pending syncs) for diagnosis.
        states = [(logging.getLogger(f"shardmq.{role}"), w.debug_state) for role, w in workers
                  if getattr(w, "debug_state", None) is not None]
        if states:
            loop.add_signal_handler(signal.SIGUSR1, lambda: [log.warning("state: %s", state())
                                                             for log, state in states])
        # SIGHUP (sent on by the node when it gets one) re-reads what a worker can reload in place
        # (a frontend's TLS certificate).
        reloads = [w.reload for _role, w in workers if getattr(w, "reload", None) is not None]
        loop.add_signal_handler(signal.SIGHUP, lambda: [reload() for reload in reloads])
        if len(workers) > 1:
            # A pair (shard/pair_main.py): the node stops its frontend part alone (a fenced cluster
            # leader, broker/supervisor.py stop_frontends_now); the other workers go on. A process of
            # one worker keeps the signal's default (it dies, and is restarted as after a crash).
            from broker.contract import FRONTEND_STOP_SIGNAL

            aborts = [w.abort for role, w in workers if role == "frontend"]
            loop.add_signal_handler(FRONTEND_STOP_SIGNAL, lambda: [abort() for abort in aborts])
        await asyncio.gather(*(w.start() for _role, w in reversed(workers)))
        for _role, worker in workers:
            await worker.stopped.wait()
        return 0

    return asyncio.run(serve())
