"""The gateway's billing phases alone, per streamed request (reserve, first checkpoint, settle + record), three ways
on one PostgreSQL schema:

- ``orm_threads``: the general path (SQLAlchemy ORM transactions, each phase in a worker thread), as before issue 21
  and as SQLite still runs it;
- ``statement_threads``: ``controlplane.billing.hotpath``'s one statement per phase, on blocking psycopg
  connections in worker threads;
- ``statement_loop``: the same statements awaited on the event loop (``cloud.metering.UsageWriter`` on
  PostgreSQL, what the gateway runs).

For each concurrency (requests in flight at once), the modes alternate round by round (A/B/C/A/B/C) and the median
round is reported: this process's CPU milliseconds per request (the gateway's share; PostgreSQL's own CPU is not
counted), wall milliseconds per request (elapsed / requests) and each request's billing latency p50/p99. The load
average is reported with the numbers: on a shared host they move with it.

    TIERLINE_TEST_DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test \\
        python -m bench.billing_hotpath_bench --requests 300 --concurrency 1,8,64 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import psycopg
from sqlalchemy.engine import Engine
from sqlmodel import Session

from bench.billing_bench import _postgres, _postgres_url
from cloud.metering import UsageWriter
from cloud.pg_async import conninfo_of
from controlplane.billing import budgets, hotpath, ledger
from controlplane.billing.scopes import Attribution
from controlplane.storage.database import create_db
from controlplane.storage.migrate import upgrade
from controlplane.tenancy.service import create_tenant

MODES = ("orm_threads", "statement_threads", "statement_loop")
AMOUNT = Decimal("0.001")
LEASE_S = 600.0

Billing = Callable[[str], Awaitable[None]]


def _usage(request_id: str, tenant_id: int, completion: int, cost: Decimal | None) -> ledger.NewUsage:
    return ledger.NewUsage(
        id=request_id,
        tenant_id=tenant_id,
        model="m",
        tier="cloud",
        occurred_at=datetime.now(UTC),
        prompt_tokens=12,
        completion_tokens=completion,
        latency_ms=40.0,
        ttft_ms=5.0,
        rating=(None, cost),
    )


def _orm_threads(engine: Engine, tenant_id: int) -> Billing:
    def checkpoint(usage: ledger.NewUsage, hold: budgets.BudgetHold | None) -> None:
        with Session(engine) as s:
            ledger.checkpoint(s, usage, hold, LEASE_S)
            s.commit()

    def settle(usage: ledger.NewUsage, hold: budgets.BudgetHold | None) -> None:
        with Session(engine) as s:
            ledger.settle_checkpointed(s, usage, hold)
            s.commit()

    async def bill(request_id: str) -> None:
        hold = await asyncio.to_thread(
            budgets.reserve_request, engine, tenant_id, Decimal(10**6), AMOUNT, Attribution(), lease_s=LEASE_S
        )
        await asyncio.to_thread(checkpoint, _usage(request_id, tenant_id, 1, None), hold)
        await asyncio.to_thread(settle, _usage(request_id, tenant_id, 16, AMOUNT / 2), hold)

    return bill


class _BlockingPool:
    """Blocking psycopg connections for worker threads, opened on demand and kept."""

    def __init__(self, conninfo: str) -> None:
        self.conninfo = conninfo
        self.idle: list[psycopg.Connection[Any]] = []
        self.all: list[psycopg.Connection[Any]] = []

    def run(self, work: Callable[[psycopg.Connection[Any]], Any]) -> Any:
        try:
            connection = self.idle.pop()
        except IndexError:
            connection = psycopg.connect(self.conninfo, autocommit=True)
            self.all.append(connection)
        try:
            return work(connection)
        finally:
            self.idle.append(connection)

    def close(self) -> None:
        for connection in self.all:
            connection.close()


def _statement_threads(pool: _BlockingPool, tenant_id: int) -> Billing:
    async def bill(request_id: str) -> None:
        prepared = hotpath.reservation(tenant_id, Decimal(10**6), AMOUNT, Attribution(), lease_s=LEASE_S)
        hold = await asyncio.to_thread(pool.run, lambda c: hotpath.reserve_blocking(c, prepared))
        assert hold is not hotpath.FALLBACK
        first = _usage(request_id, tenant_id, 1, None)
        await asyncio.to_thread(pool.run, lambda c: hotpath.checkpoint_blocking(c, first, hold, LEASE_S))
        final = _usage(request_id, tenant_id, 16, AMOUNT / 2)
        await asyncio.to_thread(pool.run, lambda c: hotpath.settle_blocking(c, final, hold, True))

    return bill


def _statement_loop(writer: UsageWriter, tenant_id: int) -> Billing:
    async def bill(request_id: str) -> None:
        hold = await writer.reserve_request(tenant_id, Decimal(10**6), AMOUNT, Attribution(), lease_s=LEASE_S)
        await writer.checkpoint(_usage(request_id, tenant_id, 1, None), hold, LEASE_S)
        await writer.settle_checkpointed(_usage(request_id, tenant_id, 16, AMOUNT / 2), hold)

    return bill


async def _round(bill: Billing, requests: int, concurrency: int) -> dict[str, float]:
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    run = uuid.uuid4().hex[:8]

    async def one(i: int) -> None:
        async with gate:
            started = time.perf_counter()
            await bill(f"bench-{run}-{i}")
            latencies.append(time.perf_counter() - started)

    await asyncio.gather(*(one(i) for i in range(min(concurrency, 8))))  # warm: connections open, statements ready
    latencies.clear()
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(8, 8 + requests)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    latencies.sort()
    return {
        "cpu_ms_per_request": round(cpu / requests * 1000, 3),
        "wall_ms_per_request": round(wall / requests * 1000, 3),
        "latency_p50_ms": round(latencies[len(latencies) // 2] * 1000, 3),
        "latency_p99_ms": round(latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000, 3),
    }


async def _measure(engine: Engine, requests: int, concurrencies: list[int], rounds: int) -> dict[str, Any]:
    with Session(engine) as s:
        tenant_id = create_tenant(s, "bench-hotpath", budget=Decimal(10**6)).id or 0
        s.commit()
    budgets.reserve_request(engine, tenant_id, Decimal(10**6), AMOUNT, Attribution())  # the month's row
    writer = UsageWriter(engine, pool_size=10)
    blocking = _BlockingPool(conninfo_of(engine))
    modes: dict[str, Billing] = {
        "orm_threads": _orm_threads(engine, tenant_id),
        "statement_threads": _statement_threads(blocking, tenant_id),
        "statement_loop": _statement_loop(writer, tenant_id),
    }
    results: dict[str, Any] = {}
    try:
        for concurrency in concurrencies:
            per_mode: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
            for _ in range(rounds):
                for mode in MODES:
                    per_mode[mode].append(await _round(modes[mode], requests, concurrency))
            results[str(concurrency)] = {
                mode: {
                    **min(runs, key=lambda r: abs(r["cpu_ms_per_request"] - _median(runs))),
                    "cpu_ms_per_request_rounds": [r["cpu_ms_per_request"] for r in runs],
                }
                for mode, runs in per_mode.items()
            }
    finally:
        await writer.close()
        blocking.close()
    return results


def _median(runs: list[dict[str, float]]) -> float:
    return statistics.median(r["cpu_ms_per_request"] for r in runs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=300, help="requests per round and mode")
    parser.add_argument("--concurrency", default="1,8,64", help="requests in flight at once, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per mode, alternating the modes")
    args = parser.parse_args(argv)
    url = _postgres_url()
    if url is None:
        raise SystemExit("set TIERLINE_BENCH_DATABASE_URL (or TIERLINE_TEST_DATABASE_URL) to a PostgreSQL")
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    load_before = os.getloadavg()
    with _postgres(url) as schema_url:
        upgrade(schema_url)
        engine = create_db(schema_url, pool_size=10)
        try:
            results = asyncio.run(_measure(engine, args.requests, concurrencies, args.rounds))
        finally:
            engine.dispose()
    print(
        json.dumps(
            {
                "phases": "reserve + first checkpoint + settle with its usage record, per request",
                "requests": args.requests,
                "rounds": args.rounds,
                "load_average_before": [round(x, 2) for x in load_before],
                "load_average_after": [round(x, 2) for x in os.getloadavg()],
                "by_concurrency": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
