"""The management HTTP API on a real node: plain HTTP, RabbitMQ's shapes, auth and tags."""

from __future__ import annotations

import os
import time

import pika
import pytest

from shard.store import queue_dir
from tests.helpers import get_one, uid
from tests.mgmt_api import Api, connect, q

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def mnode(tmp_path_factory):
    from tests.harness import NodeFactory

    factory = NodeFactory(tmp_path_factory.mktemp("mgmt_node"))
    try:
        yield factory(name="node", frontends=2, shards=2, extra_args=["--stats-interval", "200"])
    finally:
        factory.cleanup()


@pytest.fixture(scope="module")
def api(mnode):
    return Api(mnode.http_port)


def test_auth_and_tags(mnode, api):
    assert api.get("/api/whoami") == {"name": "guest", "tags": ["administrator"]}
    assert api.as_user("guest", "wrong").call("GET", "/api/overview")[0] == 401
    status, body = Api(mnode.http_port, "nobody", "x").call("GET", "/api/overview")
    assert (status, body["error"]) == (401, "not_authorised")
    api.add_user("plain", "pw", tags="")
    assert api.as_user("plain", "pw").call("GET", "/api/overview") == (
        401, {"error": "not_authorised", "reason": "Not management user"})
    api.add_user("watcher", "pw", tags="monitoring", vhost=None)
    watcher = api.as_user("watcher", "pw")
    assert watcher.get("/api/overview")["product_name"] == "ShardMQ"
    assert watcher.call("PUT", "/api/vhosts/nope", {})[0] == 401
    assert watcher.call("GET", "/api/users")[0] == 401
    # A management user sees only the vhosts it has permissions on.
    api.put(f"/api/vhosts/{q('team-a')}")
    api.add_user("teamer", "pw", tags="management", vhost="team-a")
    teamer = api.as_user("teamer", "pw")
    assert [v["name"] for v in teamer.get("/api/vhosts")] == ["team-a"]
    assert teamer.call("GET", "/api/queues/%2F")[0] == 404
    assert teamer.call("PUT", "/api/queues/team-a/mine", {"durable": True})[0] == 201
    assert [x["name"] for x in teamer.get("/api/queues")] == ["mine"]


def test_queue_counts_paging_sorting_filtering(mnode, api):
    prefix = uid("page")
    conn = mnode.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    for i in range(12):
        ch.queue_declare(f"{prefix}-{i:02d}")
        for _ in range(i):
            ch.basic_publish("", f"{prefix}-{i:02d}", b"m")
    conn.close()
    listing = api.wait_for(f"/api/queues/%2F?name={prefix}&page=1&page_size=5&sort=messages&sort_reverse=true",
                           lambda d: [i["messages"] for i in d["items"]] == [11, 10, 9, 8, 7])
    assert [i["name"] for i in listing["items"]] == [f"{prefix}-{i:02d}" for i in (11, 10, 9, 8, 7)]
    assert (listing["filtered_count"], listing["page_count"], listing["page_size"]) == (12, 3, 5)
    assert listing["items"][0]["messages_ready"] == 11 and listing["items"][0]["vhost"] == "/"
    last = api.get(f"/api/queues?name=^{prefix}-0[0-3]$&use_regex=true&page=1&page_size=10&columns=name,messages")
    assert last["items"] == [{"name": f"{prefix}-{i:02d}", "messages": i} for i in range(4)]
    one = api.get(f"/api/queues/%2F/{prefix}-05")
    assert (one["messages"], one["consumers"], one["durable"], one["type"]) == (5, 0, False, "classic")
    assert api.call("GET", f"/api/queues/%2F/{prefix}-nope")[0] == 404
    assert api.call("GET", "/api/queues?page=0")[0] == 400


