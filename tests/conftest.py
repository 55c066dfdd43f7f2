"""Fixtures that start REAL nodes (see tests/harness.py).

- ``node``: a fresh node per test (2 frontends, 2 shards).
- ``node_factory``: ``node_factory(frontends=1, shards=3, extra_args=[...], start=True)`` for custom nodes.
- ``shared_node``: one node per test module for tests that need no isolation; use unique queue names.

A module that sets ``QUEUE_PLACEMENT = "hash"`` gets nodes placing queues by name, one that sets
``COLOCATE = "off"`` nodes whose frontends and shards are separate processes (``module_node_args``).

When a test fails, the tail of each of its nodes' logs is added to the report.

Every test that uses one of these fixtures (directly or through another fixture) is marked
``integration``; modules that start processes some other way say so with a module-level
``pytestmark``. ``pytest -m "not integration"`` is the fast inner loop.
"""

from __future__ import annotations

import inspect
import signal

import pytest

from loadtest.etcd import EtcdCluster
from tests.harness import Node, NodeFactory, sweep_own_nodes, sweep_stale_nodes


def module_node_args(module) -> list[str]:
    """Node arguments a test module asks for: ``QUEUE_PLACEMENT = "hash"`` in a module that picks
    queue names by their crc32 to put them on given shards (tests/helpers.py); others get the default."""
    placement = getattr(module, "QUEUE_PLACEMENT", None)
    args = ["--queue-placement", placement] if placement else []
    # COLOCATE = "off": a module that kills or stops one role's process and expects the other role
    # of that index to live on (a paired process, --colocate, is both).
    colocate = getattr(module, "COLOCATE", None)
    return [*args, "--colocate", colocate] if colocate else args


def _stats_unreported(factory: NodeFactory) -> None:
    """Fail the test when a shard of one of its nodes logged a queue change its STATS reports missed
    (shard/stats.py), or a queue its channel-close or periodic-sync index missed (shard/walk_check.py),
    or a pair's link handed over an item that differs from its packing or changed after
    (broker/local_link.py): the harness turns these checks on in every node."""
    from broker.local_link import LINK_CHECK_FAILED
    from shard.stats import STATS_CHECK_FAILED
    from shard.walk_check import WALK_CHECK_FAILED

    for n in factory.nodes:
        lines = [line for line in n.log_text().splitlines() if STATS_CHECK_FAILED in line]
        if lines:
            pytest.fail(f"{n.log_path}: a shard's STATS missed a change:\n" + "\n".join(lines[:3]))
        lines = [line for line in n.log_text().splitlines() if WALK_CHECK_FAILED in line]
        if lines:
            pytest.fail(f"{n.log_path}: a shard's index missed a queue:\n" + "\n".join(lines[:3]))
        lines = [line for line in n.log_text().splitlines() if LINK_CHECK_FAILED in line]
        if lines:
            pytest.fail(f"{n.log_path}: a pair's link handed over what a socket would not:\n" + "\n".join(lines[:3]))


@pytest.fixture
def node_factory(tmp_path, request):
    factory = NodeFactory(tmp_path, module_node_args(request.module))
    try:
        yield factory
    finally:
        factory.cleanup()
    _stats_unreported(factory)


@pytest.fixture
def node(node_factory) -> Node:
    return node_factory(name="node", frontends=2, shards=2)


@pytest.fixture(scope="module")
def shared_node(tmp_path_factory, request):
    factory = NodeFactory(tmp_path_factory.mktemp("shared_node"), module_node_args(request.module))
    try:
        yield factory(name="node", frontends=2, shards=2)
    finally:
        factory.cleanup()
    _stats_unreported(factory)


@pytest.fixture
def conn(shared_node):
    """A pika connection to the module's shared node (modules may override it)."""
    connection = shared_node.connect()
    yield connection
    if connection.is_open:
        connection.close()


@pytest.fixture
def ch(conn):
    """A confirm-mode channel: a queue's count is settled when basic_publish returns."""
    channel = conn.channel()
    channel.confirm_delivery()
    return channel


def _nodes_of(item) -> list[Node]:
    nodes: list[Node] = []
    for value in getattr(item, "funcargs", {}).values():
        if isinstance(value, Node):
            nodes.append(value)
        elif isinstance(value, NodeFactory):
            nodes.extend(value.nodes)
    return list(dict.fromkeys(nodes))


def pytest_sessionstart(session):
    # Nodes of an earlier test run that was killed (its fixtures never ran their teardown).
    swept = sweep_stale_nodes()
    if swept:
        print(f"\nswept {len(swept)} node process group(s) left by a killed test run: {swept}")
    # A SIGTERM'd run (CI cancel, timeout) tears its fixtures down like a Ctrl-C does.
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminate)


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_sessionfinish(session, exitstatus):
    sweep_own_nodes()  # whatever a failed teardown left


# Fixtures that start real nodes: a test whose fixture closure holds one is an integration test,
# and so is one using a module's own node fixture (any fixture whose code makes a Node or NodeFactory).
NODE_FIXTURES = frozenset({"node", "node_factory", "shared_node"})
_STARTS_NODES: dict = {}


def _fixture_starts_nodes(func) -> bool:
    known = _STARTS_NODES.get(func)
    if known is None:
        try:
            source = inspect.getsource(func)
        except (OSError, TypeError):
            source = ""
        known = _STARTS_NODES[func] = "NodeFactory(" in source or "Node(" in source
    return known


def pytest_collection_modifyitems(config, items):
    for item in items:
        names = getattr(item, "fixturenames", ())
        integration = bool(NODE_FIXTURES.intersection(names))
        if not integration:
            info = getattr(item, "_fixtureinfo", None)
            for defs in (info.name2fixturedefs.values() if info is not None else ()):
                if any(_fixture_starts_nodes(d.func) for d in defs):
                    integration = True
                    break
        if integration:
            item.add_marker(pytest.mark.integration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for node in _nodes_of(item):
            report.sections.append((f"node log {node.log_path}", node.log_tail(200)))


@pytest.fixture(scope="session")
def spark():
    """One local Spark session (local[2], UI off, small memory) for the whole run; JVM start-up is slow.

    The `shardmq` and `shardmq-segments` formats are registered on it (pipeline/session.py).
    """
    from pipeline.session import local_session

    session = local_session()
    yield session
    session.stop()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    """A one-member etcd for the cluster modules, one per module (a module-scoped conftest fixture)."""
    cluster = EtcdCluster(1, tmp_path_factory.mktemp("etcd"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
