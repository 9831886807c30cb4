"""Price plans on SQLite and PostgreSQL: the plan in force when the usage happened rates it, a price scheduled for
tomorrow leaves today's ratings alone, a tenant's override comes first, and an invoice spanning a price change
shows both prices and names the plan.
"""

from __future__ import annotations

import dataclasses
import subprocess
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy import create_engine
from sqlmodel import Session, select

from controlplane.billing import plans
from controlplane.billing.invoicing import PriceSpec, add_price, finalize, invoice_json, month_invoice
from controlplane.billing.ledger import NewUsage, ingest_usage, load_prices
from controlplane.storage.tables import Price, PricePlan, Tenant, TenantPlan, UsageRecord
from shared.errors import ValidationError
from tests.conftest import base_env
from tests.forkserver import run_tierline

pytestmark = pytest.mark.integration

MODEL = "tierline/lm-cloud"


def _usage(id: str, tenant_id: int, at: datetime, prompt: int = 1_000_000, completion: int = 0) -> NewUsage:
    return NewUsage(
        id=id, tenant_id=tenant_id, model=MODEL, tier="cloud", occurred_at=at, prompt_tokens=prompt,
        completion_tokens=completion,
    )  # fmt: skip


def _price(session: Session, prompt: str, at: datetime, **kw: object) -> Price:
    spec = PriceSpec(model=MODEL, prompt_per_mtok=Decimal(prompt), completion_per_mtok=Decimal(0), effective_from=at)
    return add_price(session, dataclasses.replace(spec, **kw), actor="test")  # type: ignore[arg-type]


def test_the_migration_moves_the_price_book_into_the_default_plan(migrated_db: str) -> None:
    engine = create_engine(migrated_db)
    with Session(engine) as s:
        default = s.exec(select(PricePlan).where(PricePlan.name == "default")).one()
        row = _price(s, "0.50", datetime(2026, 1, 1, tzinfo=UTC))
        s.commit()
        assert row.plan_id == default.id and row.tenant_id is None
    engine.dispose()


def test_a_price_change_for_tomorrow_leaves_today_alone_and_the_plan_in_force_rates(migrated_db: str) -> None:
    engine = create_engine(migrated_db)
    now = datetime.now(UTC)
    tomorrow = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    with Session(engine) as s:
        pro = plans.create_plan(s, "pro", "volume discount", "test")
        _price(s, "2.00", now - timedelta(days=30))  # the default plan
        _price(s, "1.00", now - timedelta(days=30), plan="pro")
        _price(s, "0.80", tomorrow, plan="pro")  # scheduled: from tomorrow on
        on_pro, on_default, own = Tenant(name="pro-co"), Tenant(name="plain-co"), Tenant(name="vip-co")
        for t in (on_pro, on_default, own):
            s.add(t)
        s.flush()
        plans.assign_plan(s, on_pro, pro, effective_from=now, actor="test")
        plans.assign_plan(s, own, pro, effective_from=now, actor="test")
        _price(s, "0.10", now - timedelta(days=1), tenant=own)  # vip-co's own override of its plan
        with pytest.raises(ValidationError) as past:
            plans.assign_plan(s, on_default, pro, effective_from=now - timedelta(days=2), actor="test")
        assert past.value.param == "effective_from"
        s.commit()
        batch = [
            _usage("today-pro", on_pro.id or 0, now),
            _usage("tomorrow-pro", on_pro.id or 0, tomorrow + timedelta(hours=1)),
            _usage("today-default", on_default.id or 0, now),
            _usage("today-vip", own.id or 0, now),
            # before vip-co went on the plan (an hour ago, before the override started): the default plan's price
            _usage("before-vip", own.id or 0, now - timedelta(days=3)),
        ]
        ingest_usage(s, batch, load_prices(s))
        s.commit()
        cost = {r.id: r.cost for r in s.exec(select(UsageRecord))}
    engine.dispose()
    assert cost == {
        "today-pro": Decimal("1.00"),
        "tomorrow-pro": Decimal("0.80"),
        "today-default": Decimal("2.00"),
        "today-vip": Decimal("0.10"),
        "before-vip": Decimal("2.00"),
    }


def test_an_invoice_spanning_a_price_change_shows_both_prices_and_names_the_plan(migrated_db: str) -> None:
    engine = create_engine(migrated_db)
    change = datetime(2026, 3, 15, tzinfo=UTC)
    with Session(engine) as s:
        tenant = Tenant(name="span-co")
        s.add(tenant)
        s.flush()
        plans.create_plan(s, "growth", "", "test")
        _price(s, "1.00", datetime(2026, 1, 1, tzinfo=UTC), plan="growth")
        _price(s, "1.50", change, plan="growth")
        s.commit()
        # The assignment is stored as made before March (assign_plan refuses the past; history is data).
        growth = plans.get_plan(s, "growth")
        s.add(
            TenantPlan(
                tenant_id=tenant.id or 0, plan_id=growth.id or 0, effective_from=datetime(2026, 2, 1, tzinfo=UTC)
            )
        )
        s.commit()
        batch = [_usage(f"m{i}", tenant.id or 0, datetime(2026, 3, 10, tzinfo=UTC)) for i in range(2)]
        batch += [_usage(f"n{i}", tenant.id or 0, datetime(2026, 3, 20, tzinfo=UTC)) for i in range(3)]
        ingest_usage(s, batch, load_prices(s))
        s.commit()
        draft = month_invoice(s, tenant, "2026-03")
        invoice = finalize(s, tenant, "2026-03", actor="test")
        s.commit()
        final = invoice_json(s, invoice)
    engine.dispose()
    for view in (draft, final):
        assert view["plan"] == "growth"
        lines = sorted(view["lines"], key=lambda ln: ln["amount"])
        assert [(ln["requests"], ln["amount"]) for ln in lines] == [(2, "2.00"), (3, "4.50")]
        assert "1/0/1 per Mtok" in lines[0]["description"] and "plan growth" in lines[0]["description"]
        assert "1.5/0/1.5 per Mtok" in lines[1]["description"] and "from 2026-03-15" in lines[1]["description"]
        assert view["total"] == "6.50"


def test_plans_from_the_command_line(migrated_db: str, tmp_path: Path) -> None:
    env = base_env(tmp_path, TIERLINE_DATABASE_URL=migrated_db)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return run_tierline(*args, env=env)

    assert cli("tenants", "create", "cli-co").returncode == 0
    assert cli("billing", "plans", "create", "team", "--description", "for teams").returncode == 0
    assert cli("billing", "prices", "set", "--model", MODEL, "--prompt", "0.4", "--completion", "0.8",
               "--plan", "team", "--per-call", "0.003").returncode == 0  # fmt: skip
    assigned = cli("billing", "plans", "assign", "--tenant", "cli-co", "--plan", "team")
    assert assigned.returncode == 0 and "on plan team" in assigned.stdout
    missing = cli("billing", "plans", "assign", "--tenant", "cli-co", "--plan", "nope")
    assert missing.returncode != 0 and "no price plan 'nope'" in missing.stderr
    listed = cli("billing", "plans", "list")
    assert '"name": "team"' in listed.stdout and '"per_call": "0.003' in listed.stdout
