"""A stream's last steps (its usage settled, its upstream slot given back) survive the client leaving: Litestar
cancels a streaming response's task group when the client disconnects, and anyio keeps cancelling every await
inside it, the ones in the stream's ``finally`` too."""

from __future__ import annotations

import asyncio

import anyio

from cloud.serving.completions import run_to_end


def _settle_in_a_cancelled_scope(finish: bool) -> list[str]:
    steps: list[str] = []

    async def settle() -> None:  # a rate-limit release, then the record: two awaits, as ``_settle`` has
        await asyncio.sleep(0.01)
        steps.append("limits released")
        await asyncio.sleep(0.01)
        steps.append("record written")

    async def main() -> None:
        with anyio.CancelScope() as scope:  # the response's task group, cancelled by the client's disconnect
            scope.cancel()
            try:
                await asyncio.sleep(1)  # the stream waits for its upstream's next event
            finally:
                if finish:
                    await run_to_end(settle())
                else:
                    await settle()
        await asyncio.sleep(0.1)

    asyncio.run(main())
    return steps


def test_a_stream_cancelled_by_its_client_leaving_settles_to_the_end() -> None:
    assert _settle_in_a_cancelled_scope(finish=True) == ["limits released", "record written"]


def test_without_it_the_settle_stops_at_its_first_await() -> None:
    # why the stream's finally needs run_to_end: the cancellation is delivered again to the settle's own awaits
    assert _settle_in_a_cancelled_scope(finish=False) == []


def test_run_to_end_returns_what_the_work_returns() -> None:
    async def usage() -> dict[str, int]:
        await asyncio.sleep(0)
        return {"completion_tokens": 3}

    assert asyncio.run(run_to_end(usage())) == {"completion_tokens": 3}
