"""``bench backends``: what the gateway costs in front of a model server, and how fast it fails over.

Three ways to the same model (the zoo's ``lm-cloud``, greedy, ``ignore_eos``, streamed chat completions), each a
real process on 127.0.0.1:

- ``direct``: the client talks to ``tierline engine serve`` itself (no gateway: the baseline);
- ``builtin``: ``tierline cloud serve`` with the model in its own engine child (the in-process path);
- ``remote``: ``tierline cloud serve`` as a gateway only (no local engine), the model an ``openai`` backend
  pointing at the same ``engine serve``.

For each, ``requests`` streams at concurrency 1 and at ``concurrency``: latency p50/p99 and time to first token.
The three servers run together and are measured in alternating ``rounds`` (the order rotates each round), so a
load change on a shared host hits every path alike; each figure is the median over rounds (``rounds`` lists
them). ``gateway_overhead_ms`` is ``remote`` minus ``direct`` per round, median over rounds (what the gateway adds
over the same upstream: auth, limits, metering, the SSE relay). Then failover: a second ``engine serve`` joins the
backend, ``kills`` times one upstream is SIGKILLed while streams run; ``failover_s`` is kill → the first request
sent after the kill that succeeded, and ``failed_not_started`` the requests sent after the kill that failed
(target 0).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.common import free_port, tierline_server

CLI = [sys.executable, "-m", "tierline.cli"]

PROMPTS = ("def parse(line):\n", "import os\n\n\nclass ", "    for key, value in ", "# Copyright", "return ")


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 2) if values else None


async def _one(http: httpx.AsyncClient, model: str, i: int, max_tokens: int) -> tuple[float, float | None, bool]:
    """One streamed chat: (latency, time to first content, ok)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.monotonic()
    first: float | None = None
    ok = False
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return time.monotonic() - started, None, False
            async for line in response.aiter_lines():
                if first is None and '"content":"' in line and '"content":""' not in line:
                    first = time.monotonic() - started
                if line == "data: [DONE]":
                    ok = True
                elif line.startswith('data: {"error"'):
                    break
    except httpx.HTTPError:
        ok = False
    return time.monotonic() - started, first, ok


async def _load(
    url: str, key: str | None, model: str, requests: int, concurrency: int, max_tokens: int
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300, limits=limits) as http:
        await _one(http, model, 0, 2)  # warm: connections, caches
        sem = asyncio.Semaphore(concurrency)

        async def bounded(i: int) -> tuple[float, float | None, bool]:
            async with sem:
                return await _one(http, model, i, max_tokens)

        started = time.monotonic()
        results = await asyncio.gather(*(bounded(i) for i in range(requests)))
        elapsed = time.monotonic() - started
    latencies = [r[0] for r in results if r[2]]
    ttfts = [r[1] for r in results if r[2] and r[1] is not None]
    return {
        "requests": requests,
        "errors": sum(not r[2] for r in results),
        "requests_per_s": round(len(latencies) / elapsed, 2),
        "p50_ms": _pct(latencies, 50),
        "p99_ms": _pct(latencies, 99),
        "ttft_p50_ms": _pct(ttfts, 50),
        "ttft_p99_ms": _pct(ttfts, 99),
    }


async def _failover(url: str, key: str, model: str, kill: Any, streams: int, max_tokens: int) -> dict[str, Any]:
    """``streams`` streams run; ``kill()``; then requests one after another until one succeeds."""
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300) as http:
        running = [asyncio.create_task(_one(http, model, i, max_tokens)) for i in range(streams)]
        await asyncio.sleep(0.5)
        killed_at = time.monotonic()
        kill()
        failed = 0
        while True:
            _, _, ok = await _one(http, model, 0, 4)
            if ok:
                failover_s = time.monotonic() - killed_at
                break
            failed += 1
        after = await asyncio.gather(*(_one(http, model, i, 4) for i in range(streams)))
        cut = await asyncio.gather(*running)
    return {
        "failover_s": round(failover_s, 4),
        "failed_not_started": failed + sum(not ok for _, _, ok in after),
        "started_streams_cut": sum(not ok for _, _, ok in cut),
    }


def _median(values: list[float]) -> float | None:
    return round(float(np.median(values)), 2) if values else None


def _summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One path at one concurrency: each figure's median over the rounds, and the rounds."""
    keys = ("requests_per_s", "p50_ms", "p99_ms", "ttft_p50_ms", "ttft_p99_ms")
    out: dict[str, Any] = {k: _median([r[k] for r in rounds if r[k] is not None]) for k in keys}
    out["requests"] = sum(r["requests"] for r in rounds)
    out["errors"] = sum(r["errors"] for r in rounds)
    out["rounds"] = rounds
    return out


