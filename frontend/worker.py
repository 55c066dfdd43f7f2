"""The frontend process: node and shard sockets, client sessions of every protocol, per-turn flushing.

One FrontendWorker per process. It holds the local copy of the definitions
(kept current by DEFS from the node), routes items from shards to the client
connection they belong to, matches replies to requests, counts data batches in
flight per shard (back-pressure on publishers) and, once per loop turn and after
each read from a shard, lets every connection that produced output write it in one go.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from broker import contract, data_sockets, gc_pause, local_link, pair_defs, stage_trace
from broker.definitions import Definitions
from broker.defs_fence import catch_up, control_delay_for_tests_s, open_fence
from broker.heap_trim import HeapTrimmer
from broker.tls import reload_certificate, server_context
from broker.unixio import CONTROL_TURN_S, UnixDealer
from frontend.listeners import FORWARDED, LISTENERS, load
from frontend.proxy import ProxyProtocolListener
from frontend.session import CONNECTION_FORCED, Session
from frontend.stats import StatsReporter

log = logging.getLogger("shardmq.frontend")

Callback = Callable[[bool, Any], None]

_DELIVER = contract.DELIVER
_CONFIRM = contract.CONFIRM
_CONFIRM_NACK = contract.CONFIRM_NACK
_REPLY_DATA = contract.REPLY_DATA
_PROCESSED = contract.PROCESSED
_CANCEL_NOTIFY = contract.CANCEL_NOTIFY
_CLOSE_CHANNEL = contract.CLOSE_CHANNEL
_RETURN = contract.RETURN
_MAX_IN_FLIGHT = contract.MAX_BATCHES_IN_FLIGHT
_MAX_BYTES_IN_FLIGHT = contract.MAX_BYTES_IN_FLIGHT
_PUBLISH = contract.PUBLISH
_PUBLISH_RUN = contract.PUBLISH_RUN
_CONTROL_LANE_KINDS = contract.CONTROL_LANE_KINDS


class FrontendWorker:
    def __init__(self, index: int, run_dir: str, loop: asyncio.AbstractEventLoop,
                 ctx: zmq.Context | None = None) -> None:
        self.index = index
        self.run_dir = run_dir
        self.loop = loop
        self.bulk_changes = gc_pause.BulkChanges(loop)
        self.ctx = ctx or zmq.Context.instance()
        self.ident = contract.worker_id("frontend", index)
        self.defs = Definitions()
        # The definitions fence (broker/defs_fence.py): every session compares fence[0] with
        # defs_version before it handles what it read, and calls catch_up_defs when it is behind.
        self.defs_version = -1  # the version of self.defs: SNAPSHOT's, then each DEFS'
        self.fence = open_fence(run_dir)
        self._in_control = False  # handling a control-plane batch: no catch-up from inside it
        self._fence_gave_up = -1  # a version waited for in vain (node stuck or gone): not waited for again
        if local_link.paired_index() == index:  # our shard part may read our control stream (pair_defs.py)
            pair_defs.register_frontend(self)
        self.settings: dict = {}
        self.shard_count = 0
        self.epochs: list[int] = []
        self.shards: list[Any] = []  # publish lanes (BatchSocket or UnixDealer: broker/data_sockets.py)
        self.control: list[Any] = []  # control lanes (see contract.CONTROL_LANE_KINDS)
        self._sent: list[int] = []  # last batch_seq flushed per shard
        self._processed: list[int] = []  # highest batch_seq a shard answered with PROCESSED
        # Per shard: (batch_seq, bytes) of the publish-lane batches not answered yet, and their sum.
        self._unanswered: list[deque[tuple[int, int]]] = []
        self._bytes_in_flight: list[int] = []
        self._unsent_bytes: list[int] = []  # bodies put on a publish lane since its last send
        self.pressure = False  # a shard is behind: reading paused on publishing connections
        self.alarms: list[str] = []  # resource alarms in effect (node ALARMS): publishers are blocked
        self.stats_reporter = StatsReporter()  # STATS as deltas (frontend/stats.py)
        self.heap_trimmer = HeapTrimmer(loop, collect=True)  # memory back to the kernel after a wave of closes
        # Totals since this frontend started, reported in STATS (Prometheus' *_opened_total/_closed_total).
        self.counters = {"connections_opened": 0, "connections_closed": 0,
                         "publish_bytes_in_flight_peak": 0,  # the most bytes in flight to one shard
                         # the most bytes one AMQP connection was read in one loop turn (TURN_READ_BYTES)
                         "read_bytes_per_turn_peak": 0}
        # Publish totals for rabbitmq_global_messages_*: n_received is the one add per publish on
        # the plain path; the others are counted on paths that already branch (confirm mode, no
        # route) or once per confirm batch (frontend/amqp/channel.py emit_confirms).
        self.n_received = 0
        self.n_received_confirm = 0
        self.n_confirmed = 0
        self.n_unroutable_returned = 0
        self.n_unroutable_dropped = 0
        self.node: UnixDealer | None = None  # the control plane (broker/unixio.py)
        self.servers: list[asyncio.AbstractServer] = []
        self._forwarded: dict[str, Callable] = {}
        self._ws_runner: Any = None
        self.tls: Any = None  # the TLS listeners' ssl.SSLContext (broker/tls.py), None without a certificate
        self.conns: dict[int, Session] = {}
        # Connection ids count from this process's pid << 24 (the life token its data headers carry too):
        # a shard's answer for a connection of the frontend's earlier life (a confirm its running group
        # sync held when that life died, sent to our identity fe-N afterwards) names no connection of ours,
        # where ids restarting at 1 acked another connection's publish (tests/test_frontend_lives.py).
        # Under 2**53: ids stay exact as JSON numbers.
        self._next_conn = os.getpid() << 24
        self._next_req = 0
        self._node_pending: dict[int, Callback | None] = {}
        # req_id -> (shard, connection, callback)
        self._shard_pending: dict[int, tuple[int, Session, Callback, Callable[[int], list]]] = {}
        self._dirty: list[Session] = []
        # Node requests held back, in order: (shard, batch seq it must have processed, item); see
        # node_request (a queue.delete behind a publish still in flight to the queue's shard).
        self._held_requests: deque[tuple[int | None, int, list]] = deque()
        self._turn_scheduled = False
        self._turn_handle: asyncio.Handle | None = None  # the scheduled _end_of_turn, while _turn_scheduled
        self._early: list[int] = []  # shards idle when this read put a publish for them (send_early)
        # Restarted shards whose publish lane has not answered yet: their control-lane items wait here.
        self._control_held: dict[int, list] = {}
        self._snapshot: asyncio.Future = loop.create_future()
        self.stopped = asyncio.Event()
        self._stopping = False
        self._aborted = False  # stopped by abort(): as the process's death would (a fenced paired frontend)
        self._trace = stage_trace.get("frontend")  # --trace-stages (debug): None normally

    # ----------------------------------------------------------------- startup
    async def start(self) -> None:
        if self._aborted:
            return
        self.node = UnixDealer(self.loop, contract.node_stream_path(self.run_dir), self.ident, self._on_node)
        # A sliced commit (a vhost of 10,000 queues) is applied a few ms per loop turn at most, so
        # publishes to other queues go on between its slices (broker/node.py _commit).
        self.node.turn_s = CONTROL_TURN_S
        self.node.read_delay_s = control_delay_for_tests_s("frontend", self.ident.decode())
        self.node.on_drained = self._node_drained
        self.node.send_now(None, [[contract.HELLO, contract.VERSION, "frontend", self.index, os.getpid()]])
        snapshot = await self._snapshot
        if self._aborted:  # stopped while it waited (a fence during a promotion): no lane, no listener
            return
        version, epochs, settings = snapshot
        self.settings = settings
        self.shard_count = int(settings.get("shards", 1))
        self.epochs = [_epoch_of(epochs, i) for i in range(self.shard_count)]
        self._sent = [0] * self.shard_count
        self._processed = [0] * self.shard_count
        self._unanswered = [deque() for _ in range(self.shard_count)]
        self._bytes_in_flight = [0] * self.shard_count
        self._unsent_bytes = [0] * self.shard_count
        # Lane order (docs/architecture.md "Lanes"): control-lane items put per shard, and that count
        # when the last publish-lane item was put (the shard handles a publish-lane batch only after
        # that many control-lane items: an ack before a publish on a channel stays before it).
        self._ctl_put = [0] * self.shard_count
        self._pub_need = [0] * self.shard_count
        for i in range(self.shard_count):
            lane = data_sockets.shard_connection(self.loop, self.run_dir, i, self.ident, self._shard_handler(i),
                                                 self._header_for(i))
            lane.on_sent = self._sent_bytes(i)
            lane.on_drained = self._shard_drained
            if self._trace is not None:
                lane.set_trace(self._trace, "fe_deliver_in", "fe_publish_out", keep_in=True)
            self.shards.append(lane)
            self.control.append(data_sockets.shard_connection(
                self.loop, self.run_dir, i, self.ident + contract.CONTROL_LANE_SUFFIX, self._shard_handler(i),
                self._control_header_for(i)))
        await _held_for_tests()
        bind = settings.get("bind") or "0.0.0.0"
        tls = self.tls = server_context(settings)
        proxied = bool(settings.get("proxy_protocol"))
        for listener in LISTENERS:
            port = int(settings.get(listener.port_setting, 0) or 0)
            if not port or (listener.tls and tls is None):
                continue
            ctx = tls if listener.tls else None
            factory = self._protocol_factory(load(listener.session), proxied, ctx)
            server = await self.loop.create_server(  # with PROXY, TLS goes on after the header
                factory, host=bind, port=port, reuse_port=True, backlog=1024, ssl=None if proxied else ctx)
            if self._aborted:
                server.close()
                return
            self.servers.append(server)
            log.info("frontend %d (pid %d) listening for %s on %s:%d", self.index, os.getpid(),
                     listener.protocol, bind, port)
        ws_port = int(settings.get("ws_port", 0) or 0)
        wss_port = int(settings.get("wss_port", 0) or 0) if tls is not None else 0
        if ws_port or wss_port:
            from frontend.ws_listener import LazyWebSocket  # aiohttp comes on the first WebSocket connection

            self._ws_runner = LazyWebSocket(self)
            await self._ws_runner.listen(bind, ws_port, wss_port, tls)
            if self._aborted:
                await self._ws_runner.cleanup()
                return
            log.info("frontend %d (pid %d) listening for websocket on %s:%d%s", self.index, os.getpid(), bind,
                     ws_port, f" and over TLS on {wss_port}" if wss_port else "")
        # The snapshot's APPLIED only once every listener is bound: the node's health checks
        # (/api/health/checks/ready and /leader) turn 200 on it, and a load balancer or a client that
        # goes by them found the port refusing connections while the listeners were still being made.
        self.node.put(None, [contract.APPLIED, version])
        self._send_stats()

    def _send_stats(self) -> None:
        """Connections, channels and consumers for the node's management API, once per stats_interval."""
        if self._stopping:
            return
        try:
            self.node.put(None, [contract.STATS, self.stats_reporter.report(self)])
        except Exception:
            log.exception("frontend %d: stats report failed", self.index)
        self.loop.call_later(int(self.settings.get("stats_interval") or 5000) / 1000, self._send_stats)

    def _protocol_factory(self, session: Callable, proxied: bool, tls: Any = None) -> Callable[[], asyncio.Protocol]:
        """What asyncio calls per accepted connection: the session, or the PROXY header reader before it."""
        def make_session() -> asyncio.Protocol:
            return session(self)

        if not proxied:
            return make_session
        return lambda: ProxyProtocolListener(make_session, self.loop, tls)

    def reload(self) -> None:
        """SIGHUP: re-read the TLS certificate files without dropping established connections."""
        if self.tls is None:
            return
        try:
            reload_certificate(self.tls, self.settings)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            log.error("frontend %d: TLS certificate not reloaded, keeping the old one: %s", self.index, exc)
            return
        log.info("frontend %d: TLS certificate reloaded", self.index)

    def _header_for(self, shard: int) -> Callable[[bytes | None], list]:
        sent = self._sent
        token = os.getpid()  # tells this process's counts from an earlier frontend's with our identity

        def header(_dest: bytes | None) -> list:
            seq = sent[shard] + 1
            sent[shard] = seq
            if seq - self._processed[shard] > _MAX_IN_FLIGHT and not self.pressure:
                self._set_pressure(True)
            return [self.epochs[shard], seq, self._pub_need[shard], token]

        return header

    def _sent_bytes(self, shard: int) -> Callable[[int], None]:
        unanswered = self._unanswered[shard]
        in_flight = self._bytes_in_flight
        sent = self._sent
        counters = self.counters

        unsent = self._unsent_bytes

        def on_sent(n: int) -> None:
            unsent[shard] = 0
            unanswered.append((sent[shard], n))
            total = in_flight[shard] = in_flight[shard] + n
            if total > counters["publish_bytes_in_flight_peak"]:
                counters["publish_bytes_in_flight_peak"] = total
            if total > _MAX_BYTES_IN_FLIGHT and not self.pressure:
                self._set_pressure(True)

        return on_sent

    def _answered(self, shard: int, seq: int) -> None:
        """PROCESSED up to ``seq``: those batches' bytes are no longer in flight."""
        unanswered = self._unanswered[shard]
        freed = 0
        while unanswered and unanswered[0][0] <= seq:
            freed += unanswered.popleft()[1]
        self._bytes_in_flight[shard] -= freed

    def _control_header_for(self, shard: int) -> Callable[[bytes | None], list]:
        epochs = self.epochs
        ctl_put = self._ctl_put
        token = os.getpid()
        return lambda _dest: [epochs[shard], None, ctl_put[shard], token]

    def debug_state(self) -> dict:
        return {"pressure": self.pressure, "sent": list(self._sent), "processed": list(self._processed),
                "bytes_in_flight": list(self._bytes_in_flight),
                "connections": len(self.conns), "shard_pending": len(self._shard_pending),
                "node_pending": len(self._node_pending)}

    # -------------------------------------------------------------- node side
    def fence_check(self) -> None:
        """Before routing what no data_received brought (an MQTT will): the definitions fence."""
        if self.fence[0] > self.defs_version:
            self.catch_up_defs()

    def catch_up_defs(self) -> None:
        """The fence is ahead of our definitions: apply the control plane up to it now, before the
        caller (a session, about to handle what it read) routes anything (broker/defs_fence.py)."""
        if self._in_control or self.node is None:
            return  # inside _on_node (a REPLY's callback): that batch's DEFS come first; read time checked
        self._fence_gave_up = catch_up(self.node, self.fence, lambda: self.defs_version, self._fence_gave_up,
                                       f"frontend {self.index}")

    def _on_node(self, _ident: bytes | None, _header: Any, items: list) -> int:
        self._in_control = True
        try:
            return self._on_node_items(items)
        finally:
            self._in_control = False

    def _on_node_items(self, items: list) -> int:
        applied = None  # one APPLIED per batch, for its newest DEFS (pipelined declares bring many)
        ack = False  # the batch has DEFS that are not only the copy sent with our own request's REPLY
        weight = len(items)  # what this batch counts against the turn's read budget (broker/unixio.py)
        for item in items:
            kind = item[0]
            try:
                if kind == contract.REPLY:
                    cb = self._node_pending.pop(item[1], None)
                    if cb is not None:
                        cb(item[2], item[3])
                elif kind == contract.DEFS:
                    if len(item) > 4 and item[4]:
                        # Our shard part's copy too (broker/pair_defs.py): handed over first, so an op
                        # that fails to apply here does not keep it from the shard part.
                        pair_defs.hand_over(item[1], item[2])
                    # The version first: an op that fails to apply must not leave the fence waiting.
                    applied = self.defs_version = item[1]
                    defs = self.defs
                    self.bulk_changes.note(len(item[2]))  # no full GC during a bulk (broker/gc_pause.py)
                    for op in item[2]:
                        defs.apply(op)
                    ack = ack or len(item) < 4 or item[3]
                    weight += len(item[2])
                elif kind == contract.SNAPSHOT:
                    if not self._snapshot.done():
                        # Loaded here, not where start() awaits it: DEFS in the frames behind it are
                        # applied on top of it, in this same read.
                        with gc_pause.paused():  # see broker/gc_pause.py
                            self.defs = Definitions.from_dict(item[2])
                        gc_pause.settle()
                        self.defs_version = item[1]
                        self._snapshot.set_result((item[1], item[3], item[4]))
                elif kind == contract.SHARD_UP:
                    self._shard_up(int(item[1]), int(item[2]))
                elif kind == contract.CLOSE_CONNECTIONS:
                    vhost, code, text = item[1], item[2], item[3]
                    user, conn_id = (item[4], item[5]) if len(item) > 5 else (None, None)
                    for conn in list(self.conns.values()):
                        if ((vhost is None or conn.vhost == vhost)
                                and (user is None or getattr(conn, "user", None) == user)
                                and (conn_id is None or conn.conn_id == conn_id)):
                            conn.fail(code, text)
                elif kind == contract.ALARMS:
                    self.alarms = list(item[1])
                    for conn in list(self.conns.values()):
                        apply = getattr(conn, "apply_alarms", None)  # sessions that publish block on alarms
                        if apply is not None:
                            apply()
                elif kind == contract.FORWARDED:
                    payload = item[1]
                    handler = self._forwarded.get(payload[0])
                    if handler is None and payload[0] in FORWARDED:
                        handler = self._forwarded[payload[0]] = load(FORWARDED[payload[0]])
                    if handler is not None:
                        handler(self, *payload[1:])
                elif kind == contract.QUERY:
                    if item[2] == "stats_full":  # the node lost track of our rows (a seq gap); no reply
                        self.stats_reporter.full_next = True
                elif kind == contract.STOP:
                    self.loop.create_task(self.stop())
            except Exception:
                log.exception("frontend %d: failed to handle node item kind %r", self.index, kind)
        if ack:
            self.node.put(None, [contract.APPLIED, applied])
        return weight

    def node_request(self, op: str, args: dict, callback: Callback | None) -> None:
        self._next_req += 1
        req_id = self._next_req
        self._node_pending[req_id] = callback
        item = [contract.REQUEST, req_id, op, args]
        held = self._held_requests
        if op == "queue.delete" and not held:
            # delete-ok counts the queue's messages: the node asks its shard over the control plane,
            # which may overtake a publish to it still on our publish lane (a publish right before
            # the delete on the same channel). The request waits until the shard has PROCESSED
            # every batch sent (or about to be sent, this turn) to it: no wait when none is in flight.
            q = self.defs.queue(args.get("vhost", "/"), args.get("queue", ""))
            if q is not None and q.shard < self.shard_count:
                need = self._sent[q.shard] + (1 if self.shards[q.shard]._pending else 0)
                if self._processed[q.shard] < need:
                    held.append((q.shard, need, item))
                    return
        if held:  # requests reach the node in the order made (a channel's chain, request_chains.py)
            held.append((None, 0, item))
            return
        self.node.put(None, item)

    def _release_requests(self) -> None:
        """Send the held node requests whose shard has processed what they wait for, in order."""
        held = self._held_requests
        while held:
            shard, need, item = held[0]
            if shard is not None and self._processed[shard] < need:
                return
            held.popleft()
            self.node.put(None, item)

    def _shard_up(self, shard: int, epoch: int) -> None:
        if shard >= self.shard_count or self.epochs[shard] == epoch:
            return
        self.epochs[shard] = epoch
        log.info("frontend %d: shard %d restarted (epoch %d)", self.index, shard, epoch)
        self._ctl_put[shard] = self._pub_need[shard] = 0  # the new incarnation has seen none
        # Nothing more will come back for batches the old incarnation had.
        self._processed[shard] = self._sent[shard]
        self._answered(shard, self._sent[shard])
        self._release_requests()
        self._update_pressure()
        # Connections stay open (frontend/amqp/shard_loss.py): what they had in flight there is settled...
        for conn in list(self.conns.values()):
            conn.shard_lost(shard)
        # ...and requests the old incarnation never answered go to the new one (get, consume, purge,
        # queue counts: the restarted shard has recovered the queue by the time it reads them).
        for req_id, (s, _conn, _cb, build) in list(self._shard_pending.items()):
            if s == shard:
                self.shard_put(shard, build(req_id))
        self._probe_publish_lane(shard, epoch)

    def _probe_publish_lane(self, shard: int, epoch: int) -> None:
        """Hold control-lane items for a restarted shard until its publish lane answers.

        A shard replies and delivers to our publish-lane identity, and its ROUTER silently drops what
        it sends to an identity whose DEALER has not reconnected yet. The two lanes reconnect
        independently, so a consume sent on the control lane could be answered (and its messages
        delivered) into the void. The first reply on the publish lane proves it is connected.
        """
        if self.epochs[shard] != epoch or self.stopped.is_set():
            return
        self._control_held.setdefault(shard, [])

        def answered(_ok: bool, _result: Any) -> None:
            if self.epochs[shard] != epoch:
                return
            held = self._control_held.pop(shard, None)
            for item in held or ():
                self.control[shard].put(None, item)

        self._next_req += 1
        req_id = self._next_req
        probe = [contract.QUEUE_INFO, req_id, "", ""]  # no such queue: a 404 reply, nothing else
        self._shard_pending[req_id] = (shard, None, answered, lambda _r: probe)
        self.shards[shard].put(None, probe)

        def again() -> None:
            # A probe written to the dead incarnation's connection is lost: ask again until answered.
            if shard in self._control_held and self.epochs[shard] == epoch:
                self._shard_pending.pop(req_id, None)
                self._probe_publish_lane(shard, epoch)

        self.loop.call_later(0.5, again)

    # ------------------------------------------------------------- shard side
    def shard_put(self, shard: int, item: list) -> None:
        kind = item[0]
        if kind != _PUBLISH and kind in _CONTROL_LANE_KINDS:
            if self._control_held:
                held = self._control_held.get(shard)
                if held is not None:
                    held.append(item)
                    return
            self._ctl_put[shard] += 1  # before put: a full batch is sent inside it, counting this item
            self.control[shard].put(None, item)
        else:
            if kind == _PUBLISH:
                # Bytes are checked as publishes come in, not only when the batch leaves: one loop
                # turn can read megabytes per connection (libuv reads a socket up to 32 times).
                n = self._unsent_bytes[shard] = self._unsent_bytes[shard] + len(item[6])
                if n + self._bytes_in_flight[shard] > _MAX_BYTES_IN_FLIGHT and not self.pressure:
                    self._set_pressure(True)
                self._pub_need[shard] = self._ctl_put[shard]
                self.shards[shard].put(None, item)
            elif kind == _PUBLISH_RUN:
                # As many messages as it has bodies: their bytes, and their number in the batch
                # (put_weighted), so batches in flight bound messages as with single PUBLISH items.
                bodies = item[6]
                n = self._unsent_bytes[shard] = self._unsent_bytes[shard] + sum(map(len, bodies))
                if n + self._bytes_in_flight[shard] > _MAX_BYTES_IN_FLIGHT and not self.pressure:
                    self._set_pressure(True)
                self._pub_need[shard] = self._ctl_put[shard]
                self.shards[shard].put_weighted(None, item, len(bodies))
            else:
                self._pub_need[shard] = self._ctl_put[shard]
                self.shards[shard].put(None, item)
                return
            if self._sent[shard] == self._processed[shard] and shard not in self._early:
                self._early.append(shard)  # sent at the end of this read (send_early)

    def send_early(self) -> None:
        """End of a client read that put publishes for a shard with nothing in flight: send them now.

        The shard has answered every batch, so it is idle: the publishes read in one go (a burst is
        one batch still) leave at the end of the read rather than of the loop turn, and what the
        turn still does after that (end-of-turn callbacks, other connections' flushes) no longer
        delays them. While batches are in flight (a busy shard) publishes wait for the turn's end as
        before, so saturation batches as much as ever. Control-lane items put before them go first:
        the shard would hold the publish batch until it has them (docs/architecture.md "Lanes").
        """
        early = self._early
        self._early = []
        for shard in early:
            if self._sent[shard] == self._processed[shard]:
                control = self.control[shard]
                if control._pending:
                    control.send_pending()
                self.shards[shard].send_pending()

    def shard_request(self, shard: int, build: Callable[[int], list], conn: Session,
                      callback: Callback) -> None:
        self._next_req += 1
        req_id = self._next_req
        self._shard_pending[req_id] = (shard, conn, callback, build)
        self.shard_put(shard, build(req_id))

    def _shard_handler(self, shard: int) -> Callable[[bytes | None, Any, list], None]:
        return lambda _ident, _header, items: self._on_shard(shard, items)

    def _on_shard(self, shard: int, items: list) -> None:
        conns = self.conns
        i = 0
        n = len(items)
        while i < n:
            item = items[i]
            i += 1
            try:
                kind = item[0]
                if kind == _DELIVER:
                    conn = conns.get(item[1])
                    if conn is None:
                        continue
                    # A run of deliveries for one consumer (a shard's delivery pass) goes to the
                    # session whole, to be encoded in one pass (issue #15); sessions without
                    # on_deliver_run (MQTT) get them one by one, as before.
                    j = i
                    # A run needs a DELIVER next (a lone message's batch is DELIVER, PROCESSED).
                    on_run = getattr(conn, "on_deliver_run", None) if i < n and items[i][0] == _DELIVER else None
                    if on_run is not None:
                        conn_id = item[1]
                        lane = item[2]
                        ctag = item[3]
                        while j < n:
                            nxt = items[j]
                            if nxt[0] != _DELIVER or nxt[3] != ctag or nxt[2] != lane or nxt[1] != conn_id:
                                break
                            j += 1
                    if j == i:
                        conn.on_deliver(shard, item)
                    else:
                        run = items[i - 1:j]
                        i = j
                        on_run(shard, run)
                elif kind == _PROCESSED:  # in every batch a shard sends: tested before the rarer kinds
                    if item[1] > self._processed[shard]:
                        self._processed[shard] = item[1]
                        self._answered(shard, item[1])
                        if self._held_requests:
                            self._release_requests()
                        if self.pressure:
                            self._update_pressure()
                elif kind == _CONFIRM or kind == _CONFIRM_NACK:
                    conn = conns.get(item[1])
                    if conn is not None:
                        conn.on_confirm(item[2], item[3], kind == _CONFIRM)
                elif kind == _REPLY_DATA:
                    pending = self._shard_pending.pop(item[1], None)
                    if pending is not None:
                        pending[2](item[2], item[3])
                elif kind == _CANCEL_NOTIFY:
                    conn = conns.get(item[1])
                    if conn is not None:
                        conn.on_cancel_notify(item[2], item[3])
                elif kind == _CLOSE_CHANNEL:
                    conn = conns.get(item[1])
                    if conn is not None:
                        conn.on_close_channel(item[2], item[3], item[4])
                elif kind == _RETURN:
                    conn = conns.get(item[1])
                    if conn is not None:
                        conn.on_return(item[2], item)
            except Exception as exc:
                conn = conns.get(item[1]) if len(item) > 1 and isinstance(item[1], int) else None
                if conn is not None and item[0] != _PROCESSED and item[0] != _REPLY_DATA:
                    conn.internal_error(exc)
                else:
                    log.exception("frontend %d: failed to handle shard %d item %r", self.index, shard, item[:1])

    def _shard_drained(self) -> None:
        """The batches of one read from a shard are handled (unix data plane): their deliveries and
        confirms are written to the clients now, not after the rest of the loop turn (its other
        callbacks, other sockets). At a steady rate that read is all the turn carries, and what runs
        after it would only delay the client; a flood still writes once per read."""
        if self._dirty:
            self._end_turn_now()

    def _node_drained(self) -> None:
        """The batches of one read from the node are handled: the replies they carried (a bind-ok)
        are written to the clients now. In a paired process the shard part's copy of the same DEFS
        is read from its own socket in this loop turn too; it need not delay the client (on two
        cores the client runs while the shard applies them)."""
        if self._dirty:
            self._end_turn_now()

    # ---------------------------------------------------------- back-pressure
    def _set_pressure(self, on: bool) -> None:
        self.pressure = on
        for conn in self.conns.values():
            if not on:
                conn.resume_reading("pressure")
            elif conn.publisher:  # consumers keep being read: their acks are what relieves the shard
                conn.pause_reading("pressure")

    def _update_pressure(self) -> None:
        sent = self._sent
        processed = self._processed
        in_flight = self._bytes_in_flight
        behind = any(sent[i] - processed[i] > _MAX_IN_FLIGHT or in_flight[i] > _MAX_BYTES_IN_FLIGHT
                     for i in range(self.shard_count))
        if behind != self.pressure:
            self._set_pressure(behind)

    # ------------------------------------------------------------ connections
    def new_conn_id(self) -> int:
        self._next_conn += 1
        return self._next_conn

    def add_connection(self, conn: Session) -> None:
        self.conns[conn.conn_id] = conn
        self.counters["connections_opened"] += 1
        if self._aborted:  # accepted before abort() (a PROXY header or TLS handshake was under way)
            _drop(conn)
        elif self._stopping:
            conn.fail(CONNECTION_FORCED, "broker shutdown")

    def remove_connection(self, conn: Session) -> None:
        if self.conns.pop(conn.conn_id, None) is not None:
            self.counters["connections_closed"] += 1
            self.heap_trimmer.closed()

    def mark_dirty(self, conn: Session) -> None:
        self._dirty.append(conn)
        if not self._turn_scheduled:
            self._turn_scheduled = True
            self._turn_handle = self.loop.call_soon(self._end_of_turn)

    def _end_turn_now(self) -> None:
        """``_end_of_turn`` before its callback: the callback, which would find nothing dirty, is
        cancelled (at a steady rate that empty callback was a fixed cost of every delivery); what is
        marked dirty later in the turn schedules its own."""
        if self._turn_scheduled:
            self._turn_handle.cancel()  # type: ignore[union-attr]
        self._end_of_turn()

    def _end_of_turn(self) -> None:
        self._turn_scheduled = False
        if self._trace is not None:  # stamped before the writes: the client may read them at once
            self._trace.mark_pending("fe_write")
        dirty = self._dirty
        self._dirty = []
        for conn in dirty:
            try:
                conn.flush_turn()
            except Exception as exc:
                conn.internal_error(exc)

    # ------------------------------------------------------------------ stop
    def abort(self) -> None:
        """Stop now, as this process's death would, while the process lives on: a paired frontend
        (--colocate) that a fenced cluster leader stops (contract.FRONTEND_STOP_SIGNAL) while the
        shard part of its process goes on streaming to the followers.

        What clients see is what a SIGKILLed frontend process shows them: the listeners close and
        every connection is cut at once (no connection.close, no wait for close-ok; the kernel sends
        FIN, or RST with unread input), so a client reconnects elsewhere. From this call on nothing
        reaches a client: the sessions' transports are closed (late writes go nowhere), and the lanes
        to the shards and the connection to the node close too (a batch put in this turn still goes,
        as one already in a socket would after a kill), so no confirm or delivery is read any more.
        """
        if self._aborted:
            return
        self._aborted = True
        self._stopping = True
        for server in self.servers:
            server.close()
        for conn in list(self.conns.values()):
            _drop(conn)
        for sock in (*self.shards, *self.control):
            sock.close()
        if self.node is not None:
            self.node.close()
        if not self._snapshot.done():
            self._snapshot.set_result(None)  # start() waits for it: it returns now, listening on nothing
        if self._ws_runner is not None:
            self.loop.create_task(self._ws_runner.cleanup())  # its listeners (its sessions are cut above)
        log.warning("frontend %d (pid %d) stopped at the node's request: listeners and client connections "
                    "closed; the process goes on", self.index, os.getpid())
        self.stopped.set()

    async def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        for server in self.servers:
            server.close()
        if self._ws_runner is not None:
            await self._ws_runner.shutdown()
        for conn in list(self.conns.values()):
            conn.fail(CONNECTION_FORCED, "broker shutdown")
        self._end_of_turn()
        # Give clients a moment to answer close-ok so they see a clean close, not a reset.
        deadline = self.loop.time() + 1.0
        while self.conns and self.loop.time() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self.conns.values()):
            if conn.transport is not None:
                conn.transport.close()
        if self._ws_runner is not None:
            await self._ws_runner.cleanup()
        for sock in (*self.shards, *self.control):
            sock.close()
        if self.node is not None:
            self.node.close()
        log.info("frontend %d stopped", self.index)
        self.stopped.set()


