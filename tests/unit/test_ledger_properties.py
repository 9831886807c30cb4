"""Ledger properties over random streams of usage records with duplicates and reorderings (hypothesis), against
a real database (a SQLite file; PostgreSQL too when TIERLINE_TEST_DATABASE_URL is set):

* batched ingestion is idempotent: replaying every batch, in any order, changes nothing;
* totals by tenant / day / month / model / version / tier equal the sums of their records, rated with the
  price in force at each record's time;
* invoices over months, with records arriving after their month was finalized, bill every record exactly
  once: on its own month's invoice while that month is open, else as an adjustment on the next invoice;
  voiding and re-issuing keeps that true.

Each example works on fresh tenants in one database per backend, so examples never see each other's rows.
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from controlplane.billing import invoicing as billing
from controlplane.billing.ledger import GROUP_BY, NewUsage, ingest_usage, usage_totals
from controlplane.billing.pricing import Tokens, cost, period_of, price_for
from controlplane.storage.database import create_db
from controlplane.storage.migrate import upgrade
from controlplane.storage.tables import Invoice, InvoiceLine, Price, Tenant, UsageRecord

START = datetime(2026, 1, 1, tzinfo=UTC)
MONTHS = ["2026-01", "2026-02", "2026-03"]
MODELS = ["m0", "m1", "m2"]  # m2 has no price: its records are flagged, never dropped
PG_URL = os.environ.get("TIERLINE_TEST_DATABASE_URL")


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def ledger_db(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """One migrated database per backend for the module, with the price book the examples share."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('ledger') / 'ledger.db'}"
        yield from _with_prices(url)
        return
    if not PG_URL:
        pytest.skip("PostgreSQL not configured: set TIERLINE_TEST_DATABASE_URL")
    from tests.conftest import _postgres_schema

    with _postgres_schema() as url:
        yield from _with_prices(url)


def _with_prices(url: str) -> Iterator[Engine]:
    upgrade(url)
    engine = create_db(url)
    with Session(engine) as s:
        for model, start, prompt, completion, tier, version in (
            ("m0", START - timedelta(days=30), "1.10", "3.30", None, None),
            ("m0", START + timedelta(days=40), "2.20", "6.60", None, None),  # a price change in February
            ("m1", START - timedelta(days=30), "0.70", "0.90", None, None),
            ("m1", START - timedelta(days=30), "0.10", "0.30", "edge", None),  # the edge tier is cheaper
            ("m1", START - timedelta(days=30), "5.00", "5.00", None, 2),  # version 2 is dearer
        ):
            s.add(
                Price(
                    model=model,
                    version=version,
                    tier=tier,
                    prompt_per_mtok=Decimal(prompt),
                    completion_per_mtok=Decimal(completion),
                    cached_per_mtok=Decimal(prompt) / 2,
                    effective_from=start,
                )
            )
        s.commit()
    yield engine
    engine.dispose()


@dataclass(frozen=True)
class Draw:
    """One record as hypothesis draws it: who, what, when, how much, and in which phase it arrives."""

    tenant: int
    model: int
    version: int | None
    tier: str
    minute: int
    prompt: int
    completion: int
    cached: int
    arrives: int  # 0, 1, 2: ingested before January, February, March is finalized


draws = st.builds(
    Draw,
    tenant=st.integers(0, 1),
    model=st.integers(0, 2),
    version=st.sampled_from([None, 1, 2]),
    tier=st.sampled_from(["edge", "cloud"]),
    minute=st.integers(0, 90 * 24 * 60 - 1),
    prompt=st.integers(0, 50_000),
    completion=st.integers(0, 20_000),
    cached=st.integers(0, 10_000),
    arrives=st.integers(0, 2),
)


@dataclass
class Example:
    records: list[NewUsage]
    arrival: dict[str, int]
    stream: list[list[NewUsage]]  # the batches, with duplicates, reordered
    tenants: list[Tenant]


