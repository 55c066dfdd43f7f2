"""shard/sync_thread.py: a shard's group syncs on one thread, their ends reported on the loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from shard.sync_thread import SyncThread


def test_jobs_run_in_order_on_one_thread_and_done_runs_on_the_loop_with_the_settled_future():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        st = SyncThread(loop, "test-sync")
        ran: list[tuple[int, str]] = []
        seen: list[tuple[int, bool, object]] = []
        loop_thread = threading.current_thread().name

        def job(i: int) -> None:
            ran.append((i, threading.current_thread().name))

        def done(i: int):
            def cb(fut: asyncio.Future) -> None:
                assert threading.current_thread().name == loop_thread
                seen.append((i, fut.done(), fut.exception()))
            return cb

        futs = [st.run(job, (i,), done(i)) for i in range(3)]
        await asyncio.gather(*futs)
        st.close()
        assert [i for i, _ in ran] == [0, 1, 2]
        assert {name for _, name in ran} == {"test-sync"}
        assert seen == [(0, True, None), (1, True, None), (2, True, None)]

    asyncio.run(main())


def test_an_exception_of_the_job_reaches_done_through_the_future_and_the_thread_goes_on():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        st = SyncThread(loop, "test-sync")
        errors: list[BaseException | None] = []

        def fail() -> None:
            raise OSError(5, "EIO")

        fut = st.run(fail, (), lambda f: errors.append(f.exception()))
        with pytest.raises(OSError):
            await fut
        await st.run(lambda: None, (), lambda f: errors.append(f.exception()))
        st.close()
        assert isinstance(errors[0], OSError) and errors[1] is None

    asyncio.run(main())


def test_done_runs_before_a_task_awaiting_the_future_resumes():
    """ShardWorker.stop awaits the running sync and relies on its _sync_done having run first."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        st = SyncThread(loop, "test-sync")
        order: list[str] = []
        await st.run(lambda: None, (), lambda f: order.append("done"))
        order.append("resumed")
        st.close()
        assert order == ["done", "resumed"]

    asyncio.run(main())
