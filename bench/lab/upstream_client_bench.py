"""CPU per streamed upstream call: httpx (the gateway's client before) against ``cloud.serving.backends.http1``.

One local upstream in a child process (its CPU is not counted) answers every POST with a model server's stream:
``chunked``, one server-sent event per write (a chat chunk of one token each), a usage chunk, ``[DONE]``. In
this process, ``concurrency`` tasks make ``requests`` streamed calls with each client in turn, alternating
rounds (httpx, lean, httpx, lean, ...) so both see the same host; each call is what the gateway does with an
upstream stream (``UpstreamClient.post``, the body through ``_sse_batches``, ``aclose``) and is checked to have
got every event. CPU milliseconds per call (``time.process_time``: this process, all threads) per round, and
their medians; on uvloop by default, as the gateway runs.

    python -m bench.lab.upstream_client_bench --requests 400 --concurrency 8 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import time
from typing import Any

import httpx
import uvloop

from bench.common import free_port
from cloud.serving.backends.http1 import Http1Client, HttpxUpstream, UpstreamClient

TIMEOUT_S = 30.0
_EVENT = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"lm-cloud",'
    b'"choices":[{"index":0,"delta":{"content":" token"},"finish_reason":null}]}\n\n'
)
_USAGE = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"lm-cloud","choices":[],'
    b'"usage":{"prompt_tokens":8,"completion_tokens":%d,"total_tokens":%d}}\n\n'
)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _upstream(port: int, events: int, gap_s: float) -> None:
    """A model server's streams: every request answered with ``events`` token events ``gap_s`` apart, usage and
    [DONE]."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    tail = _chunk(_USAGE % (events, events + 8)) + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
    token = _chunk(_EVENT)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (int(line[15:]) for line in request.split(b"\r\n") if line.lower().startswith(b"content-length:")),
                    0,
                )
                await reader.readexactly(length)
                writer.write(head)
                for _ in range(events):  # one write per token, as a model server sends them
                    writer.write(token)
                    await writer.drain()
                    await asyncio.sleep(gap_s)
                writer.write(tail)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def _serve(port: int, events: int, gap_s: float) -> None:
    uvloop.run(_upstream(port, events, gap_s))


async def _call(client: UpstreamClient, url: str, body: bytes, events: int) -> None:
    from cloud.serving.backends.upstream import _sse_batches  # here: the upstream's child process imports none of cloud

    response = await client.post(url, body, {"Content-Type": "application/json", "Authorization": "Bearer sk-x"})
    try:
        if response.status_code != 200:
            raise RuntimeError(f"upstream answered {response.status_code}")
        got = 0
        async for batch in _sse_batches(response.aiter_bytes()):
            got += len(batch)
            if batch[-1] == b"[DONE]":
                break
        if got != events + 2:
            raise RuntimeError(f"a stream relayed {got} events of {events + 2}")
    finally:
        await response.aclose()


async def _round(client: UpstreamClient, url: str, requests: int, concurrency: int, events: int) -> dict[str, float]:
    body = json.dumps({"model": "lm-cloud", "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
    left = requests

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await _call(client, url, body, events)

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {"cpu_ms_per_call": round(cpu * 1000 / requests, 4), "wall_s": round(wall, 3)}


def _wait_listening(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=1.0)  # a GET without a body: answered like a POST
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("the bench upstream did not start")


def run(
    requests: int, concurrency: int, events: int, rounds: int, loop: str = "uvloop", gap_ms: float = 1.0
) -> dict[str, Any]:
    port = free_port()
    upstream = multiprocessing.get_context("spawn").Process(
        target=_serve, args=(port, events, gap_ms / 1000), daemon=True
    )
    upstream.start()
    try:
        _wait_listening(port)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"

        async def measure() -> dict[str, list[dict[str, float]]]:
            http = httpx.AsyncClient(
                timeout=httpx.Timeout(TIMEOUT_S, connect=2.0),
                limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024),
            )
            clients: dict[str, UpstreamClient] = {"httpx": HttpxUpstream(http), "lean": Http1Client(TIMEOUT_S)}
            out: dict[str, list[dict[str, float]]] = {name: [] for name in clients}
            for client in clients.values():  # warm-up: connections made, code paths loaded
                await _round(client, url, concurrency * 2, concurrency, events)
            for _ in range(rounds):
                for name, client in clients.items():
                    out[name].append(await _round(client, url, requests, concurrency, events))
            for client in clients.values():
                await client.aclose()
            return out

        factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
        with asyncio.Runner(loop_factory=factory) as runner:
            per_round = runner.run(measure())
    finally:
        upstream.kill()
        upstream.join()
    medians = {name: statistics.median(r["cpu_ms_per_call"] for r in rs) for name, rs in per_round.items()}
    return {
        "requests": requests,
        "concurrency": concurrency,
        "events_per_call": events + 2,
        "token_gap_ms": gap_ms,
        "rounds": rounds,
        "loop": loop,
        "httpx_cpu_ms_per_call": round(medians["httpx"], 4),
        "lean_cpu_ms_per_call": round(medians["lean"], 4),
        "lean_over_httpx": round(medians["lean"] / medians["httpx"], 3),
        "per_round": per_round,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="streamed calls per client per round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--events", type=int, default=16, help="token events per stream (with usage and [DONE])")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per client, alternating")
    parser.add_argument("--gap-ms", type=float, default=1.0, help="between two token events (0: back to back)")
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    args = parser.parse_args()
    print(json.dumps(run(args.requests, args.concurrency, args.events, args.rounds, args.loop, args.gap_ms), indent=2))


if __name__ == "__main__":
    main()
