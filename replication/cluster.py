"""A cluster node's role, decided through etcd: follower (replicate + proxy) or leader (serve).

Start-up (as LavinMQ does, see docs/cluster.md): take a lease and publish this node's record ->
follow the current leader (replication stream into the data dir, client ports proxied to it) ->
when there is no leader: campaign if this node is in the ISR (or no ISR exists yet) -> on winning,
promotion: a warm start of the replicated data dir (the node's normal boot) and the replication
leader -> serve, keep the ISR in etcd in step with the followers, and watch the lease.

Fencing: a watchdog thread (independent of the event loop, which a stalled disk or a long pause
may hold) SIGKILLs the frontends as soon as the lease has not been renewed for half its TTL or a
disk probe's fsync has not returned within its bound. Killing the frontends closes every client
connection at once, so no confirm leaves this node after that; the lease can only expire (and
another node win) later. The event loop then steps down (shards stopped, leader key given up)
and the node rejoins as a follower, which resyncs its data dir from the new leader.

ISR changes are ordered so that a confirm never relies on a follower that could not win an
election, and a node that could win has every confirmed message: a follower is added to the
confirm gating before it is written to etcd, and removed from the gating only after etcd has
the smaller ISR (a write the etcd transaction refuses unless we still hold the leader key).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from typing import Any

from broker import fsync_beacon
from replication.coordination import CoordinationError, Coordinator, NodeInfo, boost_thread_priority
from replication.proxy import ClientProxy

log = logging.getLogger("shardmq.cluster")

# Client listeners a follower proxies: (listener name, Settings field of its port).
_LISTENER_FIELDS = (("amqp", "port"), ("amqps", "amqps_port"), ("mqtt", "mqtt_port"),
                    ("mqtts", "mqtts_port"), ("ws", "ws_port"))
_DISK_PROBE = "disk-probe"
# With the etcd watch open a follower re-reads the leader key this often anyway (a watch that died
# without an error, e.g. a half-open connection, costs at most this much failover time).
_SAFETY_POLL_S = 2.0


class ClusterRole:
    def __init__(self, node: Any) -> None:
        self.node = node
        s = node.settings
        self.settings = s
        self.name = s.node_name
        self.ttl = s.lease_ttl
        self.coord = Coordinator(s.etcd_endpoints, s.etcd_prefix, s.node_name, s.lease_ttl,
                                 on_lease_lost=self._on_lease_lost)
        listeners = {name: getattr(s, field, 0) or 0 for name, field in _LISTENER_FIELDS
                     # the TLS listeners exist only with a certificate (as in the frontends)
                     if getattr(s, "tls_cert", None) or name not in ("amqps", "mqtts")}
        self.info = NodeInfo(
            name=s.node_name, host=s.advertised_host, amqp_port=s.port,
            replication_port=getattr(s, "replication_port", 0), http_port=s.http_port,
            listeners={k: v for k, v in listeners.items() if v},
            proxy_protocol=_accepts_proxy_protocol(getattr(s, "proxy_protocol", False)))
        self.proxy = ClientProxy({name: (s.bind, port) for name, port in listeners.items()},
                                 wait_for_leader=max(5.0, 2.0 * self.ttl))
        self.role = "starting"  # starting | follower | leader | fenced
        self.leader: NodeInfo | None = None
        self.leader_lease = 0
        self.isr: list[str] = []
        self.replication: Any = None  # the ReplicationLeader while leading
        # How often a follower reads the leader key while the etcd watch is not open (etcd down,
        # the watch re-opening); with it open, changes wake the loop and _SAFETY_POLL_S applies.
        self.poll = min(0.25, self.ttl / 10)
        self._changed = asyncio.Event()  # the watch saw the leader or ISR key change
        # Disk probe: an fsync still running after this long means the disk is stalled.
        self.disk_bound = max(2.0, self.ttl / 2)
        self.last_failover: dict[str, float] = {}
        self._probe_started: float | None = None
        self._fence_reason: str | None = None
        self._fenced = asyncio.Event()
        self.stopping = False
        self._task: asyncio.Task | None = None
        self._isr_task: asyncio.Task | None = None
        self._isr_dirty = False
        self._watchdog: threading.Thread | None = None
        self._watch_stop = threading.Event()
        # Wakes the fence watchdog, which sleeps while this node does not lead.
        self._watchdog_wake = threading.Event()
        # The watchdog's period while leading: TTL/50 bounds how late a fence comes (20 ms at a 1 s
        # lease), at most 0.1 s (the shard fsync beacons' period).
        self._watchdog_interval = max(0.02, min(0.1, self.ttl / 50))
        self._campaign_after = 0.0

    # ---------------------------------------------------------------- status
    @property
    def proxying(self) -> bool:
        return self.role == "follower" and self.proxy.listening and self.leader is not None

    def status(self) -> dict:
        """What /api/cluster/status answers (broker/http/cluster.py)."""
        out: dict[str, Any] = {
            "node": self.name, "role": self.role, "leader": self.leader.name if self.leader else None,
            "isr": list(self.isr), "lease_ttl": self.ttl,
            "lease_age": round(self.coord.lease_age(), 3) if self.coord.lease_id else None,
            "proxied_connections": self.proxy.relayed, "last_failover": self.last_failover,
        }
        if self.replication is not None:
            followers = {}
            for name, st in self.replication.followers().items():
                followers[name] = {k: getattr(st, k, None)
                                   for k in ("connected", "in_sync", "lag_bytes", "lag_seconds")}
                last = getattr(st, "last_ack_monotonic", 0) or 0
                followers[name]["last_ack_seconds_ago"] = round(time.monotonic() - last, 3) if last else None
            out["followers"] = followers
        follower = getattr(self.node, "repl_follower", None)
        if follower is not None and hasattr(follower, "status"):
            with contextlib.suppress(Exception):
                out["replication"] = _plain(follower.status())
        return out

    # ------------------------------------------------------------- life cycle
    async def start(self) -> None:
        with contextlib.suppress(CoordinationError):  # etcd may come later: _run retries
            await self.coord.start(self.info)
        self._watchdog = threading.Thread(target=self._watchdog_loop, name="fence-watchdog", daemon=True)
        self._watchdog.start()
        # The leader and ISR keys wake the role loop as they change (and it polls slowly besides).
        self.coord.watch(["leader", "isr"], self._changed.set)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self.stopping = True
        self._watch_stop.set()
        self._watchdog_wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self.proxy.stop()
        await self._stop_replication_leader()
        # Revoking the lease deletes the leader key: a follower is elected at once.
        await self.coord.stop()

    async def _run(self) -> None:
        while not self.stopping:
            try:
                await self._connect()
                await self._loop()
            except CoordinationError as exc:
                # A follower keeps relaying to the leader it knows: etcd trouble alone says nothing
                # about the leader (which fences itself if it is cut off).
                log.warning("%s; retrying", exc)
                await asyncio.sleep(self.poll)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("cluster role loop failed; retrying")
                await asyncio.sleep(1.0)

    async def _connect(self) -> None:
        if self.coord.lease_id is None:
            await self.coord.abandon_lease()  # revokes nothing when there was no lease
            await self.coord.register(self.info)

    async def _loop(self) -> None:
        while not self.stopping and self.coord.lease_id is not None:
            self._changed.clear()  # before the read: a change while it runs ends the next wait at once
            leader, lease = await self.coord.leader_lease()
            if leader is not None and leader.name == self.name and lease != self.coord.lease_id:
                # Our own record under an older lease (a previous run: we hold the data dir lock, so
                # that process is dead; or a lease this process gave up when fenced). Revoke it
                # instead of waiting for it to expire.
                log.info("revoking this node's older leader lease %x", lease)
                await self.coord.revoke(lease)
                continue
            if leader is not None:
                await self._follow(leader, lease)
                await self._wait_change()
                continue
            if self.leader is not None:
                log.info("leader %s is gone", self.leader.name)
                self.last_failover = {"leader_gone_at": time.time()}
                self.leader = None
                self.proxy.set_target(None)
            isr = await self.coord.isr()
            if isr is not None and self.name not in isr:
                # Not a valid candidate: someone in the ISR has every confirmed message.
                await self._wait_change()
                continue
            if time.monotonic() < self._campaign_after:
                await self._wait_change(self._campaign_after - time.monotonic())
                continue
            if await self.coord.campaign(self.info):
                await self._lead()
            else:
                await asyncio.sleep(self.poll / 5)

    async def _wait_change(self, at_most: float | None = None) -> None:
        """Until the leader or ISR key changes (the etcd watch), the safety poll is due, or
        ``at_most`` seconds passed. Without an open watch it is the short poll interval."""
        timeout = _SAFETY_POLL_S if self.coord.watching else self.poll
        if at_most is not None:
            timeout = max(0.0, min(timeout, at_most))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._changed.wait()

    # -------------------------------------------------------------- follower
    async def _follow(self, leader: NodeInfo, lease: int) -> None:
        if self.role == "follower" and self.leader == leader and self.leader_lease == lease:
            return
        log.info("following leader %s (%s, AMQP %d, replication %d)", leader.name, leader.host,
                 leader.amqp_port, leader.replication_port)
        self.role = "follower"
        self.leader = leader
        self.leader_lease = lease
        self.proxy.set_target(leader)
        await self.proxy.start()
        await self.node.become_follower(leader.host, leader.replication_port)

    # ---------------------------------------------------------------- leader
    async def _lead(self) -> None:
        t0 = time.monotonic()
        isr = await self.coord.isr() or [self.name]
        if self.name not in isr:  # the campaign's transaction checked it; never serve otherwise
            log.error("won the election but not in the ISR %s: giving up leadership", isr)
            await self.coord.resign()
            return
        self.isr = sorted(isr)
        # Spawning the workers keeps the CPUs busy: start it with a freshly renewed lease.
        with contextlib.suppress(CoordinationError):
            await self.coord.renew_now()
        self.role = "leader"
        self.leader = self.info
        self.leader_lease = self.coord.lease_id
        self._fence_reason = None
        self._fenced.clear()
        self._watchdog_wake.set()  # the watchdog watches the lease from now on
        # The frontends take the client ports: relayed connections to the old leader are dead anyway.
        await self.proxy.stop()
        self.proxy.set_target(None)
        # The coordinator drives the ISR: the replication leader reports, etcd decides.
        self.node.repl_on_change = self._isr_changed
        self.node.repl_auto_isr = False
        self.node.repl_initial_isr = {n for n in self.isr if n != self.name}
        try:
            await self.node.become_leader()
        except Exception:
            log.exception("promotion failed: stepping down")
            await self._step_down("promotion failed")
            return
        self.replication = getattr(self.node, "repl_leader", None)
        self._isr_changed()
        # Promotion ends when clients can connect: every frontend listens.
        deadline = time.monotonic() + 30
        while not self.node.ready and time.monotonic() < deadline and not self._fenced.is_set():
            await asyncio.sleep(0.01)
        promoted = time.monotonic() - t0
        self.last_failover = {**self.last_failover, "promoted_at": time.time(), "promotion_seconds": promoted}
        log.info("leader %s serving after a %.3f s promotion; ISR %s", self.name, promoted, self.isr)
        # Lead until fenced (watchdog, lost lease) or the leader key is gone.
        while not self.stopping:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.1, self.ttl / 3)):
                    await self._fenced.wait()
            if self._fenced.is_set():
                break
            try:
                if not await self.coord.still_leader():
                    self._fence_reason = "the leader key is no longer ours"
                    break
            except CoordinationError:
                pass  # the lease watchdog decides; etcd may answer again in time
        if not self.stopping:
            await self._step_down(self._fence_reason or "fenced")

    async def _step_down(self, reason: str) -> None:
        log.warning("stepping down as leader: %s", reason)
        self.role = "fenced"
        self.node.fence()
        await self._stop_replication_leader()
        await self.node.step_down()
        self.leader = None
        self.isr = []
        # Let the other ISR members win this round; we rejoin as a follower and resync.
        self._campaign_after = time.monotonic() + 2.0 * self.ttl
        try:
            if self.coord.lease_fresh():
                await self.coord.resign()
            else:
                await self.coord.abandon_lease()
                await self.coord.register(self.info)
        except CoordinationError as exc:
            log.warning("could not give up leadership in etcd (%s): the lease expires by itself", exc)
            self.coord.lease_id = None  # _connect takes a new one when etcd answers
        self.role = "starting"

    async def _stop_replication_leader(self) -> None:
        repl, self.replication = self.replication, None
        if repl is not None:
            with contextlib.suppress(Exception):
                await repl.stop()
        if getattr(self.node, "repl_leader", None) is repl:
            self.node.repl_leader = None

    # ------------------------------------------------------------------- ISR
    def _isr_changed(self, *_args: Any) -> None:
        """ReplicationLeader.on_change: a follower caught up, or stopped acking, or left."""
        if self.stopping:
            return
        self._isr_dirty = True
        if self._isr_task is None or self._isr_task.done():
            self._isr_task = asyncio.get_running_loop().create_task(self._sync_isr())

    async def _sync_isr(self) -> None:
        while self._isr_dirty and self.role == "leader" and not self.stopping and self._fence_reason is None:
            self._isr_dirty = False
            repl = self.replication
            followers = repl.followers() if repl is not None else {}
            want = sorted({self.name} | {n for n, st in followers.items() if getattr(st, "in_sync", False)})
            if want == self.isr:
                continue
            if repl is not None:
                # Wait on the union while etcd changes: added ones are gated before they can win,
                # removed ones until etcd no longer lets them win.
                repl.set_isr((set(want) | set(self.isr)) - {self.name})
            try:
                ok = await self.coord.write_isr(want)
            except CoordinationError as exc:
                log.warning("ISR not written (%s): retrying", exc)
                self._isr_dirty = True
                await asyncio.sleep(0.5)
                continue
            if not ok:
                self._fence_reason = "the ISR write was refused: no longer the leader"
                self._fenced.set()
                return
            log.info("ISR %s -> %s", self.isr, want)
            self.isr = want
            if repl is not None:
                repl.set_isr(set(want) - {self.name})

    # --------------------------------------------------------------- fencing
    def _on_lease_lost(self) -> None:
        if self.role == "leader":
            self._fence_now("the etcd lease is gone")
        else:
            self.coord.lease_id = None  # _run takes a new lease and registers again

    def _fence_now(self, reason: str) -> None:
        """From any thread: stop the frontends (no confirm leaves after this), then tell the loop."""
        if self._fence_reason is None:
            self._fence_reason = reason
        self.node.is_leader = False
        self.node.serving = False
        # SIGKILL of each frontend process; a paired one (--colocate) stops its frontend part only.
        killed, paired = self.node.sup.stop_frontends_now()
        log.error("fenced: %s; client connections closed (frontend pids killed: %s; paired pids told to stop "
                  "their frontend part: %s)", reason, killed or "none", paired or "none")
        with contextlib.suppress(RuntimeError):  # the loop may be closing
            self.node.loop.call_soon_threadsafe(self._fenced.set)

    def _watchdog_loop(self) -> None:
        boost_thread_priority()
        probe_path = os.path.join(self.node.datadir.run_dir, _DISK_PROBE)
        next_probe = next_beacons = 0.0
        while not self._watch_stop.wait(self._watchdog_interval):
            if self.role != "leader" or self._fence_reason is not None:
                # Nothing to watch: sleep until _lead wakes us (the timeout only bounds a missed wake).
                self._watchdog_wake.wait(1.0)
                self._watchdog_wake.clear()
                continue
            if not self.coord.lease_fresh():
                self._fence_now(f"etcd lease not renewed for {self.coord.lease_age():.2f} s "
                                f"(half the {self.ttl} s TTL)")
                continue
            started = self._probe_started
            if started is not None and time.monotonic() - started > self.disk_bound:
                self._fence_now(f"disk stalled: an fsync has not returned for {self.disk_bound:.1f} s")
                continue
            if time.monotonic() >= next_beacons:
                next_beacons = time.monotonic() + 0.1
                stalled = self._stalled_shard_sync()
                if stalled is not None:
                    self._fence_now(f"disk stalled: shard {stalled[0]}'s fsync has not returned for "
                                    f"{stalled[1]:.1f} s (bound {self.disk_bound:.1f} s)")
                    continue
            if started is None and time.monotonic() >= next_probe:
                next_probe = time.monotonic() + 1.0
                self._probe_started = time.monotonic()
                threading.Thread(target=self._probe_disk, args=(probe_path,), daemon=True,
                                 name="disk-probe").start()

    def _stalled_shard_sync(self) -> tuple[int, float] | None:
        """(shard, seconds) of a running shard whose group fsync is older than the bound (its
        beacon, broker/fsync_beacon.py: read here without asking the shard, which may be stuck)."""
        run_dir = self.node.datadir.run_dir
        now = time.monotonic()
        for w in list(self.node.sup.workers):
            proc = w.proc
            if w.role != "shard" or proc is None or proc.returncode is not None:
                continue
            pid, since = fsync_beacon.running_since(run_dir, w.index)
            # Another pid: the beacon a killed incarnation left behind, or the new one not yet set.
            if pid == proc.pid and since > 0 and now - since > self.disk_bound:
                return w.index, now - since
        return None

    def _probe_disk(self, path: str) -> None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, str(time.time()).encode(), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("disk probe %s: %s", path, exc)
        self._probe_started = None


def _accepts_proxy_protocol(value: Any) -> bool:
    """--proxy-protocol may be a switch or a version ("v1", "v2"); "off"-like strings are off."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "0", "off", "false", "no", "none")
    return bool(value)


def _plain(value: Any) -> Any:
    """A status object as JSON-able data (dataclasses and simple objects)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "__dict__"):
        return {k: _plain(v) for k, v in vars(value).items() if not k.startswith("_")}
    return value
