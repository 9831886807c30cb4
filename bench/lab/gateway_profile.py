"""Where a gateway's CPU goes per streamed chat completion relayed to an upstream ``tierline engine serve``.

The same platform as ``bench scale`` (one gateway with tenants, a rate limit counted in Redis, a monthly budget,
a price and exactly-once metering in PostgreSQL; an ``openai`` backend in front of one model server), loaded by
``concurrency`` streaming clients, sampled by py-spy (``pip install py-spy``; profiling only, never a
dependency). Each sample of the gateway's threads is put in the first stage of ``STAGES`` one of its frames
matches; the report gives each stage's share of the samples and its CPU milliseconds per request (the share of
the gateway's CPU seconds, from /proc, over the requests served).

    python -m bench.lab.gateway_profile --requests 300 --concurrency 8,64

A second run without py-spy gives the unperturbed CPU per request (``--no-profile``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import free_port, tierline_server
from bench.scale_bench import _load, _Platform, _setup, _summary, _tree_cpu, _upstream

# (stage, substrings of a frame) in priority order: a sample counts for the first stage any of its frames matches.
STAGES: list[tuple[str, tuple[str, ...]]] = [
    (
        "budget settle + usage record (PostgreSQL)",
        ("_settle_checkpointed", "settle_checkpointed (", "settle_async (", "_settled ("),
    ),
    (
        "usage checkpoint (PostgreSQL)",
        (
            "UsageWriter._checkpoint",
            "checkpoint (cloud/gateway/metering",
            "checkpoint (controlplane",
            "checkpoint_async (",
        ),
    ),
    (
        "budget reservation (PostgreSQL)",
        ("_reserve (cloud/serving/completions", "reserve (controlplane/billing", "reserve_async (", "pg_async"),
    ),
    ("usage writer batch (PostgreSQL)", ("_ingest (cloud/gateway/metering", "ingest_usage")),
    ("budget sweeper / background", ("sweep", "budget_watch", "canary", "job_worker", "webhook")),
    ("rate limits (Redis)", ("cloud/gateway/limits.py", "/limits/", "/redis/")),
    ("auth / key lookup", ("require_caller", "auth_cache")),
    ("settle: rating, metrics, release", ("_settle (cloud/serving/completions", "bill (cloud/serving/backends")),
    ("prompt counting (tokenizer)", ("encode_counted", "chat_prompt", "_checked_size", "tokenizers")),
    ("SSE relay per chunk", ("_relay (cloud/serving/backends",)),
    (
        "upstream request + first event",
        ("_call (cloud/serving/backends", "_first_event", "cloud/serving/backends/http1", "/httpx/", "/httpcore/"),
    ),
    ("request parsing/validation", ("pydantic", "_dumper", "signature", "kwargs_model", "msgspec")),
    ("metrics", ("prometheus", "observability")),
    ("logging", ("logging/",)),
    ("HTTP server (uvicorn, litestar)", ("uvicorn", "litestar", "httptools", "starlette")),
]


def classify(stack: str) -> str:
    for stage, needles in STAGES:
        if any(n in stack for n in needles):
            return stage
    return "other (event loop, asyncio)"


def breakdown(raw: Path) -> Counter[str]:
    """Samples per stage of a py-spy ``--format raw`` file (one collapsed stack and its count a line)."""
    counts: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            counts[classify(stack)] += int(n)
    return counts


def _point(
    url: str,
    key: str,
    pid: int,
    tmp: Path,
    requests: int,
    concurrency: int,
    max_tokens: int,
    profile: bool,
    rate: int,
    gil: bool = False,
) -> dict[str, Any]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    raw = tmp / f"profile-{concurrency}.txt"
    sampler = None
    if profile:
        cmd = [
            spy,
            "record",
            "-p",
            str(pid),
            "-f",
            "raw",
            "-o",
            str(raw),
            "-r",
            str(rate),
            "--nonblocking",
            "--threads",
            *(["--gil"] if gil else []),
        ]
        sampler = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(2.0)  # attached
    outcomes, _, elapsed, _, cpu = asyncio.run(_load(url, key, requests, concurrency, max_tokens, cpu_pids=(pid,)))
    if sampler is not None:
        sampler.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            sampler.wait(30)
    result = _summary(outcomes, elapsed)
    served = requests - result["errors"]
    result["gateway_cpu_s"] = round(cpu, 2)
    result["gateway_cpu_ms_per_request"] = round(cpu / served * 1000, 3) if served else None
    if profile and raw.exists():
        counts = breakdown(raw)
        total = sum(counts.values())
        per_request = result["gateway_cpu_ms_per_request"] or 0.0
        result["samples"] = total
        result["stages"] = {
            stage: {"share": round(n / total, 3), "cpu_ms_per_request": round(per_request * n / total, 3)}
            for stage, n in counts.most_common()
        }
        keep = os.environ.get("TIERLINE_PROFILE_KEEP")
        if keep:
            shutil.copy(raw, f"{keep}.{concurrency}")
    return result


@contextlib.contextmanager
def bench_platform(prefix: str, pace: tuple[float, float] | None = None) -> Iterator[tuple[Path, _Platform]]:
    """``bench scale``'s platform (tenants, a rate limit in Redis, a budget, a price, metering in PostgreSQL: a
    fresh schema of ``TIERLINE_BENCH_DATABASE_URL``; ``TIERLINE_BENCH_REDIS_URL``) with its model server up (the
    paced one for ``pace``: ttft and token ms), and a temporary directory; the gateways are the caller's."""
    from bench.billing_bench import _postgres, _postgres_url
    from bench.common import zoo_root
    from shared.settings import CoreSettings

    db_url = _postgres_url()
    if db_url is None:
        raise SystemExit("set TIERLINE_BENCH_DATABASE_URL (or TIERLINE_TEST_DATABASE_URL)")
    redis_url = os.environ.get("TIERLINE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
    zoo = zoo_root("tiny", None)
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp_name, _postgres(db_url) as schema_url:
        tmp = Path(tmp_name)
        up_port = free_port()
        platform = _setup(tmp, zoo, CoreSettings().data_dir, schema_url, redis_url, f"http://127.0.0.1:{up_port}")
        with _upstream(zoo, platform, up_port, pace):
            yield tmp, platform


def run(
    requests: int,
    concurrency: list[int],
    max_tokens: int,
    profile: bool,
    rate: int,
    gil: bool = False,
    idle_s: float = 0.0,
) -> dict[str, Any]:
    result: dict[str, Any] = {"requests": requests, "concurrency": concurrency, "max_tokens": max_tokens, "gil": gil}
    with bench_platform("tierline-gw-profile-") as (tmp, platform):
        port = free_port()
        with tierline_server(["cloud", "serve"], platform.envs[0], port, "/readyz") as gateway:
            url = f"http://127.0.0.1:{port}"
            asyncio.run(_load(url, platform.key, 2 * max(concurrency), max(concurrency), max_tokens))  # warm
            if idle_s > 0:  # what the gateway burns with no request: its background work, per second
                time.sleep(1.0)
                cpu0 = _tree_cpu(gateway.pid)
                time.sleep(idle_s)
                result["idle_cpu_ms_per_s"] = round((_tree_cpu(gateway.pid) - cpu0) / idle_s * 1000, 2)
            points = {}
            for c in concurrency:
                points[str(c)] = _point(
                    url, platform.key, gateway.pid, tmp, requests, c, max_tokens, profile, rate, gil
                )
            result["points"] = points
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", default="8", help="comma-separated: one point each, one platform")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--no-profile", action="store_true", help="no py-spy: the unperturbed CPU per request")
    parser.add_argument(
        "--gil",
        action="store_true",
        help="sample only the thread holding the GIL: Python's CPU, without threads waiting on PostgreSQL",
    )
    parser.add_argument(
        "--idle", type=float, default=0.0, help="seconds of no load first: the gateway's idle CPU ms per second"
    )
    args = parser.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    result = run(args.requests, concurrency, args.max_tokens, not args.no_profile, args.rate, args.gil, args.idle)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
