"""Prepaid credit on SQLite and PostgreSQL: racing requests never overdraw it, the balance is always the sum of its
append-only entries, at zero the tenant's monthly budget applies, and through the real cloud API a tenant with
1.00 of credit at 0.003 a request is refused at its 334th request, with 1.00 of credit used on its invoice and one
signed ``credit.low_balance`` webhook.
"""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, func
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from cloud.gateway.webhooks import is_valid_signature
from controlplane.billing import credit
from controlplane.billing.budgets import (
    BudgetExceededError,
    add_spend,
    reclaim_expired,
    reserve,
    settle,
    tightest_remaining,
)
from controlplane.billing.pricing import period_of
from controlplane.storage.tables import BudgetPeriod, CreditAccount, CreditEntry, Tenant
from tests.conftest import base_env, free_port, seed_data_dir
from tests.integration.test_budget_alerts import _cli
from tests.integration.test_jobs import Receiver, cloud_process, receiver

pytestmark = pytest.mark.integration

__all__ = ["receiver"]

MODEL = "tierline/lm-cloud"


def _engine(url: str) -> Engine:
    if "postgresql" in url:
        return create_engine(url, pool_size=25, max_overflow=40)
    return create_engine(url, connect_args={"timeout": 30})


def _prepaid(engine: Engine, name: str, amount: str, budget: Decimal | None = None) -> int:
    with Session(engine) as s:
        tenant = Tenant(name=name, monthly_budget=budget)
        s.add(tenant)
        s.flush()
        credit.top_up(s, tenant, Decimal(amount), note="test", actor="test")
        s.commit()
        return tenant.id or 0


def _ledger(engine: Engine, tenant_id: int) -> tuple[CreditAccount, Decimal, int]:
    with Session(engine) as s:
        account = s.exec(select(CreditAccount).where(CreditAccount.tenant_id == tenant_id)).one()
        total = s.exec(select(func.sum(col(CreditEntry.amount))).where(CreditEntry.tenant_id == tenant_id)).one()
        draws = len(
            s.exec(select(CreditEntry).where(CreditEntry.tenant_id == tenant_id, CreditEntry.kind == "draw")).all()
        )
    return account, Decimal(total), draws


