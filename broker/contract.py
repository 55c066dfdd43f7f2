"""The one inter-process contract of a ShardMQ node.

Every byte that crosses a process boundary inside a node is described here:
the socket addresses, the message kinds and their fields, and the codec
(msgpack over ZeroMQ, and over length-prefixed unix stream frames for the data plane with
``--ipc-transport unix``). No other module invents a wire format.

Sockets (under the node's run directory, each named so that it fits ``sun_path`` however deep the
data dir is: ``broker/sun_path.py``; ``node.sock`` is a unix stream socket, the data plane's
``shard-N.sock`` is ZeroMQ ``ipc://``, or with ``--ipc-transport unix`` a unix stream socket
``shard-N.stream`` instead, same batches, see ``shard_stream_path``):

* ``node.sock``   - the node listens (broker/unixio.py UnixRouter); every worker connects
  (UnixDealer) with its worker id as identity (``fe-0``, ``sh-1``). Control traffic:
  hello, definition snapshots and deltas, applied-acks, requests from workers
  to the node, node queries to shards, worker up/down events, stop.
* ``shard-N.sock`` - shard N binds a ROUTER; every frontend connects a DEALER
  with its worker id as identity. Data traffic: publishes, consumes, acks
  one way; deliveries, confirms, replies the other way. Every other shard
  connects a DEALER too (identity ``sh-M``) and sends PUBLISH and DEDUP_PUBLISH items only
  (and one PEER_DONE at a clean stop):
  dead-lettered messages and due delayed messages whose target queues live on
  shard N, and messages of a deduplicating exchange that shard M owns (M also
  connects one to itself for those). Their header is ``[target_epoch, seq]``
  like a frontend's (epochs from SNAPSHOT and SHARD_UP); PROCESSED answers are
  ignored by the sending shard. Publishes a shard must see stored (due delayed
  messages, forwarded deduplicating-exchange publishes) carry conn_id = the sending shard's epoch, the
  channel PEER_CHANNEL_DELAYED or PEER_CHANNEL_DEDUP and the sending shard's own
  confirm_seq; shard N answers CONFIRM/CONFIRM_NACK to shard M exactly as to a
  frontend, and the channel tells M which of its parts waits for the answer (M drops an answer
  whose conn_id is not its own epoch: meant for an earlier life of M, shard/forward_lives.py).
  Dead letters carry them too (PEER_CHANNEL_DLX; PUBLISH, or DEDUP_PUBLISH to the owner of a
  deduplicating exchange, M itself included): M keeps each in its outbox until N confirmed it, sends
  it again to a restarted N and, after M's own restart, again to every N (at least once).

One ZeroMQ message (one ``STREAM_FRAME`` payload) is one *batch*: ``msgpack([header, items])``. Items are
lists whose first element is a kind (small int). Senders collect items during
one event-loop turn and flush once at the end of it (see ``broker.zmqio``).

Data batches from a frontend to a shard carry header ``[epoch, batch_seq, control_count, token]``
(control lane: batch_seq None; shard-to-shard batches ``[epoch, batch_seq]``):
a shard drops batches whose epoch is not its own (they were meant for a
previous incarnation of that shard) and answers each batch_seq with a
PROCESSED item so frontends can apply back-pressure to publishers.
control_count orders the lanes: the number of control-lane items the frontend put for
that shard (up to the batch's last item; for a publish-lane batch, as of its last item);
the shard handles a publish-lane batch only after the control-lane batch that brings
the count that far from the same token (the frontend's pid). Counts restart at 0 with a
new shard epoch.
Batches in the other direction and all control batches carry header ``0``.

Channels: the ``channel`` field of every frontend <-> shard item is the channel's *key*,
``number + 65536 * generation``, where the generation counts the connection's channel
openings. A client may close channel 1 and open it again at once; an item a shard sent for
the earlier opening (a late DELIVER, CONFIRM, CANCEL_NOTIFY) then carries the old key and the
frontend drops it instead of handing it to the new opening (docs/architecture.md).

Versions: VERSION is bumped whenever a field is added, removed or changes
meaning; HELLO carries it and the node refuses a worker of another version.
"""

from __future__ import annotations

import os
import signal
import struct
from typing import Any

import msgpack

from broker.sun_path import fit

