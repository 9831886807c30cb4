"""Two gateways side by side on one platform, alternated: the CPU a change saves per streamed request.

The platform of ``bench scale`` (one ``tierline engine serve``; tenants, a rate limit in Redis, a monthly budget,
a price and exactly-once metering in PostgreSQL) with two gateways on it at once: A, and B from another checkout
(``--b-tree``: its code, run from its root) and/or with more environment (``--b-env NAME=VALUE``). Rounds
alternate A, B then B, A, so both see the same host load in turn; each point's gateway CPU (``/proc``) per
request is reported per round, with the medians and their ratio. One process per point loads one gateway at a
time, as ``bench scale`` does.

    python -m bench.lab.gateway_ab --b-tree /work/base --rounds 4 --concurrency 1,64
    python -m bench.lab.gateway_ab --b-env TIERLINE_CLOUD_USAGE_CHECKPOINT_TOKENS=0      # what a setting costs
    python -m bench.lab.gateway_ab --b-tree /work/base --paced 20,10     # before a model server at a set pace

Needs ``TIERLINE_BENCH_DATABASE_URL`` (PostgreSQL) and Redis (``TIERLINE_BENCH_REDIS_URL``, default local).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import free_port, tierline_server
from bench.lab.gateway_profile import bench_platform
from bench.scale_bench import _load, _summary


@contextlib.contextmanager
def _in(directory: Path | None) -> Iterator[None]:
    """Start what is started here from ``directory`` (``python -m tierline.cli`` imports the code found there)."""
    here = Path.cwd()
    if directory is not None:
        os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(here)


def run(
    rounds: int,
    requests: int,
    concurrency: list[int],
    max_tokens: int,
    b_tree: Path | None,
    b_env: dict[str, str],
    pace: tuple[float, float] | None = None,
) -> dict[str, Any]:
    cpu: dict[str, dict[int, list[float]]] = {"A": {c: [] for c in concurrency}, "B": {c: [] for c in concurrency}}
    with bench_platform("tierline-gw-ab-", pace) as (_, platform), contextlib.ExitStack() as stack:
        gateways = {}
        for name, tree, env in (("A", None, platform.envs[0]), ("B", b_tree, {**platform.envs[0], **b_env})):
            port = free_port()
            with _in(tree):
                proc = stack.enter_context(tierline_server(["cloud", "serve"], env, port, "/readyz"))
            gateways[name] = (f"http://127.0.0.1:{port}", proc.pid)
        for r in range(rounds):
            for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                url, pid = gateways[name]
                for c in concurrency:
                    outcomes, _, elapsed, _, used = asyncio.run(
                        _load(url, platform.key, requests, c, max_tokens, cpu_pids=(pid,))
                    )
                    served = requests - _summary(outcomes, elapsed)["errors"]
                    if served <= 0:
                        raise SystemExit(f"gateway {name}: every request failed at {c} streams")
                    cpu[name][c].append(round(used / served * 1000, 3))
    points = {}
    for c in concurrency:
        a, b = statistics.median(cpu["A"][c]), statistics.median(cpu["B"][c])
        points[str(c)] = {
            "a_cpu_ms_per_request": cpu["A"][c],
            "b_cpu_ms_per_request": cpu["B"][c],
            "a_median": round(a, 3),
            "b_median": round(b, 3),
            "b_over_a": round(b / a, 3),
        }
    return {
        "upstream": {"ttft_ms": pace[0], "token_ms": pace[1]} if pace else "tierline engine serve",
        "b_tree": str(b_tree) if b_tree else None,
        "b_env": b_env,
        "rounds": rounds,
        "requests": requests,
        "max_tokens": max_tokens,
        "points": points,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=400, help="streams per gateway, point and round")
    parser.add_argument("--concurrency", default="1", help="comma-separated: one point each")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--b-tree", type=Path, help="B runs the code of this checkout (default: this one)")
    parser.add_argument("--b-env", action="append", default=[], metavar="NAME=VALUE", help="B's extra environment")
    parser.add_argument("--paced", metavar="TTFT_MS,TOKEN_MS", help="bench.paced_upstream as the model server")
    args = parser.parse_args()
    b_env = {}
    for item in args.b_env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            parser.error(f"--b-env {item!r}: expected NAME=VALUE")
        b_env[name] = value
    if args.b_tree is not None and not (args.b_tree / "tierline" / "cli.py").is_file():
        parser.error(f"--b-tree {args.b_tree}: not a tierline checkout (no tierline/cli.py)")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    pace = None
    if args.paced:
        try:
            ttft_ms, token_ms = (float(v) for v in args.paced.split(","))
        except ValueError:
            parser.error(f"--paced {args.paced!r}: expected TTFT_MS,TOKEN_MS, e.g. 20,10")
        pace = (ttft_ms, token_ms)
    result = run(args.rounds, args.requests, concurrency, args.max_tokens, args.b_tree, b_env, pace)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
