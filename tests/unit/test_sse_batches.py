"""The relay's reading of an upstream's server-sent events: what a client gets relayed depends on it, whatever way
the upstream frames its events and however the network splits them into reads."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from cloud.backends.upstream import _sse_batches


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