def _drop(conn: Session) -> None:
    """Cut a client connection without a word, as the process's death would (FrontendWorker.abort)."""
    transport = conn.transport
    if transport is not None:
        drop = getattr(transport, "drop", None)  # a WebSocket's: the TCP connection under it
        (drop or transport.abort)()


_HOLD_LISTEN_PATH = os.environ.get("SHARDMQ_TEST_HOLD_LISTEN_WHILE") or None


async def _held_for_tests() -> None:
    """Fault injection for tests only: while SHARDMQ_TEST_HOLD_LISTEN_WHILE's path exists, a frontend
    that has its snapshot waits before it binds its listeners (tests/test_ready_listening.py)."""
    if _HOLD_LISTEN_PATH is None or not os.path.exists(_HOLD_LISTEN_PATH):
        return
    log.warning("frontend: listeners held while %s exists (SHARDMQ_TEST_HOLD_LISTEN_WHILE)", _HOLD_LISTEN_PATH)
    while os.path.exists(_HOLD_LISTEN_PATH):
        await asyncio.sleep(0.02)


def _epoch_of(epochs: Any, index: int) -> int:
    if isinstance(epochs, dict):
        return int(epochs.get(index, epochs.get(str(index), 0)))
    if isinstance(epochs, list | tuple) and index < len(epochs):
        return int(epochs[index])
    return 0