# 2: DELAYED_PUBLISH; shards confirm forwarded delayed messages. 3: QUEUE_INFO, DEDUP_PUBLISH,
# CHANNEL_CLOSED's and CANCEL's req_id, channel fields carry the channel key (number + 65536 * generation).
# 4: STATS, ALARMS, CLOSE_CONNECTIONS by user/conn; KV_PUT, KV_GET (MQTT retained messages and
# sessions). 5: REPL_STATUS, REPL_ISR (cluster).
# 6: DEDUP_PUBLISH's return_to and RETURN; PEER_CHANNEL_DLX (dead letters carry peer confirms).
# 7: MARKED_PUBLISH, UNMARK, MARKED_ACK (MQTT QoS 2 exactly-once across a crash).
# 8: dead letters into a deduplicating exchange carry confirm fields (PEER_CHANNEL_DLX); the confirm seq
# of a dead letter is its outbox record id (unique across restarts of the sending shard). Frontend data
# headers carry control_count and token (lane order: an ack before a publish stays before it).
# 9: a shard's STATS carries deltas: "seq", "full", "removed", "rows_sent" (only the queue rows changed since
# its last report); QUERY op "stats_full" asks for every row.
# 10: a frontend's STATS carries deltas too: "seq", "full", "closed", "rows_sent" (only the connections
# opened or changed since its last report); QUERY op "stats_full" to a frontend (no reply) asks for all.
# 11: DEFS' optional 4th field ack (default True): False on the copy the node sends to the worker whose
# request it answers, in the batch of that REPLY; the worker sends no APPLIED for it.
# 12: CREDIT counts 512 B units (CREDIT_BYTES_SHIFT 9, was 12) and CREDIT_WINDOW is 16000 (was 2000).
# 13: PUBLISH_RUN (consecutive publishes of one channel alike but for their bodies, in one item).
# 14: the definitions fence (run/defs.fence, broker/defs_fence.py): a worker applies its control plane up to
# the word's version before it acts on input; the DEFS of a fenced change (bind, unbind, exchange
# declare/delete) carry ack False for every worker that has applied its SNAPSHOT (no APPLIED for them).
# 18: PEER_DONE (shard -> shard at a clean stop: nothing more follows from the sender).
# 19: a replication handoff (pack_handoff) carries the follower's heartbeat interval from its HELLO.
# 21: shard-to-shard forwards carry the sending shard's epoch as conn_id (was 0); the sender drops a
# CONFIRM/CONFIRM_NACK whose conn_id is not its epoch (an answer meant for its earlier life). PEER_DONE's
# optional phase field ([PEER_DONE, 2]: a cluster leader's shard has its final state acked).
# 22: a shard's STATS report may come in parts: every part but the last has "more": true (see STATS).
# 23: FRONTEND_STOP_SIGNAL (SIGUSR2 to a paired worker process: its frontend part stops as if its process had
# died, its shard part lives on; a fenced cluster leader's pairs).
# 26: CONFIRM_NACK's optional 5th field refused: the queues of a PUBLISH that did not store it (a shard
# that forwarded a due delayed message or a dead letter sends it to those again, only).
# 27: DEFS' optional 5th field partner (default False): a fenced change's copy to a paired frontend part is
# its shard part's too; the node sends that shard part none, the frontend part hands it over in-process
# (broker/pair_defs.py), and the shard part applies DEFS in version order (a DEFS's ops start at
# defs_version - len(ops)).
# 28: queue.auto_delete and queue.expire name the queue's life: "shard", "epoch", "qid" (the node deletes
# that life only, never a queue declared again under the name since); a shard's queue_info answer carries "qid".
# 29: a deduplicating exchange's owner answers a DEDUP_PUBLISH's CONFIRM_NACK to a dead letter's source
# (PEER_CHANNEL_DLX) as a shard answers a PUBLISH: refused names the routed queues that may not hold it
# (those its targets refused, all of a target that restarted or was never reached), [] none; without it
# every routed queue holds it, not durable as asked. The source no longer sends such a dead letter again
# whole (a copy more per second of an ISR outage), only to the queues named.
VERSION = 29

