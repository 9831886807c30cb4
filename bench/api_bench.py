"""``bench api``: many concurrent streaming clients against a real cloud server, beside the engine's own latency.

The server runs as its own process on a temporary data dir (SQLite, the built zoo), with a tenant and key
made through the CLI. Clients stream chat completions for ``duration_s``. The server's usage record of each
request holds the engine's own latency for it (hand-over to the engine until its last token, ``engine_ms``),
so the API's overhead is measured on the same requests in the same run: the clients' p50 latency minus the
engine's p50 for those requests. The same comparison one request at a time (``sequential_*``) shows the API's
own cost per request without load.

``isolated_*`` replays the request mix on an in-process engine that has the host to itself (no HTTP server, no
clients). On a small host the difference to that is mostly CPU contention: the server's and the clients' work
takes cores from the engine's steps, which the same-run comparison counts as engine time.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np

from bench.common import tree_cpu_seconds
from bench.sse_client import Connection, ProtocolError
from cloud.engine.async_engine import AsyncLLMEngine
from cloud.engine.config import EngineConfig
from cloud.engine.sampling_params import SamplingParams

T = TypeVar("T")
PROMPTS = ("def parse(line):\n", "import os\n\n\nclass ", "    for key, value in ", "# Copyright", "return ")


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on uvloop where it is installed (as the server runs): the clients take less CPU from the
    server they measure on a shared host."""
    try:
        import uvloop
    except ImportError:  # Windows
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def _pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)) * 1000, 2) if values else 0.0


async def _clients(
    url: str, key: str, model: str, duration_s: float, concurrency: int, max_tokens: int
) -> dict[str, Any]:
    """``concurrency`` clients, each on its own keep-alive connection, streaming chat completions back to back."""
    latencies: dict[str, float] = {}  # by request id (the usage record's id)
    ttfts: list[float] = []
    errors: dict[str, int] = {}
    deadline = time.monotonic() + duration_s
    connections = [Connection(url, {"Authorization": f"Bearer {key}"}) for _ in range(concurrency)]

    async def one_client(i: int) -> None:
        conn, n = connections[i], 0
        while time.monotonic() < deadline:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": PROMPTS[(i + n) % len(PROMPTS)]}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            n += 1
            started = time.monotonic()
            try:
                r = await conn.request("/v1/chat/completions", body)
            except (OSError, ProtocolError) as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                continue
            done = time.monotonic()
            events = [(at, line[6:]) for at, line in r.lines if line.startswith(b"data: ")]
            if r.status != 200 or not events or events[-1][1] != b"[DONE]":
                kind = str(r.status) if r.status != 200 else "incomplete stream"
                errors[kind] = errors.get(kind, 0) + 1
                continue
            rid = json.loads(events[0][1])["id"].removeprefix("chatcmpl-")
            latencies[rid] = done - started
            first = next((at for at, e in events if b'"content":"' in e and b'"content":""' not in e), None)
            if first is not None:
                ttfts.append(first - started)

    started = time.monotonic()
    try:
        await asyncio.gather(*(one_client(i) for i in range(concurrency)))
    finally:
        await asyncio.gather(*(c.close() for c in connections))
    elapsed = time.monotonic() - started
    return {
        "latencies": latencies,
        "ttfts": ttfts,
        "errors": errors,
        "seconds": elapsed,
        "connections_opened": sum(c.connects for c in connections),
    }


async def _engine_alone(
    model_dir: Path, draft_dir: Path | None, count: int, concurrency: int, max_tokens: int
) -> list[float]:
    engine = AsyncLLMEngine.from_config(EngineConfig(model_dir, draft_model_dir=draft_dir, kv_cache_bytes=256 << 20))
    tok = engine.engine.tokenizer
    latencies: list[float] = []
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        prompt = tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
        async with sem:
            started = time.monotonic()
            async for _ in engine.generate(
                prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            ):
                pass
            latencies.append(time.monotonic() - started)

    try:
        await asyncio.gather(*(one(i) for i in range(count)))
    finally:
        engine.shutdown()
    return latencies