@st.composite
def examples(draw: st.DrawFn, tenants: list[Tenant]) -> Example:
    items = draw(st.lists(draws, min_size=1, max_size=40))
    records, arrival = [], {}
    for d in items:
        record = NewUsage(
            id=uuid.uuid4().hex,
            tenant_id=tenants[d.tenant].id or 0,
            model=MODELS[d.model],
            model_version=d.version,
            tier=d.tier,
            occurred_at=START + timedelta(minutes=d.minute),
            prompt_tokens=d.prompt,
            completion_tokens=d.completion,
            cached_prompt_tokens=d.cached,
        )
        records.append(record)
        arrival[record.id] = d.arrives
    repeats = draw(st.lists(st.sampled_from(records), max_size=len(records)))
    sent = draw(st.permutations(records + repeats))
    cuts = sorted(draw(st.lists(st.integers(0, len(sent)), max_size=5)))
    bounds = [0, *cuts, len(sent)]
    stream = [sent[a:b] for a, b in itertools.pairwise(bounds) if b > a]
    return Example(records, arrival, stream, tenants)


def _tenants(engine: Engine) -> list[Tenant]:
    with Session(engine, expire_on_commit=False) as s:
        tenants = [Tenant(name=f"t-{uuid.uuid4().hex[:12]}") for _ in range(2)]
        s.add_all(tenants)
        s.commit()
    return tenants


def _snapshot(engine: Engine, tenant_ids: list[int]) -> list[tuple[Any, ...]]:
    with Session(engine) as s:
        rows = s.exec(select(UsageRecord).where(col(UsageRecord.tenant_id).in_(tenant_ids))).all()
        return sorted((r.id, r.tenant_id, r.model, r.price_id, r.cost, r.prompt_tokens, r.invoice_id) for r in rows)


def _expected_cost(prices: list[Price], r: NewUsage) -> Decimal | None:
    price = price_for(prices, r.model, r.model_version, r.tier, r.occurred_at)
    return None if price is None else cost(price, Tokens(r.prompt_tokens, r.completion_tokens, r.cached_prompt_tokens))


def _key(r: NewUsage, dim: str) -> Any:
    return {
        "day": r.occurred_at.strftime("%Y-%m-%d"),
        "month": r.occurred_at.strftime("%Y-%m"),
        "model": r.model,
        "version": r.model_version,
        "tier": r.tier,
    }[dim]


PROPERTY_SETTINGS = settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@PROPERTY_SETTINGS
@given(data=st.data())
def test_ingestion_is_idempotent_and_totals_equal_the_sums_of_their_records(
    ledger_db: Engine, data: st.DataObject
) -> None:
    engine = ledger_db
    ex = data.draw(examples(_tenants(engine)))
    ids = [t.id or 0 for t in ex.tenants]
    accepted = 0
    for batch in ex.stream:
        with Session(engine) as s:
            accepted += ingest_usage(s, batch).accepted
            s.commit()
    assert accepted == len(ex.records)
    before = _snapshot(engine, ids)
    for batch in data.draw(st.permutations(ex.stream)):  # replayed, in another order
        with Session(engine) as s:
            again = ingest_usage(s, batch)
            s.commit()
        assert again.accepted == 0 and again.duplicates == len(batch)
    assert _snapshot(engine, ids) == before

    with Session(engine) as s:
        prices = list(s.exec(select(Price)).all())
        stored = {row[0]: row for row in before}
        for r in ex.records:  # each record rated with the price in force at its own time, or flagged
            assert stored[r.id][4] == _expected_cost(prices, r)
        for tenant_id in ids:
            mine = [r for r in ex.records if r.tenant_id == tenant_id]
            for dims in ([], *[[d] for d in GROUP_BY], ["day", "model", "tier"]):
                got = usage_totals(s, tenant_id, START, START + timedelta(days=90), dims)
                want: dict[tuple[Any, ...], list[NewUsage]] = defaultdict(list)
                for r in mine:
                    want[tuple(_key(r, d) for d in dims)].append(r)
                groups = {tuple(g[d] for d in dims): g for g in got["groups"]}
                assert set(groups) == set(want), dims
                for key, rs in want.items():
                    g = groups[key]
                    costs = [_expected_cost(prices, r) for r in rs]
                    assert g["requests"] == len(rs)
                    assert g["prompt_tokens"] == sum(r.prompt_tokens for r in rs)
                    assert g["completion_tokens"] == sum(r.completion_tokens for r in rs)
                    assert g["cached_prompt_tokens"] == sum(r.cached_prompt_tokens for r in rs)
                    assert Decimal(g["cost"]) == sum((c for c in costs if c is not None), Decimal(0))
                    assert g["unpriced_records"] == costs.count(None)
                assert got["totals"]["requests"] == len(mine)


