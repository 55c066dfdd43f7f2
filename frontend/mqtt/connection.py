"""One MQTT 3.1.1 client connection: CONNECT, sessions, QoS 0/1/2 both ways, subscriptions, retained, will.

An asyncio.Protocol around the sans-IO ``MQTTParser``; a ``frontend.session.Session``
for the worker. Packets are handled strictly in order: a packet that needs the node
(declare, bind) or a shard (session state, retained messages) blocks the ones behind
it until the reply, so a PUBLISH after a SUBACK routes through the new binding. The
plain PUBLISH path does not wait for anything.

The session's messages wait in one queue bound to ``amq.topic`` with a binding per
subscription, so overlapping subscriptions yield one copy; the QoS it is delivered
with is min(publish QoS, highest granted QoS of the matching subscriptions). A clean
session uses an exclusive transient queue; a persistent one (clean session 0) the
durable queue ``mqtt-subscription-<client id>qos1`` plus a record in the session
store on a shard (granted QoS per filter, QoS 2 packet ids in flight both ways), so
they survive a reconnect and a node restart. See docs/mqtt.md.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from broker import contract
from broker.amqp.errors import AMQPError
from broker.auth import check_password, is_loopback_peer, user_can_access_vhost
from broker.mqtt import codec as M
from broker.mqtt.topics import (
    filter_to_key,
    key_to_topic,
    matches,
    topic_to_key,
    valid_topic_filter,
    valid_topic_name,
)
from broker.permissions import READ, Access
from broker.tls import peer_common_name
from frontend.mqtt.direct import DROP_BYTES, DROP_QUEUED, SLOW_AFTER, TURN_PACKETS, direct_queues
from frontend.mqtt.messages import (
    EXCHANGE,
    INBOUND2,
    OUTBOUND2,
    PROPS,
    RETAINED,
    SESSIONS,
    qos_of,
    retained_shard,
    session_queue,
    session_shard,
    transient_queue,
)
from frontend.paused_credit import START_WINDOW, give_back_step, keeps_up, take_back
from frontend.publish import put_marked_publish, put_publish, queues_by_shard
from frontend.session import CONNECTION_FORCED

if TYPE_CHECKING:
    from frontend.worker import FrontendWorker

log = logging.getLogger("shardmq.mqtt")

# A packet identifier's two bytes. A struct call, not a table of all 65,536 encoded once: that
# list held 2.7 MB in every frontend, with or without MQTT clients.
_PID = struct.Struct(">H").pack
LANE = 1  # the contract's channel number for everything of an MQTT connection
# The session queue's consumer: without acks while every subscription is QoS 0 (the shard settles
# at delivery, no ack round trip bounds the rate), with acks and the in-flight limit as prefetch once
# one is QoS 1/2. Two tags, so a delivery says which consumer it came from across a switch.
TAG_NO_ACK = "mqtt-qos0"
TAG_ACK = "mqtt-qos1"
CONNECT_TIMEOUT = 10.0
BACKLOG_PAUSE = 10_000

CONNECTING = 0
RUNNING = 1
CLOSED = 2

_ACK = contract.ACK
_CREDIT = contract.CREDIT
_CREDIT_SHIFT = contract.CREDIT_BYTES_SHIFT
_KV_PUT = contract.KV_PUT
_KV_GET = contract.KV_GET
_UNMARK = contract.UNMARK
_MARKED_ACK = contract.MARKED_ACK



class MQTTConnection(asyncio.Protocol):
    def __init__(self, worker: FrontendWorker) -> None:
        self.worker = worker
        self.conn_id = worker.new_conn_id()
        settings = worker.settings
        self.max_inflight = int(settings.get("mqtt_max_inflight", 1000))
        self.parser = M.MQTTParser(int(settings.get("mqtt_max_packet_size", 134217728)))
        self.transport: asyncio.Transport | None = None
        self.peer: Any = None
        self.state = CONNECTING
        self.vhost = "/"
        self.user = ""
        self.access = Access("", "/")  # the user's permission checks, set at CONNECT
        self.client_id = ""
        # What the management API lists for a connection (frontend/stats.py reads these).
        self.client_properties: dict = {"product": "MQTT client", "protocol": "MQTT 3.1.1"}
        self.connected_at = int(time.time() * 1000)
        # Bytes read from / written to the transport (RabbitMQ's recv_oct / send_oct): one add per
        # socket read and per turn's write, nothing per packet.
        self.recv_oct = 0
        self.send_oct = 0
        self.clean = True
        self.publisher = False
        self.will: M.Publish | None = None
        self.keep_alive = 0
        self.subs: dict[str, int] = {}  # filter -> granted QoS
        self.queue: str | None = None
        self.queue_shard: int | None = None
        self.consuming = False
        self.shards: set[int] = set()  # shards that may hold state of this connection
        self.registered = False  # counted by the node (connection.open)
        # inbound QoS 1/2 publishes waiting for shard confirms / store writes: seq -> [remaining, qos, pid]
        self._pending: dict[int, list] = {}
        self._next_seq = 1
        self.in2: set[int] = set()  # QoS 2 packet ids received, PUBREL not yet
        # outbound: pid -> (shard|None, qid, mid, qos) sent, not acknowledged; out2: PUBREC seen, PUBCOMP not yet
        self.inflight: dict[int, tuple] = {}
        self.out2: set[int] = set()
        # persistent sessions: queue message id -> packet id of a QoS 2 PUBLISH sent and not yet PUBREC'd, so
        # one sent again after a reconnect or restart keeps its packet identifier [MQTT-4.4.0-1]
        self.pub2: dict[int, int] = {}
        self._next_pid = 0
        self._sub_cache: dict[str, int] = {}
        self._key_cache: dict[str, str] = {}  # topic -> routing key of this connection's publishes
        # Per publish QoS: topic -> routing plan (_plan), valid while the definitions and the frontend's
        # directly served sessions (frontend/mqtt/direct.py) are unchanged.
        self._routes: tuple[dict, dict, dict] = ({}, {}, {})
        self._direct = direct_queues(worker)
        self.direct = False  # this (clean) session is served directly (frontend/mqtt/direct.py)
        self._waiting: deque = deque()  # direct QoS 1/2 messages beyond the in-flight window: (head, payload, qos)
        self._progress = 0  # acknowledgements from the client (a held session that acks is not stuck)
        self.dropped = 0  # QoS 0 messages dropped because the client did not keep up (direct.py)
        self._holding: set[MQTTConnection] = set()  # publishers paused until our writing resumes (direct.py)
        self._hold_reason = f"subscriber {self.conn_id}"
        self._slow = False
        self._slow_timer: asyncio.TimerHandle | None = None
        self._slow_mark: Any = -1  # (bytes waiting in the transport, -acks) at the last look; -1: none yet
        self._topic_cache: dict[str, tuple[str, bytes]] = {}
        self._out: list[bytes] = []
        self._dirty = False
        self._acks: dict[int, list] = {}
        self._credit: dict[tuple[int, str], int] = {}
        self._taken: dict[tuple[int, int, str], int] | None = None  # credit taken back while paused
        self.consumer_tag: str | None = None
        self._backlog: deque = deque()
        self._busy = False
        self._read_pause: set[str] = set()
        self._write_paused = False
        self._received = False
        self._timer: asyncio.TimerHandle | None = None
        self._graceful = False  # DISCONNECT received: no will
        self._released = False
        self._close_after_flush = False

    # ------------------------------------------------------------- transport
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.peer = transport.get_extra_info("peername")
        self.worker.add_connection(self)
        self._timer = self.worker.loop.call_later(CONNECT_TIMEOUT, self._connect_timeout)

    def data_received(self, data: bytes) -> None:
        if self.state == CLOSED or self._close_after_flush:
            return  # closing: nothing the client sends counts any more
        worker = self.worker
        if worker.fence[0] > worker.defs_version:  # definitions fence: broker/defs_fence.py
            worker.catch_up_defs()
            if self.state == CLOSED or self._close_after_flush:
                return  # the node closed us (CLOSE_CONNECTIONS) in what it read
        self._received = True
        self.recv_oct += len(data)
        try:
            packets = self.parser.feed(data)
        except M.MQTTProtocolError as exc:
            self._protocol_error(str(exc))
            return
        except Exception as exc:  # the parser raises only MQTTProtocolError; still never a crash
            self.internal_error(exc)
            return
        try:
            for packet in packets:
                if self._busy or self._backlog:
                    self._backlog.append(packet)
                    if len(self._backlog) > BACKLOG_PAUSE:
                        self.pause_reading("backlog")
                    continue
                self._handle(packet)
                if self.state == CLOSED or self._close_after_flush:
                    return
            if self._waiting and len(self.inflight) < self.max_inflight:
                self._send_waiting()  # once per read, not per acknowledgement
        except M.MQTTProtocolError as exc:
            self._protocol_error(str(exc))
        except Exception as exc:
            self.internal_error(exc)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        was = self.state
        self.state = CLOSED
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if was == RUNNING and not self._graceful and self.will is not None:
            try:
                self._publish_will()
            except Exception:
                log.exception("mqtt connection %s: publishing the will failed", self.conn_id)
        self._release()
        self._out = []
        self.worker.remove_connection(self)

    def pause_writing(self) -> None:
        self._write_paused = True
        self._take_back_credit()

    def _take_back_credit(self, keep: int = 0) -> None:
        """The client stopped reading: the shard keeps what it has not sent (frontend/paused_credit.py).
        At the pause (all of it), and after a CONSUME (all but ``keep``: START_WINDOW, or 0 while paused)."""
        if self.state != CLOSED:
            consumers = []
            if self.consuming and self.consumer_tag is not None and self.queue_shard is not None:
                key = (self.queue_shard, LANE, self.consumer_tag)
                consumers.append((key, self._credit.get((self.queue_shard, self.consumer_tag), 0)))
            if self._taken is None:
                self._taken = {}
            take_back(self.worker.shard_put, self.conn_id, consumers, self._taken, keep)

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._taken is not None:
            self._give_back()
        self._slow = False
        if (self._holding or self._slow_timer is not None) and not self._waiting:
            self._let_go()
        if self._credit:
            self._mark_dirty()

    def _give_back(self, moved: set | None = None) -> None:
        """At resume, and after a turn that wrote deliveries (``moved``: for whom): a step of the credit
        taken back (frontend/paused_credit.py give_back_step)."""
        self._taken = give_back_step(self.worker.shard_put, self.conn_id, self._taken, self.state != CLOSED,
                                     keeps_up(self.transport, self.send_oct), moved)

    def _let_go(self) -> None:
        """Resume the publishers this (directly served) session held."""
        self._slow_mark = -1
        if self._slow_timer is not None:
            self._slow_timer.cancel()
            self._slow_timer = None
        reason = self._hold_reason
        for publisher in self._holding:
            publisher.resume_reading(reason)
        self._holding.clear()

    def _too_slow(self) -> None:
        """Every SLOW_AFTER s while we hold publishers: did the client read or acknowledge anything since?"""
        self._slow_timer = None
        if self.state != RUNNING or self.transport is None or not (self._write_paused or self._waiting):
            return
        mark = (self.transport.get_write_buffer_size(), -self._progress)
        if self._slow_mark == -1 or mark < self._slow_mark:  # it goes on, only slower than they publish
            self._slow_mark = mark
            self._slow_timer = self.worker.loop.call_later(SLOW_AFTER, self._too_slow)
            return
        log.warning("mqtt connection %s (%s): client '%s' has not read or acknowledged anything for %.0fs; "
                    "no longer holding publishers: beyond %d bytes its QoS 0 messages are dropped, beyond %d "
                    "waiting its QoS 1/2 ones", self.conn_id, self.peer, self.client_id, SLOW_AFTER, DROP_BYTES,
                    DROP_QUEUED)
        self._slow = True
        self._let_go()

    def apply_alarms(self) -> None:
        """A resource alarm (worker.alarms) blocks a publishing connection: it is not read until it clears.
        MQTT 3.1.1 has no way to tell the client (AMQP's connection.blocked)."""
        if self.state == CLOSED:
            return
        if self.worker.alarms and self.publisher:
            self.pause_reading("alarm")
        else:
            self.resume_reading("alarm")

    def pause_reading(self, reason: str) -> None:
        if not self._read_pause and self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()
        self._read_pause.add(reason)

    def resume_reading(self, reason: str) -> None:
        if reason in self._read_pause:
            self._read_pause.discard(reason)
            if not self._read_pause and self.transport is not None and not self.transport.is_closing():
                self.transport.resume_reading()

    # ---------------------------------------------------------------- output
    def _mark_dirty(self) -> None:
        if not self._dirty:
            self._dirty = True
            self.worker.mark_dirty(self)

    def write(self, data: bytes) -> None:
        self._out.append(data)
        if not self._dirty:
            self._dirty = True
            self.worker.mark_dirty(self)

    def flush_turn(self) -> None:
        self._dirty = False
        out = self._out
        transport = self.transport
        if out:
            self._out = []
            if transport is not None and not transport.is_closing():
                # One buffer: a turn can hold thousands of small PUBLISH packets, and a transport's queue
                # of that many tiny buffers is slow to drain once the client falls behind.
                data = out[0] if len(out) == 1 else b"".join(out)
                transport.write(data)
                self.send_oct += len(data)
        put = self.worker.shard_put
        if self._acks:
            for shard, flat in self._acks.items():
                put(shard, [_ACK, self.conn_id, LANE, flat])
            self._acks = {}
        if self._credit and not self._write_paused and self.state != CLOSED:
            for (shard, tag), n in self._credit.items():
                put(shard, [_CREDIT, self.conn_id, LANE, tag, n])
            if self._taken is not None and transport is not None:  # a step for those with deliveries
                self._give_back({(shard, LANE, tag) for shard, tag in self._credit})  # (paused_credit.keeps_up)
            self._credit = {}
        if (self._holding or self._slow_timer is not None) and not self._write_paused and not self._waiting:
            self._let_go()  # held for this turn only: the transport took it all
        if self._close_after_flush and transport is not None:
            transport.close()

    def close(self) -> None:
        """Close the network connection after what is queued is written (a will follows unless DISCONNECT)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._close_after_flush = True
        self._mark_dirty()

    # ------------------------------------------------------------- ordering
    def _block(self) -> None:
        self._busy = True

    def _unblock(self) -> None:
        self._busy = False
        backlog = self._backlog
        try:
            while backlog and not self._busy and self.state != CLOSED and not self._close_after_flush:
                self._handle(backlog.popleft())
            if self._waiting and len(self.inflight) < self.max_inflight and self.state == RUNNING:
                self._send_waiting()
        except M.MQTTProtocolError as exc:
            self._protocol_error(str(exc))
        except Exception as exc:
            self.internal_error(exc)
        if "backlog" in self._read_pause and len(backlog) < BACKLOG_PAUSE // 2:
            self.resume_reading("backlog")

    def _guard(self, fn: Callable[..., None]) -> Callable[..., None]:
        """A reply callback that runs only while the connection is alive and never raises."""
        def run(*args: Any) -> None:
            if self.state == CLOSED or self.transport is None or self._close_after_flush:
                return
            try:
                fn(*args)
            except M.MQTTProtocolError as exc:
                self._protocol_error(str(exc))
            except Exception as exc:
                self.internal_error(exc)
        return run

    def _node(self, op: str, args: dict, on_done: Callable[[bool, Any], None]) -> None:
        # With "user" the node checks the user's permissions on declares, deletes and binds (as for AMQP).
        args = {**args, "vhost": self.vhost, "owner": [self.worker.index, self.conn_id], "user": self.user}
        self.worker.node_request(op, args, self._guard(on_done))

    def _shard_request(self, shard: int, build: Callable[[int], list], on_done: Callable[[bool, Any], None]) -> None:
        self.shards.add(shard)
        self.worker.shard_request(shard, build, self, self._guard(on_done))

    # --------------------------------------------------------------- dispatch
    def _handle(self, p: Any) -> None:
        cls = p.__class__
        if cls is M.Publish:
            if self.state != RUNNING:
                raise M.MQTTProtocolError("PUBLISH before CONNECT")
            self._on_publish(p)
        elif cls is M.Ack:
            if self.state != RUNNING:
                raise M.MQTTProtocolError("packet before CONNECT")
            t = p.type
            if t == M.PUBACK:
                self._on_puback(p.packet_id)
            elif t == M.PUBREC:
                self._on_pubrec(p.packet_id)
            elif t == M.PUBREL:
                self._on_pubrel(p.packet_id)
            elif t == M.PUBCOMP:
                self._on_pubcomp(p.packet_id)
            else:
                raise M.MQTTProtocolError("UNSUBACK sent to a server")
        elif cls is M.Connect:
            if self.state != CONNECTING or self._busy:
                raise M.MQTTProtocolError("second CONNECT")  # [MQTT-3.1.0-2]
            self._on_connect(p)
        elif self.state != RUNNING:
            raise M.MQTTProtocolError("the first packet must be CONNECT")  # [MQTT-3.1.0-1]
        elif cls is M.Subscribe:
            self._on_subscribe(p)
        elif cls is M.Unsubscribe:
            self._on_unsubscribe(p)
        elif cls is M.Simple:
            if p.type == M.PINGREQ:
                self.write(M.PINGRESP_BYTES)
            elif p.type == M.DISCONNECT:
                self._graceful = True  # the will is discarded [MQTT-3.14.4-3]
                self.will = None
                self.close()
                self.state = CLOSED
                self._release()
        else:
            raise M.MQTTProtocolError(f"unexpected packet {cls.__name__}")

    # ---------------------------------------------------------------- CONNECT
    def _on_connect(self, p: M.Connect) -> None:
        if p.protocol_name not in ("MQTT", "MQIsdp"):
            raise M.MQTTProtocolError(f"protocol name {p.protocol_name!r}")  # [MQTT-3.1.2-1]: no CONNACK
        if (p.protocol_name, p.protocol_level) not in (("MQTT", 4), ("MQIsdp", 3)):
            self._refuse(M.REFUSED_PROTOCOL_VERSION)  # [MQTT-3.1.2-2]
            return
        client_id = p.client_id
        if not client_id:
            if not p.clean_session:
                self._refuse(M.REFUSED_IDENTIFIER)  # [MQTT-3.1.3-8]
                return
            client_id = "shardmq-" + secrets.token_hex(8)  # [MQTT-3.1.3-6]
        if p.will is not None and not valid_topic_name(p.will.topic):
            raise M.MQTTProtocolError("invalid will topic")
        defs = self.worker.defs
        settings = self.worker.settings
        cert_user = peer_common_name(self.transport, settings)
        if cert_user is None and p.username is None and settings.get("mqtt_allow_anonymous"):
            cert_user = settings.get("default_user") or "guest"  # configured anonymous login
        if p.username is None and cert_user is None:
            self._refuse(M.REFUSED_NOT_AUTHORIZED)  # no anonymous login unless configured
            return
        if p.username is None:
            # A verified client certificate is the credential: its CN is the user, vhost "/" (or the
            # configured anonymous user).
            vhost, user = "/", cert_user
            if defs.users.get(user) is None:
                self._refuse(M.REFUSED_NOT_AUTHORIZED)
                return
        else:
            vhost, _, user = p.username.rpartition(":")
            vhost = vhost or "/"
            u = defs.users.get(user)
            if u is None or p.password is None or not check_password(u, p.password):
                self._refuse(M.REFUSED_BAD_CREDENTIALS)
                return
        loopback_users = self.worker.settings.get("loopback_users")
        restricted = defs.loopback_users if loopback_users is None else loopback_users
        if user in restricted and not is_loopback_peer(self.peer):
            self._refuse(M.REFUSED_NOT_AUTHORIZED)
            return
        if not user_can_access_vhost(defs, user, vhost) or defs.exchange(vhost, EXCHANGE) is None:
            self._refuse(M.REFUSED_NOT_AUTHORIZED)
            return
        self.vhost, self.user, self.client_id = vhost, user, client_id
        self.access = Access(user, vhost, client_id)
        self.client_properties = {"product": "MQTT client", "protocol": "MQTT 3.1.1",  # level 4, the only one accepted
                                  "client_id": client_id, "clean_session": bool(p.clean_session)}
        self.clean = bool(p.clean_session)
        self.will = p.will
        self.keep_alive = p.keep_alive
        self._block()
        self._node("connection.open", {"user": user}, self._counted)

    def _refuse(self, code: int) -> None:
        self.write(M.encode_connack(False, code))  # session present 0 with a refusal [MQTT-3.2.2-4]
        self.close()
        self.state = CLOSED

    def _counted(self, ok: bool, result: Any) -> None:
        if not ok:
            self._refuse(M.REFUSED_SERVER_UNAVAILABLE)
            return
        self.registered = True
        owner = [self.worker.index, self.conn_id]
        if self.clean:
            takeover(self.worker, self.vhost, self.client_id, owner)
            self._resume()
        else:
            # The session record is read once the other frontends have flushed what an older connection
            # of this client id wrote to it (a reconnect within milliseconds must not read it stale).
            takeover(self.worker, self.vhost, self.client_id, owner, then=self._guard(self._resume))

    def _resume(self) -> None:
        defs = self.worker.defs
        durable = session_queue(self.client_id)
        exists = defs.queue(self.vhost, durable) is not None
        shard = session_shard(self.vhost, self.client_id, self.worker.shard_count)
        if self.clean:
            if exists:  # clean session 1 discards a stored session [MQTT-3.1.2-6]
                def deleted(ok: bool, result: Any) -> None:
                    if not ok:
                        self._refuse(M.REFUSED_NOT_AUTHORIZED if result[0] == 403 else M.REFUSED_SERVER_UNAVAILABLE)
                        return
                    self._kv_put(shard, SESSIONS, self.client_id, None, lambda: self._accept(False))
                self._node("queue.delete", {"queue": durable}, deleted)
            else:
                self._accept(False)
            return

        def loaded(ok: bool, result: Any) -> None:
            # A record without its queue (deleted by an operator) is no session: start empty.
            state = result["items"][0][1] if ok and result.get("items") and exists else {}
            self.subs = {str(k): int(v) for k, v in (state.get("subs") or {}).items()}
            self.in2 = set(state.get("in2") or ())
            self.out2 = set(state.get("out2") or ())
            self.pub2 = {int(mid): int(pid) for mid, pid in state.get("pub2") or ()}

            def declared(ok: bool, result: Any) -> None:
                if not ok:  # 403: no configure permission on the session queue
                    self._refuse(M.REFUSED_NOT_AUTHORIZED if result[0] == 403 else M.REFUSED_SERVER_UNAVAILABLE)
                    return
                self._set_queue(durable)
                if not exists:  # a new session: no QoS 2 mark of an older one with this client id may count
                    self._unmark(None, lambda: self._accept(False, consume=bool(self.subs)))
                    return

                def owed(ok: bool, result: Any) -> None:
                    if ok:  # PUBREL owed for these (the shard keeps them with the acks, see _on_pubrec)
                        for _key, marks in result.get("items", ()):
                            self.out2.update(int(m) for m in marks)
                    self._accept(True, consume=bool(self.subs))

                if self.queue_shard is None:
                    self._accept(True, consume=bool(self.subs))
                else:
                    vhost, client_id = self.vhost, self.client_id
                    self._shard_request(self.queue_shard, lambda req: [_KV_GET, req, vhost, OUTBOUND2, client_id],
                                        owed)

            self._node("queue.declare", {"queue": durable, "durable": True, "exclusive": False,
                                         "auto_delete": False, "arguments": {}}, declared)

        self._shard_request(shard, lambda req: [_KV_GET, req, self.vhost, SESSIONS, self.client_id], loaded)

    def _accept(self, session_present: bool, consume: bool = False) -> None:
        self.state = RUNNING
        self.write(M.encode_connack(session_present, M.ACCEPTED))
        for pid in sorted(self.out2):  # resend PUBREL for what the client had received [MQTT-4.4.0-1]
            self.write(M.encode_ack(M.PUBREL, pid))
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.keep_alive:
            self._timer = self.worker.loop.call_later(self.keep_alive * 1.5, self._keep_alive_tick)
        log.debug("mqtt connection %s (%s): client '%s' user '%s' vhost '%s' clean=%s", self.conn_id, self.peer,
                  self.client_id, self.user, self.vhost, self.clean)
        if consume:  # after CONNACK, the first packet we send [MQTT-3.2.0-1]
            self._consume(self._unblock)
        else:
            self._unblock()

    def _set_queue(self, name: str) -> None:
        self.queue = name
        q = self.worker.defs.queue(self.vhost, name)
        self.queue_shard = q.shard if q is not None else None

    # ------------------------------------------------------------- timers
    def _connect_timeout(self) -> None:
        self._timer = None
        if self.state == CONNECTING and self.transport is not None:
            self.transport.abort()

    def _keep_alive_tick(self) -> None:
        """Nothing from the client for 1.5 x keep-alive: close, will published [MQTT-3.1.2-24]."""
        self._timer = None
        if self.state != RUNNING or self.transport is None:
            return
        if not self._received and not self._read_pause:  # not while we are the ones not reading
            log.info("mqtt connection %s (%s): keep-alive timeout (%ds)", self.conn_id, self.peer, self.keep_alive)
            self.transport.abort()
            return
        self._received = False
        self._timer = self.worker.loop.call_later(self.keep_alive * 1.5, self._keep_alive_tick)

    # ------------------------------------------------------------ publishing
    def _on_publish(self, p: M.Publish) -> None:
        if p.topic not in self._key_cache and not valid_topic_name(p.topic):  # cached ones were valid
            raise M.MQTTProtocolError(f"invalid topic name {p.topic!r}")  # [MQTT-3.3.2-2]
        if not self.publisher:
            self.publisher = True
            if self.worker.pressure:
                self.pause_reading("pressure")
            if getattr(self.worker, "alarms", None):
                self.apply_alarms()
        if not self._may_publish(p.topic):
            # MQTT 3.1.1 cannot refuse one PUBLISH: the connection is closed (as RabbitMQ's plugin does).
            self._backlog.clear()
            self.close()
            return
        qos = p.qos
        if qos == 2 and p.packet_id in self.in2:
            self.write(M.encode_ack(M.PUBREC, p.packet_id))  # a resend: routed once already [MQTT-4.3.3-2]
            return
        if qos == 0:
            self._route(p.topic, p.payload, 0, None)
            if p.retain:
                self._retain(p.topic, 0, p.payload, None)
            return
        seq = self._next_seq
        self._next_seq = seq + 1
        entry = self._pending[seq] = [1, qos, p.packet_id]  # 1: released below once everything is sent
        if p.retain:
            entry[0] += 1
            self._retain(p.topic, qos, p.payload, lambda: self._settle(seq, True))
        mark = None
        if qos == 2:
            self.in2.add(p.packet_id)
            if not self.clean:
                # Each shard that stores it keeps the packet id with it (MARKED_PUBLISH): a resend after a
                # crash of this frontend or of that shard is not stored twice; PUBREL removes the marks.
                mark = p.packet_id
        entry[0] += self._route(p.topic, p.payload, qos, seq, mark)
        self._settle(seq, True)

    def _may_publish(self, topic: str) -> bool:
        """Write on amq.topic and, with topic permissions, on the routing key (RabbitMQ's MQTT plugin)."""
        defs = self.worker.defs
        access = self.access
        if EXCHANGE in access.writable and access.version == defs.version and access.topics is None:
            return True  # the plain case: one set lookup, one compare
        try:
            self.access.check_publish(defs, defs.exchange(self.vhost, EXCHANGE), EXCHANGE, self._key(topic))
        except AMQPError as exc:
            log.warning("mqtt connection %s (%s): %s", self.conn_id, self.peer, exc.text)
            return False
        return True

    def _key(self, topic: str) -> str:
        key = self._key_cache.get(topic)
        if key is None:
            if len(self._key_cache) > 10_000:
                self._key_cache.clear()
            key = self._key_cache[topic] = topic_to_key(topic)
        return key

    def _route(self, topic: str, payload: bytes, qos: int, seq: int | None, mark: int | None = None) -> int:
        """Publish to amq.topic; the number of shards that will confirm (seq set)."""
        worker = self.worker
        plan = self._routes[qos].get(topic)
        if plan is None or plan[0] != worker.defs.version or plan[1] != self._direct.gen:
            plan = self._plan(topic, qos)
        key, targets, groups = plan[2], plan[3], plan[4]
        if targets:
            if mark is None:
                packet = None
                heads = None
                for conn, best in targets:
                    if qos and best:
                        q = qos if qos < best else best
                        if heads is None:
                            heads = [None, None, None]
                        head = heads[q]
                        if head is None:
                            head = heads[q] = M.publish_head(plan[5], len(payload), q)
                        conn.deliver_direct_acked(head, payload, q, self)
                        continue
                    if packet is None:
                        packet = M.encode_publish(plan[5], payload)  # the same bytes for every QoS 0 delivery
                    conn.deliver_direct(packet, self)
            else:
                # A QoS 2 resend (DUP) after a reconnect is routed again and only the shards know it was
                # stored: through them, so a QoS 0 session gets it at most once.
                defs = worker.defs
                groups = queues_by_shard(defs, self.vhost, defs.route(self.vhost, EXCHANGE, key, PROPS[qos]))
        if not groups:
            return 0
        vhost = self.vhost
        props = PROPS[qos]
        if seq is None:
            put_publish(worker, groups, vhost, EXCHANGE, key, props, payload, qos > 0)
            return 0
        if mark is None:
            put_publish(worker, groups, vhost, EXCHANGE, key, props, payload, True, self.conn_id, LANE, seq)
        else:
            put_marked_publish(worker, groups, vhost, INBOUND2, self.client_id, mark, EXCHANGE, key, props, payload,
                               self.conn_id, LANE, seq)
        self.shards.update(groups)
        return len(groups)

    def _plan(self, topic: str, qos: int) -> tuple:
        """(defs version, direct gen, routing key, ((session served here, its QoS for topic), ...),
        {shard: queue names}, topic bytes)."""
        worker = self.worker
        defs = worker.defs
        vhost = self.vhost
        key = self._key(topic)
        queues = defs.route(vhost, EXCHANGE, key, PROPS[qos])
        direct = self._direct
        targets = []
        if direct.conns and queues:
            rest = []
            for name in queues:
                conn = direct.conns.get((vhost, name))
                if conn is None:
                    rest.append(name)
                else:
                    best = conn._sub_qos(topic)
                    if best >= 0:  # not a $-topic that only a first-level wildcard matched
                        targets.append((conn, best))
            queues = rest
        routes = self._routes[qos]
        if len(routes) > 10_000:
            routes.clear()
        plan = routes[topic] = (defs.version, direct.gen, key, tuple(targets),
                                queues_by_shard(defs, vhost, queues) if queues else {}, topic.encode())
        return plan

    def _retain(self, topic: str, qos: int, payload: bytes, done: Callable[[], None] | None) -> None:
        """Replace (or, with an empty payload, delete) the topic's retained message [MQTT-3.3.1-5..11]."""
        shard = retained_shard(self.vhost, self.worker.shard_count)
        self._kv_put(shard, RETAINED, topic, [qos, payload] if payload else None, done)

    def _kv_put(self, shard: int, space: str, key: str, value: Any, done: Callable[[], None] | None) -> None:
        vhost = self.vhost
        if done is None:
            self.worker.shard_put(shard, [_KV_PUT, None, vhost, space, key, value])
            return

        def answered(ok: bool, result: Any) -> None:
            if not ok:
                raise RuntimeError(f"store write failed: {result}")
            done()

        self._shard_request(shard, lambda req: [_KV_PUT, req, vhost, space, key, value], answered)

    def _save_state(self, done: Callable[[], None] | None = None) -> None:
        """Write the persistent session's state (subscriptions, QoS 2 packet ids) to its store."""
        if self.clean:
            if done is not None:
                done()
            return
        shard = session_shard(self.vhost, self.client_id, self.worker.shard_count)
        # The inbound QoS 2 packet ids are not here: the shards keep them with the messages (_unmark).
        self._kv_put(shard, SESSIONS, self.client_id,
                     {"subs": dict(self.subs), "out2": sorted(self.out2), "pub2": sorted(self.pub2.items())}, done)

    def _unmark(self, mark: int | None, done: Callable[[], None]) -> None:
        """Remove an inbound QoS 2 packet id's marks (None: all marks of this client id, both ways) from every
        shard, then done().

        Every shard, not just those this connection routed to: the message may have been stored by an
        earlier connection (before a crash) whose routes we do not know.
        """
        vhost, client_id = self.vhost, self.client_id
        count = self.worker.shard_count
        left = [count]

        def one(ok: bool, result: Any) -> None:
            if not ok:  # MQTT has no error for PUBREL: close; the client sends PUBREL again on reconnect
                raise RuntimeError(f"QoS 2 mark not removed: {result}")
            left[0] -= 1
            if not left[0]:
                done()

        spaces = (INBOUND2,) if mark is not None else (INBOUND2, OUTBOUND2)
        left[0] *= len(spaces)
        for shard in range(count):
            for space in spaces:
                self._shard_request(shard, lambda req, space=space: [_UNMARK, req, vhost, space, client_id, mark], one)

    def _settle(self, seq: int, ok: bool) -> None:
        entry = self._pending.get(seq)
        if entry is None:
            return
        if not ok:
            # MQTT 3.1.1 has no negative acknowledgement: close, the client publishes again on reconnect.
            log.warning("mqtt connection %s: a shard refused a publish; closing", self.conn_id)
            self._pending.clear()
            self.close()
            return
        entry[0] -= 1
        if entry[0] > 0:
            return
        # Acknowledge in the order the publishes came [MQTT-4.6.0-2].
        pending = self._pending
        while pending:
            first = next(iter(pending))
            e = pending[first]
            if e[0] > 0:
                break
            del pending[first]
            self.write(M.encode_ack(M.PUBACK if e[1] == 1 else M.PUBREC, e[2]))

    def on_confirm(self, channel: int, seqs: list, ok: bool) -> None:
        for seq in seqs:
            self._settle(seq, ok)

    def _on_pubrel(self, pid: int) -> None:
        self.in2.discard(pid)
        if not self.clean:
            # Also for an id this connection does not know: it may be marked since before a crash.
            self._unmark(pid, lambda: self.write(M.encode_ack(M.PUBCOMP, pid)))
            return
        self.write(M.encode_ack(M.PUBCOMP, pid))  # also for an id we no longer know [MQTT-4.3.3-2]

    def _publish_will(self) -> None:
        will = self.will
        self.will = None
        self.worker.fence_check()  # a will is routed as of now, as a publish (broker/defs_fence.py)
        if not self._may_publish(will.topic):
            return
        self._route(will.topic, will.payload, will.qos, None)
        if will.retain:
            self._retain(will.topic, will.qos, will.payload, None)

    # -------------------------------------------------------- subscriptions
    def _on_subscribe(self, p: M.Subscribe) -> None:
        codes: list[int] = []
        wanted: list[tuple[str, int]] = []
        for topic_filter, qos in p.topics:
            if not valid_topic_filter(topic_filter):
                codes.append(M.SUBACK_FAILURE)
                continue
            codes.append(qos)
            wanted.append((topic_filter, qos))
        self._block()
        pid = p.packet_id

        def bound(results: dict[str, bool]) -> None:
            for i, (topic_filter, _qos) in enumerate(p.topics):
                if codes[i] != M.SUBACK_FAILURE and not results.get(topic_filter, False):
                    codes[i] = M.SUBACK_FAILURE
            granted = [(f, q) for f, q in wanted if results.get(f)]
            for f, q in granted:
                self.subs[f] = q
            self._sub_cache.clear()

            def finish() -> None:
                self.write(M.encode_suback(pid, codes))
                self._serve_directly()  # after SUBACK: a direct PUBLISH may follow in this turn
                if granted:
                    self._send_retained(granted)
                self._save_state()
                self._unblock()

            if granted and (not self.consuming or (self.consumer_tag == TAG_NO_ACK and any(
                    q for _f, q in granted))):
                self._consume(finish)
            else:
                finish()

        def refused() -> None:
            self.write(M.encode_suback(pid, [M.SUBACK_FAILURE] * len(p.topics)))
            self._unblock()

        def queue_ready() -> None:
            if not self.access.allowed(self.worker.defs, READ, self.queue):  # consuming it needs read
                log.warning("mqtt connection %s: read access to queue '%s' refused for user '%s'", self.conn_id,
                            self.queue, self.user)
                refused()
                return
            self._bind_all(wanted, bound)

        self._ensure_queue(queue_ready, refused)

    def _ensure_queue(self, then: Callable[[], None], refused: Callable[[], None]) -> None:
        if self.queue is not None:
            then()
            return
        name = transient_queue(self.client_id, self.worker.index, self.conn_id)

        def declared(ok: bool, result: Any) -> None:
            if not ok:  # e.g. 403: no configure permission on mqtt-subscription-*
                log.warning("mqtt connection %s: queue.declare refused: %s", self.conn_id, result)
                refused()
                return
            self._set_queue(name)
            then()

        self._node("queue.declare", {"queue": name, "durable": False, "exclusive": True, "auto_delete": False,
                                     "arguments": {}}, declared)

    def _bind_all(self, filters: list[tuple[str, int]], done: Callable[[dict[str, bool]], None]) -> None:
        results: dict[str, bool] = {}
        todo = [f for f, _q in filters if f not in self.subs]
        for f, _q in filters:
            if f in self.subs:
                results[f] = True  # already bound: only the QoS changes [MQTT-3.8.4-3]
        if not todo:
            done(results)
            return
        left = [len(todo)]
        for f in todo:
            def one(ok: bool, _result: Any, f: str = f) -> None:
                results[f] = ok
                left[0] -= 1
                if not left[0]:
                    done(results)
            self._node("queue.bind", {"queue": self.queue, "exchange": EXCHANGE, "routing_key": filter_to_key(f),
                                      "arguments": {}}, one)

    def _consume(self, then: Callable[[], None]) -> None:
        """Consume the session queue (again, with acks, when the first QoS 1/2 subscription comes)."""
        q = self.worker.defs.queue(self.vhost, self.queue)
        if q is None:
            raise RuntimeError(f"session queue {self.queue} is gone")
        put = self.worker.shard_put
        if self.consuming and self.consumer_tag is not None:
            put(q.shard, [contract.CANCEL, self.conn_id, LANE, self.consumer_tag])
            # Credit held back for the old consumer would reach nothing (or, were its tag ever consumed
            # again, a consumer whose window it is not): each consumer's credit is its own.
            self._credit.pop((self.queue_shard, self.consumer_tag), None)
            if self._taken:
                self._taken.pop((self.queue_shard, LANE, self.consumer_tag), None)  # that consumer is gone
        self.consuming = True
        self.queue_shard = q.shard
        no_ack = not any(self.subs.values())
        tag = self.consumer_tag = TAG_NO_ACK if no_ack else TAG_ACK
        tail = [self.conn_id, LANE, self.vhost, self.queue, tag, no_ack, False, 0 if no_ack else self.max_inflight,
                {}]

        def consumed(ok: bool, result: Any) -> None:
            if not ok:
                raise RuntimeError(f"consume failed: {result}")
            then()

        self._shard_request(q.shard, lambda req: [contract.CONSUME, req, *tail], consumed)
        # After the CONSUME, on the same lane: START_WINDOW of the window to start with, none while paused.
        self._take_back_credit(0 if self._write_paused else START_WINDOW)

    def _on_unsubscribe(self, p: M.Unsubscribe) -> None:
        known = [f for f in p.topics if f in self.subs]
        pid = p.packet_id
        if not known:
            self.write(M.encode_ack(M.UNSUBACK, pid))  # [MQTT-3.10.4-5]
            return
        self._block()
        left = [len(known)]
        for f in known:
            del self.subs[f]
        self._sub_cache.clear()

        def one(_ok: bool, _result: Any) -> None:
            left[0] -= 1
            if not left[0]:
                self._save_state()
                self._serve_directly()
                self.write(M.encode_ack(M.UNSUBACK, pid))
                self._unblock()

        for f in known:
            self._node("queue.unbind", {"queue": self.queue, "exchange": EXCHANGE, "routing_key": filter_to_key(f),
                                        "arguments": {}}, one)

    def _send_retained(self, granted: list[tuple[str, int]]) -> None:
        shard = retained_shard(self.vhost, self.worker.shard_count)
        vhost = self.vhost

        def got(ok: bool, result: Any) -> None:
            if not ok:
                return
            for topic, (rqos, payload) in result.get("items", ()):
                best = -1
                for f, q in granted:
                    if q > best and matches(f, topic):
                        best = q
                if best >= 0:
                    self._send_publish(topic.encode(), payload, min(int(rqos), best), True, False, None)

        self._shard_request(shard, lambda req: [_KV_GET, req, vhost, RETAINED, None], got)

    # ------------------------------------------------------------- delivering
    def _sub_qos(self, topic: str) -> int:
        """Highest granted QoS of the subscriptions matching topic; -1 when none does."""
        cached = self._sub_cache.get(topic)
        if cached is not None:
            return cached
        best = -1
        for f, q in self.subs.items():
            if q > best and matches(f, topic):
                best = q
        if len(self._sub_cache) > 10_000:
            self._sub_cache.clear()
        self._sub_cache[topic] = best
        return best

    def deliver_direct(self, packet: bytes, publisher: MQTTConnection) -> None:
        """A QoS 0 PUBLISH from a connection of this frontend (frontend/mqtt/direct.py). While the client does
        not keep up the publisher is not read; a client that stays stuck for SLOW_AFTER seconds holds no
        one and loses what is beyond DROP_BYTES."""
        if self.state != RUNNING:
            return
        if self._write_paused or self._waiting or len(self._out) >= TURN_PACKETS:
            if self._slow:
                if self.transport is not None and self.transport.get_write_buffer_size() > DROP_BYTES:
                    self.dropped += 1
                    return
            elif publisher not in self._holding:
                self._hold(publisher)
        self._out.append(packet)
        if not self._dirty:
            self._dirty = True
            self.worker.mark_dirty(self)

    def deliver_direct_acked(self, head: bytes, payload: bytes, qos: int, publisher: MQTTConnection) -> None:
        """A QoS 1/2 message from a connection of this frontend (``head``: the PUBLISH up to its packet id,
        codec.publish_head): sent within the in-flight window, else waits here in order (the session
        ends with the connection, as its transient queue would)."""
        if self.state != RUNNING:
            return
        waiting = self._waiting
        if waiting or self._write_paused or len(self.inflight) >= self.max_inflight:
            if not self._slow:
                if publisher not in self._holding:
                    self._hold(publisher)
            elif len(waiting) >= DROP_QUEUED:
                self.dropped += 1  # a stuck client, as mosquitto's max_queued_messages
                return
            if waiting or len(self.inflight) >= self.max_inflight:
                waiting.append((head, payload, qos))
                return
        pid = self._alloc_pid()
        self.inflight[pid] = (None, qos)
        self.write(head + _PID(pid) + payload)

    def _send_waiting(self) -> None:
        """The in-flight window has room again: send what waits, then let the held publishers go."""
        waiting = self._waiting
        inflight = self.inflight
        room = self.max_inflight - len(inflight)
        alloc = self._alloc_pid
        out = self._out
        while waiting and room > 0:
            head, payload, qos = waiting.popleft()
            pid = alloc()
            inflight[pid] = (None, qos)
            out.append(head + _PID(pid) + payload)
            room -= 1
        self._mark_dirty()
        if not waiting and not self._write_paused and (self._holding or self._slow_timer is not None):
            self._let_go()

    def _hold(self, publisher: MQTTConnection) -> None:
        """Stop reading a publisher while we are behind. Only a connection without subscriptions: one that
        has some must be read for its own acknowledgements (two QoS 1 sessions publishing to each other
        would each wait for the other), and a client may block on its writes while it does not read."""
        if not publisher.subs:
            publisher.pause_reading(self._hold_reason)
            self._holding.add(publisher)
        if self._slow_timer is None:  # a stuck client is noticed also when it holds no one
            self._slow_timer = self.worker.loop.call_later(SLOW_AFTER, self._too_slow)

    def _serve_directly(self) -> None:
        """After a change of subscriptions: a clean session is served here (frontend/mqtt/direct.py) from
        its first subscription to its end; publishers re-plan, as which topics it takes may have changed."""
        if self.direct:
            self._direct.changed()
        elif self.clean and self.subs and self.queue is not None and self.state == RUNNING:
            self.direct = True
            self._direct.add(self.vhost, self.queue, self)

    def on_deliver(self, shard: int, item: list) -> None:
        """[DELIVER, conn, lane, tag, qid, mid, redelivered, exchange, routing_key, props, body]"""
        tag = item[3]
        key = (shard, tag)
        credit = self._credit
        credit[key] = credit.get(key, 0) + 1 + (len(item[10]) >> _CREDIT_SHIFT)  # as the shard charged
        settled = tag == TAG_NO_ACK
        if self.state != RUNNING:
            return  # the shard requeues it when the connection's end reaches it
        rk = item[8]
        cached = self._topic_cache.get(rk)
        if cached is None:
            topic = key_to_topic(rk)
            if len(self._topic_cache) > 10_000:
                self._topic_cache.clear()
            cached = self._topic_cache[rk] = (topic, topic.encode())
        topic, topic_bytes = cached
        best = self._sub_qos(topic)
        if best < 0:  # e.g. a $-topic that only a wildcard at the first level matched [MQTT-4.7.2-1]
            if not settled:
                self._ack(shard, item[4], item[5])
            self._mark_dirty()
            return
        qos = min(qos_of(item[9]), best) if best else 0
        if qos == 0:
            if not settled:
                self._ack(shard, item[4], item[5])
            self.write(M.encode_publish(topic_bytes, item[10]))
            return
        self._send_publish(topic_bytes, item[10], qos, False, bool(item[6]),
                           None if settled else (shard, item[4], item[5]))

    def _send_publish(self, topic: bytes, payload: bytes, qos: int, retain: bool, dup: bool,
                      ref: tuple | None) -> None:
        if qos == 0:
            self.write(M.encode_publish(topic, payload, 0, retain))
            return
        if qos == 2 and ref is not None and not self.clean:
            mid = ref[2]
            pid = self.pub2.get(mid)
            if pid is not None and pid not in self.inflight and pid not in self.out2:
                dup = True  # sent before this reconnect or restart: same packet id, DUP set
            else:
                pid = self.pub2[mid] = self._alloc_pid()
                self._save_state()  # not waited for: the PUBLISH goes out now
        else:
            pid = self._alloc_pid()
        self.inflight[pid] = (ref, qos)
        self.write(M.encode_publish(topic, payload, qos, retain, dup, pid))

    def _alloc_pid(self) -> int:
        pid = self._next_pid
        for _ in range(65535):
            pid = pid % 65535 + 1
            if pid not in self.inflight and pid not in self.out2 and not (self.pub2 and pid in self.pub2.values()):
                self._next_pid = pid
                return pid
        raise RuntimeError("no free packet identifier")

    def _ack(self, shard: int, qid: int, mid: int) -> None:
        flat = self._acks.get(shard)
        if flat is None:
            self._acks[shard] = [qid, mid]
        else:
            flat.append(qid)
            flat.append(mid)

    def _on_puback(self, pid: int) -> None:
        entry = self.inflight.pop(pid, None)
        self._progress += 1
        if entry is not None and entry[0] is not None:
            self._ack(*entry[0])
            self._mark_dirty()

    def _on_pubrec(self, pid: int) -> None:
        entry = self.inflight.pop(pid, None)
        self._progress += 1
        if entry is not None and entry[0] is not None and entry[1] == 2 and not self.clean:
            # The queue's shard acknowledges the message and keeps the packet id (PUBREL owed) in one
            # step (MARKED_ACK): after any crash the message is either still there to send again with
            # its packet id, or gone and PUBREL is owed. PUBREL once that is durable.
            shard, qid, mid = entry[0]
            self.out2.add(pid)
            vhost, client_id, conn_id = self.vhost, self.client_id, self.conn_id

            def marked(ok: bool, result: Any) -> None:
                if not ok:
                    raise RuntimeError(f"PUBREC not recorded: {result}")
                if isinstance(result, dict) and result.get("acked") is False:
                    # The delivery was no longer ours (requeued by a shard restart): it comes again, with
                    # its packet id; no PUBREL for it now.
                    self.out2.discard(pid)
                    return
                self.pub2.pop(mid, None)
                self._save_state()  # pub2 housekeeping only, not waited for
                self.write(M.encode_ack(M.PUBREL, pid))

            self._shard_request(shard, lambda req: [_MARKED_ACK, req, conn_id, LANE, qid, mid, vhost, OUTBOUND2,
                                                    client_id, pid], marked)
            return
        if entry is not None:
            if entry[0] is not None:
                self._ack(*entry[0])
                if entry[1] == 2:
                    self.pub2.pop(entry[0][2], None)
            self.out2.add(pid)
            if not self.clean:
                # The shard's ack and the session record go out in this turn; PUBREL once the record
                # is durable, so after a restart we still know to send PUBREL rather than the message.
                self._save_state(self._guard(lambda: self.write(M.encode_ack(M.PUBREL, pid))))
                self._mark_dirty()
                return
        self.write(M.encode_ack(M.PUBREL, pid))

    def _on_pubcomp(self, pid: int) -> None:
        if pid in self.out2:
            self.out2.discard(pid)
            self._save_state()
            if not self.clean and self.queue_shard is not None:
                self.worker.shard_put(self.queue_shard, [_UNMARK, None, self.vhost, OUTBOUND2, self.client_id, pid])

    # --------------------------------------------------------- worker side
    def on_cancel_notify(self, channel: int, tag: str) -> None:
        # The session queue was deleted (by an operator): the session cannot go on.
        self.fail(CONNECTION_FORCED, "session queue deleted")

    def on_close_channel(self, channel: int, code: int, text: str) -> None:
        log.warning("mqtt connection %s (%s): closed by a shard: %d %s", self.conn_id, self.peer, code, text)
        self.close()

    def uses_shard(self, shard: int) -> bool:
        return (self.consuming and self.queue_shard == shard) or (bool(self._pending) and shard in self.shards)

    def shard_lost(self, shard: int) -> None:
        # MQTT has no way to cancel a subscription or nack a publish: a session with state on the dead
        # shard is closed (the client reconnects and resumes its session), the others are untouched.
        if self.uses_shard(shard):
            self.fail(CONNECTION_FORCED, f"shard {shard} restarted")

    def fail(self, code: int, text: str) -> None:
        if self.state == CLOSED or self._close_after_flush:
            return
        log.info("mqtt connection %s (%s): closed by the broker: %s", self.conn_id, self.peer, text)
        self.close()

    def internal_error(self, exc: BaseException) -> None:
        log.error("mqtt connection %s (%s): internal error", self.conn_id, self.peer, exc_info=exc)
        if self.transport is not None:
            self.transport.abort()

    def _protocol_error(self, text: str) -> None:
        """Malformed packet or protocol violation: close the network connection [MQTT-4.8.0-1]."""
        log.info("mqtt connection %s (%s): protocol error: %s", self.conn_id, self.peer, text)
        self._backlog.clear()
        if self.transport is not None:
            self.transport.abort() if self.state == CONNECTING else self.close()

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        worker = self.worker
        if self.direct:
            self.direct = False
            self._direct.remove(self.vhost, self.queue, self)
        self._waiting.clear()
        if self._holding or self._slow_timer is not None:
            self._let_go()
        shards = set(self.shards)
        if self.queue_shard is not None and self.consuming:
            shards.add(self.queue_shard)
        if self._acks:
            for shard, flat in self._acks.items():
                worker.shard_put(shard, [_ACK, self.conn_id, LANE, flat])
            self._acks = {}
        for shard in shards:
            worker.shard_put(shard, [contract.CONNECTION_CLOSED, self.conn_id])
        if self.registered:
            worker.node_request("connection.closed", {"owner": [worker.index, self.conn_id]}, None)


def takeover(worker: FrontendWorker, vhost: str, client_id: str, owner: list, forward: bool = True,
             then: Callable[[], None] | None = None) -> None:
    """Close every other connection of this client id [MQTT-3.1.4-2]: here, and on the other frontends.

    With ``then``: call it once every other frontend has answered that the session writes of its
    connections of this client id have reached the session shard (or after TAKEOVER_WAIT, for a
    frontend that is down).
    """
    for conn in list(worker.conns.values()):
        if (isinstance(conn, MQTTConnection) and conn.client_id == client_id and conn.vhost == vhost
                and [worker.index, conn.conn_id] != list(owner) and conn.state == RUNNING):
            log.info("mqtt connection %s: client id '%s' connected again: taken over", conn.conn_id, client_id)
            conn.close()
    others = [i for i in range(int(worker.settings.get("frontends", 1))) if i != worker.index] if forward else []
    if then is not None:
        if not others:
            then()
            return
        key = (vhost, client_id, owner[1])
        waits = _takeover_waits(worker)
        timer = worker.loop.call_later(TAKEOVER_WAIT, _takeover_answered, worker, key, True)
        waits[key] = [len(others), then, timer]
    for index in others:
        worker.node.put(None, [contract.FORWARD, index, ["mqtt.takeover", vhost, client_id, owner, then is not None]])


TAKEOVER_WAIT = 2.0  # s a resuming session waits at most for the other frontends' answers


def _takeover_waits(worker: FrontendWorker) -> dict:
    """(vhost, client id, conn id) -> [answers missing, then, timer] of this frontend's resuming sessions."""
    waits = worker.__dict__.get("mqtt_takeover_waits")
    if waits is None:
        waits = worker.__dict__["mqtt_takeover_waits"] = {}
    return waits


def _takeover_answered(worker: FrontendWorker, key: tuple, timed_out: bool = False) -> None:
    waits = _takeover_waits(worker)
    wait = waits.get(key)
    if wait is None:
        return
    wait[0] -= 1
    if timed_out:
        log.warning("mqtt: client id '%s': no answer from another frontend in %.0fs; resuming the session",
                    key[1], TAKEOVER_WAIT)
    elif wait[0] > 0:
        return
    del waits[key]
    wait[2].cancel()
    wait[1]()


def forwarded_takeover(worker: FrontendWorker, vhost: str, client_id: str, owner: list, answer: bool = False) -> None:
    """The FORWARDED "mqtt.takeover" handler (frontend/listeners.py)."""
    takeover(worker, vhost, client_id, owner, forward=False)
    if not answer:
        return

    def flushed(_ok: bool, _result: Any) -> None:
        worker.node.put(None, [contract.FORWARD, owner[0], ["mqtt.taken", vhost, client_id, owner]])

    # Any session write of this client id this frontend made went out before this request, on the same
    # (publish) lane to the session shard, which answers in order: the answer means they are applied.
    shard = session_shard(vhost, client_id, worker.shard_count)
    worker.shard_request(shard, lambda req: [_KV_GET, req, vhost, SESSIONS, client_id], None, flushed)


def forwarded_taken(worker: FrontendWorker, vhost: str, client_id: str, owner: list) -> None:
    """The FORWARDED "mqtt.taken" handler: another frontend has flushed its writes to this session."""
    _takeover_answered(worker, (vhost, client_id, owner[1]))
