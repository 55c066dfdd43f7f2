"""MQTT.js in headless Chromium talks to ShardMQ over WebSocket (--ws-port, /ws, subprotocol mqtt)."""

from __future__ import annotations

import shutil
import time

from broker.mqtt import codec as M
from tests.browser import headless_chromium, mqttjs_bundle
from tests.harness import free_port
from tests.raw_mqtt import RawMQTT

PAGE = "tests/js/mqtt_page.html"


def test_mqttjs_in_chromium_publishes_and_receives(node_factory, tmp_path):
    from tests.harness import REPO_ROOT

    node = node_factory(name="ws", frontends=1, shards=1, mqtt_port=free_port(), ws_port=free_port())
    shutil.copy(mqttjs_bundle(), tmp_path / "mqtt.min.js")
    shutil.copy(REPO_ROOT / PAGE, tmp_path / "page.html")
    watcher = RawMQTT(node.mqtt_port)
    assert watcher.connect("watcher").return_code == 0
    assert watcher.subscribe(1, [("browser/out", 1)]) == [1]
    driver = headless_chromium()
    try:
        driver.get(f"file://{tmp_path / 'page.html'}?url=ws://127.0.0.1:{node.ws_port}/ws")
        p = watcher.recv(timeout=30)  # Chromium's start is slow on a loaded machine
        assert (p.topic, p.payload, p.qos) == ("browser/out", b"hello from chromium", 1)
        watcher.ack(M.PUBACK, p.packet_id)
        watcher.publish("browser/in/x", b"hello browser", qos=1, pid=5)
        assert watcher.recv() == M.Ack(M.PUBACK, 5)
        deadline = time.monotonic() + 15
        state = {}
        while time.monotonic() < deadline:
            state = driver.execute_script("return window.state")
            if state["received"]:
                break
            time.sleep(0.1)
        assert state["received"] == [["browser/in/x", "hello browser", 1]], state
        assert state["errors"] == []
    finally:
        driver.quit()
        watcher.disconnect()
