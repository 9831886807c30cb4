"""A model server that streams at a set pace and spends almost no CPU: what a gateway's overhead is when the model
server does not share its cores (in production it runs on a GPU host of its own).

On this bench host the tiny ``tierline engine serve`` saturates the two cores the gateway, PostgreSQL, Redis and
the load generator share, so a gateway's latency over it is mostly the CPU it takes from the model server. This
server answers ``POST /v1/chat/completions`` and ``/v1/completions`` (OpenAI shapes, streamed or not) with
``max_tokens`` tokens of text: the first after ``--ttft-ms``, then one every ``--token-ms``, one server-sent
event per token as vLLM sends them, then the usage chunk (``stream_options.include_usage``) and ``[DONE]``.
``GET /health`` answers 200. HTTP/1.1 with keep-alive, on uvloop.

    python -m bench.paced_upstream --port 8100 --ttft-ms 20 --token-ms 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from typing import Any

TOKEN = " word"  # one token of the zoo's tokenizers


def _event(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    event = f"data: {data}\n\n".encode()
    return b"%x\r\n%s\r\n" % (len(event), event)  # one chunk of a chunked body


def _head(status: str, content_type: str, length: int | None = None) -> bytes:
    framing = f"content-length: {length}" if length is not None else "transfer-encoding: chunked"
    return f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\n{framing}\r\n\r\n".encode()


class PacedUpstream:
    def __init__(self, ttft_s: float, token_s: float) -> None:
        self.ttft_s = ttft_s
        self.token_s = token_s

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                request_line, *lines = head.decode("latin-1").split("\r\n")
                method, path, _ = request_line.split(" ", 2)
                length = 0
                for line in lines:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                body = await reader.readexactly(length) if length else b""
                if method == "GET" and path == "/health":
                    writer.write(_head("200 OK", "application/json", 2) + b"{}")
                elif method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
                    await self._complete(writer, json.loads(body or b"{}"), chat=path.endswith("chat/completions"))
                else:
                    message = json.dumps({"error": {"message": f"no route {method} {path}"}}).encode()
                    writer.write(_head("404 Not Found", "application/json", len(message)) + message)
                await writer.drain()
        except ConnectionError:
            return
        finally:
            writer.close()

    async def _complete(self, writer: asyncio.StreamWriter, request: dict[str, Any], *, chat: bool) -> None:
        tokens = int(request.get("max_tokens") or 16)
        prompt = request.get("messages") if chat else request.get("prompt")
        usage = {
            "prompt_tokens": max(1, len(json.dumps(prompt)) // 4),
            "completion_tokens": tokens,
            "total_tokens": max(1, len(json.dumps(prompt)) // 4) + tokens,
        }
        base: dict[str, Any] = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": request.get("model", "paced"),
        }
        start = time.monotonic()
        if not request.get("stream"):
            await asyncio.sleep(self.ttft_s + self.token_s * (tokens - 1))
            text = TOKEN * tokens
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            answer = {**base, "object": "chat.completion" if chat else "text_completion", "choices": [choice]}
            data = json.dumps({**answer, "usage": usage}).encode()
            writer.write(_head("200 OK", "application/json", len(data)) + data)
            return
        writer.write(_head("200 OK", "text/event-stream"))
        if chat:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            writer.write(_event({**base, "choices": [role]}))
        for i in range(tokens):
            # paced from the start (not from the last write): a late wake-up does not slow every later token
            delay = start + self.ttft_s + self.token_s * i - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            last = i == tokens - 1
            finish = "length" if last else None
            choice = {"index": 0, "delta": {"content": TOKEN}} if chat else {"index": 0, "text": TOKEN}
            writer.write(_event({**base, "choices": [{**choice, "finish_reason": finish}]}))
        if (request.get("stream_options") or {}).get("include_usage"):
            writer.write(_event({**base, "choices": [], "usage": usage}))
        writer.write(_event("[DONE]") + b"0\r\n\r\n")


async def serve(host: str, port: int, ttft_s: float, token_s: float) -> None:
    server = await asyncio.start_server(PacedUpstream(ttft_s, token_s).handle, host, port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ttft-ms", type=float, default=20.0, help="the first token this long after the request")
    parser.add_argument("--token-ms", type=float, default=10.0, help="then one token this often")
    args = parser.parse_args()
    import uvloop  # the gateway's own loop (a cloud dependency)

    uvloop.run(serve(args.host, args.port, args.ttft_ms / 1000, args.token_ms / 1000))


if __name__ == "__main__":
    main()
