"""frontend/timer_wheel.py: one loop timer for every connection's handshake deadline and heartbeat check."""

from __future__ import annotations

import asyncio

from frontend.timer_wheel import RESOLUTION, TimerWheel, wheel_for


class Conn:
    def __init__(self, wheel: TimerWheel, name: str, log: list, rearm: float = 0.0, times: int = 1) -> None:
        self.wheel_tick: int | None = None
        self.wheel, self.name, self.log, self.rearm, self.times = wheel, name, log, rearm, times

    def on_tick(self) -> None:
        self.log.append((self.name, self.wheel.loop.time()))
        self.times -= 1
        if self.times > 0:
            self.wheel.arm(self, self.rearm)


def test_checks_fire_in_order_never_early_and_disarmed_ones_never():
    loop = asyncio.new_event_loop()
    try:
        wheel = TimerWheel(loop)
        log: list = []
        start = loop.time()
        late = Conn(wheel, "late", log)
        early = Conn(wheel, "early", log)
        gone = Conn(wheel, "gone", log)
        beat = Conn(wheel, "beat", log, rearm=0.1, times=3)  # re-arms itself from on_tick, as heartbeats do
        wheel.arm(late, 0.35)
        wheel.arm(early, 0.05)
        wheel.arm(gone, 0.2)
        wheel.arm(beat, 0.1)
        assert len(wheel) == 4
        wheel.disarm(gone)
        assert gone.wheel_tick is None and len(wheel) == 3
        wheel.arm(late, 0.3)  # arming again replaces the earlier due time

        async def until_done() -> None:  # 5 checks expected; "gone" (0.2 s) would come before the last beat (0.3 s)
            deadline = loop.time() + 10
            while len(log) < 5 and loop.time() < deadline:
                await asyncio.sleep(0.02)
        loop.run_until_complete(until_done())
        names = [n for n, _ in log]
        assert "gone" not in names
        assert names.count("beat") == 3 and names.count("late") == 1 and names[0] == "early"
        due = {"early": 0.05, "late": 0.3}
        for name, at in log:
            if name in due:  # rounded up to the next tick: never early (1 ms of loop-timer rounding allowed)
                assert at - start >= due[name] - 0.001, (name, at - start)
        beats = [at for n, at in log if n == "beat"]
        assert all(b - a >= 0.1 - 0.001 for a, b in zip(beats, beats[1:], strict=False)), beats
        assert len(wheel) == 0 and wheel._handle is None  # nothing armed: no timer left on the loop
    finally:
        loop.close()


def test_one_wheel_per_loop_and_a_failing_check_does_not_stop_the_others():
    loop = asyncio.new_event_loop()
    try:
        assert wheel_for(loop) is wheel_for(loop)
        wheel = wheel_for(loop)
        log: list = []

        class Broken(Conn):
            def on_tick(self) -> None:
                raise RuntimeError("bug")

        wheel.arm(Broken(wheel, "broken", log), 0.0)
        wheel.arm(Conn(wheel, "ok", log), 0.0)
        async def until_ok() -> None:
            deadline = loop.time() + 10
            while not log and loop.time() < deadline:
                await asyncio.sleep(RESOLUTION)
        loop.run_until_complete(until_ok())
        assert [n for n, _ in log] == ["ok"]
    finally:
        loop.close()
    other = asyncio.new_event_loop()
    try:
        assert wheel_for(other) is not wheel
    finally:
        other.close()