def test_queue_exchange_binding_crud_publish_get_purge(mnode, api):
    qn, xn = uid("crud"), uid("x")
    assert api.put(f"/api/queues/%2F/{qn}", {"durable": True, "arguments": {"x-max-length": 100}}) == 201
    assert api.call("PUT", f"/api/queues/%2F/{qn}", {"durable": False})[0] == 400  # inequivalent
    assert api.put(f"/api/exchanges/%2F/{xn}", {"type": "topic", "durable": True}) == 201
    status, _ = api.call("POST", f"/api/bindings/%2F/e/{xn}/q/{qn}", {"routing_key": "a.#"})
    assert status == 201
    bindings = api.get(f"/api/bindings/%2F/e/{xn}/q/{qn}")
    assert [(b["routing_key"], b["properties_key"]) for b in bindings] == [("a.#", "a.#")]
    assert api.get(f"/api/exchanges/%2F/{xn}")["type"] == "topic"
    for i in range(3):
        status, routed = api.call("POST", f"/api/exchanges/%2F/{xn}/publish", {
            "routing_key": "a.b", "payload": f"hello {i}", "payload_encoding": "string",
            "properties": {"content_type": "text/plain", "headers": {"k": "v"}}})
        assert (status, routed) == (200, {"routed": True})
    assert api.call("POST", f"/api/exchanges/%2F/{xn}/publish", {"routing_key": "z", "payload": "x",
                                                                 "payload_encoding": "string"})[1] == {"routed": False}
    status, msgs = api.call("POST", f"/api/queues/%2F/{qn}/get", {"count": 2, "ackmode": "ack_requeue_true",
                                                                 "encoding": "auto", "truncate": 3})
    assert status == 200 and [m["payload"] for m in msgs] == ["hel", "hel"]
    assert msgs[0]["properties"]["headers"] == {"k": "v"} and msgs[0]["payload_bytes"] == 7
    assert msgs[0]["routing_key"] == "a.b" and msgs[0]["exchange"] == xn
    status, msgs = api.call("POST", f"/api/queues/%2F/{qn}/get", {"count": 1, "ackmode": "ack_requeue_false",
                                                                 "encoding": "base64"})
    assert msgs[0]["payload_encoding"] == "base64" and msgs[0]["redelivered"] is True
    assert api.get(f"/api/queues/%2F/{qn}")["messages"] == 2
    api.delete(f"/api/queues/%2F/{qn}/contents")
    assert api.get(f"/api/queues/%2F/{qn}")["messages"] == 0
    api.delete(f"/api/bindings/%2F/e/{xn}/q/{qn}/a.%23")
    assert api.get(f"/api/bindings/%2F/e/{xn}/q/{qn}") == []
    api.delete(f"/api/exchanges/%2F/{xn}")
    api.delete(f"/api/queues/%2F/{qn}")
    assert api.call("GET", f"/api/queues/%2F/{qn}")[0] == 404
    assert api.call("PUT", "/api/exchanges/%2F/bad", {"type": "nope"})[0] == 400
    assert api.call("PUT", "/api/queues/%2F/bad", "not an object")[0] == 400
    assert api.call("PUT", "/api/exchanges/%2F/bad", {"type": "direct", "arguments": "x"})[0] == 400
    for bad in ({"queues": [1]}, {"users": "x"}, [1, 2]):
        status, body = api.call("POST", "/api/definitions", bad)
        assert status == 400 and body["error"] == "bad_request", (bad, body)


def test_connections_channels_consumers_and_close(mnode, api):
    conn = pika.BlockingConnection(pika.ConnectionParameters(
        host="127.0.0.1", port=mnode.port, credentials=pika.PlainCredentials("guest", "guest"),
        client_properties={"connection_name": "api-test"}))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=7)
    qn = ch.queue_declare("", exclusive=True).method.queue
    tag = ch.basic_consume(qn, lambda *a: None)
    port = conn._impl.socket.getsockname()[1] if hasattr(conn._impl, "socket") else None

    def mine(rows):
        return [r for r in rows if r["client_properties"].get("connection_name") == "api-test"]
    rows = mine(api.wait_for("/api/connections", lambda d: mine(d)))
    c = rows[0]
    assert (c["user"], c["vhost"], c["peer_host"], c["protocol"]) == ("guest", "/", "127.0.0.1", "AMQP 0-9-1")
    if port:
        assert c["peer_port"] == port
    chans = api.wait_for("/api/channels", lambda d: any(x["connection_details"]["name"] == c["name"]
                                                        and x["prefetch_count"] == 7 for x in d))
    assert chans
    cons = api.wait_for("/api/consumers", lambda d: any(x["consumer_tag"] == tag for x in d))
    assert [x["queue"]["name"] for x in cons if x["consumer_tag"] == tag] == [qn]
    status, _ = api.call("DELETE", f"/api/connections/{q(c['name'])}", headers={"X-Reason": "bye now"})
    assert status == 204
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as info:
        conn.process_data_events(time_limit=10)
    assert info.value.reply_code == 320 and "bye now" in info.value.reply_text
    api.wait_for("/api/connections", lambda d: not mine(d))
    assert api.call("DELETE", f"/api/connections/{q(c['name'])}")[0] == 404


def test_vhost_delete_removes_queues_and_their_data(mnode, api):
    api.put("/api/vhosts/doomed", {"description": "short lived", "tags": "a,b"})
    assert api.get("/api/vhosts/doomed")["tags"] == ["a", "b"]
    conn = connect(mnode, "guest", "guest", vhost="doomed")
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("keep", durable=True)
    ch.basic_publish("", "keep", b"x", pika.BasicProperties(delivery_mode=2))
    path = queue_dir(str(mnode.data_dir), "doomed", "keep")
    assert os.path.isdir(path)
    api.delete("/api/vhosts/doomed")
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker):
        conn.process_data_events(time_limit=10)
    deadline = time.monotonic() + 10
    while os.path.exists(path):
        assert time.monotonic() < deadline, "queue data still on disk after its vhost was deleted"
        time.sleep(0.05)
    assert api.call("GET", "/api/vhosts/doomed")[0] == 404
    assert "doomed" not in [v["name"] for v in api.get("/api/vhosts")]