# --------------------------------------------------------------------------
# Control plane: node <-> every worker (node.sock)
# --------------------------------------------------------------------------
# worker -> node
HELLO = 1  # [HELLO, contract_version, role("frontend"|"shard"), index, pid]
APPLIED = 2  # [APPLIED, defs_version]
REQUEST = 3  # [REQUEST, req_id, op(str), args(dict)]   (op list: see REQUEST_OPS)
QUERY_REPLY = 4  # [QUERY_REPLY, query_id, ok(bool), result]  (shard answering a node QUERY)
# FORWARD: [FORWARD, frontend_index, payload]  the node passes payload on to that frontend as
# FORWARDED (low-rate frontend-to-frontend traffic: direct reply-to answers published on another
# frontend). payload: ["reply", routing_key, exchange, props_raw, body] or
# ["mqtt.takeover", vhost, client_id, [frontend_index, conn_id]] (an MQTT client connected with that
# client id there: every other connection holding it is closed, [MQTT-3.1.4-2]).
FORWARD = 5
# STATS: [STATS, payload(dict)]  every stats_interval ms (one item, never per message), for the
# management API and Prometheus. A frontend's payload:
#   {"connections": [[conn_id, peer_host, peer_port, user, vhost, client_properties(dict), connected_at_ms,
#                     recv_oct, send_oct, blocked(bool), [[channel, prefetch, global_prefetch, consumers,
#                     unacked, unconfirmed, confirm(bool), tx(bool)], ...], send_pend(bytes buffered)], ...],
#    "consumers": [[conn_id, channel, tag, queue, no_ack, prefetch], ...],
#    "counters": {"connections_opened": n, "connections_closed": n},  (totals since the frontend started)
#    "seq": n, "full": bool, "closed": [conn_id, ...], "rows_sent": n}
#   "connections" holds only the connections opened or changed (bytes, channels, consumers, blocked) since
#   the previous report, "consumers" every consumer of those connections, and "closed" the connections
#   gone since then, unless "full": then every connection, every consumer and "closed" is []. The first
#   report after a frontend starts is full; on a seq gap the node sends [QUERY, 0, "stats_full", {}] and
#   the frontend's next report is full (it sends no QUERY_REPLY).
# a shard's: {"queues": [[vhost, name, ready, unacked, consumers, ready_bytes, published, delivered, acked], ...]}
#   (published/delivered/acked: totals since the shard started; the node turns them into rates),
#   "totals": [published, delivered, acked] summed over the shard's queues, "segment_bytes": n,
#   "dead_letters_unconfirmed": n (dead letters to other shards in its outbox, not yet confirmed by them),
#   "fsync": {"buckets": [le, ...], "counts": [n, ...], "sum": seconds, "count": n},
#   "damaged": [[vhost, name, damaged_records, damaged_acks], ...]  (only queues with storage damage
#   since the shard opened them; an older shard leaves the key out, read as none)
#   "seq": n (1, 2, ... per report since the shard started), "full": bool, "removed": [[vhost, name], ...],
#   "rows_sent": n (queue rows sent in reports since the shard started). "queues" holds only the rows that
#   changed since the shard's previous report, and "removed" the queues gone since then, unless "full":
#   then "queues" is every row and "removed" is []. The first report after a shard starts is full; when
#   the node sees a seq that does not follow the last one, it sends QUERY "stats_full" and the next
#   report is full. (A payload without "seq" is read as full.) A shard sends a report of many rows in
#   parts, one per loop turn (shard/stats.py PART_ROWS queues each): every part but the last is
#   {"seq": n, "full": bool, "more": true, "queues": [...], "removed": [...]} with the seq and full of the
#   report it belongs to; the last part is the whole payload above with that seq and the last rows. The
#   node merges a part's rows at once; a full report's rows replace the old ones at its last part. Rows now also carry deliver_no_ack, get,
#   get_no_ack, redelivered after acked, and "totals" the same seven counters (broker/node_stats.py).
STATS = 6
# REPL_STATUS: [REPL_STATUS, {follower: [connected, in_sync, lag_bytes, lag_seconds, last_ack_monotonic,
#                                         acked_position]}]
# a leader's shard reports its replication stream's followers (on every connect, disconnect or
# in-sync change, and every second while followers are attached). A follower missing from the map
# is not connected to that shard's stream.
REPL_STATUS = 7  # (6 and 19 are STATS and ALARMS on branch mgmt)

# node -> worker
SNAPSHOT = 10  # [SNAPSHOT, defs_version, definitions(dict), shard_epochs({index: epoch}), settings(dict)]
DEFS = 11  # [DEFS, defs_version, ops(list), ack(bool, optional), partner(bool, optional)]   ops are applied in
#          order with Definitions.apply; APPLIED answers every batch with a DEFS whose ack is not False.
#          defs_version is the version after the ops (one per op): the ops start at defs_version - len(ops),
#          where the worker's previous SNAPSHOT or DEFS ended. partner True (only with ack False, on a
#          fenced change, outside a cluster): to a paired frontend part (--colocate) whose shard part has
#          applied its SNAPSHOT; that shard part gets no copy from the node, its frontend part hands this
#          one over (broker/pair_defs.py). A paired shard part so gets DEFS from two streams and applies
#          them in version order.
REPLY = 12  # [REPLY, req_id, ok(bool), result]  result is a dict when ok, [reply_code, text, class_id, method_id] when not
SHARD_UP = 13  # [SHARD_UP, index, epoch]      a shard (re)started; frontends and shards use the new epoch
WORKER_DOWN = 14  # [WORKER_DOWN, role, index]  a worker died; shards drop a dead frontend's consumers
QUERY = 15  # [QUERY, query_id, op(str), args(dict)]  node asks a shard (queue_info, ...)
STOP = 16  # [STOP]  graceful shutdown: finish the current turn, sync, exit 0
# Not an item but a signal, the node -> a paired worker process (frontend K and shard K in one process,
# --colocate): stop the frontend part only, as its process's death would (listeners and every client
# connection closed at once, without a close handshake; nothing more to clients, shards or the node); the
# shard part keeps running. A signal, not a control item: the fence sends it from a watchdog thread that
# must not depend on the node's event loop (replication/cluster.py), as SIGKILL of a lone frontend does.
FRONTEND_STOP_SIGNAL = signal.SIGUSR2
# [CLOSE_CONNECTIONS, vhost or None, reply_code, text, user or None, conn_id or None]  frontends close the
# connections that match every field that is not None (conn_id: sent only to the frontend that has it)
CLOSE_CONNECTIONS = 17
FORWARDED = 18  # [FORWARDED, payload]  see FORWARD
# [ALARMS, [name, ...]]  the resource alarms in effect ("disk", "memory"; [] = none), sent to frontends when
# the set changes and after a frontend's SNAPSHOT: publishing connections are blocked while it is not empty
ALARMS = 19
# REPL_ISR: [REPL_ISR, followers(list[str]), min_isr]  the in-sync replica set a leader's shard must
# wait for before it confirms (every one acked its stream past the record); with fewer than
# min_isr followers it nacks. [] and 0: confirm after the local sync only (standalone, follower).
REPL_ISR = 8

