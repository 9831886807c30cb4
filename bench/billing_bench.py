"""``tierline bench billing``: usage ingestion throughput, rating and dedup included, on SQLite and PostgreSQL.

The work is what edge syncs deliver: batches of ``batch_size`` usage records (several models, versions and
both tiers over a month, with a price change in the middle), of which ``duplicate_rate`` are ids the ledger
already holds or that repeat inside the batch (retried syncs). Each batch is one transaction through
``controlplane.billing.ledger.ingest_usage``: one price-book query, every record rated with the price in force at its
time, one ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` and the budget spend of what was new.

The peer is the common naive path (what per-request metering does): one ORM row per transaction, a lookup
for the id first, rating against the price list. Both paths are checked to have stored exactly the unique
records with the same total cost, so the faster one is not faster by skipping work.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import click
from sqlalchemy import func, text
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from bench.common import emit
from controlplane.billing.ledger import NewUsage, ingest_usage, load_prices
from controlplane.billing.pricing import Tokens, cost, price_for
from controlplane.storage.database import create_db
from controlplane.storage.migrate import upgrade
from controlplane.storage.tables import Price, Tenant, UsageRecord

TARGET_RECORDS_PER_S = 5000  # the target, reported beside the measurements
MODELS = [("tierline/lm-edge", "edge"), ("tierline/lm-cloud", "cloud"), ("tierline/lm-edge", "cloud")]
MONTH = datetime(2026, 3, 1, tzinfo=UTC)


def make_batches(num_records: int, batch_size: int, duplicate_rate: float, seed: int = 0) -> list[list[NewUsage]]:
    """Sync batches of realistic records; about ``duplicate_rate`` of all records are repeats of earlier ids."""
    rng = random.Random(seed)
    batches: list[list[NewUsage]] = []
    sent: list[NewUsage] = []
    for _ in range(max(1, num_records // batch_size)):
        batch: list[NewUsage] = []
        while len(batch) < batch_size:
            if sent and rng.random() < duplicate_rate:
                batch.append(rng.choice(sent[-4 * batch_size :]))  # a retried sync resends recent records
                continue
            model, tier = rng.choice(MODELS)
            record = NewUsage(
                id=uuid.UUID(int=rng.getrandbits(128)).hex,
                tenant_id=0,  # set per database
                model=model,
                model_version=rng.choice((3, 4)),
                tier=tier,
                occurred_at=MONTH + timedelta(seconds=rng.uniform(0, 30 * 86400)),
                prompt_tokens=rng.randint(20, 2000),
                completion_tokens=rng.randint(1, 400),
                device_id=f"dev-{rng.randint(1, 50):03d}",
                latency_ms=rng.uniform(5, 500),
            )
            batch.append(record)
            sent.append(record)
        batches.append(batch)
    return batches


def _seed(engine: Engine) -> int:
    with Session(engine) as s:
        tenant = Tenant(name=f"bench-{uuid.uuid4().hex[:8]}")
        s.add(tenant)
        for model, tier in MODELS:
            for start, scale in ((datetime(2025, 1, 1, tzinfo=UTC), 1), (MONTH + timedelta(days=15), 2)):
                s.add(
                    Price(
                        model=model,
                        tier=tier,
                        currency="USD",
                        prompt_per_mtok=Decimal("0.25") * scale,
                        completion_per_mtok=Decimal("1.00") * scale,
                        cached_per_mtok=Decimal("0.10") * scale,
                        effective_from=start,
                    )
                )
        s.commit()
        return tenant.id or 0


def _for_tenant(batches: list[list[NewUsage]], tenant_id: int, id_prefix: str = "") -> list[list[NewUsage]]:
    """The batches as one tenant's; ``id_prefix`` gives every record (and its repeats) a distinct id."""
    return [
        [replace(u, tenant_id=tenant_id, id=id_prefix + u.id[len(id_prefix) :]) for u in batch] for batch in batches
    ]


def _batched(engine: Engine, batches: list[list[NewUsage]]) -> float:
    started = time.perf_counter()
    for batch in batches:
        with Session(engine) as s:
            ingest_usage(s, batch, load_prices(s))
            s.commit()
    return time.perf_counter() - started


def _naive(engine: Engine, batches: list[list[NewUsage]]) -> float:
    """One ORM row per transaction: look the id up, rate it against the price list, insert, commit."""
    started = time.perf_counter()
    for batch in batches:
        for u in batch:
            with Session(engine) as s:
                if s.get(UsageRecord, u.id) is not None:
                    continue
                price = price_for(s.exec(select(Price)).all(), u.model, u.model_version, u.tier, u.occurred_at)
                amount = cost(price, Tokens(u.prompt_tokens, u.completion_tokens)) if price else None
                s.add(
                    UsageRecord(
                        id=u.id,
                        tenant_id=u.tenant_id,
                        device_id=u.device_id,
                        model=u.model,
                        model_version=u.model_version,
                        tier=u.tier,
                        prompt_tokens=u.prompt_tokens,
                        completion_tokens=u.completion_tokens,
                        latency_ms=u.latency_ms,
                        price_id=getattr(price, "id", None),
                        cost=amount,
                        occurred_at=u.occurred_at,
                    )
                )
                s.commit()
    return time.perf_counter() - started


def _stored(engine: Engine, tenant_id: int, ids: set[str] | None = None) -> tuple[int, Decimal]:
    """How many records a tenant has, and their total cost (only ``ids``, when given)."""
    with Session(engine) as s:
        count = s.exec(select(func.count()).where(UsageRecord.tenant_id == tenant_id)).one()
        rows = s.exec(select(UsageRecord).where(UsageRecord.tenant_id == tenant_id)).all()
    costs = [r.cost for r in rows if r.cost is not None and (ids is None or r.id in ids)]
    return int(count), sum(costs, Decimal(0))