@PROPERTY_SETTINGS
@given(data=st.data(), void_month=st.sampled_from([None, *MONTHS]))
def test_invoices_over_months_bill_every_record_exactly_once(
    ledger_db: Engine, data: st.DataObject, void_month: str | None
) -> None:
    engine = ledger_db
    ex = data.draw(examples(_tenants(engine)))
    numbers: dict[tuple[int, str], str] = {}
    for phase, month in enumerate(MONTHS):
        for batch in ex.stream:  # every batch is sent each phase: retries of what already arrived are no-ops
            arriving = [r for r in batch if ex.arrival[r.id] <= phase]
            with Session(engine) as s:
                ingest_usage(s, arriving)
                s.commit()
        with Session(engine, expire_on_commit=False) as s:
            for tenant in ex.tenants:
                numbers[(tenant.id or 0, month)] = billing.finalize(s, tenant, month, actor="test").number or ""
            s.commit()

    with Session(engine) as s:
        by_id = {inv.id: inv for inv in s.exec(select(Invoice).where(col(Invoice.number).in_(numbers.values())))}
        rows = {r.id: r for r in s.exec(select(UsageRecord).where(col(UsageRecord.id).in_(ex.arrival)))}
        for r in ex.records:
            month = period_of(r.occurred_at)
            # Its own month's invoice if it arrived while that month was open, else the next one finalized.
            want = MONTHS[max(MONTHS.index(month), ex.arrival[r.id])]
            invoice = by_id[rows[r.id].invoice_id]
            assert (invoice.tenant_id, invoice.period) == (r.tenant_id, want)
        lines = s.exec(select(InvoiceLine).where(col(InvoiceLine.invoice_id).in_(by_id))).all()
        billed = Counter[tuple[int, str, str, int | None, str, str]]()
        for ln in lines:
            inv = by_id[ln.invoice_id]
            if ln.kind == "rounding":  # the total is the exact sum rounded once: this line bills no record
                assert ln.requests == 0
                continue
            assert ln.kind == ("usage" if ln.usage_period == inv.period else "adjustment")
            billed[(inv.tenant_id, inv.period, ln.usage_period, ln.model_version, ln.model, ln.tier)] += ln.requests
        expected = Counter(
            (
                r.tenant_id,
                MONTHS[max(MONTHS.index(period_of(r.occurred_at)), ex.arrival[r.id])],
                period_of(r.occurred_at),
                r.model_version,
                r.model,
                r.tier,
            )
            for r in ex.records
        )
        assert billed == expected
        for inv in by_id.values():
            assert inv.total == sum((ln.amount for ln in lines if ln.invoice_id == inv.id), Decimal(0))

    if void_month is None:
        return
    with Session(engine, expire_on_commit=False) as s:
        for tenant in ex.tenants:
            billing.void(s, numbers[(tenant.id or 0, void_month)], reason="re-issue", actor="test")
            billing.finalize(s, tenant, void_month, actor="test")
        s.commit()
    with Session(engine) as s:
        live = s.exec(select(Invoice.id).where(col(Invoice.tenant_id).in_([t.id for t in ex.tenants]))).all()
        finalized = s.exec(select(Invoice.id).where(col(Invoice.id).in_(live), Invoice.status == "finalized")).all()
        requests = s.exec(select(InvoiceLine.requests).where(col(InvoiceLine.invoice_id).in_(finalized))).all()
        assert sum(requests) == len(ex.records)  # after void + re-issue, still each record once
        stamps = s.exec(select(UsageRecord.invoice_id).where(col(UsageRecord.id).in_(ex.arrival))).all()
        assert set(stamps) <= set(finalized) and None not in stamps