# Requests a frontend or shard sends to the node (REQUEST op names). Args are dicts
# with the AMQP method's fields plus "vhost" and, for frontends, "owner" = [frontend_index, conn_id].
# A channel's declare/bind/delete also carries "chain" = the channel's key: a frontend sends the next
# one before the previous is answered, and the node plans a chain's requests in order and skips those
# after one that failed (broker/request_chains.py).
REQUEST_OPS = (
    "connection.open",  # {"vhost", "user", "owner"}: counted for max-connections; open-ok waits for it
    "exchange.declare",
    "exchange.delete",
    "exchange.bind",
    "exchange.unbind",
    "queue.declare",
    "queue.bind",
    "queue.unbind",
    "queue.delete",
    "connection.closed",  # {"owner": [fe, conn], "exclusive"?: bool}: uncount it, delete its exclusive queues
    #                       (none to look for when "exclusive" is false; absent = look)
    # shard -> node, {"vhost", "queue", "shard", "epoch", "qid"}: the queue's life (the shard's index and
    # epoch, its qid there). The node deletes the queue only if it is still that life and still unused (a
    # request without them is refused: COMMAND_INVALID).
    "queue.auto_delete",  # the last consumer of an auto-delete queue went away
    "queue.expire",  # an x-expires queue was unused that long; delete it if still unused
)

# Queries the node sends to a shard (QUERY op names).
QUERY_OPS = (
    # {"vhost", "queue"} -> {"messages": int, "consumers": int, "qid": int, "expired": bool (x-expires only),
    #                        "damaged_records": int, "damaged_acks": int}
    "queue_info",
    "purge",  # management API, see shard/admin.py for these three
    "get",
    "publish",
    "stats_full",  # {} -> {}: the shard's next STATS carries every queue row (see STATS)
)

