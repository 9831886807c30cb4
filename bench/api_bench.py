"""``bench api``: many concurrent streaming clients against a real cloud server, beside the engine alone.

The server runs as its own process on a temporary data dir (SQLite, the built zoo), with a tenant and key
made through the CLI. Clients stream chat completions for ``duration_s``; the same request mix is then run
on an in-process engine with the same concurrency, and the API's overhead is the difference of the two
median latencies. The same comparison one request at a time (``sequential_*``) shows the API's own cost per
request apart from CPU contention between the server, its engine and the load generator.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from cloud.engine.async_engine import AsyncLLMEngine
from cloud.engine.config import EngineConfig
from cloud.engine.sampling_params import SamplingParams

PROMPTS = ("def parse(line):\n", "import os\n\n\nclass ", "    for key, value in ", "# Copyright", "return ")


def _pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)) * 1000, 2) if values else 0.0


async def _clients(
    url: str, key: str, model: str, duration_s: float, concurrency: int, max_tokens: int
) -> dict[str, Any]:
    latencies: list[float] = []
    ttfts: list[float] = []
    errors: dict[str, int] = {}
    deadline = time.monotonic() + duration_s
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120, limits=limits) as client:

        async def one_client(i: int) -> None:
            n = 0
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
                first = None
                try:
                    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        if r.status_code != 200:
                            errors[str(r.status_code)] = errors.get(str(r.status_code), 0) + 1
                            await r.aread()
                            continue
                        async for line in r.aiter_lines():
                            is_text = '"content":"' in line and '"content":""' not in line
                            if first is None and line.startswith("data: ") and is_text:
                                first = time.monotonic()
                except httpx.HTTPError as exc:
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                    continue
                latencies.append(time.monotonic() - started)
                if first is not None:
                    ttfts.append(first - started)

        started = time.monotonic()
        await asyncio.gather(*(one_client(i) for i in range(concurrency)))
        elapsed = time.monotonic() - started
    return {"latencies": latencies, "ttfts": ttfts, "errors": errors, "seconds": elapsed}


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
) -> dict[str, Any]:
    from shared.storage.migrate import upgrade

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
            }
        )
        cli = [sys.executable, "-m", "shared.cli"]
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
            api = asyncio.run(_clients(url, key, model, duration_s, concurrency, max_tokens))
            one_by_one = asyncio.run(_clients(url, key, model, min(5.0, duration_s / 3), 1, max_tokens))
        finally:
            server.terminate()
            server.wait(timeout=60)
    artifacts = zoo_root / "artifacts"
    name = model.split("/", 1)[1]
    draft = artifacts / "lm-edge" if name == "lm-cloud" else None
    alone = asyncio.run(
        _engine_alone(artifacts / name, draft, max(concurrency, len(api["latencies"])), concurrency, max_tokens)
    )
    alone_one_by_one = asyncio.run(_engine_alone(artifacts / name, draft, len(one_by_one["latencies"]), 1, max_tokens))
    api_p50 = _pct(api["latencies"], 50)
    engine_p50 = _pct(alone, 50)
    return {
        "model": model,
        "concurrency": concurrency,
        "duration_s": duration_s,
        "max_tokens": max_tokens,
        "requests": len(api["latencies"]),
        "requests_per_s": round(len(api["latencies"]) / api["seconds"], 2),
        "errors": sum(api["errors"].values()),
        "errors_by_kind": api["errors"],
        "ttft_p50_ms": _pct(api["ttfts"], 50),
        "ttft_p99_ms": _pct(api["ttfts"], 99),
        "latency_p50_ms": api_p50,
        "engine_latency_p50_ms": engine_p50,
        "overhead_p50_ms": round(api_p50 - engine_p50, 2),
        # One request at a time: what the API adds per request when it does not compete for CPU with dozens of
        # concurrent streams and their client (on a small host most of overhead_p50_ms is that contention).
        "sequential_latency_p50_ms": _pct(one_by_one["latencies"], 50),
        "sequential_engine_latency_p50_ms": _pct(alone_one_by_one, 50),
        "sequential_overhead_p50_ms": round(_pct(one_by_one["latencies"], 50) - _pct(alone_one_by_one, 50), 2),
    }


if __name__ == "__main__":
    print(json.dumps(run_api_bench(Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])), indent=2))
