"""replication/coordination.py against a real etcd (Debian's etcd-server, started per module)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from loadtest.etcd import EtcdCluster
from replication.coordination import CoordinationError, Coordinator, NodeInfo, parse_endpoint
from tests.harness import REPO_ROOT

pytestmark = pytest.mark.integration


_prefixes = iter(range(1_000_000))


def coordinator(etcd, name: str, prefix: str, ttl: int = 1, **kw) -> Coordinator:
    return Coordinator(etcd.endpoints.split(","), prefix, name, ttl, **kw)


def info(name: str) -> NodeInfo:
    return NodeInfo(name=name, host="127.0.0.1", amqp_port=5000, replication_port=5001, http_port=5002)


async def _until(pred, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def test_parse_endpoint():
    assert parse_endpoint("10.0.0.1:2379") == ("10.0.0.1", 2379)
    assert parse_endpoint("http://etcd:2380/") == ("etcd", 2380)
    assert parse_endpoint("etcd") == ("etcd", 2379)


def test_first_boot_election_exactly_one_leader_and_isr_is_the_winner(etcd):
    prefix = f"t{next(_prefixes)}-first"

    async def main():
        cs = [coordinator(etcd, f"n{i}", prefix) for i in range(3)]
        for c in cs:
            await c.start(info(c.name))
        won = await asyncio.gather(*(c.campaign(info(c.name)) for c in cs))
        assert sum(won) == 1
        winner = cs[won.index(True)]
        assert (await cs[0].leader()).name == winner.name
        assert await cs[0].isr() == [winner.name]
        assert set(await cs[0].nodes()) == {"n0", "n1", "n2"}
        # A second campaign loses while the leader key exists.
        assert not any(await asyncio.gather(*(c.campaign(info(c.name)) for c in cs if c is not winner)))
        for c in cs:
            await c.stop()

    asyncio.run(main())


def test_only_isr_members_may_win_and_only_the_leader_writes_the_isr(etcd):
    prefix = f"t{next(_prefixes)}-isr"

    async def main():
        a, b, c = (coordinator(etcd, n, prefix) for n in ("a", "b", "c"))
        for x in (a, b, c):
            await x.start(info(x.name))
        assert await a.campaign(info("a"))
        assert await a.write_isr(["a", "b"])
        assert await a.isr() == ["a", "b"]
        assert not await b.write_isr(["b", "c"]), "a follower must not write the ISR"
        assert await a.still_leader() and not await b.still_leader()
        await a.stop()  # graceful: revoking the lease deletes the leader key at once
        assert await b.leader() is None
        assert not await c.campaign(info("c")), "c is not in the ISR"
        assert await b.campaign(info("b"))
        assert (await c.leader()).name == "b"
        for x in (b, c):
            await x.stop()

    asyncio.run(main())


def test_lease_keepalive_holds_and_a_dead_leaders_key_expires_after_the_ttl(etcd):
    prefix = f"t{next(_prefixes)}-ttl"

    async def main():
        a = coordinator(etcd, "a", prefix)
        b = coordinator(etcd, "b", prefix)
        await a.start(info("a"))
        await b.start(info("b"))
        assert await a.campaign(info("a"))
        await a.write_isr(["a", "b"])
        await asyncio.sleep(2.5)  # well past the 1 s TTL: only keep-alives keep the key
        assert (await b.leader()).name == "a" and a.lease_fresh()
        # Simulate a frozen leader: its keep-alive stops, the lease is not revoked.
        a._stop.set()
        t0 = time.monotonic()
        await _until(lambda: _is_none(b.leader()), timeout=5)
        assert time.monotonic() - t0 < 2.5
        assert not a.lease_fresh()
        assert not await a.write_isr(["a"]), "the deposed leader's ISR write is fenced"
        assert await b.campaign(info("b"))
        await b.stop()

    asyncio.run(main())


async def _is_none(coro) -> bool:
    return (await coro) is None


def test_lost_lease_is_reported_and_a_new_lease_can_be_taken(etcd):
    prefix = f"t{next(_prefixes)}-lost"

    async def main():
        lost = asyncio.Event()
        a = coordinator(etcd, "a", prefix, on_lease_lost=lost.set)
        await a.start(info("a"))
        old = a.lease_id
        other = coordinator(etcd, "x", prefix)
        await other.start(info("x"))
        await other._run(lambda c: c.revoke_lease(old))
        await asyncio.wait_for(lost.wait(), 3)
        await a.abandon_lease()
        assert a.lease_id != old
        await a.register(info("a"))
        assert "a" in await other.nodes()
        await a.stop()
        await other.stop()

    asyncio.run(main())


def test_unreachable_etcd_is_a_clear_error():
    async def main():
        c = Coordinator(["127.0.0.1:1"], "x", "a", 1)
        with pytest.raises(CoordinationError, match="etcd unreachable"):
            await c.start(info("a"))
        await c.stop()

    asyncio.run(main())


def test_a_hung_keep_alive_does_not_hold_back_the_next_ones(etcd, monkeypatch):
    """One keep-alive call hangs (a dead connection, a starved etcd): the next ones go out and renew
    the lease meanwhile. (One call at a time, as before, the lease aged until the hung call's
    deadline, past the TTL/2 at which a leader fences: a needless failover.)"""
    import itertools
    import threading

    import etcd3

    real = etcd3.Etcd3Client.refresh_lease
    calls = itertools.count()
    hung_at: list[float] = []
    release = threading.Event()

    def refresh(self, lease_id):
        if next(calls) == 3:
            hung_at.append(time.monotonic())
            release.wait(30)
        return real(self, lease_id)

    monkeypatch.setattr(etcd3.Etcd3Client, "refresh_lease", refresh)
    prefix = f"t{next(_prefixes)}-hung"

    async def main():
        c = coordinator(etcd, "n1", prefix, ttl=1)
        await c.start(info("n1"))
        try:
            deadline = time.monotonic() + 20
            while not hung_at:
                assert time.monotonic() < deadline, "no keep-alive call hung"
                await asyncio.sleep(0.01)
            # Renewed by a keep-alive sent after the hung one started, while it still hangs.
            while not c.renewed_at > hung_at[0]:
                assert time.monotonic() < deadline, "the hung keep-alive held back the next ones"
                await asyncio.sleep(0.01)
            assert not release.is_set()
        finally:
            release.set()
            await c.stop()

    asyncio.run(main())


def test_watch_reports_leader_and_isr_changes_and_comes_back_after_an_etcd_restart(tmp_path):
    """Coordinator.watch: every write or delete of a watched key calls on_change on the loop; when
    etcd goes away the watch says so (watching False, one more call) and opens again once etcd is
    back, without anyone calling it again."""
    own = EtcdCluster(1, tmp_path / "etcd").start()
    prefix = f"t{next(_prefixes)}-watch"

    async def main():
        changes = asyncio.Event()
        a = coordinator(own, "a", prefix)
        await a.start(info("a"))
        a.watch(["leader", "isr"], changes.set)
        try:
            async def watching() -> bool:
                return a.watching

            async def changed() -> bool:
                return changes.is_set()

            await _until(watching, 10)
            changes.clear()
            assert await a.campaign(info("a"))  # writes the leader key and, on a first boot, the ISR
            await _until(changed)
            changes.clear()
            assert await a.write_isr(["a", "b"])
            await _until(changed)
            changes.clear()
            await a.resign()  # deletes the leader key
            await _until(changed)
            changes.clear()
            await a._run(lambda c: c.put(a.key("isr"), '["a"]'))  # any writer's change, not only ours
            await _until(changed)
            own.stop_member(own.members[0])
            changes.clear()

            async def broken() -> bool:
                return not a.watching and changes.is_set()

            await _until(broken, 10)
            own.start_member(own.members[0])
            await _until(watching, 20)
        finally:
            await a.stop()
        assert a._watch_thread is not None and not a._watch_thread.is_alive()

    try:
        asyncio.run(main())
    finally:
        own.stop()


_FORKS_DURING_CALLS = r"""
import asyncio, sys, threading
from replication.coordination import Coordinator  # as in the node: before any other gRPC import