# --------------------------------------------------------------------------
# Data plane: frontend -> shard (shard-N.sock)
# --------------------------------------------------------------------------
# PUBLISH: a message routed to one or more queues of this shard (from a frontend; or from another
# shard: a dead letter or a due delayed message with conn_id = its epoch, channel PEER_CHANNEL_DLX or
# PEER_CHANNEL_DELAYED and that shard's confirm_seq).
#   [PUBLISH, vhost, queues(list[str]), exchange, routing_key, props_raw(bytes), body(bytes),
#    persistent(bool), conn_id|None, channel|None, confirm_seq|None]
# conn_id/channel/seq are set when the channel is in confirm mode; the shard answers CONFIRM
# once the message is written (and synced, when persistent into a durable queue).
PUBLISH = 20
# PUBLISH_RUN: consecutive basic.publish of one channel with the same exchange, routing key, flags and
# properties bytes (the parser's PublishRun), routed once: one item per shard instead of one per message.
#   [PUBLISH_RUN, vhost, queues(list[str]), exchange, routing_key, props_raw(bytes), bodies(list[bytes]),
#    persistent(bool), conn_id|None, channel|None, first_confirm_seq|None]
# The shard handles it as len(bodies) PUBLISH items in order; with confirms body i has seq first + i.
# Numbered 48 because 20..39 (to a shard) are all taken; a receiver decodes every kind either way.
PUBLISH_RUN = 48
# CONSUME: [CONSUME, req_id, conn_id, channel, vhost, queue, consumer_tag, no_ack, exclusive,
#           prefetch(int, 0 = unlimited), arguments(dict)]  -> REPLY_DATA {} or error
CONSUME = 21
# CANCEL: [CANCEL, conn_id, channel, consumer_tag, req_id|None (or absent: MQTT)] -> REPLY_DATA {} once
# the consumer is gone, when there is a req_id
# (basic.cancel-ok waits for it; deliveries sent before the answer still reach the client).
CANCEL = 22
# ACK: [ACK, conn_id, channel, flat list q0, m0, q1, m1, ...]  (queue id, message id pairs)
ACK = 23
# NACK: [NACK, conn_id, channel, requeue(bool), flat list q0, m0, ...]  (reject is a nack of one)
NACK = 24
GET = 25  # [GET, req_id, conn_id, channel, vhost, queue, no_ack] -> REPLY_DATA {"message": [...]|None}
QOS = 26  # [QOS, conn_id, channel, global_prefetch(int, 0 = unlimited)]
RECOVER = 27  # [RECOVER, conn_id, channel]  requeue this channel's unacked messages on this shard
# CHANNEL_CLOSED: [CHANNEL_CLOSED, conn_id, channel, req_id|None]  cancel its consumers, requeue its
# unacked; with a req_id (the client's channel.close) -> REPLY_DATA {} once done: close-ok waits for it.
CHANNEL_CLOSED = 28
CONNECTION_CLOSED = 29  # [CONNECTION_CLOSED, conn_id]
PURGE = 30  # [PURGE, req_id, vhost, queue] -> REPLY_DATA {"messages": purged_count}
CREDIT = 31  # [CREDIT, conn_id, channel, consumer_tag, n]  frontend wrote deliveries costing n credits out
# (n < 0: the frontend takes back credit of a consumer whose client stopped reading, and gives it back
# later with positive n; the shard adds n either way and delivers only while the sum is positive:
# frontend/paused_credit.py)
# QUEUE_INFO: [QUEUE_INFO, req_id, vhost, queue] -> REPLY_DATA {"messages", "consumers"}. Asked on the
# data path (not through the node) so the counts include every publish this frontend sent before.
QUEUE_INFO = 32
# DELAYED_PUBLISH: a message for a delayed exchange with a positive x-delay, sent to the shard that
# keeps that exchange's delay store (routing.delay_store_shard). Publish lane, like PUBLISH.
#   [DELAYED_PUBLISH, vhost, exchange, routing_key, props_raw(bytes), body(bytes), persistent(bool),
#    delay_ms(int > 0), conn_id|None, channel|None, confirm_seq|None]
# props_raw already carries x-delay = -delay_ms (what the consumer sees, as RabbitMQ's plugin) and
# keeps CC/BCC: they are applied when the message is routed at its due time. CONFIRM is sent once
# the message is in the delay store (synced first when persistent and the exchange durable).
DELAYED_PUBLISH = 33

# DEDUP_PUBLISH: a publish to a deduplicating exchange (x-message-deduplication), sent by the
# frontend to the exchange's owner shard (broker.dedup.exchange_shard) only, instead of PUBLISHes
# (also by a shard dead-lettering to such an exchange, over its peer DEALER, with conn_id = its epoch, channel
# PEER_CHANNEL_DLX and its outbox record id as confirm_seq: the owner confirms it as a publisher's):
#   [DEDUP_PUBLISH, vhost, exchange, routing_key, props_raw(bytes), body(bytes), persistent(bool),
#    conn_id|None, channel|None, confirm_seq|None, key|None, ttl_ms|None, groups, return_to|None]
# key: the dedup header's value (str, bytes, int, or a tagged str for other field types), None
# when the message has none; ttl_ms: how long the key is remembered (None = until evicted);
# groups: [[shard, [queue, ...]], ...] the routed queues by shard. The owner drops a duplicate
# and forwards the rest as PUBLISH items (conn_id 0, channel PEER_CHANNEL_DEDUP, seq = owner token) to those
# shards, itself included; they answer CONFIRM to the owner's sh-N identity, and the owner
# answers the frontend's confirm_seq once all of them have (one CONFIRM or CONFIRM_NACK).
# return_to: [conn_id, channel] of a mandatory publish: a duplicate routes nowhere, so the owner
# sends it back as RETURN (before its CONFIRM), as RabbitMQ's deduplication exchange does.
DEDUP_PUBLISH = 34