def run_api_bench(
    zoo_root: Path,
    data_dir: Path,
    duration_s: float = 30.0,
    concurrency: int = 64,
    max_tokens: int = 16,
    model: str = "tierline/lm-cloud",
    stream_interval: int = 1,
    usage_checkpoint_tokens: int | None = None,
) -> dict[str, Any]:
    from controlplane.storage.migrate import upgrade

    with tempfile.TemporaryDirectory(prefix="tierline-bench-api-") as tmp:
        d = Path(tmp)
        shutil.copytree(data_dir / "keys", d / "keys")
        shutil.copytree(zoo_root, d / "zoo" / zoo_root.name)
        db_url = f"sqlite:///{d / 'tierline.db'}"
        upgrade(db_url)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIERLINE_")}
        env.update(
            {
                "TIERLINE_DATA_DIR": str(d),
                "TIERLINE_DATABASE_URL": db_url,
                "TIERLINE_CLOUD_ZOO_PRESET": zoo_root.name,
                "TIERLINE_LOG_LEVEL": "WARNING",
                "TIERLINE_CLOUD_STREAM_INTERVAL": str(stream_interval),
            }
        )
        if usage_checkpoint_tokens is not None:  # durable usage of streams: one write per this many tokens; 0: off
            env["TIERLINE_CLOUD_USAGE_CHECKPOINT_TOKENS"] = str(usage_checkpoint_tokens)
        cli = [sys.executable, "-m", "tierline.cli"]
        subprocess.run([*cli, "tenants", "create", "bench"], env=env, check=True, capture_output=True)
        key = subprocess.run(
            [*cli, "keys", "create", "--tenant", "bench"], env=env, check=True, capture_output=True, text=True
        ).stdout.strip()
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen(
            [*cli, "cloud", "serve", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            for _ in range(600):
                try:
                    if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None:
                    raise RuntimeError("the cloud server exited during start-up")
                time.sleep(0.2)
            # The load generator imported torch for the isolated comparison: a full collection of its ~300k
            # objects would stall every client for ~100 ms and be measured as the server's latency.
            gc.collect()
            gc.freeze()
            try:
                server_cpu, client_cpu = tree_cpu_seconds(server.pid), time.process_time()
                api = _run(_clients(url, key, model, duration_s, concurrency, max_tokens))
                cpu = [round(tree_cpu_seconds(server.pid) - server_cpu, 2), round(time.process_time() - client_cpu, 2)]
                one_by_one = _run(_clients(url, key, model, min(5.0, duration_s / 3), 1, max_tokens))
            finally:
                gc.unfreeze()
        finally:
            server.terminate()
            server.wait(timeout=60)  # a graceful stop writes every usage record still queued
        engine_ms = _engine_latencies(d / "tierline.db")
    artifacts = zoo_root / "artifacts"
    name = model.split("/", 1)[1]
    draft = artifacts / "lm-draft" if name == "lm-cloud" else None
    n_api, n_one = len(api["latencies"]), len(one_by_one["latencies"])
    alone = _run(_engine_alone(artifacts / name, draft, max(concurrency, n_api), concurrency, max_tokens))
    alone_one_by_one = _run(_engine_alone(artifacts / name, draft, n_one, 1, max_tokens))
    result: dict[str, Any] = {
        "model": model,
        "concurrency": concurrency,
        "stream_interval": stream_interval,
        "usage_checkpoint_tokens": usage_checkpoint_tokens,
        "duration_s": duration_s,
        "max_tokens": max_tokens,
        "requests": n_api,
        "requests_per_s": round(n_api / api["seconds"], 2),
        "errors": sum(api["errors"].values()),
        "errors_by_kind": api["errors"],
        "connections_opened": api["connections_opened"],
        "ttft_p50_ms": _pct(api["ttfts"], 50),
        "ttft_p99_ms": _pct(api["ttfts"], 99),
        # CPU seconds during the load: the server (API process and engine children) and these clients. On a host
        # where they share the cores, the clients' CPU is taken from the server.
        "cpu_s": {"server": cpu[0], "clients": cpu[1], "host_cores": os.cpu_count()},
    }
    for prefix, run, isolated in (("", api, alone), ("sequential_", one_by_one, alone_one_by_one)):
        result.update({f"{prefix}{k}": v for k, v in _overhead(run["latencies"], engine_ms, isolated).items()})
    return result


def _engine_latencies(db: Path) -> dict[str, float]:
    """The engine's own latency of each request the server metered, by request id, in seconds."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(db)) as conn:
        rows = conn.execute("SELECT id, engine_ms FROM usage_record WHERE engine_ms IS NOT NULL").fetchall()
    return {rid: ms / 1000 for rid, ms in rows}


def _overhead(client: dict[str, float], engine: dict[str, float], isolated: list[float]) -> dict[str, Any]:
    """The API's p50 latency minus the engine's p50 for the same requests, and the same against ``isolated``."""
    same = [rid for rid in client if rid in engine]
    api = [client[rid] for rid in same]
    own = [engine[rid] for rid in same]
    return {
        "latency_p50_ms": _pct(api, 50),
        "engine_latency_p50_ms": _pct(own, 50),
        "overhead_p50_ms": round(_pct(api, 50) - _pct(own, 50), 2),
        "overhead_per_request_p50_ms": _pct([a - e for a, e in zip(api, own, strict=True)], 50),
        "matched_requests": len(same),
        "isolated_engine_latency_p50_ms": _pct(isolated, 50),
        "isolated_overhead_p50_ms": round(_pct(api, 50) - _pct(isolated, 50), 2),
    }


if __name__ == "__main__":
    print(json.dumps(run_api_bench(Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])), indent=2))
