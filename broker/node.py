"""The node process: supervisor of all workers and single writer of definitions.

Every declare/bind/delete a client asks for arrives here as a REQUEST from a
frontend. The node validates it against its Definitions (``plan_*``), applies
the resulting ops, records them durably (DefStore, group fsync in a thread),
broadcasts them with a new version to every worker, and answers only when
every live worker has applied that version and the ops are on disk. That is
what makes a publish on any connection right after ``bind-ok`` route through
the new binding.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
from typing import Any

import zmq

from broker import contract
from broker.amqp.errors import AMQPConnectionError, AMQPError
from broker.config import Settings
from broker.datadir import PRIVATE_UMASK, DataDir, DataDirLocked, DataDirUnsafe
from broker.definitions import Definitions
from broker.definitions_file import plan_from_file, read_definitions_file
from broker.defstore import DefStore
from broker.http.server import HttpServer
from broker.process import install_uvloop
from broker.supervisor import Supervisor, WorkerProcess
from broker.zmqio import BatchSocket, make_socket

log = logging.getLogger("shardmq.node")

_QUERY_TIMEOUT_S = 5.0
_STARTUP_TIMEOUT_S = 60.0


class Node:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.datadir = DataDir(settings.data_dir)
        self.loop = asyncio.get_running_loop()
        self.defstore = DefStore(self.datadir.path)
        self.defs: Definitions | None = None
        self.epochs: dict[int, int] = {}
        self.sup = Supervisor(self.datadir.run_dir, settings.log_level, self._on_worker_exit, self._on_spawn)
        self.by_ident: dict[bytes, WorkerProcess] = {}
        self.ctl: BatchSocket | None = None
        self._apply_waiters: list[tuple[int, asyncio.Future]] = []
        self._queries: dict[int, asyncio.Future] = {}
        self._next_query = 0
        self._sync_waiters: list[asyncio.Future] = []
        self._sync_running = False
        self._tasks: set[asyncio.Task] = set()
        self.stopped = asyncio.Event()
        self._shards_ready = asyncio.Event()
        # Open connections per vhost, counted against max-connections: vhost -> {(frontend, conn_id)}.
        self.vhost_conns: dict[str, set[tuple]] = {}
        # What the health checks report (broker/http/health.py): ready once this node serves (or, in
        # a cluster, proxies to the leader); is_leader on the node that serves clients; alarms names
        # the resource alarms in effect.
        self.serving = False
        self.is_leader = False
        self.alarms: list[str] = []
        self.http = HttpServer(self, settings.http_bind, settings.http_port)

    # ------------------------------------------------------------------ life
    async def start(self) -> None:
        s = self.settings
        self.datadir.lock()
        self.defs = self.defstore.load(default_user=s.default_user, default_pass=s.default_pass)
        self.defs.loopback_users = tuple(s.loopback_users)
        self.defs.rebalance(s.shards)
        if s.definitions:
            ops = plan_from_file(self.defs, read_definitions_file(s.definitions))
            self.defs.apply_all(ops)
            self.defstore.record(ops)
            self.defstore.sync()
        # After load only durable queues exist: every other queue directory is left over.
        self.datadir.remove_stale_queues(
            {(v.name, q) for v in self.defs.vhosts.values() for q in v.queues})
        self.datadir.remove_stale_delay_stores(
            {(v.name, x) for v in self.defs.vhosts.values() for x in v.exchanges})
        ctx = zmq.Context.instance()
        sock = make_socket(ctx, zmq.ROUTER)
        sock.bind(contract.node_address(self.datadir.run_dir))
        self.ctl = BatchSocket(self.loop, sock, self._on_control)
        for i in range(s.shards):
            self.epochs[i] = 1
            await self.sup.spawn(self._worker("shard", i))
        try:
            await asyncio.wait_for(self._shards_ready.wait(), _STARTUP_TIMEOUT_S)
        except TimeoutError:
            raise RuntimeError(f"shards did not start within {_STARTUP_TIMEOUT_S:.0f} s") from None
        for i in range(s.frontends):
            await self.sup.spawn(self._worker("frontend", i))
        # A standalone node serves clients itself: it is its own leader.
        self.is_leader = True
        self.serving = True
        await self.http.start()
        log.info("node (pid %d) started %d shards and %d frontends; AMQP on %s:%d; data dir %s",
                 os.getpid(), s.shards, s.frontends, s.bind, s.port, self.datadir.path)

    @property
    def ready(self) -> bool:
        """Serving, and every frontend has applied its snapshot (so it listens and routes)."""
        return self.serving and all(w.applied >= 0 for w in self.sup.workers if w.role == "frontend")

    def _worker(self, role: str, index: int) -> WorkerProcess:
        w = WorkerProcess(role, index)
        self.by_ident[contract.worker_id(role, index)] = w
        return w

    async def stop(self) -> None:
        if self.sup.stopping:
            return
        self.sup.stopping = True
        log.info("node stopping")
        self.serving = False
        await self.http.stop()
        # Frontends first so no new work reaches the shards, then shards sync and exit.
        for role, timeout in (("frontend", 5.0), ("shard", 15.0)):
            for ident, w in self.by_ident.items():
                if w.role == role and w.connected:
                    self.ctl.send_now(ident, [[contract.STOP]])
            for w in self.sup.workers:
                if w.role == role and w.proc and w.proc.returncode is None and not w.connected:
                    w.proc.send_signal(signal.SIGTERM)
            await self.sup.stop_role(role, timeout)
        await self.loop.run_in_executor(None, self.defstore.sync)
        if self.ctl is not None:
            self.ctl.close()
        self.datadir.unlock()
        log.info("node stopped")
        self.stopped.set()

    def _on_spawn(self, _worker: WorkerProcess) -> None:
        # pids.json is information for operators and tests; failing to write it must not stop anything.
        try:
            self.datadir.write_pids(self.sup.pids())
        except OSError as exc:
            log.warning("cannot write %s/pids.json: %s", self.datadir.run_dir, exc)

    def _on_worker_exit(self, worker: WorkerProcess, _code: int) -> None:
        self._check_apply_waiters()
        if worker.role == "shard":
            # The restarted shard gets a new epoch: batches meant for the dead one are dropped,
            # frontends close the client connections that had state on it, and other shards
            # address their forwarded dead letters to the new epoch.
            self.epochs[worker.index] += 1
            self._broadcast(None, [contract.SHARD_UP, worker.index, self.epochs[worker.index]])
            for fut in list(self._queries.values()):
                if not fut.done():
                    fut.set_result(None)
        else:
            self._broadcast("shard", [contract.WORKER_DOWN, "frontend", worker.index])
            for owners in self.vhost_conns.values():
                owners.difference_update([o for o in owners if o[0] == worker.index])
            for owners in self.vhost_conns.values():
                owners.difference_update([o for o in owners if o[0] == worker.index])
            ops = self.defs.ops_for_owner_gone([worker.index])
            if ops:
                self._spawn_task(self._commit(ops))

    def _broadcast(self, role: str | None, item: list) -> None:
        for ident, w in self.by_ident.items():
            if w.connected and (role is None or w.role == role):
                self.ctl.put(ident, item)

    # --------------------------------------------------------------- control
    def _on_control(self, ident: bytes | None, _header: Any, items: list) -> None:
        w = self.by_ident.get(ident)
        if w is None:
            log.warning("control message from unknown worker %r", ident)
            return
        for item in items:
            kind = item[0]
            if kind == contract.APPLIED:
                first = w.applied < 0
                if item[1] > w.applied:
                    w.applied = item[1]
                    self._check_apply_waiters()
                if first and w.role == "shard":
                    self._shard_up(w)
            elif kind == contract.REQUEST:
                self._spawn_task(self._handle_request(ident, item[1], item[2], item[3]))
            elif kind == contract.FORWARD:
                target = self.by_ident.get(contract.worker_id("frontend", int(item[1])))
                if target is not None and target.connected:
                    self.ctl.put(contract.worker_id("frontend", int(item[1])), [contract.FORWARDED, item[2]])
            elif kind == contract.QUERY_REPLY:
                fut = self._queries.pop(item[1], None)
                if fut is not None and not fut.done():
                    fut.set_result(item[3] if item[2] else None)
            elif kind == contract.HELLO:
                self._hello(ident, w, item)

    def _hello(self, ident: bytes, w: WorkerProcess, item: list) -> None:
        if item[1] != contract.VERSION:
            log.error("%s speaks contract version %s, node %s: stopping it", w.name, item[1], contract.VERSION)
            if w.proc:
                w.proc.send_signal(signal.SIGKILL)
            return
        settings = dataclasses.asdict(self.settings)
        self.ctl.put(ident, [contract.SNAPSHOT, self.defs.version, self.defs.to_dict(), self.epochs, settings])
        if w.role == "shard":
            # Shards that came up before this one said hello: it would not hear of them otherwise, and
            # it must know its peers are ready before it forwards recovered delayed messages to them.
            for x in self.sup.workers:
                if x.role == "shard" and x is not w and x.connected and x.applied >= 0:
                    self.ctl.put(ident, [contract.SHARD_UP, x.index, self.epochs[x.index]])
        w.connected = True

    def _shard_up(self, w: WorkerProcess) -> None:
        """A (re)started shard has loaded its queues: frontends may send it data."""
        self._broadcast(None, [contract.SHARD_UP, w.index, self.epochs[w.index]])
        if all(x.connected and x.applied >= 0 for x in self.sup.workers if x.role == "shard"):
            self._shards_ready.set()

    def _check_apply_waiters(self) -> None:
        # A worker that has not said HELLO yet gets a snapshot with the newest version, so only
        # connected workers can hold a reply back.
        live = [w.applied for w in self.by_ident.values() if w.connected]
        low = min(live) if live else 1 << 62
        keep = []
        for version, fut in self._apply_waiters:
            if fut.done():
                continue
            if version <= low:
                fut.set_result(None)
            else:
                keep.append((version, fut))
        self._apply_waiters = keep

    # ------------------------------------------------------------- requests
    def _spawn_task(self, coro) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle_request(self, ident: bytes, req_id: int, op: str, args: dict) -> None:
        try:
            result = await self._execute(op, args)
        except AMQPError as exc:
            reply = [contract.REPLY, req_id, False, [exc.code, exc.text, exc.class_id, exc.method_id]]
        except Exception:
            log.exception("request %s failed", op)
            reply = [contract.REPLY, req_id, False, [541, "INTERNAL_ERROR", 0, 0]]
        else:
            reply = [contract.REPLY, req_id, True, result]
        self.ctl.put(ident, reply)

    async def _execute(self, op: str, a: dict) -> dict:
        defs = self.defs
        vhost = a.get("vhost", "/")
        owner = a.get("owner")
        if op == "queue.declare":
            name = a.get("queue", "")
            existed = bool(name) and defs.queue(vhost, name) is not None
            ops, name = defs.plan_queue_declare(
                vhost, name, bool(a.get("passive")), bool(a.get("durable")), bool(a.get("exclusive")),
                bool(a.get("auto_delete")), a.get("arguments") or {}, owner, self.settings.shards)
            await self._commit(ops)
            info = {"messages": 0, "consumers": 0}
            if existed:
                info = await self._queue_info(vhost, name) or info
            return {"queue": name, **info}
        if op == "queue.delete":
            name = a.get("queue", "")
            info = await self._queue_info(vhost, name) or {"messages": 0, "consumers": 0}
            ops = defs.plan_queue_delete(vhost, name, bool(a.get("if_unused")), bool(a.get("if_empty")),
                                         owner, info["consumers"], info["messages"])
            await self._commit(ops)
            return {"messages": info["messages"] if ops else 0}
        if op == "queue.auto_delete":
            q = defs.queue(vhost, a["queue"])
            if q is not None and q.auto_delete:
                info = await self._queue_info(vhost, a["queue"])
                if info is not None and info["consumers"] == 0:
                    await self._commit(defs.plan_queue_delete(vhost, a["queue"], False, False, None, 0, 0))
            return {}
        if op == "queue.expire":
            # x-expires ran out on the shard; a consumer may have come meanwhile.
            q = defs.queue(vhost, a["queue"])
            # The effective arguments: an `expires` policy counts as much as the x-expires argument.
            if q is not None and defs.effective_arguments(vhost, "queue", a["queue"]).get("x-expires"):
                info = await self._queue_info(vhost, a["queue"])
                # "expired" is False when a redeclare renewed the lease after the shard asked.
                if info is not None and info["consumers"] == 0 and info.get("expired", True):
                    await self._commit(defs.plan_queue_delete(vhost, a["queue"], False, False, None, 0, 0))
            return {}
        if op == "exchange.declare":
            ops = defs.plan_exchange_declare(
                vhost, a.get("exchange", ""), a.get("exchange_type", a.get("type", "direct")),
                bool(a.get("passive")), bool(a.get("durable")), bool(a.get("auto_delete")),
                bool(a.get("internal")), a.get("arguments") or {})
        elif op == "exchange.delete":
            ops = defs.plan_exchange_delete(vhost, a.get("exchange", ""), bool(a.get("if_unused")))
        elif op in ("queue.bind", "queue.unbind"):
            plan = defs.plan_bind if op == "queue.bind" else defs.plan_unbind
            ops = plan(vhost, a.get("exchange", ""), "queue", a.get("queue", ""), a.get("routing_key", ""),
                       a.get("arguments") or {}, owner)
        elif op in ("exchange.bind", "exchange.unbind"):
            plan = defs.plan_bind if op == "exchange.bind" else defs.plan_unbind
            ops = plan(vhost, a.get("source", ""), "exchange", a.get("destination", ""),
                       a.get("routing_key", ""), a.get("arguments") or {}, owner)
        elif op == "connection.closed":
            for owners in self.vhost_conns.values():
                owners.discard(tuple(owner))
            ops = defs.ops_for_owner_gone(list(owner))
        elif op == "connection.open":
            return self._count_connection(vhost, tuple(owner), a.get("user", ""))
        else:
            raise AMQPError(540, f"NOT_IMPLEMENTED - unknown request {op}")
        await self._commit(ops)
        return {}

    def _count_connection(self, vhost: str, owner: tuple, user: str) -> dict:
        limit = self.defs.vhost_limits(vhost).get("max-connections")
        owners = self.vhost_conns.setdefault(vhost, set())
        if limit is not None and owner not in owners and len(owners) >= limit:
            raise AMQPConnectionError(530, f"access to vhost '{vhost}' refused for user '{user}': "
                                           f"connection limit ({limit}) is reached", 10, 40)
        owners.add(owner)
        return {}

    # ------------------------------------------------- policies, limits (Python API)
    async def set_policy(self, vhost: str, name: str, pattern: str, definition: dict, priority: int = 0,
                         apply_to: str = "all", operator: bool = False) -> None:
        """Set a policy (or operator policy); applied to existing queues/exchanges on every worker."""
        await self._commit(self.defs.plan_policy_put(vhost, name, pattern, definition, priority, apply_to,
                                                     operator))

    async def delete_policy(self, vhost: str, name: str, operator: bool = False) -> None:
        await self._commit(self.defs.plan_policy_delete(vhost, name, operator))

    async def set_vhost_limits(self, vhost: str, limits: dict) -> None:
        """Set max-connections / max-queues of a vhost (a negative value removes a limit)."""
        await self._commit(self.defs.plan_vhost_limits(vhost, limits))

    async def reload_definitions(self) -> None:
        """Re-read the --definitions file (SIGHUP) and apply what changed."""
        path = self.settings.definitions
        if not path:
            log.warning("SIGHUP: no definitions file configured")
            return
        try:
            ops = plan_from_file(self.defs, read_definitions_file(path))
        except (OSError, ValueError, KeyError) as exc:
            log.error("definitions file %s not applied: %s", path, exc)
            return
        await self._commit(ops)
        log.info("definitions file %s applied (%d changes)", path, len(ops))

    async def _queue_info(self, vhost: str, name: str) -> dict | None:
        q = self.defs.queue(vhost, name)
        if q is None:
            return None
        ident = contract.worker_id("shard", q.shard)
        w = self.by_ident.get(ident)
        if w is None or not w.connected:
            return None
        self._next_query += 1
        qid = self._next_query
        fut = self.loop.create_future()
        self._queries[qid] = fut
        self.ctl.put(ident, [contract.QUERY, qid, "queue_info", {"vhost": vhost, "queue": name}])
        try:
            return await asyncio.wait_for(fut, _QUERY_TIMEOUT_S)
        except TimeoutError:
            self._queries.pop(qid, None)
            return None

    async def _commit(self, ops: list) -> None:
        """Apply, persist and broadcast ops; return once durable and applied by every live worker."""
        if not ops:
            return
        defs = self.defs
        defs.apply_all(ops)  # bumps defs.version once per op; every replica does the same
        version = defs.version
        wrote = self.defstore.record(ops)
        self._broadcast(None, [contract.DEFS, version, ops])
        waits = [self._wait_all_applied(version)]
        if wrote:
            waits.append(self._durable())
        await asyncio.gather(*waits)

    async def _wait_all_applied(self, version: int) -> None:
        fut = self.loop.create_future()
        self._apply_waiters.append((version, fut))
        self._check_apply_waiters()
        await fut

    async def _durable(self) -> None:
        fut = self.loop.create_future()
        self._sync_waiters.append(fut)
        self._start_sync()
        await fut

    def _start_sync(self) -> None:
        if self._sync_running or not self._sync_waiters:
            return
        self._sync_running = True
        waiters = self._sync_waiters
        self._sync_waiters = []

        def done(f: asyncio.Future) -> None:
            self._sync_running = False
            exc = f.exception()
            for w in waiters:
                if not w.done():
                    w.set_exception(exc) if exc else w.set_result(None)
            self._start_sync()

        self.loop.run_in_executor(None, self.defstore.sync).add_done_callback(done)


async def _main(settings: Settings) -> int:
    node = Node(settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: loop.create_task(node.stop()))
    loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(node.reload_definitions()))
    try:
        await node.start()
    except (DataDirLocked, DataDirUnsafe) as exc:
        log.error("%s", exc)
        return 1
    except Exception as exc:
        log.exception("node failed to start: %s", exc)
        await node.stop()
        return 1
    await node.stopped.wait()
    return 0


def run(settings: Settings) -> int:
    """Run a node until SIGTERM/SIGINT; returns the process exit status."""
    # Files 0600 and directories 0700 whatever umask we were started with; workers inherit it.
    os.umask(PRIVATE_UMASK)
    install_uvloop()
    return asyncio.run(_main(settings))