def test_policies_limits_and_aliveness(mnode, api):
    assert api.put("/api/policies/%2F/ttl", {"pattern": "^ttl-", "definition": {"message-ttl": 1000},
                                             "apply-to": "queues"}) == 201
    assert api.get("/api/policies/%2F/ttl")["definition"] == {"message-ttl": 1000}
    assert api.call("PUT", "/api/policies/%2F/bad", {"pattern": "x", "definition": {"nope": 1}})[0] == 400
    api.delete("/api/policies/%2F/ttl")
    api.put("/api/vhost-limits/%2F/max-queues", {"value": 10000})
    assert api.get("/api/vhost-limits/%2F") == [{"vhost": "/", "value": {"max-queues": 10000}}]
    api.delete("/api/vhost-limits/%2F/max-queues")
    assert api.get("/api/aliveness-test/%2F") == {"status": "ok"}
    assert api.get("/api/nodes")[0]["running"] is True


def test_message_stats_totals_and_rates(mnode, api):
    qn = uid("stats")
    conn = mnode.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(qn)
    for _ in range(20):
        ch.basic_publish("", qn, b"m")
    for _ in range(5):
        method, _props, _body = ch.basic_get(qn)
        ch.basic_ack(method.delivery_tag)
    q = api.wait_for(f"/api/queues/%2F/{qn}", lambda d: d["message_stats"].get("ack") == 5)
    stats = q["message_stats"]
    assert (stats["publish"], stats["deliver_get"], stats["ack"]) == (20, 5, 5)
    assert set(stats["publish_details"]) == {"rate"}
    # The overview's publish count is the frontends' (their own STATS reports, on their own timers):
    # it may arrive after the shard's report that showed the acks.
    api.wait_for("/api/overview", lambda d: d["message_stats"]["publish"] >= 20)
    conn.close()


def test_rates_from_two_reports():
    from broker.node_stats import NodeStats

    st = NodeStats()
    st.update("shard", 0, {"queues": [["/", "q", 0, 0, 0, 0, 100, 40, 30]], "totals": [100, 40, 30]})
    st.update("shard", 0, {"queues": [["/", "q", 0, 0, 0, 0, 300, 140, 30]], "totals": [300, 140, 30]})
    st.received_at[("shard", 0)] = st.previous[0][0] + 2.0  # the second report came 2 s later
    st._prev_rows = None
    ms = st.message_stats(st.queues()[("/", "q")])
    assert ms["publish"] == 300 and ms["publish_details"] == {"rate": 100.0}
    assert ms["deliver_get_details"] == {"rate": 50.0} and ms["ack_details"] == {"rate": 0.0}
    for totals in (st.totals(), st.totals({("/", "q")})):  # from the shard's sums, and per queue
        assert totals["publish"] == 300 and totals["publish_details"] == {"rate": 100.0}
    st.update("shard", 0, {"queues": [["/", "q", 0, 0, 0, 0, 5, 0, 0]]})  # shard restarted: counters reset
    assert st.message_stats(st.queues()[("/", "q")])["publish_details"]["rate"] == 0.0


def test_overview_totals(mnode, api):
    qn = uid("ov")
    conn = mnode.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(qn)
    ch.basic_publish("", qn, b"1")
    ov = api.wait_for("/api/overview", lambda d: d["object_totals"]["connections"] >= 1
                      and d["queue_totals"]["messages"] >= 1)
    assert ov["object_totals"]["queues"] >= 1 and ov["listeners"][0]["port"] == mnode.port
    assert get_one(ch, qn)[2] == b"1"
    conn.close()


def test_vhost_default_queue_type_applies_to_declares(mnode, api):
    assert api.call("PUT", "/api/vhosts/dqt-bad", {"default_queue_type": "mirrored"})[0] == 400
    api.put("/api/vhosts/dqt", {"default_queue_type": "quorum"})
    assert api.get("/api/vhosts/dqt")["default_queue_type"] == "quorum"
    api.put("/api/vhosts/dqt-stream", {"default_queue_type": "stream"})
    conn = connect(mnode, "guest", "guest", vhost="dqt")
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("work", durable=True)  # no x-queue-type: the vhost's default
    ch.queue_declare("work", durable=True)  # redeclared the same way: not "inequivalent"
    ch.queue_declare("plain", durable=True, arguments={"x-queue-type": "classic"})
    excl = ch.queue_declare("", exclusive=True).method.queue  # cannot be quorum: stays classic
    ch.basic_publish("", "work", b"q", pika.BasicProperties(delivery_mode=2))
    assert get_one(ch, "work")[2] == b"q"
    types = {n: api.get(f"/api/queues/dqt/{q(n)}")["type"] for n in ("work", "plain", excl)}
    assert types == {"work": "quorum", "plain": "classic", excl: "classic"}
    conn.close()
    sconn = connect(mnode, "guest", "guest", vhost="dqt-stream")
    sch = sconn.channel()
    sch.queue_declare("events", durable=True)
    assert api.get("/api/queues/dqt-stream/events")["type"] == "stream"
    assert api.get("/api/queues/dqt-stream/events")["arguments"] == {"x-queue-type": "stream"}
    sconn.close()
