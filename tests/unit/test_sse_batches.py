"""The relay's reading of an upstream's server-sent events: what a client gets relayed depends on it, whatever way
the upstream frames its events and however the network splits them into reads."""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import AsyncIterator

import pytest

from cloud.serving.backends.upstream import _aclose, _sse_batches


def _batches(*reads: bytes) -> list[list[bytes]]:
    async def chunks() -> AsyncIterator[bytes]:
        for read in reads:
            yield read

    async def collect() -> list[list[bytes]]:
        return [batch async for batch in _sse_batches(chunks())]

    return asyncio.run(collect())


def test_the_events_one_read_completes_come_together() -> None:
    assert _batches(b'data: {"a":1}\n\ndata: {"a":2}\n\n', b"data: [DONE]\n\n") == [
        [b'{"a":1}', b'{"a":2}'],
        [b"[DONE]"],
    ]


def test_an_event_split_across_reads_comes_whole_once_it_ends() -> None:
    assert _batches(b'data: {"te', b'xt":"x"}\n', b"\ndata: [DONE]\n\n") == [[b'{"text":"x"}', b"[DONE]"]]


@pytest.mark.parametrize("end", [b"\r\n", b"\r", b"\n"])
def test_every_line_ending_ends_lines_and_events(end: bytes) -> None:
    stream = b"data: 1" + end + end + b": keep-alive" + end + b"data: 2" + end + end + b"data: [DONE]" + end + end
    split = [stream[i : i + 3] for i in range(0, len(stream), 3)]  # a CRLF split across reads too
    assert [d for batch in _batches(*split) for d in batch] == [b"1", b"2", b"[DONE]"]


def test_multi_line_data_comments_and_other_fields() -> None:
    stream = b": comment\nevent: message\nid: 7\ndata: first\ndata:second\ndata\nretry: 10\n\n: only a comment\n\n"
    assert _batches(stream) == [[b"first\nsecond\n"]]


def test_a_last_event_without_its_empty_line_still_counts() -> None:
    assert _batches(b"data: 1\n\ndata: [DONE]") == [[b"1"], [b"[DONE]"]]
    assert _batches(b"data: 1\n\n", b"\n\n") == [[b"1"]]


def test_a_relay_stopping_at_done_closes_both_generators_leaving_none_to_the_loops_finalizer() -> None:
    """The relay stops reading at ``[DONE]``; what it leaves open the event loop's finalizer hook would close later,
    at the cost of a thread-safe wake-up of the loop and a task each (two per relayed stream)."""
    closed: list[str] = []
    finalized: list[str] = []

    async def body() -> AsyncIterator[bytes]:
        try:
            yield b'data: {"a":1}\n\ndata: [DONE]\n\n'
            yield b"data: never read\n\n"
        finally:
            closed.append("body")

    async def relay() -> None:
        firstiter, finalizer = sys.get_asyncgen_hooks()

        def counted(agen: object) -> None:
            finalized.append(getattr(agen, "__qualname__", "?"))
            if finalizer is not None:
                finalizer(agen)  # type: ignore[arg-type]

        sys.set_asyncgen_hooks(firstiter, counted)
        batches = _sse_batches(body())
        assert await anext(batches) == [b'{"a":1}', b"[DONE]"]
        await _aclose(batches)
        del batches
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(relay())
    assert closed == ["body"]
    assert finalized == []
