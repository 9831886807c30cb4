"""What a gateway request costs beyond relaying it: the gateway's CPU against floors that only relay.

On the platform of ``bench scale`` (``bench.lab.gateway_profile.bench_platform``: one ``tierline engine serve``; a
tenant with a rate limit in Redis, a budget, a price and exactly-once metering in PostgreSQL), each path is
loaded by one streaming client at a time at two completion lengths, rounds alternated, and its server's CPU per
request is split into a fixed part and a part per token (the line through the two lengths):

- ``gateway``: ``tierline cloud serve`` (authentication, limits, budget, metering, the relay);
- ``litestar``: a Litestar route returning tierline's ``EventStream`` (the request-id middleware around it) over
  ``json``'s relay;
- ``json``: a bare ASGI app under the same uvicorn relaying each event decoded and re-encoded (id and model
  rewritten), as the gateway's relay does;
- ``raw``: the same app passing the upstream's bytes through.

All floors use the gateway's upstream client (``cloud.serving.backends.http1``) and no authentication or billing.

    python -m bench.lab.relay_floor --rounds 2 --requests 300 --tokens 2,32
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
from collections.abc import AsyncIterator
from typing import Any

PATHS = ("gateway", "litestar", "json", "raw")


# --- the floors --------------------------------------------------------------------------------------------------


def _floor_app(mode: str, upstream: str) -> Any:
    import msgspec

    from cloud.serving.backends.http1 import Http1Client
    from cloud.serving.backends.upstream import _sse_batches
    from shared.openai_responses import SSE_DONE, sse

    decode = msgspec.json.Decoder().decode
    clients: list[Http1Client] = []

    async def events(body: bytes) -> AsyncIterator[bytes]:
        if not clients:
            clients.append(Http1Client(30.0))
        response = await clients[0].post(f"{upstream}/v1/chat/completions", body, {"content-type": "application/json"})
        if mode == "raw":
            async for piece in response.aiter_bytes():
                yield piece
            return
        async for batch in _sse_batches(response.aiter_bytes()):
            out = []
            for data in batch:
                if data == b"[DONE]":
                    out.append(SSE_DONE)
                    continue
                out.append(sse({**decode(data), "id": "chatcmpl-floor", "model": "lm-cloud"}))
            yield b"".join(out)

    async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] != "/v1/chat/completions":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok", "more_body": False})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        async for piece in events(body):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    if mode != "litestar":
        return asgi
    from litestar import Litestar, Request, get, post

    from shared.http import EventStream
    from shared.logs import request_id_middleware

    @post("/v1/chat/completions", status_code=200)
    async def chat(request: Request[Any, Any, Any]) -> EventStream:
        return EventStream(events(await request.body()), media_type="text/event-stream")

    @get("/healthz", sync_to_thread=False)
    def healthz() -> str:
        return "ok"

    names = {"EventStream": EventStream, "Request": Request, "Any": Any}  # local imports: annotations by name
    app = Litestar([chat, healthz], logging_config=None, signature_namespace=names)
    app.asgi_handler = request_id_middleware(app.asgi_handler)
    return app


def _serve_floor(mode: str, upstream: str, port: int) -> None:
    import uvicorn

    app = _floor_app(mode, upstream)
    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", access_log=False, log_level="error")


# --- the measurement ------------------------------------------------------------------------------------------------


def run(rounds: int, requests: int, tokens: tuple[int, int], paths: list[str]) -> dict[str, Any]:
    from bench.common import free_port, served, tierline_server
    from bench.lab.gateway_profile import bench_platform
    from bench.scale_bench import _load, _summary

    cpu: dict[str, dict[int, list[float]]] = {p: {t: [] for t in tokens} for p in paths}
    with bench_platform("tierline-floor-") as (_, platform), contextlib.ExitStack() as stack:
        servers: dict[str, tuple[str, int]] = {}
        for path in paths:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            if path == "gateway":
                proc = stack.enter_context(tierline_server(["cloud", "serve"], platform.envs[0], port, "/readyz"))
            else:
                cmd = [sys.executable, "-m", "bench.lab.relay_floor", "--serve", path, "--upstream", platform.upstream]
                floor = served([*cmd, "--port", str(port)], os.environ.copy(), f"{url}/healthz", f"the {path} relay")
                proc = stack.enter_context(floor)
            servers[path] = (url, proc.pid)
        for url, _ in servers.values():  # warm: connections, prepared statements, caches
            asyncio.run(_load(url, platform.key, 32, 4, tokens[0]))
        for r in range(rounds):
            for path in paths if r % 2 == 0 else list(reversed(paths)):
                url, pid = servers[path]
                for t in tokens:
                    outcomes, _, elapsed, _, used = asyncio.run(
                        _load(url, platform.key, requests, 1, t, cpu_pids=(pid,))
                    )
                    summary = _summary(outcomes, elapsed)
                    if summary["errors"] or any(o.events != t for o in outcomes):
                        raise SystemExit(f"{path} at {t} tokens did not relay every event: {summary}")
                    cpu[path][t].append(round(used / requests * 1000, 3))
    low, high = tokens
    result: dict[str, Any] = {"rounds": rounds, "requests": requests, "tokens": list(tokens), "paths": {}}
    for path in paths:
        a, b = statistics.median(cpu[path][low]), statistics.median(cpu[path][high])
        per_token = (b - a) / (high - low)
        result["paths"][path] = {
            f"cpu_ms_per_request_at_{low}": cpu[path][low],
            f"cpu_ms_per_request_at_{high}": cpu[path][high],
            "fixed_ms": round(a - per_token * low, 3),
            "per_token_us": round(per_token * 1000, 1),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=300, help="streams per path, length and round")
    parser.add_argument("--tokens", default="2,32", help="the two completion lengths, comma-separated")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    parser.add_argument("--serve", choices=PATHS[1:], help=argparse.SUPPRESS)  # a floor relay's own process
    parser.add_argument("--upstream", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        if not args.upstream or not args.port:
            parser.error("--serve needs --upstream and --port")
        _serve_floor(args.serve, args.upstream, args.port)
        return
    try:
        low, high = (int(t) for t in args.tokens.split(","))
    except ValueError:
        parser.error(f"--tokens {args.tokens!r}: expected two lengths, such as 2,32")
    if not 0 < low < high:
        parser.error(f"--tokens {args.tokens!r}: expected two lengths, the first smaller, both above 0")
    paths = [p for p in args.paths.split(",") if p]
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths:
        parser.error(f"--paths {args.paths!r}: expected some of {', '.join(PATHS)}")
    if args.rounds < 1 or args.requests < 1:
        parser.error("--rounds and --requests must be at least 1")
    print(json.dumps(run(args.rounds, args.requests, (low, high), paths), indent=2))


if __name__ == "__main__":
    main()