# KV_PUT / KV_GET: small durable key-value stores on a shard (shard/kvstore.py), one per (vhost, space):
# MQTT retained messages (space "mqtt.retained", key = topic) and persistent-session state (space
# "mqtt.session", key = client id). Publish lane, so a put is ordered with the publishes before it.
#   [KV_PUT, req_id|None, vhost, space, key, value|None]  value None deletes; with a req_id the
#       shard answers REPLY_DATA {} once the put is fsynced
#   [KV_GET, req_id, vhost, space, key|None] -> REPLY_DATA {"items": [[key, value], ...]} (None: all keys)
KV_PUT = 35
KV_GET = 36
# MARKED_PUBLISH: a PUBLISH that carries a mark, for MQTT QoS 2 publishes of a persistent session
# (mark = packet id, key = client id, space "mqtt.in2"). Publish lane.
#   [MARKED_PUBLISH, vhost, space, key, mark, publish]  publish: the PUBLISH item for this shard
# The shard keeps the marks of a key as a list in its KV store (vhost, space). A mark already there
# means this shard stored the message before (a resend after a crash of the frontend or of this
# shard): it is confirmed and not stored again. Otherwise the message is stored and the mark
# written in the same handler, so no crash (kill -9) keeps one without the other.
MARKED_PUBLISH = 37
# UNMARK: [UNMARK, req_id|None, vhost, space, key, mark|None]  remove a mark (None: every mark of key);
# with a req_id the shard answers REPLY_DATA {} once that is fsynced. MQTT sends it on PUBREL.
UNMARK = 38
# MARKED_ACK: [MARKED_ACK, req_id, conn_id, channel, queue_id, message_id, vhost, space, key, mark]
# Acknowledge one delivered message and, only when that acknowledgement took (the delivery was still
# this channel's), add mark to key's marks in the KV store (vhost, space), in the same handler: MQTT's
# PUBREC of a QoS 2 delivery (mark = packet id, space "mqtt.out2"), so a crash keeps both or neither.
# -> REPLY_DATA once the mark is fsynced (at once when the ack did not take). Control lane (ordered with ACK and
# CONNECTION_CLOSED of the same connection).
MARKED_ACK = 39

# PEER_DONE: over a shard's peer DEALER at a clean stop, once the sender's own forwards are settled:
#   [PEER_DONE]  nothing more follows from it. A stopping shard keeps serving (storing, syncing,
#   confirming) until every other shard said so (at most STOP_WAIT_S and a little), so a forward of a
#   peer that got its STOP later never meets a closed socket (shard/forward_settle.py).
#   [PEER_DONE, 2]  (a cluster leader's shard, later in its stop) its final sync reached the followers:
#   the shards close their replication streams once each said so (shard/streams_close.py).
PEER_DONE = 49

# Channel numbers of the confirmed PUBLISH items a shard sends to another shard (conn_id 0): the
# CONFIRM answers come back to the sender's peer DEALER and are told apart by this number.
PEER_CHANNEL_DEDUP = 0
PEER_CHANNEL_DELAYED = 1
PEER_CHANNEL_DLX = 2  # dead letters for queues of another shard (shard/dead_letter_forwards.py)

# --------------------------------------------------------------------------
# Data plane: shard -> frontend
# --------------------------------------------------------------------------
# DELIVER: [DELIVER, conn_id, channel, consumer_tag, queue_id, msg_id, redelivered,
#           exchange, routing_key, props_raw, body]
DELIVER = 40
CONFIRM = 41  # [CONFIRM, conn_id, channel, seqs(list[int])]
# CONFIRM_NACK: [CONFIRM_NACK, conn_id, channel, seqs(list[int]), refused(list[str])?]  refused (26), only in
#   the answer to one PUBLISH that a queue refused: the names of its queues that did not store it (full with
#   x-overflow reject-publish, a failed append; a reject-publish-dlx queue dead-lettered it and is not named),
#   the others did. Without it: not stored or not durable as asked (sync failed, ISR below --min-isr).
#   A deduplicating exchange's owner answers a dead letter's DEDUP_PUBLISH the same way (29): refused names
#   the routed queues that may not hold it; without it, every routed queue holds it (not durable as asked).
CONFIRM_NACK = 42
# REPLY_DATA: [REPLY_DATA, req_id, ok(bool), result]  same shape as REPLY
#   GET result: {"message": [queue_id, msg_id, redelivered, exchange, routing_key, props_raw, body,
#                            remaining_count] or None}
REPLY_DATA = 43
CANCEL_NOTIFY = 44  # [CANCEL_NOTIFY, conn_id, channel, consumer_tag]  queue deleted under a consumer
PROCESSED = 45  # [PROCESSED, batch_seq]  highest data batch from this frontend fully handled
CLOSE_CHANNEL = 46  # [CLOSE_CHANNEL, conn_id, channel, reply_code, text]  e.g. consumer timeout
# RETURN: [RETURN, conn_id, channel, reply_code, reply_text, exchange, routing_key, props_raw, body]
# a mandatory message that routed nowhere after all (a deduplicating exchange's duplicate)
RETURN = 47

