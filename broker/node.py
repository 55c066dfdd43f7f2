"""The node process: supervisor of all workers and single writer of definitions.

Every declare/bind/delete a client asks for arrives here as a REQUEST from a
frontend. The node validates it against its Definitions (``plan_*``), applies
the resulting ops, records them durably (DefStore, group fsync in a thread),
broadcasts them with a new version to every worker, and answers only when
every live worker routes through that version and the ops are on disk. That is
what makes a publish on any connection right after ``bind-ok`` route through
the new binding. Most changes wait for every worker's APPLIED; binds, unbinds
and exchange declares/deletes are kept by the definitions fence instead
(broker/defs_fence.py): answered without waiting for the workers, which apply
up to the fence before they act on any input.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from broker import contract, cpus, data_sockets, gc_pause, heap_trim, stage_trace, turn_probe
from broker.alarms import CHECK_INTERVAL_S, ResourceMonitor, parse_disk_limit, parse_memory_watermark
from broker.amqp.errors import AMQPConnectionError, AMQPError
from broker.config import Settings, cluster_secret
from broker.datadir import PRIVATE_UMASK, DataDir, DataDirLocked, DataDirUnsafe
from broker.definitions import Definitions
from broker.definitions_file import plan_from_file, read_definitions_file
from broker.defs_fence import FenceWord
from broker.defstore import DefStore, durable_ops, is_durable_relevant
from broker.delete_pacer import DeletePacer
from broker.heap_trim import HeapTrimmer
from broker.kv_layout import hold_for_tests, place_logs
from broker.kv_log import KV_DIR
from broker.mqtt.placement import SESSION_QUEUE_PREFIX, kv_owner
from broker.mqtt.placement import SPACES as MQTT_KV_SPACES
from broker.node_stats import NodeStats
from broker.permissions import CONFIGURE, READ, WRITE, check, check_topic
from broker.process import install_uvloop, raise_nofile_limit
from broker.queue_leftovers import QueueLeftovers
from broker.request_chains import RequestChains
from broker.sdnotify import Notifier
from broker.shard_watchdog import ShardWatchdog
from broker.supervisor import Supervisor, WorkerProcess
from broker.tls import reload_certificate, server_context
from broker.unixio import UnixRouter
from replication import definition_gate

# Imported where used: the HTTP servers once the shards are spawned (_start_node_services), the
# replication roles where a cluster role starts (a standalone node never loads them, ~1.6 MB).
if TYPE_CHECKING:
    from broker.http.metrics import MetricsServer
    from broker.http.server import HttpServer
    from replication.follower import ReplicationFollower
    from replication.leader import ReplicationLeader

log = logging.getLogger("shardmq.node")

_QUERY_TIMEOUT_S = 5.0
# Ops applied and broadcast in one loop turn at most (see _commit): a slice is one DEFS batch, which a
# worker applies in one piece (a shard deleting 256 queues spent ~5 ms of CPU in one turn; 32: under 1 ms).
_COMMIT_SLICE = 32
# Requests planned without waiting for anything (no shard query): Node._request_at_once may handle them
# in the turn their REQUEST arrives.
_NO_PAIRS: dict = {}  # _pairs_handing_over's answer when no pair gets a single copy (never written to)
_PLANNED_AT_ONCE = frozenset(("exchange.declare", "exchange.delete", "queue.bind", "queue.unbind",
                              "exchange.bind", "exchange.unbind"))
_STARTUP_TIMEOUT_S = 60.0
# After every worker applied its boot snapshot: malloc_trim once the read buffers shrank (broker/unixio.py).
_TRIM_AFTER_BOOT_S = 2.0
# Deleted queues' leftover entries checked per resource tick (0.25 s; one lstat each, see
# broker/queue_leftovers.py): those left after a burst of deletes go within seconds.
_LEFTOVERS_PER_TICK = 128
# After a paired frontend part's control connection closed: when to check whether its process runs on
# (Node._frontend_part_left). A killed pair's connections close before it is reaped.
_PAIR_LEFT_CHECK_S = 0.5
# Queue deletions per slice of a paced commit (a vhost delete): a shard deletes 8 queues in ~0.3 ms.
_PACED_SLICE_DELETES = 8
# A worker's control batch is handled for about this long in one loop turn; the rest of it (and what
# that worker sends meanwhile) waits for the next turn, in order (Node._on_control). 500 pipelined
# queue.delete in one batch made node turns of 12-16 ms during a 30,000-queue delete. Checked every
# _CONTROL_CHECK items. SHARDMQ_TEST_NODE_TURN_US: tests (0 = one check's worth of items per turn).
_CONTROL_TURN_S = int(os.environ.get("SHARDMQ_TEST_NODE_TURN_US") or 1000) / 1e6
_CONTROL_CHECK = 8


def _slices(ops: list, deletes_per_slice: int) -> Iterator[list]:
    """ops cut into slices of at most _COMMIT_SLICE ops and deletes_per_slice queue deletions."""
    part: list = []
    n = 0
    for op in ops:
        part.append(op)
        if op[0] == "queue.delete":
            n += 1
        if len(part) >= _COMMIT_SLICE or n >= deletes_per_slice:
            yield part
            part, n = [], 0
    if part:
        yield part


class Node:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.datadir = DataDir(settings.data_dir)
        self.loop = asyncio.get_running_loop()
        self.defstore = DefStore(self.datadir.path)
        self.defs: Definitions | None = None
        # Deleted queues whose directory may still be on their shard: a queue of the same name
        # declared meanwhile goes to that shard (broker/queue_leftovers.py); set at each load.
        self.leftovers: QueueLeftovers | None = None
        # Queue deletions go at --delete-rate per second beyond a small burst (broker/delete_pacer.py).
        # Adaptive below it unless SHARDMQ_TEST_DELETE_PACE_FIXED (A/B runs of the fixed pace).
        self.delete_pacer = DeletePacer(self.loop, settings.delete_rate,
                                        adaptive=not os.environ.get("SHARDMQ_TEST_DELETE_PACE_FIXED"))
        # No full GC while definitions change in bulk (broker/gc_pause.py): ~1 s apart, 10-20 ms each.
        self.bulk_changes = gc_pause.BulkChanges(self.loop)
        self.epochs: dict[int, int] = {}
        self.pairs = cpus.colocated_pairs(settings.colocate, settings.frontends, settings.shards)
        self.sup = self._supervisor()
        self.by_ident: dict[bytes, WorkerProcess] = {}
        self.ctl: UnixRouter | None = None
        # DEFS held back for the worker whose request they answer: sent in one batch with its REPLY,
        # before anything else for that worker (_put), instead of at once (see _commit).
        self._held: dict[bytes, list] = {}
        # (version, worker identity not waited for or None, the only workers waited for or None (every
        # connected one), future), in version order: answered once those workers applied the version.
        self._apply_waiters: deque[tuple[int, bytes | None, frozenset | None, asyncio.Future]] = deque()
        # The definitions fence (broker/defs_fence.py): binds and exchange changes are answered without
        # waiting for the workers' APPLIED; they apply up to this word before they act on input.
        self.fence_word: FenceWord | None = None
        # The fence went up in this control batch: its DEFS are written when the batch is handled
        # (_on_control), not after whatever else this loop turn runs (a worker may be waiting for them).
        self._fence_flush = False
        self._chains = RequestChains(self.loop)  # a channel's pipelined requests, in order
        # Control items read but not handled yet, per worker, in order (_on_control's turn budget),
        # and whether a loop turn is scheduled to go on with them.
        self._backlog: dict[bytes, deque] = {}
        self._backlog_scheduled = False
        self._snapshot: tuple[tuple, bytes] | None = None  # ((version, epochs), the packed SNAPSHOT batch)
        self._queries: dict[int, asyncio.Future] = {}
        self._admin_queries: dict[int, asyncio.Future] = {}  # shard_query(): answered (ok, result)
        # The workers' periodic STATS (queue counts, connections) for the management API and metrics.
        self.stats = NodeStats()
        # The frontends' closed connections free their rows here: memory back after a wave of closes.
        self.heap_trimmer = HeapTrimmer(self.loop, collect=False)
        self._next_query = 0
        self._sync_waiters: list[asyncio.Future] = []
        self._sync_running = False
        self._tasks: set[asyncio.Task] = set()
        self.stopped = asyncio.Event()
        self._shards_ready = asyncio.Event()
        # Frontends' HELLOs that wait for every shard to be up (a promotion, see _serve).
        self._deferred_hellos: list[tuple] = []
        # Shards' HELLOs while _serve loads the definitions (the shards start before that load).
        self._loading = False
        # The MQTT KV logs' placement running in a thread at a boot or promotion (_serve), until done.
        self._kv_placing: asyncio.Future | None = None
        self._services_started = False  # HTTP, Prometheus, alarms (_start_node_services)
        self._loading_hellos: list[tuple] = []
        # Open connections per vhost, counted against max-connections: vhost -> {(frontend, conn_id)}.
        self.vhost_conns: dict[str, set[tuple]] = {}
        # Cluster roles (docs/cluster.md): a leader serves and replicates, a follower only replicates.
        self.role = "standalone"
        self.repl_leader: ReplicationLeader | None = None
        self.repl_follower: ReplicationFollower | None = None
        self.repl_on_change = None  # the coordinator's callback for ReplicationLeader.on_change
        self.repl_auto_isr = True  # False once a coordinator drives the ISR (set_isr)
        # The followers confirms wait for from the start of a promotion (ClusterRole: etcd's ISR).
        self.repl_initial_isr: set[str] = set()
        # What the health checks report (broker/http/health.py): ready once this node serves (or, in
        # a cluster, proxies to the leader); is_leader on the node that serves clients; alarms names
        # the resource alarms in effect.
        self.serving = False
        self.is_leader = False
        self.alarms: list[str] = []
        self.tls = server_context(dataclasses.asdict(settings))  # HTTPS; the frontends build their own
        # Made by _start_node_services: aiohttp and prometheus_client take ~0.3 s of CPU to import (more on
        # a loaded box), which a boot does while the shards recover, not before it spawns them.
        self.http: HttpServer | None = None
        self.metrics: MetricsServer | None = None
        # In a cluster (--cluster): the etcd-driven role of this node (replication/cluster.py).
        self.cluster: Any = None
        # A shard alive but silent for --shard-hang-timeout is killed and restarted (broker/shard_watchdog.py).
        self.shard_watchdog = ShardWatchdog(self.loop, float(settings.shard_hang_timeout),
                                            settings.stats_interval / 1000, lambda: self.sup.workers,
                                            lambda: self.sup.stopping)

    # ------------------------------------------------------------------ life
    async def start(self) -> None:
        s = self.settings
        self.datadir.lock()
        self.fence_word = FenceWord(self.datadir.run_dir)
        # The control plane on unix stream sockets written and read by the loops themselves: a
        # declare's or bind's round trip crosses it twice per worker, and ZeroMQ added two I/O-thread
        # handoffs to each crossing (broker/unixio.py).
        self.ctl = UnixRouter(self.loop, contract.node_stream_path(self.datadir.run_dir), self._on_control)
        # A worker's frames for about _CONTROL_TURN_S per loop turn, then its socket waits for the next
        # turn (broker/unixio.py _drain_frames): each frame's batch had its own budget in _on_control,
        # but one read of a busy worker's 15-30 batches ran them all in one turn, 14-18 ms of the
        # node's CPU during 30,000 pipelined deletes (docs/benchmarks.md "Deletes paced by the round trips").
        self.ctl.turn_s = _CONTROL_TURN_S
        self.ctl.on_lost = self._ctl_lost
        self.shard_watchdog.start()
        if s.cluster and not s.follow and s.etcd_endpoints:
            # The role (leader, follower) is etcd's decision: replication/cluster.py drives
            # become_leader / become_follower / step_down. Health answers meanwhile.
            from replication.cluster import ClusterRole

            await self._start_node_services()
            self.cluster = ClusterRole(self)
            await self.cluster.start()
            log.info("node (pid %d) started as cluster member %s; data dir %s", os.getpid(), s.node_name,
                     self.datadir.path)
            return
        if s.cluster and s.follow:
            # Static mode (tests, manual setups): follow that leader, no etcd. (`--cluster
            # --etcd-endpoints none` without --follow is a static leader.)
            host, _, port = s.follow.rpartition(":")
            await self.become_follower(host, int(port))
        else:
            await self._serve()
            if s.cluster:
                await self._start_leader()
        await self._start_node_services()

    async def _start_node_services(self) -> None:
        """What the node runs whatever its role: HTTP (management, health), Prometheus, resource alarms.
        Once: a standalone node starts them in _serve, a cluster member before its role is known."""
        if self._services_started:
            return
        self._services_started = True
        from broker.http.metrics import MetricsServer
        from broker.http.server import HttpServer

        s = self.settings
        self.http = HttpServer(self, s.http_bind, s.http_port, s.https_port, self.tls)
        self.metrics = MetricsServer(self, s.http_bind, s.prometheus_port, s.prometheus_tls_port, self.tls)
        await self.http.start()
        await self.metrics.start()
        self._start_alarms()

    # ------------------------------------------------------------ cluster roles
    async def become_leader(self) -> None:
        """Serve clients from this data dir (a warm start of what was replicated) and replicate it."""
        if self.role == "leader":
            return
        if self.repl_follower is not None:
            await self.repl_follower.stop()
            self.repl_follower = None
        await self._serve()
        await self._start_leader()

    async def become_follower(self, host: str, port: int) -> None:
        """Stop serving (if leading) and keep the data dir a copy of the leader at host:port."""
        if self.repl_leader is not None:
            await self.repl_leader.stop()
            self.repl_leader = None
        if self.role == "leader":
            await self._stop_workers()
        if self.repl_follower is not None:
            await self.repl_follower.stop()
        from replication.follower import ReplicationFollower

        s = self.settings
        self.repl_follower = ReplicationFollower(s, self.datadir.path, cluster_secret(s), s.node_name, host, port)
        await self.repl_follower.start()
        self.role = "follower"
        log.info("node (pid %d) %s follows %s:%d; data dir %s", os.getpid(), s.node_name, host, port,
                 self.datadir.path)

    async def _start_leader(self) -> None:
        from replication.leader import ReplicationLeader

        s = self.settings
        self.repl_leader = ReplicationLeader(
            s, self.datadir.path, cluster_secret(s), shards=s.shards, run_dir=self.datadir.run_dir,
            broadcast_isr=self._broadcast_isr, on_change=self.repl_on_change, auto_isr=self.repl_auto_isr)
        self.repl_leader.isr = set(self.repl_initial_isr)  # start() hands it to the shards again
        await self.repl_leader.start()
        self.role = "leader"

    def _broadcast_isr(self, names: set[str], min_isr: int) -> None:
        if self.ctl is not None:
            self._broadcast("shard", [contract.REPL_ISR, sorted(names), min_isr])

    async def _stop_workers(self) -> None:
        """Stop frontends, then shards (they sync), and get ready to spawn them again."""
        self.sup.stopping = True
        for role, timeout in (("frontend", 5.0), ("shard", 15.0)):
            for ident, w in self.by_ident.items():
                if w.role == role and w.connected:
                    self.ctl.send_now(ident, [[contract.STOP]])
            for w in self.sup.workers:
                if w.role == role and w.proc and w.proc.returncode is None and not w.connected:
                    w.proc.send_signal(signal.SIGTERM)
            await self.sup.stop_role(role, timeout)
        self.is_leader = self.serving = False
        await self._kv_placement_ended()
        await self.loop.run_in_executor(None, self.defstore.sync)
        self.defstore.close()
        self.sup = self._supervisor()
        self.by_ident = {}
        self.epochs = {}
        self._shards_ready = asyncio.Event()
        self.vhost_conns = {}

    async def _serve(self) -> None:
        """Load the data dir and start the workers: a standalone node's boot, a leader's promotion.

        It is the warm start that ``kill -9`` recovery already exercises: definitions from the
        DefStore, queues recovered by their shards.
        """
        s = self.settings
        # The shards start first: their interpreter start and imports (about a second of CPU each)
        # overlap the loading below; their HELLO waits for it (_hello), and they touch no queue
        # directory before their SNAPSHOT, so the stale-directory removal below is still first.
        self._loading = True
        self._shards_ready.clear()
        self.sup.held.clear()
        self.fence_word.reset()  # every worker starts from this load's versions (no worker runs now)
        for i in range(s.shards):
            self.epochs[i] = 1
            await self.sup.spawn(self._worker("shard", i))
        # A fresh DefStore: in a cluster the files were rewritten by replication since the last load.
        self.defstore = DefStore(self.datadir.path)
        with gc_pause.paused():  # 100,000 queue definitions: see broker/gc_pause.py
            self.defs = self.defstore.load(default_user=s.default_user, default_pass=s.default_pass)
            self._snapshot = None  # versions of a reloaded model may repeat those of the cached one
            self.defs.loopback_users = tuple(s.loopback_users)
            self.defs.placement = s.queue_placement
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
        # With one shard every queue is placed on it: where a deleted one's directory may still be
        # changes no placement, and its bookkeeping (an lstat and a SHA-1 per delete, ~5 % of the
        # node's CPU per pipelined queue.delete) buys nothing (docs/benchmarks.md "CPU per delete").
        self.leftovers = self.defs.leftovers = (
            QueueLeftovers(self.datadir.path, self._shard_applied) if s.shards > 1 else None)
        # Every key of the MQTT KV logs in the log of the shard that owns it for this shard count, the
        # old shared logs read once (broker/kv_layout.py): in a thread, as it reads and rewrites every
        # log after an upgrade or a shard-count change (3-4.5 s per 100,000 sessions), while the
        # shards recover their queues and the loop answers (health, the shards' HELLO, a cluster's
        # lease). No shard opens a KV log before a frontend asks, and the frontends get their
        # snapshot (so listen) only once it is done (_frontends_held).
        if os.path.isdir(os.path.join(self.datadir.path, KV_DIR)):  # else nothing to place (no MQTT state yet)
            self._kv_placing = self.loop.run_in_executor(None, self._place_kv_logs, s.shards,
                                                         self._session_queue_shards())
        gc_pause.settle()
        self._loading = False
        waiting, self._loading_hellos = self._loading_hellos, []
        for ident, w, item in waiting:
            if w.proc is not None and w.proc.returncode is None:
                self._hello(ident, w, item)
        # The frontends' interpreter start overlaps the shards' recovery (a boot of 100,000 queues,
        # a promotion's failover time); their snapshot (and so their listeners) waits until every
        # shard is up and the KV logs are placed (_hello). Known to the node before anything else is
        # awaited: a pair's frontend part says HELLO as soon as its shard part has its snapshot.
        for i in range(s.frontends):
            await self.sup.spawn(self._worker("frontend", i))
        # The health checks (and the management API) answer from here on, 503 until ready; in a
        # cluster they run already (ClusterRole).
        await self._start_node_services()
        try:
            async with asyncio.timeout(_STARTUP_TIMEOUT_S):
                await self._shards_ready.wait()
        except TimeoutError:
            raise RuntimeError(f"shards did not start within {_STARTUP_TIMEOUT_S:.0f} s") from None
        await self._kv_placed()
        # A standalone node serves clients itself: it is its own leader.
        self.is_leader = True
        self.serving = True
        log.info("node (pid %d) serving with %d shards and %d frontends; AMQP on %s:%d; data dir %s",
                 os.getpid(), s.shards, s.frontends, s.bind, s.port, self.datadir.path)
        self.role = "leader" if s.cluster else "standalone"

    # ------------------------------------------------------- fencing (ClusterRole)
    def fence(self) -> None:
        """Stop confirming NOW: SIGKILL the frontends, which closes every client connection.

        Synchronous and without I/O so it works however stuck etcd or the disk are. The kernel
        closes the sockets; no confirm can reach a client after this returns. A paired process
        (--colocate) gets contract.FRONTEND_STOP_SIGNAL instead: its frontend part closes every
        client connection as its death would at the pair's next loop turn, and its shard part lives
        on (broker/supervisor.py stop_frontends_now).
        """
        self.serving = False
        self.is_leader = False
        self.sup.kill_role("frontend")

    async def _paired_frontends_left(self, timeout: float) -> None:
        """After fence(): wait until each paired frontend part has stopped (its control connection
        closed, or its process ended). It stops at its process's next loop turn, where a SIGKILLed
        frontend is gone at once: a STOP to its shard part sent meanwhile would be handled first,
        and the shard would stop while its frontend still serves (Node.stop)."""
        async def gone(w: WorkerProcess) -> None:
            waits = {asyncio.ensure_future(w.left.wait()), asyncio.ensure_future(w.proc.wait())}
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in waits:
                    task.cancel()

        paired = [w for ident, w in self.by_ident.items()
                  if w.role == "frontend" and w.index < self.sup.pairs and w.proc is not None
                  and w.proc.returncode is None and self.ctl is not None and self.ctl.has_peer(ident)]
        try:
            async with asyncio.timeout(timeout):
                await asyncio.gather(*(gone(w) for w in paired))
        except TimeoutError:
            log.warning("a paired frontend did not stop within %.0f s of the fence", timeout)

    async def step_down(self) -> None:
        """Leader -> nothing: fence, stop replicating, kill the shards (their data is crash-safe)."""
        self.fence()
        if self.repl_leader is not None:
            await self.repl_leader.stop()
            self.repl_leader = None
        await self.sup.forget_all()
        await self._stop_workers()  # nothing left to stop: DefStore synced and closed, fresh state
        self._apply_waiters.clear()
        self._deferred_hellos.clear()
        self._loading_hellos.clear()
        self._loading = False
        for fut in list(self._queries.values()):
            if not fut.done():
                fut.set_result(None)
        self._queries.clear()
        self.role = "fenced"

    def _shard_applied(self, index: int) -> int:
        """The definitions version shard `index` has applied; -1 while it is not connected."""
        w = self.by_ident.get(contract.worker_id("shard", index))
        return w.applied if w is not None and w.connected else -1

    def _start_alarms(self) -> None:
        s = self.settings
        from broker.http.metrics import node_processes, rss_bytes

        self.monitor = ResourceMonitor(
            self.datadir.path, parse_disk_limit(s.disk_free_limit), parse_memory_watermark(s.vm_memory_high_watermark),
            lambda: sum(rss_bytes(pid) for _, pid in node_processes(self)), self._alarms_changed)

        def tick() -> None:
            if self.sup.stopping:
                return
            try:
                self.monitor.check()
            except Exception:
                log.exception("resource check failed")
            if self.leftovers is not None:
                self.leftovers.prune(_LEFTOVERS_PER_TICK)
            self.loop.call_later(CHECK_INTERVAL_S, tick)

        tick()

    def _alarms_changed(self, names: list[str]) -> None:
        self.alarms = list(names)
        self._broadcast("frontend", [contract.ALARMS, self.alarms])

    @property
    def ready(self) -> bool:
        """Serving, and every frontend has applied its snapshot (so it listens and routes); or, in a
        cluster, proxying clients to the leader."""
        if self.cluster is not None and self.cluster.proxying:
            return True
        return self.serving and all(w.applied >= 0 for w in self.sup.workers if w.role == "frontend")

    def _supervisor(self) -> Supervisor:
        return Supervisor(self.datadir.run_dir, self.settings.log_level, self._on_worker_exit, self._on_spawn,
                          pairs=self.pairs)

    def _ctl_lost(self, ident: bytes) -> None:
        """A worker's control-plane connection closed: in a paired process, its frontend part stopped."""
        w = self.by_ident.get(ident)
        if w is None:
            return
        w.left.set()
        sup = self.sup
        if w.role == "frontend" and w.index < sup.pairs and w.connected and w.proc is not None:
            # Whether the pair runs on without its frontend part is decided a moment later: a killed
            # pair's connections close before the supervisor has reaped it (nothing to do then, its
            # restart is under way), and a restarted one is another process.
            self.loop.call_later(_PAIR_LEFT_CHECK_S, self._frontend_part_left, ident, w, w.proc)

    def _frontend_part_left(self, ident: bytes, w: WorkerProcess, proc: Any) -> None:
        sup = self.sup
        if (w.proc is not proc or proc.returncode is not None or w not in sup.workers or sup.stopping
                or "frontend" in sup.held or self.ctl is None or self.ctl.has_peer(ident)):
            return
        # A paired frontend part that stopped without the node asking (FRONTEND_STOP_SIGNAL from
        # outside): the process would go on with its shard alone. A STOP to the shard part stops it
        # cleanly (a stopping shard ignores it; a SIGTERM reaching a process already past its loop
        # killed it instead), the process ends, and the supervisor restarts both.
        shard_id = contract.worker_id("shard", w.index)
        shard = self.by_ident.get(shard_id)
        log.warning("frontend %d left while its pair (pid %d) runs on: stopping the pair to restart it",
                    w.index, proc.pid)
        w.connected = False
        if shard is not None and shard.connected and shard.proc is proc and self.ctl.has_peer(shard_id):
            self.ctl.send_now(shard_id, [[contract.STOP]])
        else:
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def _session_queue_shards(self) -> dict[str, dict[str, int]]:
        """vhost -> {MQTT session queue: its shard}, as loaded: what _place_kv_logs reads in its thread
        while the loop may change the definitions (a declare through the management API)."""
        return {v.name: {name: q.shard for name, q in v.queues.items() if name.startswith(SESSION_QUEUE_PREFIX)}
                for v in self.defs.vhosts.values()}

    def _place_kv_logs(self, shards: int, session_queues: dict[str, dict[str, int]]) -> None:
        """broker/kv_layout.py: the MQTT KV logs placed for ``shards`` shards, as the queues were (in a
        thread: it reads only its arguments and the data dir's kv/, which nothing else touches meanwhile)."""
        hold_for_tests()

        def queue_shard(vhost: str, name: str) -> int | None:
            return session_queues.get(vhost, {}).get(name)

        place_logs(self.datadir.path, shards, list(session_queues), MQTT_KV_SPACES,
                   lambda vhost, space, key: kv_owner(vhost, space, key, shards, queue_shard))

    async def _kv_placed(self) -> None:
        """Wait for the KV placement of this boot or promotion (its error is the boot's), then let the
        frontends held for it have their snapshot."""
        placing = self._kv_placing
        if placing is None:
            return
        try:
            await asyncio.shield(placing)  # a cancelled waiter must not leave the thread's end unseen
        finally:
            if self._kv_placing is placing:
                self._kv_placing = None
        self._release_frontends()

    async def _kv_placement_ended(self) -> None:
        """Wait for a KV placement thread still running (a stop or step-down in the middle of a boot or
        promotion): nothing else may write kv/ (a follower's replication, the data dir's next owner)
        before it ends. Its error, if any, was the boot's to report (logged here when the boot is gone)."""
        placing, self._kv_placing = self._kv_placing, None
        if placing is None:
            return
        await asyncio.wait([placing])
        if not placing.cancelled() and placing.exception() is not None:
            log.error("placing the MQTT KV logs failed: %s", placing.exception())

    def _frontends_held(self) -> bool:
        """A frontend's snapshot waits until every shard is up (nothing reaches a shard early) and
        the KV logs are placed (a frontend's first MQTT request may open one)."""
        return not self._shards_ready.is_set() or self._kv_placing is not None

    def _release_frontends(self) -> None:
        if self._frontends_held():
            return
        deferred, self._deferred_hellos = self._deferred_hellos, []
        for ident, frontend, item in deferred:
            if frontend.proc is not None and frontend.proc.returncode is None:
                self._hello(ident, frontend, item)

    def _worker(self, role: str, index: int) -> WorkerProcess:
        w = WorkerProcess(role, index)
        self.by_ident[contract.worker_id(role, index)] = w
        return w

    async def stop(self) -> None:
        if self.sup.stopping:
            return
        self.sup.stopping = True
        self.shard_watchdog.stop()
        log.info("node stopping")
        self.bulk_changes.close()
        if self.cluster is not None:
            # From now on no ISR change reaches etcd: the in-sync followers stay electable.
            self.cluster.stopping = True
        if self.repl_leader is not None:
            self.repl_leader.keep_isr()  # nor reaches the shards: followers go away only because we stop
        self.serving = False
        if self.http is not None:
            await self.http.stop()
        if self.metrics is not None:
            await self.metrics.stop()
        if self.cluster is not None:
            self.fence()  # no confirm reaches a client from here on (the frontends are killed)
            await self._paired_frontends_left(5.0)
        # Frontends first so no new work reaches the shards, then shards sync and exit. A cluster
        # leader's replication (and its lease) stays up until its shards have stopped: a stopping
        # shard's forwards to other shards (due delayed messages, dead letters) are confirmed as soon
        # as the in-sync followers acked them, as a confirm promises, and its final sync reaches the
        # followers. Replication stopped first left those confirms to wait out the whole settle
        # (shard/forward_settle.py STOP_WAIT_S) and kept them from the followers.
        for role, timeout in (("frontend", 5.0), ("shard", 15.0)):
            for ident, w in self.by_ident.items():
                if w.role == role and w.connected:
                    self.ctl.send_now(ident, [[contract.STOP]])
            for w in self.sup.workers:
                if w.role == role and w.proc and w.proc.returncode is None and not w.connected:
                    w.proc.send_signal(signal.SIGTERM)
            await self.sup.stop_role(role, timeout)
        if self.repl_leader is not None:
            await self.repl_leader.stop()
        if self.repl_follower is not None:
            await self.repl_follower.stop()
        if self.cluster is not None:
            await self.cluster.stop()  # the lease goes: a follower takes over at once
        if self.defs is not None:
            await self.loop.run_in_executor(None, self.defstore.sync)
        await self._kv_placement_ended()
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
        self._held.pop(contract.worker_id(worker.role, worker.index), None)
        self._backlog.pop(contract.worker_id(worker.role, worker.index), None)  # a dead worker's requests
        self._check_apply_waiters()
        self._chains.forget(contract.worker_id(worker.role, worker.index))
        self.stats.forget(worker.role, worker.index)
        if worker.role == "shard" and self.repl_leader is not None:
            self.repl_leader.shard_down(worker.index)
        if worker.role == "shard":
            # The restarted shard gets a new epoch: batches meant for the dead one are dropped,
            # frontends nack and cancel what their connections had on it (Session.shard_lost), and other shards
            # address their forwarded dead letters to the new epoch.
            self.epochs[worker.index] += 1
            self._broadcast(None, [contract.SHARD_UP, worker.index, self.epochs[worker.index]])
            for fut in list(self._queries.values()):
                if not fut.done():
                    fut.set_result(None)
            for fut in list(self._admin_queries.values()):
                if not fut.done():
                    fut.set_result((False, [504, "shard restarted", 0, 0]))
        else:
            self._broadcast("shard", [contract.WORKER_DOWN, "frontend", worker.index])
            for owners in self.vhost_conns.values():
                owners.difference_update([o for o in owners if o[0] == worker.index])
            ops = self.defs.ops_for_owner_gone([worker.index])
            if ops:
                self._spawn_task(self._commit(ops, gate=False))

    def _broadcast(self, role: str | None, item: list) -> None:
        for ident, w in self.by_ident.items():
            if w.connected and (role is None or w.role == role):
                self._put(ident, item)

    def _broadcast_defs(self, version: int, ops: list, origin: bytes | None, fenced: bool = False) -> frozenset:
        """DEFS to every worker; the one whose request this is (origin) gets them with its REPLY.

        The REPLY is sent only once every other worker has applied them, and the origin applies
        the DEFS before it reads the REPLY behind them: sent at once, they only woke it (and then
        the node, for an APPLIED nobody waits for) while the other workers, who are on the round
        trip's path, needed the cores. Its copy says so (``ack`` False): no APPLIED for it.

        ``fenced``: the fence word goes up first, then every worker gets them now (held for none:
        the origin would otherwise wait for them on its next input, until the REPLY), ``ack`` False
        for those that applied their snapshot; nobody waits for their APPLIED. Returns the workers
        still starting (SNAPSHOT sent, not applied): they answer APPLIED and are waited for."""
        self.bulk_changes.note(len(ops))  # no full GC during a bulk (broker/gc_pause.py)
        if fenced:
            self.fence_word.raise_to(version)
            self._fence_flush = True
            quiet = [contract.DEFS, version, ops, False]
            # A pair gets one copy, through its frontend part (broker/pair_defs.py).
            via = self._pairs_handing_over(origin) if self.sup.pairs else _NO_PAIRS
            partner = [contract.DEFS, version, ops, False, True] if via else quiet
            # The origin's batch first (batches leave in the order they were started, TurnBatcher):
            # its REPLY is the round trip; the other workers' wake-ups are off its path.
            if origin is not None and origin in self.by_ident and self.by_ident[origin].connected:
                self._put(origin, partner if via.get(origin) else quiet)
            starting = []
            for ident, w in self.by_ident.items():
                if w.connected and ident != origin:
                    if w.applied < 0:
                        starting.append(ident)
                        self._put(ident, [contract.DEFS, version, ops])
                    elif ident in via:
                        if via[ident]:  # a frontend part: its copy is its shard part's too
                            self._put(ident, partner)
                        # a shard part: nothing, its frontend part hands them over
                    else:
                        self._put(ident, quiet)
            return frozenset(starting)
        item = [contract.DEFS, version, ops]
        for ident, w in self.by_ident.items():
            if w.connected:
                if ident == origin:
                    self._held.setdefault(ident, []).append([contract.DEFS, version, ops, False])
                else:
                    self._put(ident, item)
        return frozenset()

    def _pairs_handing_over(self, origin: bytes | None) -> dict:
        """The pairs that get a fenced DEFS once (contract 27, broker/pair_defs.py): {frontend part's
        ident: True, shard part's ident: False} for each pair whose parts are both connected and past their
        SNAPSHOT (a part still starting answers APPLIED for its own copy) and whose shard part did not
        ask for the change (its copy comes with its REPLY). Not in a cluster: a fenced leader stops a
        pair's frontend part alone, and what that part had not read would be lost to the shard part."""
        if self.cluster is not None:
            return _NO_PAIRS
        via: dict = {}
        by_ident = self.by_ident
        for i in range(self.sup.pairs):
            fe = by_ident.get(contract.worker_id("frontend", i))
            sh_ident = contract.worker_id("shard", i)
            sh = by_ident.get(sh_ident)
            if (fe is not None and sh is not None and fe.connected and sh.connected and fe.applied >= 0
                    and sh.applied >= 0 and sh_ident != origin):
                via[contract.worker_id("frontend", i)] = True
                via[sh_ident] = False
        return via

    def _put(self, ident: bytes, item: list) -> None:
        """Every item for a worker goes through here: DEFS held for it (_commit) go out first, in order."""
        held = self._held.pop(ident, None)
        if held is not None:
            for h in held:
                self.ctl.put(ident, h)
        self.ctl.put(ident, item)

    # --------------------------------------------------------------- control
    def _on_control(self, ident: bytes | None, _header: Any, items: list) -> None:
        w = self.by_ident.get(ident)
        if w is None:
            log.warning("control message from unknown worker %r", ident)
            return
        if w.role == "shard":
            self.shard_watchdog.heard_from(w.pid)
        backlog = self._backlog.get(ident)
        if backlog is not None:  # behind what this worker sent before: in order, from a later turn
            backlog.extend(items)
            return
        rest = self._control_items(ident, w, items, time.perf_counter() + _CONTROL_TURN_S)
        if rest is not None:
            self._backlog[ident] = rest
            self._schedule_backlog()

    def _schedule_backlog(self) -> None:
        if not self._backlog_scheduled:
            self._backlog_scheduled = True
            self.loop.call_soon(self._run_backlog)

    def _run_backlog(self) -> None:
        """A loop turn's share of the control items left over (_on_control): a turn budget per worker."""
        self._backlog_scheduled = False
        for ident in list(self._backlog):
            items = self._backlog.pop(ident)
            w = self.by_ident.get(ident)
            if w is None or not items:
                continue
            rest = self._control_items(ident, w, items, time.perf_counter() + _CONTROL_TURN_S)
            if rest is not None:
                self._backlog[ident] = rest
        if self._backlog:
            self._schedule_backlog()

    def _control_items(self, ident: bytes, w: WorkerProcess, items: list | deque, deadline: float) -> deque | None:
        """Handle a worker's control items in order until ``deadline``; returns those left (or None).

        The deadline is looked at every _CONTROL_CHECK requests (REQUEST items are what costs:
        a delete's task, a declare's planning); the cheap items (APPLIED, STATS) do not count."""
        requests = 0
        n = len(items)
        it = iter(items)
        for i, item in enumerate(it, 1):
            self._control_item(ident, w, item)
            if item[0] == contract.REQUEST:
                requests += 1
                if not requests % _CONTROL_CHECK and i < n and time.perf_counter() > deadline:
                    rest = deque(it)
                    self._control_done()
                    return rest
        self._control_done()
        return None

    def _control_done(self) -> None:
        if self._fence_flush:
            self._fence_flush = False
            self.ctl.flush()

    def _control_item(self, ident: bytes, w: WorkerProcess, item: list) -> None:
        kind = item[0]
        if kind == contract.APPLIED:
            first = w.applied < 0
            if item[1] > w.applied:
                w.applied = item[1]
                self._check_apply_waiters()
            if first and w.role == "shard":
                self._shard_up(w)
            if first and self._snapshot is not None and all(
                    x.connected and x.applied >= 0 for x in self.sup.workers):
                # Every worker has its snapshot: a restarted one gets a fresh one (the
                # version moves on anyway), 7 MB at 100,000 queues are not kept for it. The
                # boot's big buffers are free now (the read buffers shrink after 1 s,
                # broker/unixio.py): give their pages back (10-13 MB at 100,000 queues).
                self._snapshot = None
                self.loop.call_later(_TRIM_AFTER_BOOT_S, heap_trim.trim)
        elif kind == contract.REQUEST:
            if not self._request_at_once(ident, item[1], item[2], item[3]):
                self._handle_request(ident, item[1], item[2], item[3])
        elif kind == contract.FORWARD:
            target = self.by_ident.get(contract.worker_id("frontend", int(item[1])))
            if target is not None and target.connected:
                self._put(contract.worker_id("frontend", int(item[1])), [contract.FORWARDED, item[2]])
        elif kind == contract.STATS:
            if w.role == "frontend" and isinstance(item[1], dict):
                self.heap_trimmer.closed(len(item[1].get("closed", ())))
            if self.stats.update(w.role, w.index, item[1]):
                # Its deltas do not follow on from what we hold: ask for every row once.
                if w.role == "shard":
                    self._spawn_task(self.shard_query(w.index, "stats_full", {}))
                else:  # a frontend does not answer this one
                    self._put(ident, [contract.QUERY, 0, "stats_full", {}])
        elif kind == contract.QUERY_REPLY:
            admin = self._admin_queries.pop(item[1], None)
            if admin is not None:
                if not admin.done():
                    admin.set_result((bool(item[2]), item[3]))
                return
            fut = self._queries.pop(item[1], None)
            if fut is not None and not fut.done():
                fut.set_result(item[3] if item[2] else None)
        elif kind == contract.HELLO:
            self._hello(ident, w, item)
        elif kind == contract.REPL_STATUS:
            if self.repl_leader is not None and w.role == "shard":
                self.repl_leader.shard_status(w.index, item[1])

    def _hello(self, ident: bytes, w: WorkerProcess, item: list) -> None:
        if item[1] != contract.VERSION:
            log.error("%s speaks contract version %s, node %s: stopping it", w.name, item[1], contract.VERSION)
            if w.proc:
                w.proc.send_signal(signal.SIGKILL)
            return
        if self._loading:
            # _serve is still loading the definitions this worker's SNAPSHOT is made of.
            self._loading_hellos.append((ident, w, item))
            return
        if w.role == "frontend" and self._frontends_held():
            # A boot or promotion starts the frontends while the shards recover; a frontend listens
            # once it has its snapshot, so it gets it when every shard is up and the KV logs placed.
            self._deferred_hellos.append((ident, w, item))
            return
        # Every worker says HELLO at boot: one serialization (to_dict and msgpack, 7 MB for 100,000
        # queues) per version and epochs, not per worker. Sent at once: nothing is pending for a
        # worker before its HELLO is answered (it is not connected yet), and what follows is put after.
        key = (self.defs.version, tuple(sorted(self.epochs.items())))
        if self._snapshot is None or self._snapshot[0] != key:
            with gc_pause.paused():  # 100,000 dicts: see broker/gc_pause.py
                item = [contract.SNAPSHOT, self.defs.version, self.defs.to_dict(queue_columns=True), self.epochs,
                        dataclasses.asdict(self.settings)]
                self._snapshot = (key, contract.pack(0, [item]))
        self._held.pop(ident, None)  # older than the snapshot, which holds them
        self.ctl.send_packed(ident, self._snapshot[1])
        if w.role == "frontend" and self.alarms:
            self._put(ident, [contract.ALARMS, self.alarms])
        if w.role == "shard":
            # Shards that came up before this one said hello: it would not hear of them otherwise, and
            # it must know its peers are ready before it forwards recovered delayed messages to them.
            for x in self.sup.workers:
                if x.role == "shard" and x is not w and x.connected and x.applied >= 0:
                    self._put(ident, [contract.SHARD_UP, x.index, self.epochs[x.index]])
            if self.repl_leader is not None:
                self._put(ident, [contract.REPL_ISR, sorted(self.repl_leader.isr), self.repl_leader.min_isr])
            elif self.repl_initial_isr:
                # A promotion: the shards gate confirms on the ISR from etcd from their first
                # publish on, before the replication leader runs (it starts after them).
                self._put(ident, [contract.REPL_ISR, sorted(self.repl_initial_isr), self.settings.min_isr])
        w.connected = True

    def _shard_up(self, w: WorkerProcess) -> None:
        """A (re)started shard has loaded its queues: frontends may send it data."""
        self._broadcast(None, [contract.SHARD_UP, w.index, self.epochs[w.index]])
        if self.repl_leader is not None:  # followers' connections waiting for it are handed over now
            self.repl_leader.shard_up(w.index)
        if all(x.connected and x.applied >= 0 for x in self.sup.workers if x.role == "shard"):
            self._shards_ready.set()
            self._release_frontends()

    def _check_apply_waiters(self) -> None:
        # A worker that has not said HELLO yet gets a snapshot with the newest version, so only
        # connected workers can hold a reply back. Waiters are in version order (_commit adds them
        # right after it applies), so this costs what it answers, not what still waits.
        # Twice per delete (its commit, the workers' APPLIED): the workers are looked at in place,
        # no dict of them per call.
        waiters = self._apply_waiters
        if not waiters:
            return
        by_ident = self.by_ident
        while waiters:
            version, origin, only, fut = waiters[0]
            if only is None:
                for ident, w in by_ident.items():
                    if w.connected and w.applied < version and ident != origin:
                        return
            else:
                for ident in only:  # one not connected (gone) holds nothing back
                    w = by_ident.get(ident)
                    if w is not None and w.connected and w.applied < version:
                        return
            waiters.popleft()
            if not fut.done():
                fut.set_result(None)

    # ------------------------------------------------------------- requests
    def _spawn_task(self, coro) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _request_at_once(self, ident: bytes, req_id: int, op: str, args: dict) -> bool:
        """Handle a bind, unbind or exchange declare/delete in this turn, without a task; False: not here.

        What _handle_request does for them, without its task, gather and the loop turns between
        (a quarter of the node's user CPU per bind in the synchronous bind loop, docs/benchmarks.md):
        planned, applied and broadcast now, answered from the callbacks of the futures it waits for.
        Only when nothing can make it wait before it is applied: no earlier request of its channel
        in flight, no cluster gate, no sliced commit. A request without a channel (MQTT) is sent only
        after the reply of any request it depends on (its session queue's declare before its
        binds; a subscribe's binds before an unsubscribe's unbinds), so it overtakes nothing."""
        if op not in _PLANNED_AT_ONCE or self.repl_leader is not None:
            return False
        chain = args.get("chain")
        key = None
        if chain is not None:
            key = (ident, tuple(args.get("owner") or ()), chain)
            if self._chains.busy(key) or self._chains.failed(key):
                return False
        defs = self.defs
        try:
            a = dict(args)
            a.pop("chain", None)
            vhost = a.get("vhost", "/")
            if a.get("user") is not None and vhost not in defs.vhosts:
                defs._vhost(vhost)  # a deleted vhost: 530 before any permission check
            ops = self._plan_at_once(op, a)
        except AMQPError as exc:
            self._chains.fail(key)
            self._put(ident, [contract.REPLY, req_id, False, [exc.code, exc.text, exc.class_id, exc.method_id]])
            return True
        except Exception:
            log.exception("request %s failed", op)
            self._chains.fail(key)
            self._put(ident, [contract.REPLY, req_id, False, [541, "INTERNAL_ERROR", 0, 0]])
            return True
        if len(ops) > _COMMIT_SLICE:
            return False  # planning changed nothing: _handle_request plans it again and slices it
        if not ops:
            self._put(ident, [contract.REPLY, req_id, True, {}])
            return True
        logged = durable_ops(defs, ops)  # judged before applying, as _commit does
        defs.apply_all(ops)
        # The definitions fence (broker/defs_fence.py): no worker's APPLIED is waited for but those
        # of workers still starting; a transient change is answered in this very turn.
        starting = self._broadcast_defs(defs.version, ops, ident, fenced=True)
        waits = [self._wait_applied(defs.version, ident, starting)] if starting else []
        if self.defstore.record(logged):
            waits.append(self._durable())
        if not waits:
            self._put(ident, [contract.REPLY, req_id, True, {}])
            return True

        answered = []

        def answer(_f: asyncio.Future) -> None:
            # Both futures may be done when the first callback runs: one REPLY only.
            if answered or not all(f.done() for f in waits):
                return
            answered.append(True)
            exc = next((f.exception() for f in waits if not f.cancelled() and f.exception()), None)
            if exc is not None or any(f.cancelled() for f in waits):
                log.error("request %s failed: %r", op, exc)
                self._put(ident, [contract.REPLY, req_id, False, [541, "INTERNAL_ERROR", 0, 0]])
            else:
                self._put(ident, [contract.REPLY, req_id, True, {}])

        for f in waits:
            f.add_done_callback(answer)
        return True

    def _handle_request(self, ident: bytes, req_id: int, op: str, args: dict) -> None:
        chain = args.pop("chain", None)
        if chain is None:
            self._spawn_task(self._answer(ident, req_id, op, args))
            return
        # A channel's requests (broker/request_chains.py): planned in the order sent, and none after
        # one that failed. Linked as it arrives, so a later one of the batch (maybe handled at once,
        # _request_at_once) sees it in flight.
        key = (ident, tuple(args.get("owner") or ()), chain)
        prev, mine = self._chains.link(key)
        if op == "queue.delete":
            # Its task starts once the pacer grants the deletion (paced before its counts are asked
            # for: 500 pipelined deletes are 500 shard queries too). Hundreds of waiting tasks were
            # what the node's young garbage collections walked (broker/delete_pacer.py when_granted).
            self.delete_pacer.when_granted(1, lambda: self._spawn_task(
                self._answer_chained(ident, req_id, op, args, key, prev, mine, paced=True)))
            return
        self._spawn_task(self._answer_chained(ident, req_id, op, args, key, prev, mine))

    async def _answer(self, ident: bytes, req_id: int, op: str, args: dict) -> None:
        self._put(ident, await self._reply_to(req_id, op, args, None, ident))

    async def _answer_chained(self, ident: bytes, req_id: int, op: str, args: dict, key: tuple,
                              prev: asyncio.Future | None, mine: asyncio.Future, paced: bool = False) -> None:
        """paced: a queue.delete whose deletion the pacer has granted already (_handle_request)."""
        ok = False
        early = None
        try:
            if op == "queue.delete" and not paced:
                await self.delete_pacer.take(1)
                paced = True
            if prev is not None and op == "queue.delete" and not self._chains.failed(key):
                early = self._early_counts(args)
            if self._chains.failed(key) or (prev is not None and not await prev):
                reply = [contract.REPLY, req_id, False, [504, "CHANNEL_ERROR - an earlier method failed", 0, 0]]
            else:
                reply = await self._reply_to(req_id, op, args,
                                             lambda: self._chains.settle(key, mine, True), ident, early, paced)
                ok = reply[2]
        finally:
            self._chains.settle(key, mine, ok)
            if early is not None and not early[1].done():
                early[1].cancel()
        self._put(ident, reply)

    def _early_counts(self, a: dict) -> tuple[Any, asyncio.Future] | None:
        """Ask the shard for a pipelined queue.delete's counts now, while the channel's requests
        before it are still being applied: a burst of deletes then waits for one shard round trip,
        not one each. Only for a plain delete of a queue that exists now (if-empty/if-unused ask
        again when planned, as one-at-a-time handling does); _execute uses the answer only if the
        queue is still the same one (not deleted and declared again by a request before it). The
        same channel cannot publish in between: its publishes wait behind its pipeline."""
        if a.get("if_empty") or a.get("if_unused"):
            return None
        q = self.defs.queue(a.get("vhost", "/"), a.get("queue", ""))
        if q is None:
            return None
        fut = self._queue_info_future(a.get("vhost", "/"), a.get("queue", ""))
        if self.delete_pacer.adaptive and self.delete_pacer.max_rate > 0 and not fut.done():
            # Its round trip to the shard's process, as long as a publisher's to that process: the
            # delete pacer slows while they grow (broker/delete_pacer.py).
            sent = time.monotonic()
            pacer = self.delete_pacer
            fut.add_done_callback(lambda f: f.cancelled() or f.result() is None
                                  or pacer.adapt(time.monotonic() - sent, time.monotonic()))
        return q, fut

    async def _reply_to(self, req_id: int, op: str, args: dict, on_applied: Callable[[], None] | None,
                        origin: bytes, early: tuple[Any, asyncio.Future] | None = None, paced: bool = False) -> list:
        try:
            result = await self._execute(op, args, on_applied, origin, early, paced)
        except AMQPError as exc:
            return [contract.REPLY, req_id, False, [exc.code, exc.text, exc.class_id, exc.method_id]]
        except Exception:
            log.exception("request %s failed", op)
            return [contract.REPLY, req_id, False, [541, "INTERNAL_ERROR", 0, 0]]
        return [contract.REPLY, req_id, True, result]

    async def _execute(self, op: str, a: dict, on_applied: Callable[[], None] | None = None,
                       origin: bytes | None = None, early: tuple[Any, asyncio.Future] | None = None,
                       paced: bool = False) -> dict:
        """Plan and commit one request; on_applied runs once its ops are applied (before durable).
        origin: the worker that asked (see _commit); early: a queue.delete's counts asked for
        before its turn (_early_counts); paced: its deletion already waited for the delete pacer."""
        defs = self.defs
        vhost = a.get("vhost", "/")
        owner = a.get("owner")
        user = a.get("user")  # None for the node's own requests: they are not checked
        if user is not None and vhost not in defs.vhosts:
            defs._vhost(vhost)  # a deleted vhost: 530 before any permission check
        if op == "queue.declare":
            name = a.get("queue", "")
            passive = bool(a.get("passive"))
            if name and not passive:
                check(defs, user, vhost, CONFIGURE, "queue", name, 50, 10)
            ops, name = defs.plan_queue_declare(
                vhost, name, passive, bool(a.get("durable")), bool(a.get("exclusive")),
                bool(a.get("auto_delete")), a.get("arguments") or {}, owner, self.settings.shards)
            if not passive:
                check(defs, user, vhost, CONFIGURE, "queue", name, 50, 10)
                dlx = (a.get("arguments") or {}).get("x-dead-letter-exchange")
                if isinstance(dlx, str):
                    check(defs, user, vhost, READ, "queue", name, 50, 10)
                    check(defs, user, vhost, WRITE, "exchange", dlx, 50, 10)
            await self._commit(ops, op=op, on_applied=on_applied, origin=origin)
            # No counts here: the frontend asks the shard over its publish lane (QUEUE_INFO), which
            # also counts the publishes still in flight from it; asking here too cost a round trip.
            # A queue this declare created has none to count ("created": the frontend answers at once).
            return {"queue": name, "messages": 0, "consumers": 0, "created": bool(ops)}
        if op == "queue.delete":
            name = a.get("queue", "")
            check(defs, user, vhost, CONFIGURE, "queue", name, 50, 40)
            if early is not None and early[0] is defs.queue(vhost, name):
                info = await early[1]
            else:
                info = await self._queue_info(vhost, name)
            if info is None and (a.get("if_unused") or a.get("if_empty")):
                q = defs.queue(vhost, name)
                if q is not None:
                    # Its shard did not answer (stalled past _QUERY_TIMEOUT_S, restarting): counts of 0 made
                    # an if-empty delete of a full queue go through. Kept, and said so (as RabbitMQ's
                    # NOT_FOUND for a queue whose node is down); another connection's exclusive queue first.
                    defs.plan_queue_delete(vhost, name, False, False, owner, 0, 0)
                    raise AMQPError(404, f"NOT_FOUND - shard {q.shard} of queue '{name}' in vhost '{vhost}' did not "
                                         "answer: if-empty/if-unused not checked, the queue is kept", 50, 40)
            info = info or {"messages": 0, "consumers": 0}
            ops = defs.plan_queue_delete(vhost, name, bool(a.get("if_unused")), bool(a.get("if_empty")),
                                         owner, info["consumers"], info["messages"])
            await self._commit(ops, op=op, on_applied=on_applied, origin=origin, paced=paced)
            return {"messages": info["messages"] if ops else 0}
        if op in ("queue.auto_delete", "queue.expire"):
            await self._delete_unused(op, vhost, a)
            return {}
        if op in _PLANNED_AT_ONCE:
            ops = self._plan_at_once(op, a)
        elif op == "connection.closed":
            for owners in self.vhost_conns.values():
                owners.discard(tuple(owner))
            # Only a connection that declared an exclusive queue has any (the frontend knows; an
            # MQTT session or an older frontend does not say): the search walks every queue.
            ops = defs.ops_for_owner_gone(list(owner)) if a.get("exclusive", True) else []
        elif op == "connection.open":
            return self._count_connection(vhost, tuple(owner), a.get("user", ""))
        else:
            raise AMQPError(540, f"NOT_IMPLEMENTED - unknown request {op}")
        # A closed connection's exclusive and auto-delete leftovers are cleanup, never refused.
        await self._commit(ops, op=op, gate=op != "connection.closed", on_applied=on_applied, origin=origin,
                           fenced=op in _PLANNED_AT_ONCE)
        return {}

    async def _delete_unused(self, op: str, vhost: str, a: dict) -> None:
        """A shard's queue.auto_delete (the queue's last consumer went away) or queue.expire (x-expires
        ran out): delete the queue if it is still the life the shard named, and still unused.

        A queue's life is (shard, epoch, qid): its shard's process and that process's number for it
        (never given out twice). The name is not enough: the request may come after the queue was
        deleted and declared again (a client whose connection died declares its exclusive auto-delete
        queue again while the shard has not yet read that the old frontend is gone,
        tests/test_queue_lives.py), and the new queue, which never had a consumer, went with its
        messages. RabbitMQ deletes an auto-delete queue in the queue's own process when its last
        consumer goes; a queue declared again is another process, untouched. The checks are made
        again after every await (a request of a client may change the definitions meanwhile), and
        nothing is awaited between the shard's answer and the delete: when the delete pacer makes it
        wait, the shard is asked again after (a token is taken only for a delete that goes)."""
        name = a.get("queue", "")
        try:
            shard, epoch, qid = int(a["shard"]), int(a["epoch"]), int(a["qid"])
        except (KeyError, TypeError, ValueError):
            # Contract 28 names the life; a worker of another version is refused at HELLO already.
            log.warning("%s of queue %r in vhost %r without its shard, epoch and qid: refused", op, name, vhost)
            raise AMQPError(503, f"COMMAND_INVALID - {op} without the queue's shard, epoch and qid", 0, 0) from None
        q = self.defs.queue(vhost, name)
        if q is None or q.shard != shard:
            return

        def same() -> bool:
            defs = self.defs
            if defs.queue(vhost, name) is not q or self.epochs.get(shard) != epoch:
                return False
            if op == "queue.auto_delete":
                return q.auto_delete
            # The effective arguments: an `expires` policy counts as much as the x-expires argument.
            return bool(defs.effective_arguments(vhost, "queue", name).get("x-expires"))

        pacer = self.delete_pacer
        paced = False
        while same():
            info = await self._queue_info(vhost, name)
            # A consumer may have come meanwhile; "expired" is False when a redeclare renewed the lease.
            if not same() or info is None or info.get("qid") != qid or info["consumers"] \
                    or (op == "queue.expire" and not info.get("expired", True)):
                return
            if paced or pacer.try_take(1):
                # Planned and applied now: no await between the shard's answer and the delete.
                await self._commit(self.defs.plan_queue_delete(vhost, name, False, False, None, 0, 0),
                                   gate=False, paced=True)
                return
            await pacer.take(1)  # deletions wait their turn; then the shard is asked again
            paced = True

    def _plan_at_once(self, op: str, a: dict) -> list:
        """The ops of a request in _PLANNED_AT_ONCE (checked, planned, not applied): no await needed."""
        defs = self.defs
        vhost = a.get("vhost", "/")
        owner = a.get("owner")
        user = a.get("user")
        if op in ("queue.bind", "queue.unbind", "exchange.bind", "exchange.unbind"):
            self._check_binding(op, user, vhost, a)
        if op == "exchange.declare":
            name = a.get("exchange", "")
            if not a.get("passive"):
                check(defs, user, vhost, CONFIGURE, "exchange", name, 40, 10)
                ae = (a.get("arguments") or {}).get("alternate-exchange")
                if isinstance(ae, str):
                    check(defs, user, vhost, READ, "exchange", name, 40, 10)
                    check(defs, user, vhost, WRITE, "exchange", ae, 40, 10)
            ops = defs.plan_exchange_declare(
                vhost, a.get("exchange", ""), a.get("exchange_type", a.get("type", "direct")),
                bool(a.get("passive")), bool(a.get("durable")), bool(a.get("auto_delete")),
                bool(a.get("internal")), a.get("arguments") or {})
        elif op == "exchange.delete":
            check(defs, user, vhost, CONFIGURE, "exchange", a.get("exchange", ""), 40, 20)
            ops = defs.plan_exchange_delete(vhost, a.get("exchange", ""), bool(a.get("if_unused")))
        elif op in ("queue.bind", "queue.unbind"):
            plan = defs.plan_bind if op == "queue.bind" else defs.plan_unbind
            ops = plan(vhost, a.get("exchange", ""), "queue", a.get("queue", ""), a.get("routing_key", ""),
                       a.get("arguments") or {}, owner)
        else:  # exchange.bind, exchange.unbind
            plan = defs.plan_bind if op == "exchange.bind" else defs.plan_unbind
            ops = plan(vhost, a.get("source", ""), "exchange", a.get("destination", ""),
                       a.get("routing_key", ""), a.get("arguments") or {}, owner)
        return ops

    def _check_binding(self, op: str, user: str | None, vhost: str, a: dict) -> None:
        """RabbitMQ's binding_action: write on the destination, read on the source, topic read on the key."""
        cid, mid = {"queue.bind": (50, 20), "queue.unbind": (50, 50), "exchange.bind": (40, 30),
                    "exchange.unbind": (40, 40)}[op]
        if op.startswith("queue."):
            dest_kind, dest, source = "queue", a.get("queue", ""), a.get("exchange", "")
        else:
            dest_kind, dest, source = "exchange", a.get("destination", ""), a.get("source", "")
        check(self.defs, user, vhost, WRITE, dest_kind, dest, cid, mid)
        check(self.defs, user, vhost, READ, "exchange", source, cid, mid)
        check_topic(self.defs, user, vhost, READ, source, a.get("routing_key", ""), cid, mid,
                    {"username": user or "", "vhost": vhost, "client_id": ""})

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

    def reload_tls(self) -> None:
        """SIGHUP: re-read the certificate files for HTTPS (established connections keep theirs)."""
        if self.tls is None:
            return
        try:
            reload_certificate(self.tls, dataclasses.asdict(self.settings))
        except (OSError, ValueError) as exc:
            log.error("TLS certificate not reloaded, keeping the old one: %s", exc)

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
        try:
            await self._commit(ops)
        except AMQPError as exc:
            log.error("definitions file %s not applied: %s", path, exc.text)
            return
        log.info("definitions file %s applied (%d changes)", path, len(ops))

    # --------------------------------------------- management (broker/http/management.py)
    async def commit(self, ops: list) -> None:
        """Apply definition ops as the single writer (what the management API changes)."""
        await self._commit(ops)

    async def execute(self, op: str, args: dict) -> dict:
        """A declare/delete/bind as a frontend would REQUEST it (args["user"] = whose permissions apply)."""
        return await self._execute(op, args)

    def close_connections(self, code: int, text: str, vhost: str | None = None, user: str | None = None,
                          frontend: int | None = None, conn_id: int | None = None) -> None:
        """Close the client connections that match (all given fields) on every (or one) frontend."""
        item = [contract.CLOSE_CONNECTIONS, vhost, code, text, user, conn_id]
        if frontend is None:
            self._broadcast("frontend", item)
            return
        ident = contract.worker_id("frontend", frontend)
        w = self.by_ident.get(ident)
        if w is not None and w.connected:
            self._put(ident, item)

    async def shard_query(self, shard: int, op: str, args: dict) -> tuple[bool, Any]:
        """Ask a shard (shard/admin.py ops); (ok, result), result [code, text, ...] when not ok."""
        ident = contract.worker_id("shard", shard)
        w = self.by_ident.get(ident)
        if w is None or not w.connected:
            return False, [504, f"shard {shard} is not running", 0, 0]
        self._next_query += 1
        qid = self._next_query
        fut = self.loop.create_future()
        self._admin_queries[qid] = fut
        self._put(ident, [contract.QUERY, qid, op, args])
        try:
            async with asyncio.timeout(_QUERY_TIMEOUT_S):  # cancels fut on timeout, as wait_for did
                return await fut
        except TimeoutError:
            self._admin_queries.pop(qid, None)
            return False, [504, f"shard {shard} did not answer", 0, 0]

    async def queue_info(self, vhost: str, name: str) -> dict | None:
        return await self._queue_info(vhost, name)

    async def _queue_info(self, vhost: str, name: str) -> dict | None:
        return await self._queue_info_future(vhost, name)

    def _queue_info_future(self, vhost: str, name: str) -> asyncio.Future:
        """A queue's counts from its shard: a future, done with them or None (no such queue, no
        shard, no answer within _QUERY_TIMEOUT_S). No task: 500 pipelined deletes ask at once."""
        fut = self.loop.create_future()
        q = self.defs.queue(vhost, name)
        ident = contract.worker_id("shard", q.shard) if q is not None else None
        w = self.by_ident.get(ident) if ident is not None else None
        if w is None or not w.connected:
            fut.set_result(None)
            return fut
        self._next_query += 1
        qid = self._next_query
        self._queries[qid] = fut
        self._put(ident, [contract.QUERY, qid, "queue_info", {"vhost": vhost, "queue": name}])
        timer = self.loop.call_later(_QUERY_TIMEOUT_S, lambda: fut.done() or fut.set_result(None))

        def done(_f: asyncio.Future) -> None:  # answered, timed out or cancelled: forget it
            timer.cancel()
            self._queries.pop(qid, None)

        fut.add_done_callback(done)
        return fut

    async def _commit(self, ops: list, op: str | None = None, gate: bool = True,
                      on_applied: Callable[[], None] | None = None, origin: bytes | None = None,
                      fenced: bool = False, paced: bool = False) -> None:
        """Apply, persist and broadcast ops; return once durable and applied by every live worker.

        Queue deletions among the ops wait for the delete pacer (broker/delete_pacer.py) unless
        ``paced`` (the request already did); many of them are applied in slices of a few queues each.

        ``fenced`` (a bind, unbind, exchange declare or delete): not in a cluster and in one slice, it
        returns without waiting for the workers that have applied their snapshot: they apply it before
        they act on any input read from now on (the definitions fence, broker/defs_fence.py).
        On a leader whose ISR is below --min-isr a durable change (``gate``: a client's or an
        operator's, not the node's own cleanup) is held, then refused (replication/definition_gate.py).
        """
        if not ops:
            return
        repl = self.repl_leader
        durable = repl is not None and any(is_durable_relevant(o) for o in ops)
        if gate and durable and not await definition_gate.wait_for_min_isr(repl):
            raise definition_gate.refusal(repl, op)
        defs = self.defs
        logged = durable_ops(defs, ops)  # judged before applying: a deleted queue is gone after
        fenced = fenced and self.repl_leader is None and len(ops) <= _COMMIT_SLICE
        starting: frozenset = frozenset()
        pacer = self.delete_pacer
        deletes = 0 if paced or pacer.rate <= 0 else sum(1 for o in ops if o[0] == "queue.delete")
        if len(ops) <= _COMMIT_SLICE and deletes <= _PACED_SLICE_DELETES:
            if deletes:
                await pacer.take(deletes)
                logged = durable_ops(defs, ops)  # judged again: another request may have run meanwhile
            defs.apply_all(ops)  # bumps defs.version once per op; every replica does the same
            starting = self._broadcast_defs(defs.version, ops, origin, fenced)
            if fenced:
                self._fence_flush = False
                self.ctl.flush()  # a task's turn: written now, not after what else the turn runs
            wrote = self.defstore.record(logged)
        else:
            # A vhost of 10,000 queues: applied and sent in slices, one loop turn each (paced: a few
            # queues each, at --delete-rate), so that this node and every worker (each handles a slice
            # as one batch, a bounded number per turn) go on with other work between them: publishing
            # to other queues must not stall. Each slice is logged as it is applied (flushed to the
            # OS, synced at the end): a node killed half-way restarts with the queues its workers
            # deleted gone and the others intact, never a deleted queue's directory under a
            # definition that survived.
            wrote = 0
            for part in _slices(ops, _PACED_SLICE_DELETES if deletes else _COMMIT_SLICE):
                n = sum(1 for o in part if o[0] == "queue.delete") if deletes else 0
                if n:
                    await pacer.take(n)
                logged_part = durable_ops(defs, part)
                defs.apply_all(part)
                written = self.defstore.record(logged_part)
                if written:
                    self.defstore.flush()
                    wrote += written
                self._broadcast(None, [contract.DEFS, defs.version, part])
                await asyncio.sleep(0)  # this slice leaves in its own batch (BatchSocket.flush)
        version = defs.version
        if on_applied is not None:
            on_applied()
        # The worker that asked gets our DEFS in the REPLY's batch, before it (_broadcast_defs), and
        # applies them before it reads the REPLY: its APPLIED need not be waited for (one process
        # wake-up less on every declare's and bind's round trip). A fenced change waits only for
        # the workers still starting.
        if not fenced:
            waits = [self._wait_all_applied(version, origin)]
        else:
            waits = [self._wait_applied(version, origin, starting)] if starting else []
        if wrote:
            waits.append(self._durable())
        if len(waits) == 1:  # a transient change's only wait: no gathering future and its callbacks
            await waits[0]
        elif waits:
            await asyncio.gather(*waits)
        if wrote and self.repl_leader is not None:
            # In a cluster the *-Ok also waits for the ISR followers to ack the node stream.
            repl = self.repl_leader
            if not await repl.node_stream_replicated() and gate:
                raise definition_gate.refusal(repl, op, applied=True)

    def _wait_all_applied(self, version: int, origin: bytes | None = None) -> asyncio.Future:
        return self._wait_applied(version, origin, None)

    def _wait_applied(self, version: int, origin: bytes | None, only: frozenset | None) -> asyncio.Future:
        """Done once every connected worker but origin (or only those of ``only`` still connected)
        has applied ``version``."""
        # Added at once (not when a coroutine first runs), so the waiters stay in version order.
        fut = self.loop.create_future()
        self._apply_waiters.append((version, origin, only, fut))
        self._check_apply_waiters()
        return fut

    def _durable(self) -> asyncio.Future:
        """Done once the definitions written so far are synced (a sync starts now if none runs)."""
        fut = self.loop.create_future()
        self._sync_waiters.append(fut)
        self._start_sync()
        return fut

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
    if settings.trace_stages:  # workers read it from their environment (broker/stage_trace.py)
        os.environ[stage_trace.ENV] = os.path.abspath(settings.trace_stages)
    # Every worker's data-plane sockets follow the node's setting (broker/data_sockets.py).
    os.environ[data_sockets.ENV] = settings.ipc_transport
    node = Node(settings)
    loop = asyncio.get_running_loop()
    probe = turn_probe.install(loop, "node")  # debug aid, off unless SHARDMQ_TEST_TURN_PROBE
    if probe is not None:  # the delete pacer's rate changes too (broker/delete_pacer.py adapt)
        node.delete_pacer.on_adapt = probe.pace
    # systemd Type=notify (deploy/systemd/): READY=1 when node.ready, STOPPING=1, WATCHDOG=1.
    sd = Notifier.from_env()

    def stop() -> None:
        sd.stopping()
        loop.create_task(node.stop())

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    loop.add_signal_handler(signal.SIGHUP, lambda: (loop.create_task(node.reload_definitions()),
                                                    node.reload_tls(),
                                                    node.sup.signal_role("frontend", signal.SIGHUP)))
    try:
        await node.start()
    except (DataDirLocked, DataDirUnsafe) as exc:
        log.error("%s", exc)
        return 1
    except Exception as exc:
        log.exception("node failed to start: %s", exc)
        sd.stopping("failed to start")
        await node.stop()
        return 1
    sd.start(lambda: node.ready, lambda: ("serving" if node.is_leader else "following the leader, proxying")
             + f" AMQP on {settings.bind}:{settings.port}")
    await node.stopped.wait()
    sd.close()
    return 0


def run(settings: Settings) -> int:
    """Run a node until SIGTERM/SIGINT; returns the process exit status."""
    # Files 0600 and directories 0700 whatever umask we were started with; workers inherit it.
    os.umask(PRIVATE_UMASK)
    raise_nofile_limit()  # one descriptor per client connection; the workers inherit it
    install_uvloop()
    return asyncio.run(_main(settings))