def run_backends_bench(
    zoo_root: Path,
    data_dir: Path,
    requests: int = 64,
    concurrency: int = 64,
    max_tokens: int = 32,
    kills: int = 1,
    rounds: int = 3,
) -> dict[str, Any]:
    from controlplane.storage.migrate import upgrade

    model_dir = zoo_root / "artifacts" / "lm-cloud"
    with tempfile.TemporaryDirectory(prefix="tierline-bench-backends-") as tmp:
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
                "TIERLINE_LOG_LEVEL": "WARNING",
                "TIERLINE_CLOUD_SPECULATION": "off",  # the same engine work on every path
                "TIERLINE_CLOUD_DECODE_BURST_MS": "0",  # an event a token: what each path relays, as before bursts
            }
        )
        subprocess.run([*CLI, "tenants", "create", "bench"], env=env, check=True, capture_output=True)
        key = subprocess.run(
            [*CLI, "keys", "create", "--tenant", "bench"], env=env, check=True, capture_output=True, text=True
        ).stdout.strip()
        ports = [free_port(), free_port()]
        upstreams = [f"http://127.0.0.1:{p}" for p in ports]
        spec = {"type": "openai", "upstream_model": "lm-cloud", "tokenizer": str(model_dir), "eject_s": 1.0}
        spec |= {"max_concurrency": 64, "eject_after_failures": 2, "probe_interval_s": 0.2}
        backends = d / "backends.json"
        one = {"remote": {**spec, "endpoints": upstreams[:1]}, "remote-2": {**spec, "endpoints": upstreams}}
        backends.write_text(json.dumps({"models": one}))
        gateway_env = {**env, "TIERLINE_CLOUD_ZOO_PRESET": "none", "TIERLINE_CLOUD_BACKENDS": str(backends)}
        builtin_env = {**env, "TIERLINE_CLOUD_ZOO_PRESET": zoo_root.name}
        serve = ["engine", "serve", "--model", str(model_dir), "--name", "lm-cloud"]
        result: dict[str, Any] = {
            "max_tokens": max_tokens,
            "requests": requests,
            "concurrency": [1, concurrency],
            "rounds": rounds,
            "host_cores": os.cpu_count(),
            "load_avg_1m": round(os.getloadavg()[0], 2),
        }
        measured: dict[str, dict[str, list[dict[str, Any]]]] = {}
        gport, bport = free_port(), free_port()
        targets = {
            "direct": (upstreams[0], None, "lm-cloud"),
            "remote": (f"http://127.0.0.1:{gport}", key, "remote"),
            "builtin": (f"http://127.0.0.1:{bport}", key, "tierline/lm-cloud"),
        }
        with (
            tierline_server(serve, env, ports[0], "/health"),
            tierline_server(["cloud", "serve"], gateway_env, gport, "/readyz"),
            tierline_server(["cloud", "serve"], builtin_env, bport, "/readyz"),
        ):
            order = list(targets)
            for r in range(rounds):
                for name in order[r % 3 :] + order[: r % 3]:  # rotated: no path always runs first
                    url, k, model = targets[name]
                    for c in (1, concurrency):
                        run = asyncio.run(_load(url, k, model, requests, c, max_tokens))
                        measured.setdefault(name, {}).setdefault(str(c), []).append(run)
            failovers = []
            for _ in range(kills):
                with tierline_server(serve, env, ports[1], "/health") as victim:
                    time.sleep(1.0)  # admitted, and taking requests

                    def kill(p: subprocess.Popen[bytes] = victim) -> None:
                        os.kill(p.pid, signal.SIGKILL)

                    failovers.append(
                        asyncio.run(_failover(f"http://127.0.0.1:{gport}", key, "remote-2", kill, concurrency, 64))
                    )
    paths = {name: {k: _summary(runs) for k, runs in by_c.items()} for name, by_c in measured.items()}
    result["paths"] = paths
    overhead: dict[str, dict[str, float | None]] = {}
    for level, runs in measured["direct"].items():
        pairs = list(zip(measured["remote"][level], runs, strict=True))
        overhead[level] = {
            q: _median([a[q] - b[q] for a, b in pairs if a[q] is not None and b[q] is not None])
            for q in ("p50_ms", "p99_ms")
        }
    result["gateway_overhead_ms"] = overhead
    times = [f["failover_s"] for f in failovers]
    result["failover"] = {
        "kills": kills,
        "failover_p50_s": round(float(np.percentile(times, 50)), 4) if times else None,
        "failover_p99_s": round(float(np.percentile(times, 99)), 4) if times else None,
        "failed_not_started": sum(f["failed_not_started"] for f in failovers),
        "started_streams_cut": sum(f["started_streams_cut"] for f in failovers),
    }
    return result
