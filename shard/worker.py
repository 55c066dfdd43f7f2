"""The shard process: owns a set of queues and serves frontends over ZeroMQ.

Data batches arrive from frontends on a ROUTER socket; every item is handled
in the loop turn it arrives in, replies are collected per frontend and
flushed once at the end of the turn (broker/data_sockets.py: unixio or zmqio). Publishes
that need durability are confirmed after a group fsync that runs in a worker
thread, never one fsync per message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from broker import contract, data_sockets, gc_pause, heap_trim, local_link, pair_defs, stage_trace
from broker.datadir import name_hash
from broker.definitions import Definitions
from broker.defs_fence import catch_up, control_delay_for_tests_s, open_fence
from broker.fsync_beacon import FsyncBeacon, stall_for_tests
from broker.policies import POLICY_OPS
from broker.unixio import CONTROL_TURN_S, UnixDealer
from shard import dirty_stores, idle_index, peer_answer_hold, streams_close, walk_check
from shard.ack_timeouts import AckTimeouts
from shard.admin import admin_query
from shard.consumers import ChannelRef, Consumer
from shard.dead_letter_forwards import DeadLetterForwards
from shard.deadletter import dead_letter_props, has_dlx_header, has_expiration, is_cycle
from shard.dedup import ExchangeDedup
from shard.delayed import DelayedMessages
from shard.delivery_faults import DeliveryFaults
from shard.feature_queue import EXPIRING_MARK, FeatureQueue, needs_features
from shard.forward_lives import for_this_life
from shard.forward_settle import PEERS_DONE_SLACK_S, STOP_WAIT_S, ForwardSettle, PeersDone
from shard.kvstore import KVStores
from shard.priority_store import open_store
from shard.queue import VIRTUAL as _VIRTUAL
from shard.queue import Queue
from shard.replication_stream import ShardReplication
from shard.stats import PART_MIN_ROWS, PART_ROWS, PART_S, STATS_CHECK_ENV, StatsReporter, SyncHistogram
from shard.store import QueueStore, make_queue_dir
from shard.stream_queue import StreamQueue, consume_error, retention_args, segment_size
from shard.stream_store import StreamStore
from shard.sync_thread import SyncThread
from shard.timers import TimerHeap

log = logging.getLogger("shardmq.shard")
_TRIM_AFTER_LOAD_S = 2.0  # after the snapshot's queues are open: malloc_trim (see _load_snapshot)

_CONTROL_LANE_SUFFIX = contract.CONTROL_LANE_SUFFIX

_PERIODIC_SYNC_S = 1.0
_FLOW_BACKLOG = 8000  # ready messages before publishers are paced (4x the credit window of old)
_FLOW_MAX_HOLD_S = 0.5
_PACED_KINDS = frozenset((contract.PUBLISH, contract.DELAYED_PUBLISH, contract.DEDUP_PUBLISH,
                          contract.MARKED_PUBLISH))  # items that add messages
_PUBLISH_RUN = contract.PUBLISH_RUN


def _publishes(items: list) -> int:
    """Messages a batch adds (what pacing counts; only computed while pacing): a PUBLISH_RUN counts
    its bodies, the other kinds that add messages one each."""
    n = 0
    for item in items:
        kind = item[0]
        if kind == _PUBLISH_RUN:
            n += len(item[6])
        elif kind in _PACED_KINDS:
            n += 1
    return n


def _dead_lettered_refusal(q: Queue) -> bool:
    """A queue that refused a publish dead-lettered it instead (x-overflow reject-publish-dlx): it was
    handled there (as RabbitMQ's), not to be sent to that queue again."""
    return getattr(q, "overflow", None) == "reject-publish-dlx"


def _consumer_waiting(consumers: list) -> bool:
    """An active consumer that cannot take more now: out of credit, or at its prefetch limit (its
    acks then have to get through while publishes flood the same processes)."""
    for c in consumers:
        if c.active and not c.can_take():
            return True
    return False


class ShardWorker:
    def __init__(self, index: int, run_dir: str, loop: asyncio.AbstractEventLoop) -> None:
        self.index = index
        self.run_dir = run_dir
        self.loop = loop
        self.bulk_changes = gc_pause.BulkChanges(loop)
        self.ident = contract.worker_id("shard", index)
        self._stall_as = f"shard-{index}"  # a test may stall this shard's group syncs alone (fsync_beacon)
        self.ctx = zmq.Context.instance()
        self.epoch = -1
        self.defs: Definitions | None = None
        # The definitions fence (broker/defs_fence.py): before a data-plane batch, a dead letter or a
        # due delayed message is routed, fence[0] is compared with defs_version (catch_up_defs).
        self.defs_version = -1  # the version of self.defs: SNAPSHOT's, then each DEFS'
        self.fence = open_fence(run_dir)
        self._in_control = False  # handling a control-plane batch: no catch-up from inside it
        self._fence_gave_up = -1  # a version waited for in vain (node stuck or gone): not waited for again
        # A pair's shard part gets fenced DEFS from its frontend part (broker/pair_defs.py, contract 27).
        self.handed: pair_defs.HandedDefs | None = None
        if local_link.paired_index() == index:
            self.handed = pair_defs.HandedDefs(self._apply_handed, lambda: self.defs_version, f"shard {index}",
                                               loop.call_soon)
            pair_defs.register_shard(self.handed)
        self.settings: dict = {}
        self.queues: dict[tuple[str, str], Queue] = {}
        self.sync_histogram = SyncHistogram()  # group sync durations, reported in STATS
        # STATS as deltas: rows changed since the last report, read from the queues named in
        # _stats_touched (and those of each delivery pass): shard/stats.py.
        self.stats_reporter = StatsReporter(check=os.environ.get(STATS_CHECK_ENV) == "1")
        self._stats_part_rows = PART_ROWS  # the next part's size, from the last full part's CPU (PART_S)
        dirty_stores.enable()  # before any store opens: the periodic sync visits the stores noted there
        self._stats_touched = self.stats_reporter.touched
        # Since when the running group sync runs, for the cluster leader's disk-stall check.
        self.fsync_beacon = FsyncBeacon(run_dir, index)
        self.by_qid: dict[int, Queue] = {}
        self._next_qid = 1
        self.channels: dict[tuple[bytes, int, int], ChannelRef] = {}
        # (fe, conn_id) -> its channels here (keys of self.channels): a connection's close finds them
        # without a walk of every channel. Each ChannelRef's .queues names the queues it touched.
        self._conn_channels: dict[tuple[bytes, int], dict[int, None]] = {}
        self._walk_check = os.environ.get(walk_check.WALK_CHECK_ENV) == "1"  # tests: shard/walk_check.py
        # (fe, conn_id, channel, tag) -> (queue, consumer): credit and cancel are frequent.
        self.consumers: dict[tuple[bytes, int, int, str], tuple[Queue, Consumer]] = {}
        self._dirty_queues: set[Queue] = set()
        self._deliver_scheduled = False
        # Queues whose delivery pass raised, woken again after a back-off (shard/delivery_faults.py).
        self.delivery_faults = DeliveryFaults(loop, index, self.mark_dirty)
        # Confirms waiting for the next group sync: (fe, conn_id, channel, seq).
        self._sync_waiting: list[tuple[bytes, int, int, int]] = []
        self._sync_stores: set[QueueStore] = set()
        self._sync_running = False
        self._sync_fut: asyncio.Future | None = None  # the group sync running, if any
        self._sync_thread = SyncThread(loop, f"shard-{index}-sync")
        self._closing = False  # stop()'s final sync has begun: no other one starts
        self._after_sync: list[Callable[[], None]] = []  # run once the next group sync is done
        # The next group sync also fsyncs ack files and delivered marks (set by the periodic pass):
        # the rounds confirms wait for fsync only records, so a confirm never waits on acks.
        self._sync_acks = False
        # Feature queues with delivery counts (x-delivery-limit, quorum) written or to write: the
        # periodic sync saves their changes (FeatureQueue.save_returns).
        self._returns_queues: set[FeatureQueue] = set()
        self._confirms: dict[tuple[bytes, int, int], list[int]] = {}
        self.stopped = asyncio.Event()
        self.stopping = False
        self._behind = False  # see _hold_processed
        self._held: deque[tuple[float, bytes, int, int]] = deque()
        # Deliveries not yet spent on releasing held batches (see _release_processed).
        self._release_credit = 0
        self._hold_timer_armed = False
        self._ready = asyncio.Event()
        self._early: list[tuple] = []  # data batches that arrived before the snapshot
        self.store_failures = 0  # appends refused by the file system (full disk): nacked publishes
        self._store_failure_logged = 0.0
        self._lane: bytes | None = None  # sender identity of the batch being handled
        self._node_req = 0
        self.node: UnixDealer | None = None  # the control plane (broker/unixio.py)
        self.data: Any = None  # BatchSocket or UnixRouter (broker/data_sockets.py)
        # TTL, queue expiry and consumer timeouts of every queue here: one heap, one loop timer.
        # (A timer's dead letters and due delayed messages route as of now: the fence is checked first.)
        self.timers = TimerHeap(loop, self.fence_check)
        # Dead-lettered messages for queues of other shards go over a DEALER to each of them.
        self.epochs: dict[int, int] = {}
        self.peers: dict[int, Any] = {}
        self._peer_seq: dict[int, int] = {}
        # Forward back-pressure (a deduplicating exchange's owner): the highest batch each peer
        # answered with PROCESSED (ours: key self.index, for the DEALER to our own ROUTER), and the
        # PROCESSED answers held from frontends while forwards are behind (see _forwards_behind).
        self.peer_processed: dict[int, int] = {}
        self._fwd_held: dict[bytes, list[int]] = {}
        self._batch_forwards = False  # the batch being handled holds a DEDUP_PUBLISH
        # Lane order, per (frontend, its process token): control-lane items handled so far, and the
        # publish-lane batches waiting for earlier control-lane items (see _on_data).
        self._ctl_seen: dict[tuple[bytes, int], int] = {}
        self._ctl_wait: dict[tuple[bytes, int], deque] = {}
        # Caches of the deduplicating exchanges this shard owns (broker/dedup.py exchange_shard).
        self.exchange_dedup = ExchangeDedup(self)
        self.ack_timeouts: AckTimeouts | None = None  # consumer-argument and node-default timeouts
        self.delayed = DelayedMessages(self)  # delay stores of delayed exchanges owned here
        self.dead_letters = DeadLetterForwards(self)  # cross-shard dead letters until confirmed
        self.kv = KVStores(self)  # MQTT retained messages and session state placed here
        # When the first snapshot's queues were listed (or checked idle): shard/idle_index.py.
        self._listed_ns: int | None = None
        # What a clean stop waits for: the forwards to peers (and to our own ROUTER) not confirmed yet.
        # At a clean stop, after PEER_DONE: the other shards that have not said theirs yet.
        self.peers_done = PeersDone()
        self.peers_closed = False  # we said PEER_DONE: nothing more goes to another shard
        self.streams_close = streams_close.StreamsClose()  # a cluster leader's shards close their streams together
        self.forward_settle = ForwardSettle(index, {"dead letters": self.dead_letters,
                                                    "due delayed messages": self.delayed,
                                                    "deduplicating-exchange forwards": self.exchange_dedup,
                                                    "peer shards not done": self.peers_done})
        # A cluster leader's shard streams its files to the followers and holds confirms for them.
        self.repl: ShardReplication | None = None

    # ------------------------------------------------------------------ startup
    async def start(self) -> None:
        self.data = data_sockets.shard_listener(self.loop, self.run_dir, self.index, self._on_data)
        self.data.on_drained = self._data_drained
        peer_answer_hold.install(self.data)  # SHARDMQ_TEST_HOLD_PEER_ANSWERS (tests only)
        trace = stage_trace.get("shard")  # --trace-stages (debug): None normally
        if trace is not None:
            self.data.set_trace(trace, "sh_publish_in", "sh_deliver_out")
        self.node = UnixDealer(self.loop, contract.node_stream_path(self.run_dir), self.ident, self._on_control)
        # A sliced commit (a vhost of 10,000 queues) is applied a few ms per loop turn at most, so
        # publishes to other queues go on between its slices (broker/node.py _commit).
        self.node.turn_s = CONTROL_TURN_S
        self.node.read_delay_s = control_delay_for_tests_s("shard", self.ident.decode())
        self.node.send_now(None, [[contract.HELLO, contract.VERSION, "shard", self.index, os.getpid()]])
        await self._ready.wait()
        self.loop.call_later(_PERIODIC_SYNC_S, self._periodic_sync)
        self._send_stats()

    def _send_stats(self) -> None:
        """Queue counts for the node's management API and metrics, once per stats_interval."""
        if self.stopping:
            return
        if not self.stats_reporter.busy:  # else the last one is still going out: this turn is skipped
            try:
                self.stats_reporter.begin(self, self._dirty_queues)
            except Exception:
                log.exception("shard %d: stats report failed", self.index)
            else:
                self._send_stats_part()
        interval = int(self.settings.get("stats_interval") or 5000) / 1000
        self.loop.call_later(interval, self._send_stats)

    def _send_stats_part(self) -> None:
        """One part of the report begun (shard/stats.py PART_ROWS queues at most, fewer when a part
        took over PART_S of CPU), then the next part in the next loop turn: 30,000 queues declared or
        deleted since the last report were 10-29 ms of this loop in one piece, in front of every
        publish waiting for it."""
        if self.stopping:
            return
        reporter = self.stats_reporter
        rows = self._stats_part_rows
        try:
            cpu = time.thread_time()
            part = reporter.part(self, budget=rows, pending=self._dirty_queues)
            if part.get("more"):  # a full part: the next one's size for about PART_S of this thread's CPU
                took = time.thread_time() - cpu
                self._stats_part_rows = max(PART_MIN_ROWS, min(PART_ROWS, int(rows * PART_S / took))) \
                    if took > 0 else PART_ROWS
            self.node.put(None, [contract.STATS, part])
        except Exception:
            log.exception("shard %d: stats report failed", self.index)
            reporter.full_next = True  # the next report starts over with every row
            reporter.abandon()
            return
        if reporter.busy:
            self.loop.call_soon(self._send_stats_part)

    # --------------------------------------------------------------- control
    def fence_check(self) -> None:
        """Before acting on what did not come through _on_data (a timer): the definitions fence."""
        if self.fence[0] > self.defs_version:
            self.catch_up_defs()

    def catch_up_defs(self) -> None:
        """The fence is ahead of our definitions: apply the control plane up to it now, before the
        caller routes anything (broker/defs_fence.py)."""
        if self._in_control or self.node is None:
            return  # inside _on_control (a policy's dead letters): that batch goes first
        if self.handed is not None:  # what our frontend part handed over, then what it has still to read
            self.handed.apply_ready()
            pair_defs.catch_up_frontend()  # it hands over the fenced DEFS it reads (broker/pair_defs.py)
            self.handed.apply_ready()
        self._fence_gave_up = catch_up(self.node, self.fence, lambda: self.defs_version, self._fence_gave_up,
                                       f"shard {self.index}")

    def _on_control(self, _ident: bytes | None, _header, items: list) -> int:
        self._in_control = True
        try:
            return self._on_control_items(items)
        finally:
            self._in_control = False

    def _on_control_items(self, items: list) -> int:
        applied = None  # one APPLIED per batch, for its newest DEFS (pipelined declares bring many)
        ack = False  # the batch has DEFS that are not only the copy sent with our own request's REPLY
        weight = len(items)  # what this batch counts against the turn's read budget (broker/unixio.py)
        for item in items:
            kind = item[0]
            if kind == contract.SNAPSHOT:
                self._load_snapshot(item)
            elif kind == contract.DEFS:
                handed = self.handed
                if handed is not None and item[1] - len(item[2]) > self.defs_version:
                    handed.before(item[1] - len(item[2]))  # DEFS handed by our frontend part come first
                # The version first: an op that fails to apply must not leave the fence waiting.
                applied = self.defs_version = item[1]
                self._apply_defs(item[2])
                ack = ack or len(item) < 4 or item[3]
                weight += len(item[2])
                if handed is not None and handed.pending:
                    handed.apply_ready()
            elif kind == contract.QUERY:
                self._answer_query(item[1], item[2], item[3])
            elif kind == contract.WORKER_DOWN:
                if item[1] == "frontend":
                    self._frontend_gone(contract.worker_id("frontend", item[2]))
            elif kind == contract.STOP:
                self.loop.create_task(self.stop())
            elif kind == contract.SHARD_UP:
                index, epoch = int(item[1]), int(item[2])
                restarted = self.epochs.get(index) != epoch
                self.epochs[index] = epoch
                if restarted:
                    self.exchange_dedup.shard_up(index)
                    self._peer_restarted(index)
                self.delayed.peer_up(index, restarted)
                self.dead_letters.peer_up(index, restarted)
                self.forward_settle.answered()  # what went to its dead incarnation is answered by no one
            elif kind == contract.REPLY:
                pass  # answers to our auto-delete requests need no action
            elif kind == contract.REPL_ISR:
                if self.repl is not None:
                    self.repl.set_isr(set(item[1]), int(item[2]))
        if ack:
            self.node.put(None, [contract.APPLIED, applied])
        return weight

    def _load_snapshot(self, item: list) -> None:
        _, version, defs_dict, epochs, settings = item
        self.settings = settings
        self.epoch = int(epochs.get(self.index, epochs.get(str(self.index), 0)))
        self.epochs = {int(k): int(v) for k, v in epochs.items()}
        with gc_pause.paused():  # see broker/gc_pause.py
            self.defs = Definitions.from_dict(defs_dict)
            self.defs_version = version
            self._connect_peers()
            self.dead_letters.load()  # after the peers: what it recovered goes to them
            if self.ack_timeouts is None:
                self.ack_timeouts = AckTimeouts(self, int(settings.get("consumer_timeout") or 0))
            # A restarted shard opens (and recovers) every queue placed on it; each vhost dir is
            # listed once, so opening a queue whose dir exists costs no mkdir.
            # A queue whose directory is as the last clean stop left it, holding only its name file,
            # opens empty without listing it (shard/idle_index.py): one stat instead of a listing and
            # the name file's stat.
            data_dir = self.settings["data_dir"]
            if self._listed_ns is None:
                self._listed_ns = time.time_ns()
            index = self.index
            unlisted = 0
            for v in self.defs.vhosts.values():
                vdir = os.path.join(data_dir, name_hash(v.name))
                try:
                    present = set(os.listdir(vdir))
                except FileNotFoundError:
                    present = set()
                idle = idle_index.take(vdir, index) if present else {}
                for name, q in v.queues.items():
                    if q.shard == index:
                        h = name_hash(name)
                        seen = idle.get(h) if h in present else None
                        if seen is not None:
                            try:
                                seen = seen == idle_index.stamp(f"{vdir}/{h}")
                            except OSError:
                                seen = False
                        self._open_queue(v.name, name, h in present, name_sha1=h, idle=bool(seen))
                        unlisted += bool(seen)
            self._stats_touched.clear()  # the first report reads every queue anyway
        gc_pause.settle()
        self.delayed.load()
        if settings.get("cluster") and self.repl is None:  # shards run on a leader only
            self.repl = ShardReplication(
                self.loop, self.index, settings["data_dir"], self.run_dir,
                float(settings.get("replication_ack_timeout") or 3), self._owned_store_paths,
                lambda status: self.node.put(None, [contract.REPL_STATUS, status]),
                heartbeat=float(settings.get("replication_heartbeat") or 0),
                heartbeat_timeout=float(settings.get("replication_heartbeat_timeout") or 0))
        self.node.put(None, [contract.APPLIED, version])
        log.info("shard %d (pid %d) ready: %d queues (%d idle at the last stop, not listed), epoch %d", self.index,
                 os.getpid(), len(self.queues), unlisted, self.epoch)
        self._ready.set()
        # The snapshot's decode, the first full STATS report and the grown read buffer (which
        # shrinks after 1 s, broker/unixio.py) leave free pages inside glibc's heap: give them back.
        self.loop.call_later(_TRIM_AFTER_LOAD_S, heap_trim.trim)
        if self._early:
            # Next turn, out of this control batch: the fence check in _on_data may have to apply the
            # DEFS behind this snapshot first. Batches arriving meanwhile queue behind them (_on_data).
            self.loop.call_soon(self._run_early)
        self.schedule_deliver_all()
        self.ack_timeouts.schedule()

    def _run_early(self) -> None:
        early, self._early = self._early, []
        for batch in early:
            self._on_data(*batch)

    def _apply_handed(self, version: int, ops: list) -> None:
        """A fenced DEFS our frontend part handed over (broker/pair_defs.py): as one of our own stream."""
        self.defs_version = version
        self._apply_defs(ops)

    def _apply_defs(self, ops: list) -> None:
        self.bulk_changes.note(len(ops))  # no full GC in the middle of a bulk (broker/gc_pause.py)
        defs = self.defs
        for op in ops:
            defs.apply(op)
            kind = op[0]
            if kind == "queue.declare":
                vhost, name = op[1], op[2]
                q = defs.queue(vhost, name)
                if q is not None and q.shard == self.index and (vhost, name) not in self.queues:
                    self._open_queue(vhost, name, new=True)
            elif kind == "queue.delete":
                self._delete_queue(op[1], op[2])
            elif kind == "exchange.delete":
                self.delayed.exchange_deleted(op[1], op[2])
            elif kind == "vhost.delete":
                self.delayed.vhost_deleted(op[1])
                # Its queues came with their own queue.delete ops before it; one declared while a
                # sliced delete was under way (broker/node.py _commit) goes with the vhost.
                for vhost, name in [k for k in self.queues if k[0] == op[1]]:
                    self._delete_queue(vhost, name)
            elif kind in POLICY_OPS:
                self._apply_policies(op[1])

    def _open_queue(self, vhost: str, name: str, exists: bool = False, new: bool = False,
                    name_sha1: str | None = None, idle: bool = False) -> None:
        """exists: its directory was just listed (a boot; name_sha1: its name there); new: declared
        now (starts empty, see shard/store.py make_queue_dir); idle: its directory holds only its name
        file, as the last clean stop left it (shard/idle_index.py)."""
        defn = self.defs.queue(vhost, name)
        path, made = make_queue_dir(self.settings["data_dir"], vhost, name, exists, new, name_sha1, idle)
        args = self.defs.effective_arguments(vhost, "queue", name)
        if args.get("x-queue-type") == "stream":
            seg_size = segment_size(args, int(self.settings.get("segment_size", 8 << 20)))
            stream = StreamStore(path, segment_size=seg_size)
            stream.configure(*retention_args(args))
            sq = StreamQueue(self._next_qid, vhost, name, defn, stream, self, args)
            self._next_qid += 1
            self.queues[(vhost, name)] = sq
            self.by_qid[sq.qid] = sq
            self._stats_touched.add(sq)
            return
        store = open_store(path, args, int(self.settings.get("segment_size", 8 << 20)), empty_dir=made or idle,
                           fsync=bool(defn.durable))
        if needs_features(args):
            q = FeatureQueue(self._next_qid, vhost, name, defn, store, self, args)
        else:
            q = Queue(self._next_qid, vhost, name, defn, store)
            if store.ready and (store.has_marker(EXPIRING_MARK) or has_expiration(store.peek()[6])):
                q = FeatureQueue.upgrade(q, defn, self)  # recovered messages with a per-message TTL
        self._next_qid += 1
        self.queues[(vhost, name)] = q
        self.by_qid[q.qid] = q
        self._stats_touched.add(q)

    def _delete_queue(self, vhost: str, name: str) -> None:
        q = self.queues.pop((vhost, name), None)
        if q is None:
            return
        del self.by_qid[q.qid]
        self.stats_reporter.gone((vhost, name))
        q.deleted = True
        for c in q.consumers:
            self.consumers.pop((c.fe, c.conn_id, c.channel, c.tag), None)
            self.data.put(c.fe, [contract.CANCEL_NOTIFY, c.conn_id, c.channel, c.tag])
        for owner in q.unacked.values():
            owner.settle()
        if q.held:
            q.drop_held()
        if q.unacked:  # an idle queue's is the shared empty one (shard/queue.py NO_UNACKED)
            q.unacked.clear()
        if q.consumers:
            q.consumers.clear()
        self._dirty_queues.discard(q)
        self.delivery_faults.forget(q)
        self._sync_stores.discard(q.store)
        if q.store.__class__ is QueueStore:
            q.store.delete(later=True)  # off the loop: deleting 100,000 queues must not stall the others
        else:
            q.store.delete()

    def _answer_query(self, query_id: int, op: str, args: dict) -> None:
        if op == "queue_info":
            q = self.queues.get((args["vhost"], args["queue"]))
            if q is None:
                self.node.put(None, [contract.QUERY_REPLY, query_id, False, None])
            else:
                info = q.info()
                info["qid"] = q.qid  # the node deletes an unused queue only if it is the life asked about
                self.node.put(None, [contract.QUERY_REPLY, query_id, True, info])
        elif op == "stats_full":
            # The node lost track of our rows (a seq gap): the next report carries all of them.
            self.stats_reporter.full_next = True
            self.node.put(None, [contract.QUERY_REPLY, query_id, True, {}])
        elif op in ("purge", "get", "publish"):
            # The management API's operations (low rate; see shard/admin.py).
            ok, result = admin_query(self, op, args)
            self.node.put(None, [contract.QUERY_REPLY, query_id, ok, result])
        else:
            self.node.put(None, [contract.QUERY_REPLY, query_id, False, f"unknown query {op}"])

    def _request_node(self, op: str, args: dict) -> None:
        self._node_req += 1
        self.node.put(None, [contract.REQUEST, self._node_req, op, args])

    # ------------------------------------------------------------------ data
    def _on_data(self, fe: bytes | None, header, items: list) -> None:
        if self.defs is None or self._early:
            # Not started yet: frontends learn our new epoch when the old shard dies and may send
            # before our snapshot is loaded. Dropping those batches while answering PROCESSED lost
            # publishes (a confirming publisher waited forever); they are handled once we are ready
            # (_run_early), and so is what comes until then, behind them.
            self._early.append((fe, header, items))
            return
        if self.fence[0] > self.defs_version:  # definitions fence: broker/defs_fence.py
            self.catch_up_defs()
        try:
            epoch, batch_seq = header[0], header[1]
        except (TypeError, IndexError, KeyError):
            return
        if len(header) > 3 and epoch == self.epoch:
            # A frontend's lanes, ordered (docs/architecture.md "Lanes"): [epoch, seq|None, count, token].
            # A publish-lane batch waits until the control lane has delivered `count` items: those the
            # frontend put there before this batch's publishes (an ack before a publish on a channel).
            control = fe[-1:] == _CONTROL_LANE_SUFFIX
            key = (fe[:-1] if control else fe, header[3])
            if control:
                self._process(fe, epoch, batch_seq, items)
                self._ctl_seen[key] = header[2]
                if key in self._ctl_wait:
                    self._release_ctl_wait(key)
                return
            need = header[2]
            if need and (key in self._ctl_wait or need > self._ctl_seen.get(key, 0)):
                self._ctl_wait.setdefault(key, deque()).append((fe, header, items))
                return
        self._process(fe, epoch, batch_seq, items)

    def _release_ctl_wait(self, key: tuple[bytes, int]) -> None:
        waiting = self._ctl_wait[key]
        seen = self._ctl_seen.get(key, 0)
        while waiting and waiting[0][1][2] <= seen:
            fe, header, items = waiting.popleft()
            self._process(fe, header[0], header[1], items)
        if not waiting:
            del self._ctl_wait[key]

    def _process(self, fe: bytes, epoch: int, batch_seq: int | None, items: list) -> None:
        self._lane = fe  # the identity this batch came from (CHANNEL_CLOSED answers on it)
        if fe[-1:] == _CONTROL_LANE_SUFFIX:
            fe = fe[:-1]  # same frontend, control lane: state is keyed by the publish-lane identity
        if epoch == self.epoch and self.defs is not None:
            for item in items:
                try:
                    self._handle(fe, item)
                except Exception:  # one bad item must not take the shard down
                    log.exception("shard %d: failed to handle item kind %r", self.index, item[:1])
        # Deliver before the socket's flush is scheduled (call_soon runs in order): the DELIVERs of
        # this turn then leave with its PROCESSED in the same flush, instead of waiting for the next
        # loop iteration and a second ZeroMQ send.
        if self._dirty_queues:  # _schedule_deliver's test, without its call when nothing is ready
            self._schedule_deliver()
        if batch_seq is not None:
            if self._fwd_held and fe in self._fwd_held:
                self._fwd_held[fe].append(batch_seq)  # after one held, the later ones (PROCESSED is a max)
            elif self._batch_forwards and self.forwards_behind():
                self._fwd_held[fe] = [batch_seq]
            elif self._behind and (self._held or _publishes(items)):
                # Only publishes are paced: acks, credit and cancels cost nothing (they are what lets
                # the consumers catch up), so a batch without publishes is held only behind others.
                self._hold_processed(fe, batch_seq, _publishes(items))
            else:
                self.data.put(fe, [contract.PROCESSED, batch_seq])
        self._batch_forwards = False
        if self._confirms:
            self._flush_confirms()

    def _data_drained(self) -> None:
        """The batches of one read from a frontend are handled (unix data plane): their DELIVERs,
        PROCESSED and confirms leave now, in one write, rather than from call_soon callbacks after
        the rest of the loop turn. At a steady rate that read is all the turn carries and the
        frontend waits for it; a flood still writes once per read (per batch was 8x the ack-file
        and mark writes with acks at saturation)."""
        if self._deliver_scheduled:
            self._deliver()
        self.data.send_pending()

    def _handle(self, fe: bytes, item: list) -> None:
        kind = item[0]
        if kind == contract.PUBLISH:
            self.publish(fe, item)
        elif kind == _PUBLISH_RUN:
            self._publish_run(fe, item)
        elif kind == contract.DEDUP_PUBLISH:
            self.exchange_dedup.publish(fe, item)
            # Only a frontend's batches are held: a shard's (dead letters) never, or two shards
            # forwarding to each other could each wait for the other.
            self._batch_forwards = fe[:3] == b"fe-"
        elif kind == contract.ACK:
            _, conn_id, channel, refs = item
            by_qid = self.by_qid
            for i in range(0, len(refs), 2):
                q = by_qid.get(refs[i])
                mid = refs[i + 1]
                if q is not None and q.ack(mid, fe, conn_id, channel):
                    q.n_acked += 1
                    # The ack of a message held unstored (shard/queue.py VIRTUAL) wrote nothing to
                    # flush, and with nothing ready the freed prefetch has nothing to deliver: no
                    # delivery pass (at a steady rate this turn carried only that ack).
                    if mid < _VIRTUAL or q.store.ready or q.aliases:
                        self._dirty_queues.add(q)
                    else:
                        self._stats_touched.add(q)  # its counts changed: for the next STATS report
        elif kind == contract.CREDIT:
            _, conn_id, channel, tag, n = item
            found = self.consumers.get((fe, conn_id, channel, tag))
            if found is not None:
                found[1].credit += n
                self._dirty_queues.add(found[0])
        elif kind == contract.NACK:
            _, conn_id, channel, requeue, refs = item
            for i in range(0, len(refs), 2):
                q = self.by_qid.get(refs[i])
                if q is None:
                    continue
                mid = refs[i + 1]
                if not requeue and q.__class__ is Queue and self._carries_dlx(q, mid):
                    q = self._upgrade(q)  # a per-message DLX header: FeatureQueue dead-letters it
                if q.nack(mid, fe, conn_id, channel, requeue):
                    self._dirty_queues.add(q)
        elif kind == contract.CONSUME:
            self._consume(fe, item)
        elif kind == contract.CANCEL:
            conn_id, channel, tag = item[1], item[2], item[3]
            req_id = item[4] if len(item) > 4 else None
            found = self.consumers.pop((fe, conn_id, channel, tag), None)
            if found is not None:
                q, c = found
                q.remove_consumer(c)
                self._dirty_queues.add(q)  # single active consumer: the next one may take over
                self._maybe_auto_delete(q)
            if req_id is not None:  # basic.cancel-ok waits for this: no DELIVER for it follows
                self.data.put(fe, [contract.REPLY_DATA, req_id, True, {}])
        elif kind == contract.GET:
            _, req_id, conn_id, channel, vhost, name, no_ack = item
            q = self.queues.get((vhost, name))
            if q is None:
                self.data.put(fe, [contract.REPLY_DATA, req_id, False,
                                   [404, f"NOT_FOUND - no queue '{name}' in vhost '{vhost}'", 60, 70]])
                return
            if q.__class__ is StreamQueue:
                self.data.put(fe, [contract.REPLY_DATA, req_id, False, [
                    540, f"NOT_IMPLEMENTED - basic.get not supported by stream queues queue '{name}' in vhost "
                    f"'{vhost}'", 60, 70]])
                return
            chan = self._channel(fe, conn_id, channel)
            if not no_ack:
                # Indexed before anything that can raise: the channel's close requeues the message
                # from here, also when the get fails after it took it (a store error below).
                chan.queues[q.qid] = None
            msg = None
            try:
                msg = q.get(chan, bool(no_ack))
                q.store.flush_acks()  # the delivered mark, before get-ok leaves (a slow path anyway)
            except Exception as exc:
                log.exception("shard %d: basic.get on queue %r in vhost %r failed", self.index, name, vhost)
                if msg is None or not no_ack:
                    # Answered, or the client's channel waits for get-ok forever. A connection error:
                    # its close requeues what this get may have taken (a manual-ack one's, indexed above).
                    self._stats_touched.add(q)
                    self.data.put(fe, [contract.REPLY_DATA, req_id, False, [
                        541, f"INTERNAL_ERROR - basic.get on queue '{name}' in vhost '{vhost}' failed: {exc}",
                        60, 70]])
                    return
                # A no-ack get took its message (removed here, its ack written by a later flush): it
                # goes out rather than be lost, as a delivery pass's would.
            self._stats_touched.add(q)
            if msg is not None:
                q.n_delivered += 1
                if no_ack:
                    q.n_get_no_ack += 1
                else:
                    q.n_get += 1
            self.data.put(fe, [contract.REPLY_DATA, req_id, True, {"message": msg}])
        elif kind == contract.QOS:
            _, conn_id, channel, prefetch = item
            chan = self._channel(fe, conn_id, channel)
            chan.global_prefetch = int(prefetch)
            # Only this channel's consumers take more (or less) now: a pass over its queues, not every queue.
            self._dirty_queues.update(self._queues_of((chan,)))
            self._schedule_deliver()
        elif kind == contract.RECOVER:
            _, conn_id, channel = item
            chan = self.channels.get((fe, conn_id, channel))
            self._requeue_where(self._queues_of((chan,) if chan is not None else ()),
                                lambda o: o.fe == fe and o.conn_id == conn_id and o.channel == channel)
        elif kind == contract.CHANNEL_CLOSED:
            _, conn_id, channel, req_id = item
            chan = self.channels.pop((fe, conn_id, channel), None)
            chans = ()
            if chan is not None:
                chans = (chan,)
                conn = self._conn_channels.get((fe, conn_id))
                if conn is not None:
                    conn.pop(channel, None)
                    if not conn:
                        del self._conn_channels[(fe, conn_id)]
            self._release_channels(chans, lambda o: o.fe == fe and o.conn_id == conn_id and o.channel == channel)
            if req_id is not None:
                # The client's channel.close waits for this. Answered on the lane it came from:
                # that DEALER is connected for sure, while after a shard restart the publish lane's
                # may not have reconnected yet, and a ROUTER drops what it cannot route.
                self.data.put(self._lane, [contract.REPLY_DATA, req_id, True, {}])
        elif kind == contract.CONNECTION_CLOSED:
            conn_id = item[1]
            channels = self.channels
            chans = [channels.pop((fe, conn_id, ch)) for ch in self._conn_channels.pop((fe, conn_id), ())]
            self._release_channels(chans, lambda o: o.fe == fe and o.conn_id == conn_id)
        elif kind == contract.QUEUE_INFO:
            _, req_id, vhost, name = item
            q = self.queues.get((vhost, name))
            if q is None:
                self.data.put(fe, [contract.REPLY_DATA, req_id, False,
                                   [404, f"NOT_FOUND - no queue '{name}' in vhost '{vhost}'", 50, 10]])
            else:
                if isinstance(q, FeatureQueue):
                    q.renew_lease()  # a (re)declare counts as use for x-expires, as in RabbitMQ
                self.data.put(fe, [contract.REPLY_DATA, req_id, True, q.info()])
        elif kind == contract.PURGE:
            _, req_id, vhost, name = item
            q = self.queues.get((vhost, name))
            if q is None:
                self.data.put(fe, [contract.REPLY_DATA, req_id, False,
                                   [404, f"NOT_FOUND - no queue '{name}' in vhost '{vhost}'", 50, 30]])
                return
            if q.__class__ is StreamQueue:
                self.data.put(fe, [contract.REPLY_DATA, req_id, False, [
                    540, f"NOT_IMPLEMENTED - queue.purge not supported by queue '{name}' in vhost '{vhost}'",
                    50, 30]])
                return
            self.data.put(fe, [contract.REPLY_DATA, req_id, True, {"messages": q.purge()}])
            self._dirty_queues.add(q)
        elif kind == contract.DELAYED_PUBLISH:
            self.delayed.publish(fe, item)
        elif kind == contract.KV_PUT:
            self.kv.handle_put(fe, item)
        elif kind == contract.KV_GET:
            self.kv.handle_get(fe, item)
        elif kind == contract.MARKED_PUBLISH:
            self._marked_publish(fe, item)
        elif kind == contract.UNMARK:
            self.kv.handle_unmark(fe, item)
        elif kind == contract.MARKED_ACK:
            _, req_id, conn_id, channel, qid, mid, vhost, space, key, mark = item
            q = self.by_qid.get(qid)
            if q is not None and q.ack(mid, fe, conn_id, channel):
                q.n_acked += 1
                self._dirty_queues.add(q)
                self.kv.mark(vhost, space, key, mark, fe, req_id)  # same step as the ack: both or neither
            else:
                self.data.put(fe, [contract.REPLY_DATA, req_id, True, {"acked": False}])
        elif kind == contract.PEER_DONE:  # once per peer per stop: last in the chain (and phase 2 after it)
            self._peer_done(fe, item[1] if len(item) > 1 else 1)
        else:
            log.warning("shard %d: unknown item kind %r", self.index, kind)

    def _marked_publish(self, fe: bytes, item: list) -> None:
        """[MARKED_PUBLISH, vhost, space, key, mark, publish]: store once per mark (MQTT QoS 2 exactly-once).

        The append and the mark's write happen in this one call, with no await between: a kill -9 of
        this shard keeps both or neither (both are in the kernel once written), and one of the frontend
        cannot come between them at all. So a resend after any crash finds the mark iff the message is here.

        The confirm (the client's PUBREC) waits until both are durable: first the mark's KV sync, then
        the next group sync, which covers the message's append (and, in a cluster, the ISR's acks). A
        PUBREC sent earlier could be followed by a power cut that loses the mark: the client's resend
        would then be stored a second time. A resend that finds the mark waits the same way, as the
        first copy's syncs may still be running.
        """
        _, vhost, space, key, mark, pub = item
        conn_id, channel, seq = pub[8], pub[9], pub[10]
        if self.kv.is_marked(vhost, space, key, mark):
            then = None if seq is None else self._confirm_after_sync(fe, conn_id, channel, seq)
            self.kv.sync_then(vhost, space, then)
            return
        if not self.publish(fe, [*pub[:8], None, None, None]):  # no confirm of its own: ours below
            if seq is not None:
                self.data.put(fe, [contract.CONFIRM_NACK, conn_id, channel, [seq]])
            return
        self.kv.mark(vhost, space, key, mark,
                     then=None if seq is None else self._confirm_after_sync(fe, conn_id, channel, seq))

    def _confirm_after_sync(self, fe: bytes, conn_id: int, channel: int, seq: int) -> Callable[[bool], None]:
        """A KV sync callback: once it succeeded, confirm seq after the next group sync (nack if it failed)."""
        def synced(ok: bool) -> None:
            if not ok:
                self.data.put(fe, [contract.CONFIRM_NACK, conn_id, channel, [seq]])
                return
            self._sync_waiting.append((fe, conn_id, channel, seq))
            self._start_sync()
        return synced

    def publish(self, fe: bytes, item: list) -> bool:
        """Store a PUBLISH; False when a queue refused it (the publisher gets a nack)."""
        (_, vhost, names, exchange, routing_key, props_raw, body, persistent,
         conn_id, channel, seq) = item
        ts = int(time.time() * 1000)
        flags = 1 if persistent else 0
        queues = self.queues
        needs_sync = False
        rejected = False
        refused: list[str] = []  # queues that did not store it and may later (the NACK names them)
        if len(props_raw) > 1 and props_raw[0] & 1:  # per-message TTL: the queues need FeatureQueue
            self._upgrade_queues(vhost, names)
        for name in names:
            q = queues.get((vhost, name))
            if q is None:
                continue  # deleted between routing and arrival: as if unroutable
            try:
                if q.__class__ is Queue:
                    # No backlog and a consumer waiting: a transient message goes out without being
                    # appended and read back (a persistent one is always stored first); to a manual-ack
                    # consumer it is held in memory until acked (shard/queue.py deliver_unstored).
                    if (not persistent and not q.store.ready and q.consumers and q.groups is None
                            and q.deliver_unstored(self.data.put, exchange, routing_key, props_raw, body, ts)):
                        # Not marked dirty: nothing is ready, so the turn's delivery pass would find
                        # nothing to do for this queue (at a steady rate that pass, its call_soon and
                        # its flush_acks were a fixed cost of every turn carrying one message).
                        q.n_published += 1
                        self._stats_touched.add(q)  # for the STATS report, which the pass feeds
                        continue
                    if q.held:
                        q.materialize()  # held ones first: they came before this message
                    q.store.append(ts, flags, exchange, routing_key, props_raw, body)
                elif not q.publish(ts, flags, exchange, routing_key, props_raw, body):
                    rejected = True  # x-overflow reject-publish: the publisher gets basic.nack
                    if not _dead_lettered_refusal(q):
                        refused.append(name)
                    continue
            except OSError as exc:
                # No space for a new segment (it is allocated before it is mapped, so a full disk
                # is this error, never a SIGBUS): not stored, so the publisher gets basic.nack.
                self._store_failed(q, exc)
                rejected = True
                refused.append(name)
                continue
            q.n_published += 1
            self._dirty_queues.add(q)
            if persistent and q.durable and self.fsync:
                needs_sync = True
                self._sync_stores.add(q.store)
        if seq is not None:
            if rejected:
                # One queue refused it (x-overflow reject-publish): the publisher gets basic.nack.
                # The names of those that did not store it (a reject-publish-dlx queue dead-lettered
                # it) let a shard that forwarded it (a due delayed message) send it to those again.
                self.data.put(fe, [contract.CONFIRM_NACK, conn_id, channel, [seq], refused])
            elif needs_sync:
                self._sync_waiting.append((fe, conn_id, channel, seq))
                self._start_sync()
            else:
                key = (fe, conn_id, channel)
                seqs = self._confirms.get(key)
                if seqs is None:
                    self._confirms[key] = [seq]
                else:
                    seqs.append(seq)
        return not rejected

    def _publish_run(self, fe: bytes, item: list) -> None:
        """Store a PUBLISH_RUN: each body exactly as the PUBLISH it stands for, in order (body i has
        confirm seq first + i), with what is the same for all of them (queues, time, flags) found once."""
        (_, vhost, names, exchange, routing_key, props_raw, bodies, persistent,
         conn_id, channel, first) = item
        ts = int(time.time() * 1000)
        flags = 1 if persistent else 0
        queues = self.queues
        if len(props_raw) > 1 and props_raw[0] & 1:  # per-message TTL: the queues need FeatureQueue
            self._upgrade_queues(vhost, names)
        found = [q for q in map(queues.get, [(vhost, name) for name in names]) if q is not None]
        self._stats_touched.update(found)  # once per run (its unstored deliveries skip the pass)
        dirty = self._dirty_queues
        sync_durable = persistent and self.fsync
        confirmed: list[int] = []
        nacked: list[int] = []
        synced: list[int] = []
        n_bodies = len(bodies)
        # Delivery runs: an empty plain queue with a no-ack consumer waiting takes the run's first bodies
        # at once (Queue.deliver_unstored_run, what deliver_unstored does body by body for no-ack
        # consumers); below, each body goes to the queues that did not take it, as before. Segments
        # [a, b) of bodies with the same queues left; without delivery runs, one segment of all
        # bodies and all queues.
        segments: list = [(0, n_bodies, found)]
        if not persistent:
            took = None
            for i, q in enumerate(found):
                if q.__class__ is Queue and not q.store.ready and q.consumers and q.groups is None:
                    n = q.deliver_unstored_run(self.data.put_many, exchange, routing_key, props_raw, bodies)
                    if n:
                        q.n_published += n  # not dirty: nothing ready (see publish)
                        if took is None:
                            took = [0] * len(found)
                        took[i] = n
            if took is not None:
                cuts = sorted({0, n_bodies, *took})
                segments = [(a, b, [q for q, t in zip(found, took, strict=True) if t <= a])
                            for a, b in zip(cuts, cuts[1:], strict=False)]
        seq = first
        for a, b, left in segments:
            if not left:  # every queue took these bodies: confirmed (transient, delivered)
                if first is not None:
                    confirmed.extend(range(seq, seq + b - a))
                    seq += b - a
                continue
            for body in (bodies if b - a == n_bodies else bodies[a:b]):
                rejected = needs_sync = False
                for i, q in enumerate(left):
                    if q.deleted:  # replaced (upgraded) or deleted since the run began: as PUBLISH would find it
                        q = queues.get((q.vhost, q.name))
                        if q is None or q.deleted:
                            continue
                        left[i] = q
                    try:
                        if q.__class__ is Queue:
                            if (not persistent and not q.store.ready and q.consumers and q.groups is None
                                    and q.deliver_unstored(self.data.put, exchange, routing_key, props_raw, body, ts)):
                                q.n_published += 1  # not dirty: nothing ready (see publish)
                                continue
                            if q.held:
                                q.materialize()  # held ones first: they came before this message
                            q.store.append(ts, flags, exchange, routing_key, props_raw, body)
                        elif not q.publish(ts, flags, exchange, routing_key, props_raw, body):
                            rejected = True
                            continue
                    except OSError as exc:
                        self._store_failed(q, exc)
                        rejected = True
                        continue
                    q.n_published += 1
                    dirty.add(q)
                    if sync_durable and q.durable:
                        needs_sync = True
                        self._sync_stores.add(q.store)
                if first is not None:
                    if rejected:
                        nacked.append(seq)
                    elif needs_sync:
                        synced.append(seq)
                    else:
                        confirmed.append(seq)
                    seq += 1
        if first is None:
            return
        if nacked:
            self.data.put(fe, [contract.CONFIRM_NACK, conn_id, channel, nacked])
        if synced:
            self._sync_waiting.extend((fe, conn_id, channel, s) for s in synced)
            self._start_sync()
        if confirmed:
            key = (fe, conn_id, channel)
            seqs = self._confirms.get(key)
            if seqs is None:
                self._confirms[key] = confirmed
            else:
                seqs.extend(confirmed)

    def _store_failed(self, q: Queue, exc: OSError) -> None:
        """Log a refused append at most once a second per shard (a full disk refuses every one)."""
        self.store_failures += 1
        now = time.monotonic()
        if now - self._store_failure_logged >= 1.0:
            self._store_failure_logged = now
            log.warning("shard %d: queue '%s' in vhost '%s': message not stored (%s); %d refused so far",
                        self.index, q.name, q.vhost, exc, self.store_failures)

    # ----------------------------------------------------------- features
    def _upgrade_queues(self, vhost: str, names: list[str]) -> None:
        for name in names:
            q = self.queues.get((vhost, name))
            if q is not None and q.__class__ is Queue:
                defn = self.defs.queue(vhost, name)
                if defn is not None:
                    q.store.add_marker(EXPIRING_MARK)
                    self._replace_queue(q, FeatureQueue.upgrade(q, defn, self))

    @staticmethod
    def _carries_dlx(q: Queue, msg_id: int) -> bool:
        """A plain queue's rejected message with its own x-dead-letter-exchange header (LavinMQ).

        Checked here, when a rejection is the only way a plain queue can dead-letter, rather than
        on publish: publishes pay nothing and recovered messages are covered as well.
        """
        if msg_id not in q.unacked:
            return False
        try:
            return has_dlx_header(q.read(msg_id)[4])  # a held message's too (shard/queue.py)
        except KeyError:
            return False

    def _upgrade(self, q: Queue) -> Queue:
        defn = self.defs.queue(q.vhost, q.name)
        if defn is None:
            return q
        new = FeatureQueue.upgrade(q, defn, self)
        self._replace_queue(q, new)
        return new

    def _replace_queue(self, old: Queue, new: Queue) -> None:
        new.n_published, new.n_delivered, new.n_acked = old.n_published, old.n_delivered, old.n_acked
        new.n_deliver_no_ack, new.n_get, new.n_get_no_ack = old.n_deliver_no_ack, old.n_get, old.n_get_no_ack
        self.queues[(old.vhost, old.name)] = new
        self.by_qid[old.qid] = new
        self._stats_touched.add(new)
        for key, (q, c) in list(self.consumers.items()):
            if q is old:
                self.consumers[key] = (new, c)
        if old in self._dirty_queues:
            self._dirty_queues.discard(old)
            self._dirty_queues.add(new)
        self.delivery_faults.replace(old, new)
        old.deleted = True  # a pending timer or delivery of the old object does nothing

    def _apply_policies(self, vhost: str) -> None:
        """A policy changed in `vhost`: queues here take their new effective arguments."""
        for (qv, name), q in list(self.queues.items()):
            if qv != vhost:
                continue
            args = self.defs.effective_arguments(vhost, "queue", name)
            if q.__class__ is Queue:
                if needs_features(args):
                    self._replace_queue(q, FeatureQueue.upgrade(q, self.defs.queue(vhost, name), self, args))
            else:
                q.configure(args)
                self.mark_dirty(q)

    def mark_dirty(self, q: Queue) -> None:
        self._dirty_queues.add(q)
        self._schedule_deliver()

    def request_delete_unused(self, op: str, q: Queue) -> None:
        """Ask the node to delete ``q``, unused (op "queue.auto_delete" or "queue.expire"): it deletes
        this life of the queue only, (shard, epoch, qid), never one declared again under its name since."""
        self._request_node(op, {"vhost": q.vhost, "queue": q.name, "shard": self.index, "epoch": self.epoch,
                                "qid": q.qid})

    def dead_letter(self, q: FeatureQueue, reason: str, flags: int, exchange: str, routing_key: str,
                    props_raw: bytes, body: bytes) -> None:
        """Republish a message that left `q` for `reason` to its dead-letter exchange.

        The message's own x-dead-letter-exchange / x-dead-letter-routing-key headers win over
        the queue's (LavinMQ); the routing key falls back to the queue's, then the original keys.
        """
        if q.dlx is None and not has_dlx_header(props_raw):
            return
        try:
            props, keys, deaths, msg_dlx, msg_dlrk = dead_letter_props(
                props_raw, q.name, reason, exchange, routing_key, time.time())
        except ValueError:
            log.warning("shard %d: cannot dead-letter a message with malformed properties from %r",
                        self.index, q.name)
            return
        vhost = q.vhost
        dlx = msg_dlx if msg_dlx is not None else q.dlx
        if dlx is None:
            return
        dlrk = msg_dlrk if msg_dlrk is not None else q.dlrk
        rk = dlrk if dlrk is not None else routing_key
        targets: dict[str, None] = {}
        route = self.defs.route
        for key in ([dlrk] if dlrk is not None else keys):
            targets.update(dict.fromkeys(route(vhost, dlx, key, props)))
        x = self.defs.exchange(vhost, dlx)
        if x is not None and x.dedup is not None:  # the exchange's owner shard decides, as for a publish
            self.exchange_dedup.dead_letter(x, vhost, rk, props, body, bool(flags & 1),
                                            [n for n in targets if not is_cycle(n, deaths)])
            return
        names = []
        for name in targets:
            if is_cycle(name, deaths):
                log.debug("shard %d: dead-letter cycle to %r dropped", self.index, name)
                continue
            names.append(name)
        # Other shards' copies are kept in the outbox until confirmed (shard/dead_letter_forwards.py);
        # the seq is the outbox record's id, filled in there. A queue here that refused it (full with
        # x-overflow reject-publish, a failed append) gets it the same way, through our own ROUTER
        # after the retry delay, as another shard's refusing queue does (it used to be dropped here).
        refused: list[str] = []
        _sync, remote = self.route_to_queues(vhost, names, flags, dlx, rk, props, body, 0,
                                             contract.PEER_CHANNEL_DLX, send=False, refused=refused)
        if refused:
            remote[self.index] = [contract.PUBLISH, vhost, refused, dlx, rk, props, body, bool(flags & 1),
                                  self.epoch, contract.PEER_CHANNEL_DLX, 0]
        self.dead_letters.send(remote, bool(flags & 1), later=self.index if refused else None)

    def route_to_queues(self, vhost: str, names: list[str] | tuple, flags: int, exchange: str, routing_key: str,
                        props: bytes, body: bytes, confirm_seq: int | None = None,
                        peer_channel: int = contract.PEER_CHANNEL_DELAYED,
                        send: bool = True, refused: list[str] | None = None) -> tuple[bool, dict[int, list]]:
        """Append a message the shard republishes itself (a dead letter, a due delayed message).

        Queues here get it appended, queues of other shards a PUBLISH over the peer DEALERs.
        Returns (whether a local append is persistent into a durable queue and waits for the
        next group sync, the PUBLISH item sent to each other shard). With ``confirm_seq`` the
        other shards answer CONFIRM for it (see ``on_peer_answers``); without, a copy in flight to a
        shard that is restarting is lost. With ``send=False`` the items are only built (the caller
        sends them, with their seq, through ``send_to_peer``). With ``refused``, the names of the
        queues here that did not store it (full with x-overflow reject-publish, a failed append) are
        added to it, for the caller to try again; without, those are skipped (a dead letter is
        dropped there, as RabbitMQ's at-most-once dead-lettering drops it).
        """
        if len(props) > 1 and props[0] & 1:  # per-message TTL: plain queues here need FeatureQueue
            self._upgrade_queues(vhost, list(names))
        remote: dict[int, list[str]] = {}
        ts = int(time.time() * 1000)
        needs_sync = False
        for name in names:
            defn = self.defs.queue(vhost, name)
            if defn is None:
                continue
            if defn.shard != self.index:
                remote.setdefault(defn.shard, []).append(name)
                continue
            target = self.queues.get((vhost, name))
            if target is None or target.deleted:
                continue
            try:
                if target.__class__ is Queue:
                    if target.held:
                        target.materialize()  # held ones first: they came before this message
                    target.store.append(ts, flags, exchange, routing_key, props, body)
                elif not target.publish(ts, flags, exchange, routing_key, props, body):
                    if refused is not None and not _dead_lettered_refusal(target):
                        refused.append(name)
                    continue
            except OSError as exc:
                if refused is None:
                    raise
                self._store_failed(target, exc)  # a full disk: tried again later
                refused.append(name)
                continue
            self.mark_dirty(target)
            if flags & 1 and target.durable:
                self._sync_stores.add(target.store)
                needs_sync = True
        sent: dict[int, list] = {}
        # conn_id: our epoch, echoed in the answer (one for an earlier life is dropped: shard/forward_lives.py).
        conn_to, chan_to = (None, None) if confirm_seq is None else (self.epoch, peer_channel)
        for shard, names in remote.items():
            peer = self.peers.get(shard)
            if peer is not None:
                item = sent[shard] = [contract.PUBLISH, vhost, names, exchange, routing_key, props, body,
                                      bool(flags & 1), conn_to, chan_to, confirm_seq]
                if send:
                    peer.put(None, item)
        return needs_sync and self.fsync, sent

    def forward(self, shard: int, item: list) -> None:
        """Send a PUBLISH item built by route_to_queues to that shard again (it restarted)."""
        peer = None if self.peers_closed else self.peers.get(shard)
        if peer is not None:
            peer.put(None, item)

    def send_to_peer(self, shard: int, item: list) -> bool:
        """Send an item over the peer DEALER to `shard`, this shard included (a deduplicating exchange
        it owns): the answers come back through ``on_peer_answers``. False when it cannot go (no such
        peer, or we told the peers we are done: ``exchange_dedup.socket_to``)."""
        sock = self.exchange_dedup.socket_to(shard)
        if sock is None:
            return False
        sock.put(None, item)
        return True

    def sync_first(self, store: QueueStore) -> None:
        """`store` is synced in the next group sync, before any other store of it (the dead-letter
        outbox: its record must be durable no later than the source queue's removal of the message)."""
        if self.fsync:
            self._sync_stores.add(store)
            self._start_sync()

    def confirm_stored(self, fe: bytes, conn_id: int | None, channel: int | None, seq: int | None,
                       sync_store: QueueStore | None) -> None:
        """A publish is stored: confirm it now, or after the next group sync of ``sync_store``."""
        if sync_store is not None:
            self._sync_stores.add(sync_store)
            if seq is not None:
                self._sync_waiting.append((fe, conn_id, channel, seq))
                self._start_sync()
        elif seq is not None:
            self._confirms.setdefault((fe, conn_id, channel), []).append(seq)

    def after_sync(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once everything appended so far is durable (after the next group sync)."""
        self._after_sync.append(callback)
        self._start_sync()

    def forget_store(self, store: QueueStore) -> None:
        """A store is being deleted: the next group sync must not touch it."""
        self._sync_stores.discard(store)

    def _connect_peers(self) -> None:
        for i in range(int(self.settings.get("shards", 1))):
            if i == self.index or i in self.peers:
                continue
            # Batch seqs count from our epoch << 32: a late PROCESSED for a batch of our earlier life
            # (whose seqs also started low) is below them and moves nothing (forwards_behind).
            self._peer_seq[i] = self.peer_processed[i] = self.epoch << 32
            self.peers[i] = data_sockets.shard_connection(self.loop, self.run_dir, i, self.ident,
                                                          self.on_peer_answers(i), self._peer_header(i))

    def on_peer_answers(self, shard: int) -> Callable[[bytes | None, object, list], None]:
        """Answers of another shard (or our own, for dedup forwards) to our PUBLISH items.

        CONFIRM/CONFIRM_NACK settle forwarded delayed messages, dead letters or deduplicating-exchange
        publishes, told apart by their channel (contract.PEER_CHANNEL_*); PROCESSED answers are ignored.
        """
        def on_batch(_ident: bytes | None, _header: object, items: list) -> None:
            for item in items:
                kind = item[0]
                if kind == contract.PROCESSED:
                    if item[1] > self.peer_processed.get(shard, 0):
                        self.peer_processed[shard] = item[1]
                        if self._fwd_held:
                            self._release_forward_held()
                elif kind == contract.CONFIRM or kind == contract.CONFIRM_NACK:
                    if not for_this_life(item, self.epoch):
                        continue  # for an earlier life of this shard: its seqs name other forwards now
                    if item[2] == contract.PEER_CHANNEL_DELAYED:
                        self.delayed.peer_confirmed(shard, item[3], kind == contract.CONFIRM,
                                                    item[4] if len(item) > 4 else None)
                    elif item[2] == contract.PEER_CHANNEL_DLX:
                        self.dead_letters.confirmed(shard, item[3], kind == contract.CONFIRM,
                                                    item[4] if len(item) > 4 else None)
                    else:
                        self.exchange_dedup.peer_confirmed(shard, item[3], kind == contract.CONFIRM,
                                                           item[4] if len(item) > 4 else None)
            self.forward_settle.answered()
        return on_batch

    # ------------------------------------------------------ forward back-pressure
    # A deduplicating exchange's owner forwards every publish to the shards of the routed queues.
    # Those answer its batches with PROCESSED like a frontend's (held while their consumers cannot
    # keep up, never while they are stopped); while more than MAX_BATCHES_IN_FLIGHT of the owner's
    # batches to one of them are unanswered, the owner holds its own PROCESSED answers to the
    # frontends' batches that carried DEDUP_PUBLISH items (no time limit: there is nowhere to put
    # the messages), so the frontends pause their publishers. The owner's memory stays bounded
    # however slow a target shard is, and the target's consumer pacing reaches the publisher.
    def forwards_behind(self) -> bool:
        limit = contract.MAX_BATCHES_IN_FLIGHT
        processed = self.peer_processed
        for shard, sent in self.peer_batches().items():
            if sent - processed.get(shard, 0) > limit:
                return True
        return False

    def peer_batches(self) -> dict[int, int]:
        """Batches sent so far over each peer DEALER (ours to our own ROUTER under our own index)."""
        sent = dict(self._peer_seq)
        own = self.exchange_dedup.self_batches()
        if own:
            sent[self.index] = own
        return sent

    def _release_forward_held(self) -> None:
        if self.forwards_behind():
            return
        held = self._fwd_held
        self._fwd_held = {}
        put = self.data.put
        for fe, seqs in held.items():
            put(fe, [contract.PROCESSED, seqs[-1]])

    def _peer_done(self, fe: bytes, phase: int = 1) -> None:
        """PEER_DONE from shard `fe` (sh-N): it is stopping and sends us nothing more (phase 2: and its
        final state reached the followers, shard/streams_close.py)."""
        try:
            index = int(fe[3:])
        except ValueError:
            return
        if phase == streams_close.SYNCED:
            self.streams_close.peer_synced(index)
            return
        self.peers_done.done.add(index)
        self.forward_settle.answered()

    def _say_peers_done(self) -> None:
        """At a clean stop, our forwards settled: tell every other shard nothing more comes from us.
        From here no item goes to another shard (a dead letter stays in the outbox for the restart, a
        dedup forward is refused); ours still goes to our own ROUTER."""
        self.peers_closed = True
        shards = int(self.settings.get("shards", 1))
        self.peers_done.expect({i for i in range(shards) if i != self.index})
        for peer in self.peers.values():
            peer.put(None, [contract.PEER_DONE])

    def _peer_restarted(self, index: int) -> None:
        """Batches to its dead incarnation get no answer: they no longer count as in flight."""
        sent = self.peer_batches().get(index)
        if sent is not None:
            self.peer_processed[index] = sent
        if self._fwd_held:
            self._release_forward_held()

    def _peer_header(self, shard: int) -> Callable[[bytes | None], list]:
        def header(_dest: bytes | None) -> list:
            self._peer_seq[shard] += 1
            return [self.epochs.get(shard, 0), self._peer_seq[shard]]
        return header

    @property
    def fsync(self) -> bool:
        return self.settings.get("sync", "fsync") == "fsync"

    def _consume(self, fe: bytes, item: list) -> None:
        (_, req_id, conn_id, channel, vhost, name, tag, no_ack, exclusive, prefetch, arguments) = item
        q = self.queues.get((vhost, name))
        if q is None:
            self.data.put(fe, [contract.REPLY_DATA, req_id, False,
                               [404, f"NOT_FOUND - no queue '{name}' in vhost '{vhost}'", 60, 20]])
            return
        # RabbitMQ refuses an exclusive consumer on a single-active-consumer queue the same way.
        if q.exclusive_consumer or (exclusive and (q.consumers or q.sac)):
            self.data.put(fe, [contract.REPLY_DATA, req_id, False,
                               [403, f"ACCESS_REFUSED - queue '{name}' in vhost '{vhost}' in exclusive use",
                                60, 20]])
            return
        if q.__class__ is StreamQueue:
            refusal = consume_error(q, bool(no_ack), int(prefetch or 0), arguments or {})
            if refusal is not None:
                self.data.put(fe, [contract.REPLY_DATA, req_id, False, refusal])
                return
        chan = self._channel(fe, conn_id, channel)
        consumer = Consumer(chan, tag, bool(no_ack), bool(exclusive), int(prefetch or 0), arguments or {})
        # Indexed first: the channel's close looks here for the consumer and its unacked messages,
        # whatever raises after.
        chan.queues[q.qid] = None
        q.add_consumer(consumer)
        self.consumers[(fe, conn_id, channel, tag)] = (q, consumer)
        if consumer.timeout:
            self.ack_timeouts.schedule()  # a shorter timeout than any before: scan more often
        # The reply goes out before any delivery for this consumer (same batch, earlier item).
        self.data.put(fe, [contract.REPLY_DATA, req_id, True, {}])
        self._dirty_queues.add(q)

    def _channel(self, fe: bytes, conn_id: int, channel: int) -> ChannelRef:
        key = (fe, conn_id, channel)
        chan = self.channels.get(key)
        if chan is None:
            chan = self.channels[key] = ChannelRef(fe, conn_id, channel)
            conn = self._conn_channels.get((fe, conn_id))
            if conn is None:
                self._conn_channels[(fe, conn_id)] = {channel: None}
            else:
                conn[channel] = None
        return chan

    def _queues_of(self, chans: tuple | list) -> list[Queue]:
        """The queues where these channels may have consumers or unacked messages (their ``queues``),
        in the order of self.queues (ascending qid: a queue is added there when its qid is given out,
        and a replaced one keeps both), so what a close does across queues (requeues, dead letters at a
        delivery limit, auto-delete requests) comes in the order the walk of every queue had."""
        by_qid = self.by_qid
        qids: set[int] = set()
        for chan in chans:
            mine = chan.queues
            gone = [qid for qid in mine if qid not in by_qid]
            if gone:
                # Deleted since (a qid is never given out again): off the index, or a long-lived
                # channel's consumes of short-lived queues would be walked at every scan.
                for qid in gone:
                    del mine[qid]
            qids.update(mine)
        return [by_qid[qid] for qid in sorted(qids)]

    def owned_queues(self) -> list[Queue]:
        """Every queue where a channel may hold unacked messages (the consumer-timeout scan's), in
        the order of self.queues."""
        queues = self._queues_of(list(self.channels.values()))
        if self._walk_check:
            walk_check.unacked_found(self, queues)
        return queues

    def _release_channels(self, chans: tuple | list, match: Callable) -> None:
        """Channels gone (closed, their connection closed, their frontend dead): their consumers off
        and their unacked messages requeued, in the queues they touched only. ``match`` picks their
        consumers and owners (a channel's, a connection's or a frontend's)."""
        queues = self._queues_of(chans)
        if self._walk_check:
            walk_check.owners_found(self, queues, match)
        self._drop_consumers(queues, match)
        self._requeue_where(queues, match)

    def _drop_consumers(self, queues: list[Queue], match: Callable[[Consumer], bool]) -> None:
        for q in queues:
            gone = [c for c in q.consumers if match(c)]
            for c in gone:
                q.remove_consumer(c)
                self.consumers.pop((c.fe, c.conn_id, c.channel, c.tag), None)
            if gone:
                self._dirty_queues.add(q)  # single active consumer: the next one may take over
                self._maybe_auto_delete(q)

    def _requeue_where(self, queues: list[Queue], match: Callable) -> None:
        for q in queues:
            if q.unacked and q.requeue_owned(match):
                self._dirty_queues.add(q)
        self._schedule_deliver()

    def _maybe_auto_delete(self, q: Queue) -> None:
        if q.auto_delete and q.had_consumers and not q.consumers and not q.deleted:
            self.request_delete_unused("queue.auto_delete", q)

    def _frontend_gone(self, fe: bytes) -> None:
        channels = self.channels
        chans = [channels.pop(key) for key in [k for k in channels if k[0] == fe]]  # rare: a walk of channels
        for key in [k for k in self._conn_channels if k[0] == fe]:
            del self._conn_channels[key]
        self._release_channels(chans, lambda o: o.fe == fe)
        self._confirms = {k: v for k, v in self._confirms.items() if k[0] != fe}
        self._fwd_held.pop(fe, None)
        for key in [k for k in self._ctl_seen if k[0] == fe]:
            del self._ctl_seen[key]
        for key in [k for k in self._ctl_wait if k[0] == fe]:
            del self._ctl_wait[key]
        self._sync_waiting = [w for w in self._sync_waiting if w[0] != fe]

    # -------------------------------------------------------------- delivery
    def _schedule_deliver(self) -> None:
        if self._dirty_queues and not self._deliver_scheduled:
            self._deliver_scheduled = True
            self.loop.call_soon(self._deliver_if_scheduled)

    def _deliver_if_scheduled(self) -> None:
        if self._deliver_scheduled:  # not run already, by _data_drained at the end of a read
            self._deliver()

    def schedule_deliver_all(self) -> None:
        self._dirty_queues.update(self.queues.values())
        self._schedule_deliver()

    def _deliver(self) -> None:
        self._deliver_scheduled = False
        dirty = self._dirty_queues
        self._dirty_queues = set()
        self._stats_touched |= dirty  # what the pass changes is what the next STATS report reads
        put = self.data.put
        delivered = 0
        behind = False
        faults = self.delivery_faults
        failing = faults.failing
        for q in dirty:
            if not q.deleted:
                store = q.store
                if not q.consumers and q.__class__ is Queue:
                    # Nothing to deliver to (a queue only published to, as a confirming publisher's
                    # with no consumer): of what follows only its acks and mark are written, and a
                    # failing store's recovery noted. Without the rest's property reads and calls.
                    try:
                        store.flush_acks()
                    except Exception as exc:
                        faults.failed(q, exc)
                        continue
                    if failing and q in failing and not store.ready:
                        faults.recovered(q)
                    continue
                ready = store.ready
                unacked = len(q.unacked)
                # One queue's store failing (a segment it cannot map, an I/O error) is that queue's
                # trouble: the pass goes on with the others, and it is retried after a back-off
                # (shard/delivery_faults.py). What it sent before the failure is counted and its
                # delivered mark written as for any other.
                failed = False
                try:
                    q.deliver(put)
                except Exception as exc:
                    faults.failed(q, exc)
                    failed = True
                n = ready - store.ready
                if n:
                    q.n_delivered += n  # per queue per turn, not per message (message_stats)
                    # Deliveries that did not enter the unacked map went to no-ack consumers.
                    no_ack = n - (len(q.unacked) - unacked)
                    if no_ack > 0 and q.__class__ is not StreamQueue:
                        q.n_deliver_no_ack += no_ack
                delivered += n
                try:
                    store.flush_acks()
                except Exception as exc:
                    faults.failed(q, exc)
                    failed = True
                if failing and not failed and q in failing and (n or not store.ready):
                    faults.recovered(q)
                if store.ready > _FLOW_BACKLOG and q.consumers and _consumer_waiting(q.consumers):
                    behind = True
                elif q.__class__ is StreamQueue and q.consumers and q.tail_consumer_waiting(_FLOW_BACKLOG):
                    behind = True  # a stream's ready is 0: its live consumers are behind by their lag
        self._behind = behind
        if self._held:
            self._release_processed(delivered)

    def debug_state(self) -> dict:
        return {
            "queues": {f"{v}/{n}": q.info() | {"unacked": len(q.unacked)} for (v, n), q in self.queues.items()},
            "behind": self._behind, "held": len(self._held), "hold_timer": self._hold_timer_armed,
            "sync_running": self._sync_running, "sync_waiting": len(self._sync_waiting),
            "sync_stores": len(self._sync_stores), "dirty": len(self._dirty_queues),
            "deliver_scheduled": self._deliver_scheduled,
            "delayed": self.delayed.info(),
            "peer_batches": self.peer_batches(), "peer_processed": self.peer_processed,
            "forward_held": {fe.decode(): len(seqs) for fe, seqs in self._fwd_held.items()},
            "consumers": {f"{k[1]}/{k[2]}/{k[3]}": [c.credit, c.unacked, c.prefetch] for k, (_q, c)
                          in self.consumers.items()},
        }

    # ------------------------------------------------------ publisher flow control
    # While a queue's consumers cannot keep up (a large backlog and a consumer waiting for
    # credit), PROCESSED answers are released at the pace of deliveries, so the frontends
    # slow the publishers down to what the consumers take, as RabbitMQ's flow control does.
    # No batch is held longer than _FLOW_MAX_HOLD_S: a stuck consumer cannot stop publishers.
    def _hold_processed(self, fe: bytes, batch_seq: int, n: int) -> None:
        self._held.append((self.loop.time(), fe, batch_seq, n))
        if not self._hold_timer_armed:
            self._hold_timer_armed = True
            self.loop.call_later(_FLOW_MAX_HOLD_S, self._release_old)

    def _release_processed(self, delivered: int) -> None:
        """Release held batches: all once no queue is behind, else one batch per as many deliveries
        as it holds publishes. The deliveries are counted across turns: a consumer acking a few
        messages per turn (prefetch full) lets one batch of hundreds through only after as many
        deliveries, where spending each turn's count on a whole batch let publishers run at up to a
        batch per turn and the queue grow without bound (publish 23k, consume 12k msg/s)."""
        held = self._held
        put = self.data.put
        if not self._behind:
            while held:
                _t, fe, seq, _n = held.popleft()
                put(fe, [contract.PROCESSED, seq])
            self._release_credit = 0
            return
        credit = self._release_credit + delivered
        while held and credit >= held[0][3]:
            _t, fe, seq, n = held.popleft()
            put(fe, [contract.PROCESSED, seq])
            credit -= n
        self._release_credit = credit if held else 0

    def _release_old(self) -> None:
        self._hold_timer_armed = False
        held = self._held
        deadline = self.loop.time() - _FLOW_MAX_HOLD_S
        put = self.data.put
        while held and held[0][0] <= deadline:
            _t, fe, seq, _n = held.popleft()
            put(fe, [contract.PROCESSED, seq])
        if held:
            self._hold_timer_armed = True
            self.loop.call_later(_FLOW_MAX_HOLD_S, self._release_old)

    # ----------------------------------------------------------------- confirms
    def _flush_confirms(self) -> None:
        confirms = self._confirms
        self._confirms = {}
        put = self.data.put
        for (fe, conn_id, channel), seqs in confirms.items():
            put(fe, [contract.CONFIRM, conn_id, channel, seqs])

    def _start_sync(self) -> None:
        if self._sync_running or self._closing or not (self._sync_waiting or self._sync_stores or self._after_sync):
            return
        self._sync_running = True
        waiting = self._sync_waiting
        stores = self._sync_stores
        after = self._after_sync
        self._sync_waiting = []
        self._sync_stores = set()
        self._after_sync = []
        for store in stores:
            store.flush_acks()  # on the loop thread: the sync thread only fsyncs
        started = time.monotonic()
        self.fsync_beacon.started()
        # In a cluster the confirms also wait for the ISR followers to ack everything written so far.
        target = self.repl.position() if waiting and self.repl is not None and self.repl.gating else -1
        ordered = sorted(stores, key=self._sync_order)
        acks, self._sync_acks = self._sync_acks, False
        # On the shard's sync thread, not run_in_executor: its futures and locks were ~45 Python calls
        # on the loop per sync, each persistent confirm's (shard/sync_thread.py).
        self._sync_fut = self._sync_thread.run(
            _sync_all, (ordered, acks, self._stall_as),
            lambda f: self._sync_done(f, waiting, after, target, started, ordered))

    def _sync_order(self, store: QueueStore) -> int:
        return 0 if store is self.dead_letters.store else 1  # the outbox first (sync_first)

    def _owned_store_paths(self) -> list[str]:
        """Directories of the stores this shard owns, and the KV store files it has open (its
        replication stream's files; KV files are listed by the node stream too, see docs/cluster.md)."""
        return ([q.store.path for q in self.queues.values()] + [s.path for s in self.delayed.all_stores()]
                + [s.path for s in self.dead_letters.all_stores()] + [st.path for st in self.kv.stores.values()])

    async def _followers_acked(self, repl: ShardReplication, target: int, deadline: float) -> bool:
        """At a stop: wait (until `deadline`) for the in-sync followers to ack up to `target`. Not while
        one of them is gone: the ISR does not change during a stop, so it would wait until the deadline."""
        if not repl.isr_attached():
            return False
        acked = self.loop.create_future()
        repl.when_replicated(target, lambda ok: acked.done() or acked.set_result(ok))
        while (left := deadline - self.loop.time()) > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 0.05)):
                    return await asyncio.shield(acked)
            if not repl.isr_attached():
                return False  # one went away meanwhile
        return False

    def _replicated(self, waiting: list, ok: bool) -> None:
        if not ok and self._closing:
            return  # our stream closes at a stop: not a refusal (a nack would make a delayed forward's
            # sender drop its copy); unconfirmed, the senders keep theirs
        kind = contract.CONFIRM if ok else contract.CONFIRM_NACK
        grouped: dict[tuple[bytes, int, int], list[int]] = {}
        for fe, conn_id, channel, seq in waiting:
            grouped.setdefault((fe, conn_id, channel), []).append(seq)
        for (fe, conn_id, channel), seqs in grouped.items():
            self.data.put(fe, [kind, conn_id, channel, seqs])

    def _sync_done(self, fut: asyncio.Future, waiting: list, after: list, target: int = -1,
                   started: float | None = None, stores: list | None = None) -> None:
        self._sync_running = False
        self.fsync_beacon.done()
        if started is not None:
            self.sync_histogram.observe(time.monotonic() - started)
        exc = fut.exception()
        if exc is not None:
            log.error("shard %d: sync failed: %s", self.index, exc)
            # The sync thread put the dirty flags back, out of sight of shard/dirty_stores.py.
            for store in stores or ():
                dirty_stores.note(store)
            for fe, conn_id, channel, seq in waiting:
                self.data.put(fe, [contract.CONFIRM_NACK, conn_id, channel, [seq]])
        else:
            for callback in after:
                try:
                    callback()
                except Exception:
                    log.exception("shard %d: after-sync callback failed", self.index)
            if target >= 0 and waiting:
                held, waiting = waiting, []
                self.repl.when_replicated(target, lambda ok: self._replicated(held, ok))
            confirms = self._confirms
            for fe, conn_id, channel, seq in waiting:
                key = (fe, conn_id, channel)
                seqs = confirms.get(key)
                if seqs is None:
                    confirms[key] = [seq]
                else:
                    seqs.append(seq)
            self._flush_confirms()
        self._start_sync()

    def _periodic_sync(self) -> None:
        """Acks and appends no confirm waits for reach the disk within a second, even when idle.

        Only the stores that became dirty since the last pass are visited (shard/dirty_stores.py),
        and the queues with delivery counts to save: 100,000 idle queues cost nothing here, where
        asking every store took ~14 ms of shard CPU per second (and a walk of 30,000 in one piece
        stalled publishes on the shard: it went 2,000 queues per loop turn)."""
        if self.stopping:
            return
        visited = dirty_stores.take()
        sync_stores = self._sync_stores
        for store in visited:
            if store.closed or not store.dirty:
                continue  # deleted, or made durable since (a confirm's sync): leaves the set
            if store.fsync:
                sync_stores.add(store)
            else:
                # A non-durable queue: nothing to fsync (it is gone after a restart), only acks to
                # write and sealed segments' fds to close, here on the loop.
                store.flush_acks()
                store.sync()
            if store.dirty:
                dirty_stores.note(store)  # until its sync has run: looked at again next time
        returns = self._returns_queues
        if returns:
            for q in list(returns):
                if q.deleted or not (q.save_returns() if q.count_returns else q.returns):
                    returns.discard(q)
        # Delayed-message and dead-letter stores note themselves too; these few are asked as well.
        for store in self.delayed.dirty_stores():
            if store.fsync:
                sync_stores.add(store)
            else:  # a non-durable delayed-message exchange's, as a non-durable queue's
                store.flush_acks()
                store.sync()
        sync_stores.update(s for s in self.dead_letters.all_stores() if s.dirty)
        if self._walk_check and not self._sync_running:  # (a running sync changes dirty flags)
            walk_check.dirty_found(self, {*visited, *sync_stores})
        self._sync_acks = True
        self._start_sync()
        self.loop.call_later(_PERIODIC_SYNC_S, self._periodic_sync)

    def returns_changed(self, q: FeatureQueue) -> None:
        """A queue's delivery counts changed (or were loaded): the periodic sync saves them."""
        self._returns_queues.add(q)

    # ----------------------------------------------------------------- stop
    def _write_idle_index(self) -> None:
        """At a clean stop, after the last sync: the idle queue directories the next boot need not list."""
        if self._listed_ns is None:
            return
        kept = 0
        for vdir, dirs in _idle_dirs(self.queues.values()).items():
            try:
                kept += idle_index.write(vdir, self.index, dirs, self._listed_ns)
            except OSError as exc:  # the next boot lists them: slower, not wrong
                log.warning("shard %d: idle queue index of %s not written: %s", self.index, vdir, exc)
        log.info("shard %d: %d idle queue directories noted for the next boot", self.index, kept)

    async def stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        log.info("shard %d stopping", self.index)  # tests wait for it: the stop has begun
        # Every shard stops at once: what we forwarded (dead letters, due delayed messages, a dedup
        # exchange's publishes) may be stored by its target and its CONFIRM not here yet. Wait for
        # them (syncs and confirms go on meanwhile), or they would be sent again after the restart,
        # twice in the target queue (shard/forward_settle.py).
        started = self.loop.time()
        deadline = started + STOP_WAIT_S
        await self.forward_settle.settle()
        # Then nothing more from us to the other shards, and we serve until each said the same: a peer
        # that got its STOP later may still forward to us (due delayed messages, dead letters).
        self._say_peers_done()
        await self.forward_settle.settle(max(0.0, started + STOP_WAIT_S + PEERS_DONE_SLACK_S - self.loop.time()))
        self._closing = True
        fut = self._sync_fut
        if fut is not None and not fut.done():
            # Its _sync_done (confirms, after-sync callbacks) runs before we resume; none starts after.
            with contextlib.suppress(Exception):
                await fut
        # In a cluster a confirm promises the in-sync followers have the record: what waits on the
        # final sync below is confirmed once they acked it too (the node stops replication after its
        # shards), or not at all (its sender keeps it and sends it again).
        repl = self.repl
        repl_deadline = deadline + PEERS_DONE_SLACK_S + float(self.settings.get("replication_ack_timeout") or 3)
        self.data.flush()
        for q in self.queues.values():
            if isinstance(q, FeatureQueue) and q.count_returns:
                q.save_returns()
        after = self._after_sync
        self._after_sync = []
        for callback in after:  # the final sync below covers what they wait for
            callback()
        stores = self.dead_letters.all_stores() + [q.store for q in self.queues.values()] + self.delayed.all_stores()
        while True:
            # Publishes that waited for a group sync (a peer's forwards among them) are durable
            # after this one: confirm them, or their senders keep them and send them again after the
            # restart. What arrives during it gets one more.
            waiting, self._sync_waiting = self._sync_waiting, []
            for store in stores:
                store.flush_acks()
            target = repl.position() if repl is not None and repl.gating else -1  # what the sync covers
            await self.loop.run_in_executor(None, _sync_all, stores, True, self._stall_as)
            if target < 0 or await self._followers_acked(repl, target, repl_deadline):
                self._replicated(waiting, True)
            elif waiting:
                log.warning("shard %d: stopping with %d confirms the in-sync followers have not acked "
                            "(their senders keep the messages)", self.index, len(waiting))
            settled = False
            if not self._sync_waiting and self.forward_settle.in_flight() and self.loop.time() < deadline:
                # A forward that came during it (a dead letter into a dedup exchange we own, sent on
                # to a target, maybe our own ROUTER): its answer, then one more round for what that
                # answer wrote (a removed delay record, our own queue's copy). Ends: after settle
                # nothing is in flight or the deadline has passed.
                self.data.flush()
                await self.forward_settle.settle(max(0.0, deadline - self.loop.time()))
                settled = True
            if not self._sync_waiting and not settled:
                break
        self._flush_confirms()
        if repl is not None:
            # Our stream closes with the other shards' (shard/streams_close.py): the first one closed
            # ends the followers' session.
            for peer in self.peers.values():
                peer.put(None, [contract.PEER_DONE, streams_close.SYNCED])
            self.data.flush()
            late = await self.streams_close.wait(set(self.peers), repl_deadline - self.loop.time())
            if late:
                log.warning("shard %d: closing its replication stream before shards %s had their final state "
                            "acked by the followers", self.index, sorted(late))
            self.repl = None
            repl.close()  # a confirm still waiting is dropped, not nacked (_replicated): it was not refused
        for s in stores:
            s.close()
        self._write_idle_index()
        self.timers.close()
        self._sync_thread.close()  # no group sync starts after _closing (the final one ran above)
        self.delivery_faults.close()
        if self.ack_timeouts is not None:
            self.ack_timeouts.close()
        for peer in self.peers.values():
            peer.close()
        self.exchange_dedup.close()
        self.kv.close()
        self.data.close()
        self.node.close()
        dirty_stores.disable()
        log.info("shard %d stopped", self.index)
        self.stopped.set()


def _idle_dirs(queues: Iterable) -> dict[str, list[str]]:
    """vhost dir -> the directories of the queues whose stores never wrote a file (shard/idle_index.py)."""
    out: dict[str, list[str]] = {}
    for q in queues:
        store = getattr(q, "store", None)
        if type(store) is QueueStore and store.never_written:
            out.setdefault(store.path.rpartition("/")[0], []).append(store.path)
    return out


def _sync_all(stores: list[QueueStore], acks: bool = True, stall_as: str = "") -> None:
    """One group sync (worker thread); ``acks``: ack files and delivered marks too (QueueStore.sync);
    ``stall_as``: the shard's name for a test's stall file (broker/fsync_beacon.py)."""
    stall_for_tests("group", stall_as)
    for s in stores:
        # Only stores with something to make durable: a clean store's first sync would fsync its
        # name files and three parent dirs, 5 fsyncs for each of 100,000 idle queues at every stop.
        if s.dirty:
            s.sync(acks)
