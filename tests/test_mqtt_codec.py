"""The sans-IO MQTT codec and topic rules, without a broker."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.mqtt import codec as M
from broker.mqtt.topics import (
    filter_to_key,
    key_to_topic,
    matches,
    topic_to_key,
    valid_topic_filter,
    valid_topic_name,
)

text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=30)


@given(topic=text.filter(bool), payload=st.binary(max_size=300), qos=st.integers(0, 2), retain=st.booleans(),
       pid=st.integers(1, 65535), cut=st.integers(0, 400))
def test_publish_round_trips_split_anywhere(topic, payload, qos, retain, pid, cut):
    data = M.encode_publish(topic.encode(), payload, qos, retain, qos > 0, pid if qos else 0)
    parser = M.MQTTParser()
    packets = parser.feed(data[:cut]) + parser.feed(data[cut:])
    assert packets == [M.Publish(topic, payload, qos, retain, qos > 0, pid if qos else 0)]


@given(topic=text.filter(bool), payload=st.binary(max_size=300), qos=st.integers(1, 2), pid=st.integers(1, 65535))
def test_publish_head_plus_packet_id_plus_payload_is_the_publish(topic, payload, qos, pid):
    head = M.publish_head(topic.encode(), len(payload), qos)
    assert head + pid.to_bytes(2, "big") + payload == M.encode_publish(topic.encode(), payload, qos, packet_id=pid)


@given(client_id=text, clean=st.booleans(), keep=st.integers(0, 65535), user=st.none() | text,
       will=st.none() | st.tuples(text.filter(bool), st.binary(max_size=20), st.integers(0, 2), st.booleans()))
def test_connect_round_trips(client_id, clean, keep, user, will):
    w = M.Publish(*will) if will else None
    password = b"pw" if user is not None else None
    data = M.encode_connect(client_id, clean, keep, user, password, w)
    assert M.MQTTParser().feed(data) == [M.Connect("MQTT", 4, clean, keep, client_id, w, user, password)]


@given(st.binary(max_size=200))
def test_garbage_raises_only_protocol_errors(data):
    try:
        M.MQTTParser(max_packet_size=1000).feed(data)
    except M.MQTTProtocolError:
        pass


def test_paho_encodes_what_we_parse():
    import paho.mqtt.client as mqtt

    sent: list[bytes] = []
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="codec", protocol=mqtt.MQTTv311)
    c._sock = type("S", (), {"send": lambda self, b: sent.append(bytes(b)) or len(b), "fileno": lambda self: -1,
                             "setblocking": lambda self, f: None})()
    c._state = mqtt._ConnectionState.MQTT_CS_CONNECTED if hasattr(mqtt, "_ConnectionState") else 0
    c.subscribe([("a/+", 1), ("b/#", 2)])
    c.publish("x/y", b"body", qos=1)
    c.loop_write()
    packets = M.MQTTParser().feed(b"".join(sent))
    assert packets[0] == M.Subscribe(packets[0].packet_id, [("a/+", 1), ("b/#", 2)])
    assert (packets[1].topic, packets[1].payload, packets[1].qos) == ("x/y", b"body", 1)


@pytest.mark.parametrize("topic_filter,topic,expected", [
    ("a/+/c", "a/b/c", True), ("a/+/c", "a/b/d", False), ("a/#", "a", True), ("a/#", "a/b/c", True),
    ("#", "$SYS/x", False), ("+/x", "$SYS/x", False), ("$SYS/#", "$SYS/x", True), ("+", "/x", False),
    ("+/+", "/x", True), ("a/b", "a/b/c", False), ("a/+", "a/", True),
])
def test_matching(topic_filter, topic, expected):
    assert matches(topic_filter, topic) is expected


def test_validation_and_mapping_to_amqp_keys():
    assert valid_topic_filter("a/+/#") and not valid_topic_filter("a/#/b") and not valid_topic_filter("a+")
    assert not valid_topic_filter("") and not valid_topic_name("a/+") and not valid_topic_name("")
    assert topic_to_key("a/b.c") == "a.b/c" and key_to_topic("a.b/c") == "a/b.c"
    assert filter_to_key("a/+/#") == "a.*.#"


def test_fixed_header_rules():
    with pytest.raises(M.MQTTProtocolError):
        M.MQTTParser(max_packet_size=10).feed(M.encode_publish(b"t", b"x" * 20))
    with pytest.raises(M.MQTTProtocolError):
        M.MQTTParser().feed(bytes((0x62, 2, 0, 0)) + bytes((0x60, 2, 0, 1)))  # PUBREL needs flags 0b0010
    assert M.MQTTParser().feed(bytes((0x62, 2, 0, 1))) == [M.Ack(M.PUBREL, 1)]
    assert M.encode_suback(5, [0, 0x80]) == bytes((0x90, 4, 0, 5, 0, 0x80))