# Flow control. Every consumer starts with CREDIT_WINDOW credits on its shard; each DELIVER
# spends its cost (below); the frontend returns credit (CREDIT items) once it has written deliveries to a
# client socket that is not paused, so a slow client never makes a frontend buffer unboundedly.
# The window must cover the deliveries in flight during one credit round trip (shard -> frontend ->
# socket write -> CREDIT -> shard, several loop turns on a loaded box): at 2000 the shard's delivery
# passes found the consumer out of credit 87 % of the time with 16 B bodies (issue #15).
CREDIT_WINDOW = 16000
# A delivery costs 1 + (len(body) >> CREDIT_BYTES_SHIFT) credits (shard and frontend compute the same),
# so the window bounds bytes too: about 8 MiB of large bodies per consumer (16000 credits of 512 B)
# instead of 16000 bodies; bodies under 512 B cost 1.
CREDIT_BYTES_SHIFT = 9
# A frontend stops reading from its client sockets while more than this many publish-lane
# batches to any one shard are not yet answered by PROCESSED.
MAX_BATCHES_IN_FLIGHT = 8
# ... or while the publish-lane batches to one shard that are not answered yet hold more than this
# many bytes: with large bodies a few batches are already hundreds of MB (ZeroMQ queues them in both
# processes). One turn's reads may go over it; the next batch waits.
MAX_BYTES_IN_FLIGHT = 8 << 20

# Lanes. Each frontend connects TWO DEALERs to every shard: the publish lane (identity
# "fe-K") carries PUBLISH and everything that must stay ordered with publishes (GET, PURGE,
# QUEUE_INFO); the control lane (identity "fe-K" + CONTROL_LANE_SUFFIX) carries acks, credit,
# consume/cancel and channel/connection ends. The shard's ROUTER fair-queues between the two,
# so under a publish flood acks and credit are not stuck behind thousands of queued publishes.
# Control-lane batches carry header [epoch, None, control_count, token] and get no PROCESSED answer;
# every reply goes to the publish-lane identity. A publish-lane batch waits for the control-lane
# items put before it (header comment at the top of this module).
CONTROL_LANE_SUFFIX = b"+"
CONTROL_LANE_KINDS = frozenset((23, 24, 31, 21, 22, 26, 27, 28, 29, 39))  # ACK NACK CREDIT CONSUME CANCEL QOS
#                                                          RECOVER CHANNEL_CLOSED CONNECTION_CLOSED MARKED_ACK


_packer = msgpack.Packer(use_bin_type=True, autoreset=True)
# A Packer's buffer grows to the largest batch it packed and never shrinks: after one bigger than
# this (a SNAPSHOT of 100,000 queues, a full STATS report) the next batch gets a fresh Packer, so a
# booted node and its shards do not keep a buffer of that size for good.
_PACKER_KEEP = 1 << 20


def pack(header: Any, items: list) -> bytes:
    """Encode one batch."""
    global _packer
    data = _packer.pack([header, items])
    if len(data) > _PACKER_KEEP:
        _packer = msgpack.Packer(use_bin_type=True, autoreset=True)
    return data


def unpack(data: bytes) -> tuple[Any, list]:
    """Decode one batch into (header, items). Raises ValueError on garbage."""
    try:
        header, items = msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises several types; callers only need one
        raise ValueError(f"malformed batch: {exc}") from exc
    return header, items


# --------------------------------------------------------------------------
# Addresses
# --------------------------------------------------------------------------
def node_stream_path(run_dir: str) -> str:
    """The control plane's unix stream socket (node <-> every worker, ``broker/unixio.py``): frames
    and hello as ``shard_stream_path`` describes, the worker's identity ``fe-K`` / ``sh-N``."""
    return fit(os.path.join(run_dir, "node.sock"))


def defs_fence_path(run_dir: str) -> str:
    """8 bytes the node maps read-write and every worker read-only: the newest definitions version of
    a change the node answered without waiting for APPLIED (``broker/defs_fence.py``)."""
    return os.path.join(run_dir, "defs.fence")


def shard_address(run_dir: str, index: int) -> str:
    return "ipc://" + fit(os.path.join(run_dir, f"shard-{index}.sock"))


def shard_stream_path(run_dir: str, index: int) -> str:
    """Unix stream socket of shard ``index``'s data plane with ``--ipc-transport unix``
    (``broker/unixio.py``): frames of ``STREAM_FRAME`` (the payload's length) + payload; a connecting
    peer's first frame is ``STREAM_HELLO`` + its identity (``fe-K``, ``fe-K+``, ``sh-M``), every
    later frame in either direction one batch exactly as over ZeroMQ."""
    return fit(os.path.join(run_dir, f"shard-{index}.stream"))


STREAM_FRAME = struct.Struct("<I")
STREAM_HELLO = b"SMQ-HELLO\x01"


def fsync_beacon_path(run_dir: str, index: int) -> str:
    """16 bytes shard ``index`` maps and the node reads: the start of its running group sync
    (``broker/fsync_beacon.py``; the cluster leader's disk-stall check)."""
    return os.path.join(run_dir, f"fsync-shard-{index}")


def repl_handoff_path(run_dir: str, index: int) -> str:
    """Unix datagram socket where shard ``index`` receives replication connections from the node
    (``replication/handoff.py``): one datagram per connection, the socket as SCM_RIGHTS ancillary
    data, the payload ``pack_handoff(follower_name, heartbeat)``."""
    return fit(os.path.join(run_dir, f"repl-shard-{index}.sock"))


