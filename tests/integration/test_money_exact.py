"""Money adds up exactly everywhere it is shown: 100,000 usage records with 6-decimal costs sum to the same
Decimal on the billing page, the tenant page, the rollout reports, the usage API and the invoice, on SQLite and
PostgreSQL; and the migration to integer micros keeps every stored cost."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import DateTime, MetaData, Table, bindparam, text
from sqlmodel import Session, select

from console.pages.billing import usage_series
from console.pages.tenants import usage_by_tenant
from controlplane.billing import invoicing
from controlplane.billing.invoices import round_line
from controlplane.billing.ledger import usage_totals
from controlplane.billing.pricing import period_bounds, period_of
from controlplane.rollouts.metrics import candidate_usage, collect_windows
from controlplane.storage.database import create_db
from controlplane.storage.migrate import downgrade, upgrade
from controlplane.storage.tables import Price, Rollout, Tenant, UsageRecord

pytestmark = pytest.mark.integration

NUM_RECORDS = 100_000
MODEL = "tierline/lm-cloud"


COLUMNS = (
    "id", "tenant_id", "model", "model_version", "tier", "prompt_tokens", "completion_tokens",
    "cached_prompt_tokens", "status", "rollout_arm", "price_id", "cost", "occurred_at", "ingested_at",
)  # fmt: skip


def _insert_records(session: Session, tenant_id: int, price_id: int, start: datetime, end: datetime) -> Decimal:
    """100,000 records with costs of up to 1,000.000000 at 6 decimal places (long batch jobs) in ``[start, end)``,
    inserted through the driver in one go (COPY on PostgreSQL), each value converted as its column stores it;
    returns their exact sum."""
    table = UsageRecord.__table__  # type: ignore[attr-defined]
    conn = session.connection()

    def converter(name: str) -> Any:
        return table.c[name].type.bind_processor(conn.dialect) or (lambda v: v)

    money, when = converter("cost"), converter("occurred_at")
    moments = [when(start + timedelta(seconds=s)) for s in range(max(1, int((end - start).total_seconds())))]
    now = when(datetime.now(UTC))
    rng = random.Random(7)
    micros = [rng.randrange(1_000_000_000) for _ in range(NUM_RECORDS)]
    values = [
        (f"r{i}", tenant_id, MODEL, 2, "cloud", 100, 20, 0, "ok", "candidate", price_id,
         money(Decimal(m).scaleb(-6)), moments[i % len(moments)], now)
        for i, m in enumerate(micros)
    ]  # fmt: skip
    driver = conn.connection.driver_connection
    assert driver is not None
    if conn.dialect.name == "postgresql":
        with driver.cursor() as cursor, cursor.copy(f"COPY usage_record ({', '.join(COLUMNS)}) FROM STDIN") as copy:
            for v in values:
                copy.write_row(v)
    else:
        marks = ", ".join("?" * len(COLUMNS))
        driver.cursor().executemany(f"INSERT INTO usage_record ({', '.join(COLUMNS)}) VALUES ({marks})", values)
    return Decimal(sum(micros)).scaleb(-6)


@pytest.mark.postgres
def test_100k_costs_sum_to_the_same_decimal_on_every_page(migrated_db: str) -> None:
    engine = create_db(migrated_db)
    now = datetime.now(UTC)
    month_start, _ = period_bounds(period_of(now))
    start = max(month_start, now - timedelta(hours=6))  # one month, so one invoice bills them all
    with Session(engine) as session:
        tenant = Tenant(name="acme")
        price = Price(
            model=MODEL,
            prompt_per_mtok=Decimal("3.123457"),
            completion_per_mtok=Decimal("15.654321"),
            cached_per_mtok=Decimal("1.000001"),
            effective_from=month_start - timedelta(days=40),
        )
        session.add_all([tenant, price])
        session.flush()
        assert tenant.id is not None and price.id is not None
        rollout = Rollout(
            model="lm-cloud",
            baseline_version="1",
            candidate_version="2",
            scope="cloud",
            steps=[50.0],
            status="running",
            created_at=start - timedelta(seconds=1),
        )
        session.add(rollout)
        session.commit()
        expected = _insert_records(session, tenant.id, price.id, start, now)
        session.commit()

        billing_page = usage_series(session, "tenant", "cost", start - timedelta(days=1))
        assert sum(billing_page["acme"].values(), Decimal(0)) == expected

        assert usage_by_tenant(session, [tenant.id])[tenant.id].cost == expected

        windows = collect_windows(session, rollout, rollout.created_at, now + timedelta(seconds=1))
        assert windows[0].candidate.cost == expected
        assert Decimal(candidate_usage(session, rollout, now + timedelta(seconds=1))["cost"]) == expected

        api = usage_totals(session, tenant.id, month_start, now + timedelta(seconds=1), ["day"])
        assert Decimal(api["totals"]["cost"]) == expected
        assert sum((Decimal(g["cost"]) for g in api["groups"]), Decimal(0)) == expected

        invoice = invoicing.month_invoice(session, tenant, period_of(now))
        assert [line["amount"] for line in invoice["lines"]] == [str(round_line(expected, "USD"))]
        assert Decimal(invoice["total"]) == round_line(expected, "USD")
    engine.dispose()


@pytest.mark.postgres
def test_the_migration_to_micros_keeps_every_cost_and_back(db_url: str) -> None:
    costs = {"a": "0.000125", "b": "12.345678", "c": "123456789.123456", "d": None, "e": "0"}
    upgrade(db_url, "0012")
    engine = create_db(db_url)
    at = datetime(2026, 1, 5, 12, tzinfo=UTC)
    with Session(engine) as session:
        # The tenant table as revision 0012 has it (the model has grown columns since): only those are written.
        tenant_table = Table("tenant", MetaData(), autoload_with=engine)
        values = {k: v for k, v in Tenant(name="acme").model_dump().items() if k in tenant_table.c and v is not None}
        tenant_id = session.execute(tenant_table.insert().values(**values).returning(tenant_table.c.id)).scalar_one()
        session.commit()
        stmt = text(
            "INSERT INTO usage_record (id, tenant_id, model, tier, prompt_tokens, completion_tokens, "
            "cached_prompt_tokens, status, cost, occurred_at, ingested_at) VALUES "
            "(:id, :tenant_id, 'm', 'cloud', 1, 1, 0, 'ok', CAST(:cost AS NUMERIC(18, 6)), :at, :at)"
        ).bindparams(bindparam("at", type_=DateTime(timezone=True)))
        for record_id, cost in costs.items():
            session.execute(stmt, {"id": record_id, "tenant_id": tenant_id, "cost": cost, "at": at})
        session.commit()
    upgrade(db_url)
    with Session(engine) as session:
        stored = {r.id: r.cost for r in session.exec(select(UsageRecord))}
        raw: dict[str, Any] = {k: v for k, v in session.execute(text("SELECT id, cost FROM usage_record"))}
    assert stored == {k: None if v is None else Decimal(v) for k, v in costs.items()}
    assert raw["b"] == 12_345_678 and raw["a"] == 125 and raw["d"] is None
    downgrade(db_url, "0012")
    with engine.connect() as conn:
        back: dict[str, Any] = {k: v for k, v in conn.execute(text("SELECT id, cost FROM usage_record"))}
    assert {k: Decimal(str(v)).quantize(Decimal("0.000001")) for k, v in back.items() if k in ("a", "b")} == {
        "a": Decimal("0.000125"),
        "b": Decimal("12.345678"),
    }
    assert back["d"] is None
    engine.dispose()