def _measure(engine: Engine, batches: list[list[NewUsage]], naive_batches: int) -> dict[str, Any]:
    unique = {u.id for batch in batches for u in batch}
    fast_tenant, naive_tenant = _seed(engine), _seed(engine)
    fast = _for_tenant(batches, fast_tenant)
    seconds = _batched(engine, fast)
    count, total = _stored(engine, fast_tenant)
    replay_s = _batched(engine, fast)  # replaying every batch must change nothing
    assert _stored(engine, fast_tenant) == (count, total), "replaying batches changed the ledger"
    assert count == len(unique), f"stored {count} records of {len(unique)} unique ids"
    slow = _for_tenant(batches[:naive_batches], naive_tenant, id_prefix="n")
    naive_s = _naive(engine, slow)
    naive_count, naive_total = _stored(engine, naive_tenant)
    same = {u.id for batch in fast[:naive_batches] for u in batch}
    assert naive_count == len(same), "the naive path stored a different number of records"
    assert naive_total == _stored(engine, fast_tenant, same)[1], "the two paths rated the same records differently"
    num_in = sum(len(b) for b in batches)
    num_naive_in = sum(len(b) for b in slow)
    return {
        "records_per_s": round(num_in / seconds),
        "replay_records_per_s": round(num_in / replay_s),
        "naive_records_per_s": round(num_naive_in / naive_s),
        "stored": count,
        "duplicates_skipped": num_in - count,
        "total_cost": str(total),
    }


@contextmanager
def _postgres(url: str) -> Iterator[str]:
    """A fresh schema on ``url`` for the run, dropped afterwards."""
    schema = f"bench_{uuid.uuid4().hex[:10]}"
    admin = create_db(url)
    try:
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        sep = "&" if "?" in url else "?"
        yield f"{url}{sep}options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


def _postgres_url() -> str | None:
    return os.environ.get("TIERLINE_BENCH_DATABASE_URL") or os.environ.get("TIERLINE_TEST_DATABASE_URL")


def _postgres_answers(url: str) -> str | None:
    """None when PostgreSQL at ``url`` answers, else why not (one line)."""
    try:
        engine = create_db(url)
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
    except Exception as exc:  # any failure to connect is a reason to skip, reported as such
        return f"PostgreSQL at the configured URL does not answer: {str(exc).splitlines()[0][:200]}"
    return None


def _run_one(url: str, batches: list[list[NewUsage]], naive_batches: int) -> dict[str, Any]:
    upgrade(url)
    engine = create_db(url)
    try:
        return _measure(engine, batches, naive_batches)
    finally:
        engine.dispose()


def run_billing_bench(
    num_records: int = 20_000, batch_size: int = 500, duplicate_rate: float = 0.05, naive_records: int = 2_000
) -> dict[str, Any]:
    """Ingestion throughput on SQLite (a temp file) and on PostgreSQL when one is configured and answers."""
    batches = make_batches(num_records, batch_size, duplicate_rate)
    naive_batches = max(1, naive_records // batch_size)
    result: dict[str, Any] = {
        "records": sum(len(b) for b in batches),
        "batch_size": batch_size,
        "duplicate_rate": duplicate_rate,
        "target_records_per_s": TARGET_RECORDS_PER_S,
    }
    with tempfile.TemporaryDirectory(prefix="tierline-bench-billing-") as tmp:
        sqlite = _run_one(f"sqlite:///{Path(tmp) / 'bench.db'}", batches, naive_batches)
    result["ingest_records_per_s_sqlite"] = sqlite["records_per_s"]
    result["naive_records_per_s_sqlite"] = sqlite["naive_records_per_s"]
    result["speedup_vs_naive_sqlite"] = round(sqlite["records_per_s"] / sqlite["naive_records_per_s"], 1)
    result["sqlite"] = sqlite
    url = _postgres_url()
    reason = _postgres_answers(url) if url else "no PostgreSQL configured (TIERLINE_BENCH_DATABASE_URL)"
    if url is None or reason is not None:
        result["ingest_records_per_s_postgres"] = None
        result["postgres_skipped"] = reason
        return result
    with _postgres(url) as schema_url:
        pg = _run_one(schema_url, batches, naive_batches)
    result["ingest_records_per_s_postgres"] = pg["records_per_s"]
    result["naive_records_per_s_postgres"] = pg["naive_records_per_s"]
    result["speedup_vs_naive_postgres"] = round(pg["records_per_s"] / pg["naive_records_per_s"], 1)
    result["postgres"] = pg
    return result


@click.command("billing")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--records", "num_records", type=click.IntRange(min=1), default=20_000, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1, max=5000), default=500, show_default=True)
@click.option("--duplicates", "duplicate_rate", type=click.FloatRange(0, 0.9), default=0.05, show_default=True)
@click.option(
    "--naive-records", type=click.IntRange(min=1), default=2_000, show_default=True, help="records for the naive peer"
)
def billing_command(
    as_json: bool, num_records: int, batch_size: int, duplicate_rate: float, naive_records: int
) -> None:
    """Usage ingestion (rating + dedup) in records/s on SQLite and PostgreSQL, beside one-row-per-transaction.

    PostgreSQL comes from TIERLINE_BENCH_DATABASE_URL (or TIERLINE_TEST_DATABASE_URL); the run uses a fresh
    schema there and drops it. Without one that answers, the PostgreSQL figure is null with the reason.
    """
    emit(run_billing_bench(num_records, batch_size, duplicate_rate, naive_records), as_json)
