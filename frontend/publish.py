"""The one place a routed publish becomes contract items: group the queues by shard, one PUBLISH per shard.

Every protocol calls this after routing (``Definitions.route`` on its exchange and
routing key): an AMQP basic.publish, an MQTT PUBLISH (to amq.topic). With
confirm fields the shards answer CONFIRM/CONFIRM_NACK to ``(conn_id, channel,
seq)``; the caller numbers the publish after learning how many shards it went to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from broker import contract
from broker.turn_batch import MAX_BATCH_ITEMS

if TYPE_CHECKING:
    from broker.definitions import Definitions
    from frontend.worker import FrontendWorker

_PUBLISH = contract.PUBLISH
_MARKED_PUBLISH = contract.MARKED_PUBLISH
_PUBLISH_RUN = contract.PUBLISH_RUN
RUN_MAX = MAX_BATCH_ITEMS  # bodies per PUBLISH_RUN item at most


def queues_by_shard(defs: Definitions, vhost: str, queues: Sequence[str]) -> dict[int, list]:
    """Queue names grouped by the shard that owns them (routed queues exist in defs). Lists, never the
    routing's cached tuple: a PUBLISH carries them to a paired shard as they are (broker/local_link.py)."""
    if len(queues) == 1:
        name = queues[0]
        return {defs.queue(vhost, name).shard: [name]}
    groups: dict[int, list] = {}
    for name in queues:
        shard = defs.queue(vhost, name).shard
        group = groups.get(shard)
        if group is None:
            groups[shard] = [name]
        else:
            group.append(name)
    return groups


def put_publish(worker: FrontendWorker, groups: dict[int, list], vhost: str, exchange: str, routing_key: str,
                props_raw: bytes, body: bytes, persistent: bool, conn_id: int | None = None,
                channel: int | None = None, seq: int | None = None) -> None:
    """One PUBLISH item per shard on its publish lane (confirm fields None: no CONFIRM comes back)."""
    put = worker.shard_put
    for shard, names in groups.items():
        put(shard, [_PUBLISH, vhost, names, exchange, routing_key, props_raw, body, persistent,
                    conn_id, channel, seq])


def put_publish_run(worker: FrontendWorker, groups: dict[int, list], vhost: str, exchange: str, routing_key: str,
                    props_raw: bytes, bodies: list, persistent: bool, conn_id: int | None = None,
                    channel: int | None = None, first_seq: int | None = None) -> None:
    """Publishes alike but for their bodies, routed once: one PUBLISH_RUN item per shard (body i has
    confirm seq first_seq + i)."""
    put = worker.shard_put
    if len(bodies) > RUN_MAX:
        # Cut so that one item never outweighs a batch (broker/turn_batch.py put_weighted): batches
        # in flight then bound the messages in flight as they do for single PUBLISH items.
        for i in range(0, len(bodies), RUN_MAX):
            put_publish_run(worker, groups, vhost, exchange, routing_key, props_raw, bodies[i : i + RUN_MAX],
                            persistent, conn_id, channel, None if first_seq is None else first_seq + i)
        return
    for shard, names in groups.items():
        put(shard, [_PUBLISH_RUN, vhost, names, exchange, routing_key, props_raw, bodies, persistent,
                    conn_id, channel, first_seq])


def put_marked_publish(worker: FrontendWorker, groups: dict[int, list], vhost: str, space: str, key: str,
                       mark: object, exchange: str, routing_key: str, props_raw: bytes, body: bytes,
                       conn_id: int, channel: int, seq: int) -> None:
    """A confirmed persistent publish stored at most once per (key, mark) on each shard (MARKED_PUBLISH):
    MQTT QoS 2 of a persistent session, where mark is the packet id."""
    put = worker.shard_put
    for shard, names in groups.items():
        put(shard, [_MARKED_PUBLISH, vhost, space, key, mark,
                    [_PUBLISH, vhost, names, exchange, routing_key, props_raw, body, True, conn_id, channel, seq]])