def pack_handoff(follower: str, heartbeat: float = 0.0) -> bytes:
    """``heartbeat``: the interval the follower announced in its HELLO (0: none; replication/protocol.py)."""
    return msgpack.packb([VERSION, follower, float(heartbeat)], use_bin_type=True)


def unpack_handoff(data: bytes) -> tuple[str, float]:
    """(follower name, its heartbeat interval) of a handoff datagram."""
    try:
        version, follower, heartbeat = msgpack.unpackb(data, raw=False)
    except Exception as exc:
        raise ValueError(f"malformed handoff: {exc}") from exc
    if version != VERSION:
        raise ValueError(f"handoff of contract version {version}")
    return str(follower), float(heartbeat)


def worker_id(role: str, index: int) -> bytes:
    return f"{'fe' if role == 'frontend' else 'sh'}-{index}".encode()


assert CONTROL_LANE_KINDS == frozenset((ACK, NACK, CREDIT, CONSUME, CANCEL, QOS, RECOVER, CHANNEL_CLOSED,
                                        CONNECTION_CLOSED, MARKED_ACK))


# --------------------------------------------------------------------------
# Kind registry
# --------------------------------------------------------------------------
# Every message kind, by namespace (the socket it travels on, both directions: a receiver decodes
# all of them), with the contract VERSION that introduced it (the history comment above VERSION
# names it). Two branches once picked the same numbers independently: a new kind goes here too,
# and tests/test_contract.py fails when a number is taken twice in a namespace, a kind constant is
# missing from this table, or its version is not stated.
KINDS: dict[str, dict[str, tuple[int, int]]] = {
    "control": {  # node.sock: worker -> node 1..9, node -> worker 10..19
        "HELLO": (HELLO, 1), "APPLIED": (APPLIED, 1), "REQUEST": (REQUEST, 1), "QUERY_REPLY": (QUERY_REPLY, 1),
        "FORWARD": (FORWARD, 1), "STATS": (STATS, 4), "REPL_STATUS": (REPL_STATUS, 5), "REPL_ISR": (REPL_ISR, 5),
        "SNAPSHOT": (SNAPSHOT, 1), "DEFS": (DEFS, 1), "REPLY": (REPLY, 1), "SHARD_UP": (SHARD_UP, 1),
        "WORKER_DOWN": (WORKER_DOWN, 1), "QUERY": (QUERY, 1), "STOP": (STOP, 1),
        "CLOSE_CONNECTIONS": (CLOSE_CONNECTIONS, 4), "FORWARDED": (FORWARDED, 1), "ALARMS": (ALARMS, 4),
    },
    "data": {  # shard-N.sock: to a shard 20..39, from a shard 40..
        "PUBLISH": (PUBLISH, 1), "CONSUME": (CONSUME, 1), "CANCEL": (CANCEL, 1), "ACK": (ACK, 1), "NACK": (NACK, 1),
        "GET": (GET, 1), "QOS": (QOS, 1), "RECOVER": (RECOVER, 1), "CHANNEL_CLOSED": (CHANNEL_CLOSED, 1),
        "CONNECTION_CLOSED": (CONNECTION_CLOSED, 1), "PURGE": (PURGE, 1), "CREDIT": (CREDIT, 1),
        "QUEUE_INFO": (QUEUE_INFO, 3), "DELAYED_PUBLISH": (DELAYED_PUBLISH, 2), "DEDUP_PUBLISH": (DEDUP_PUBLISH, 3),
        "KV_PUT": (KV_PUT, 4), "KV_GET": (KV_GET, 4),
        "MARKED_PUBLISH": (MARKED_PUBLISH, 7), "UNMARK": (UNMARK, 7), "MARKED_ACK": (MARKED_ACK, 7),
        "DELIVER": (DELIVER, 1), "CONFIRM": (CONFIRM, 1), "CONFIRM_NACK": (CONFIRM_NACK, 1),
        "REPLY_DATA": (REPLY_DATA, 1), "CANCEL_NOTIFY": (CANCEL_NOTIFY, 1), "PROCESSED": (PROCESSED, 1),
        "CLOSE_CHANNEL": (CLOSE_CHANNEL, 1), "RETURN": (RETURN, 6),
        "PUBLISH_RUN": (PUBLISH_RUN, 13), "PEER_DONE": (PEER_DONE, 18),
    },
}
# Integer constants of this module that are not message kinds.
NOT_KINDS = ("VERSION", "CREDIT_WINDOW", "CREDIT_BYTES_SHIFT", "MAX_BATCHES_IN_FLIGHT", "MAX_BYTES_IN_FLIGHT",
             "PEER_CHANNEL_DEDUP", "PEER_CHANNEL_DELAYED", "PEER_CHANNEL_DLX")