def test_fifty_racing_requests_never_overdraw_the_credit(migrated_db: str) -> None:
    engine = _engine(migrated_db)
    tenant_id = _prepaid(engine, "racing-prepaid", "0.50")
    outcomes: list[bool] = []
    lock = threading.Lock()
    start = threading.Barrier(50)

    def one() -> None:
        start.wait()
        try:
            held = reserve(engine, tenant_id, None, Decimal("0.03"))
        except BudgetExceededError as exc:
            assert "prepaid credit" in exc.message
            with lock:
                outcomes.append(False)
            return
        assert held.on_credit
        settle(engine, held, Decimal("0.03"))
        with lock:
            outcomes.append(True)

    threads = [threading.Thread(target=one) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    account, total, draws = _ledger(engine, tenant_id)
    engine.dispose()
    assert len(outcomes) == 50 and outcomes.count(True) == 16  # 16 x 0.03 = 0.48; a 17th would need 0.51
    assert account.balance == total == Decimal("0.02") and account.reserved == 0 and draws == 16


def test_at_zero_the_monthly_budget_applies_and_edge_usage_draws_what_is_free(migrated_db: str) -> None:
    engine = _engine(migrated_db)
    tenant_id = _prepaid(engine, "then-postpaid", "0.10", budget=Decimal("0.05"))
    first = reserve(engine, tenant_id, Decimal("0.05"), Decimal("0.08"))
    assert first.on_credit
    second = reserve(engine, tenant_id, Decimal("0.05"), Decimal("0.04"))  # 0.02 free of credit: the month's
    assert not second.on_credit
    with pytest.raises(BudgetExceededError, match="prepaid credit and the tenant's monthly budget"):
        reserve(engine, tenant_id, Decimal("0.05"), Decimal("0.03"))
    settle(engine, first, Decimal("0.08"))
    settle(engine, second, Decimal("0.04"))
    now = datetime.now(UTC)
    with Session(engine) as s:  # edge usage at sync: 0.02 of credit left, the other 0.005 counts on the month
        add_spend(s, tenant_id, now, Decimal("0.025"))
        s.commit()
        tenant = s.get(Tenant, tenant_id)
        assert tenant is not None
        assert tightest_remaining(s, tenant) == Decimal("0.05") - Decimal("0.045")
        month = s.get(BudgetPeriod, (tenant_id, period_of(now)))
        assert month is not None and month.spent == Decimal("0.045")
    # A hold whose process died is given back to the credit, not to the month.
    dead = reserve(engine, tenant_id, Decimal("0.05"), Decimal("0.001"), lease_s=0.0)
    assert dead.on_credit is False  # credit is at 0 now
    account, total, _ = _ledger(engine, tenant_id)
    assert account.balance == total == 0
    assert reclaim_expired(engine, tenant_id=tenant_id) == 1
    engine.dispose()


def test_a_tenant_with_one_unit_of_credit_is_refused_at_its_334th_request(
    migrated_db: str, tmp_path: Path, tiny_zoo: Path, session_data_dir: Path, receiver: Receiver
) -> None:
    data = seed_data_dir(tmp_path / "data", tiny_zoo, session_data_dir)
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=migrated_db,
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
        TIERLINE_CLOUD_SPECULATION="off",
        TIERLINE_CLOUD_WEBHOOK_ALLOW_PRIVATE_NETWORKS="true",
    )
    _cli(env, "tenants", "create", "prepaid-co")
    key = _cli(env, "keys", "create", "--tenant", "prepaid-co")
    _cli(env, "billing", "prices", "set", "--model", MODEL, "--prompt", "0", "--completion", "0", "--per-call", "0.003")
    _cli(env, "billing", "prepaid", "top-up", "--tenant", "prepaid-co", "--amount", "1.00", "--note", "order 17")
    _cli(env, "billing", "prepaid", "alert", "--tenant", "prepaid-co", "--below", "0.10")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {key}"}
    hook = f"/credit-low-{tmp_path.name}"  # the receiver is shared by the test's runs on each database
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    with cloud_process(env, port):
        secret = httpx.post(f"{url}/v1/webhook-secret", headers=auth).json()["secret"]
        assert httpx.put(f"{url}/v1/webhook", json={"url": f"{receiver.url}{hook}"}, headers=auth).status_code == 200
        refused_at, refusal = None, None
        with httpx.Client(base_url=url, headers=auth, timeout=60) as client:
            for n in range(1, 341):
                r = client.post("/v1/completions", json=body)
                if r.status_code != 200:
                    refused_at, refusal = n, r
                    break
        assert refused_at == 334, refusal.text if refusal is not None else "never refused"
        assert refusal is not None and refusal.status_code == 429
        error = refusal.json()["error"]
        assert error["type"] == "insufficient_quota" and "prepaid credit (0.001" in error["message"]
        got = receiver.received(hook, 1)
        # One event; a delivery that timed out on a loaded host is retried under the same id (at-least-once).
        assert len({json.loads(raw)["id"] for _, raw in got}) == 1, [raw for _, raw in got]
        headers, raw = got[0]
        assert headers["x-tierline-event"] == "credit.low_balance"
        assert is_valid_signature(secret, raw, headers["x-tierline-signature"])
        event = json.loads(raw)["data"]
        assert Decimal(event["balance"]) < Decimal("0.10") == Decimal(event["low_balance"])
    shown = json.loads(_cli(env, "billing", "prepaid", "show", "--tenant", "prepaid-co", "--limit", "1000"))
    assert Decimal(shown["balance"]) == Decimal("0.001")
    assert shown["is_low"] is True
    kinds = [e["kind"] for e in shown["entries"]]
    assert kinds.count("draw") == 333 and kinds.count("top_up") == 1
    assert sum(Decimal(e["amount"]) for e in shown["entries"]) == Decimal("0.001")
    invoice = json.loads(
        _cli(env, "billing", "invoice", "--tenant", "prepaid-co", "--month", period_of(datetime.now(UTC)))
    )
    assert invoice["total"] == "1.00" and invoice["credit_used"] == "1.00" and invoice["amount_due"] == "0.00"
    assert sum(line["requests"] for line in invoice["lines"]) == 333