coord = Coordinator(sys.argv[1].split(","), "forks", "n", 10)
lease = coord._call(lambda c: c.lease(10))
stop = threading.Event()

def keep_alive():  # as the node's keep-alive calls, several in flight
    while not stop.is_set():
        coord._call(lambda c: list(c.refresh_lease(lease.id)), keepalive=True)

threads = [threading.Thread(target=keep_alive, daemon=True) for _ in range(4)]
for t in threads:
    t.start()

async def spawn(n):
    codes = []
    for _ in range(n):  # preexec_fn: a plain fork(), as uvloop spawns the node's workers
        p = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass", preexec_fn=lambda: None)
        codes.append(await p.wait())
    return codes

codes = asyncio.run(spawn(60))
stop.set()
for t in threads:
    t.join(10)
coord._call(lambda c: c.get("after"))  # the process's gRPC still works
print("codes", sorted(set(codes)))
"""


def test_workers_forked_while_etcd_calls_run_are_not_touched_by_grpc(etcd, tmp_path):
    """The node forks its workers while its keep-alive calls etcd in other threads. gRPC's fork
    handlers (its fork support, on by default) then ran on every fork: children aborted before their
    exec and the node's connection to etcd broke for good (INTERNAL, RST_STREAM) until it fenced.
    replication.coordination turns that support off: no fork handler runs, every child execs."""
    script = tmp_path / "forks.py"
    script.write_text(_FORKS_DURING_CALLS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
    env.update(PYTHONPATH=str(REPO_ROOT), GRPC_VERBOSITY="INFO")
    out = subprocess.run([sys.executable, str(script), etcd.endpoints], capture_output=True, text=True,
                         timeout=120, env=env, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "codes [0]" in out.stdout, out.stdout + out.stderr[-3000:]  # no child died of a signal
    assert "fork_posix" not in out.stderr, out.stderr[-3000:]  # gRPC ran no fork handler
