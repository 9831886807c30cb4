"""The background refresher: runs in a worker thread, survives failures, stops on close."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from shared.periodic import Periodic


def test_a_failing_call_is_logged_and_tried_again_off_the_loop(caplog: pytest.LogCaptureFixture) -> None:
    threads: list[int] = []

    def flaky() -> None:
        threads.append(threading.get_ident())
        if len(threads) <= 2:
            raise RuntimeError("database not up yet")

    async def scenario() -> int:
        periodic = Periodic("reading the thing", flaky, 0.01)
        await periodic.start()  # the first call fails: start still returns
        assert periodic.is_running
        while len(threads) < 4:
            await asyncio.sleep(0.01)
        await periodic.close()
        assert not periodic.is_running
        calls = len(threads)
        await asyncio.sleep(0.05)
        assert len(threads) == calls  # closed: no more calls
        return threading.get_ident()

    with caplog.at_level(logging.ERROR, logger="shared.periodic"):
        loop_thread = asyncio.run(scenario())
    assert loop_thread not in threads
    failures = [r for r in caplog.records if "reading the thing failed" in r.getMessage()]
    assert len(failures) == 2


def test_without_waiting_the_first_call_runs_in_the_background() -> None:
    started = threading.Event()

    async def scenario() -> None:
        periodic = Periodic("sweeping", started.set, 60)
        await periodic.start(wait_for_first=False)
        await asyncio.to_thread(started.wait, 5)
        await periodic.close()

    asyncio.run(scenario())
    assert started.is_set()
