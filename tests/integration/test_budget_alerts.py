"""Budget alerts and the reservation sweeper on a real cloud server, on SQLite and on PostgreSQL.

A tenant's settled spend reaches 80% and then 100% of its monthly budget: each threshold is recorded once (even
with concurrent requests settling), a signed ``budget.threshold`` event is POSTed to the tenant's webhook URL,
the delivery is in the tenant's delivery log and ``GET /v1/budget`` shows it all. A reservation left by a dead
replica is released by the server's sweeper once its lease has run out.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, update
from sqlmodel import Session, col, select

from cloud.gateway.webhooks import is_valid_signature
from controlplane.billing.pricing import period_of
from controlplane.storage.tables import BudgetAlert, BudgetPeriod, BudgetReservation, Tenant
from tests.conftest import base_env, free_port, seed_data_dir
from tests.forkserver import run_tierline
from tests.integration.test_jobs import Receiver, cloud_process, receiver

pytestmark = pytest.mark.integration
__all__ = ["receiver"]  # the webhook receiver fixture, shared with test_jobs

MODEL = "tierline/lm-cloud"
# ignore_eos: every request generates max_tokens, so it costs exactly its worst case, which it reserves; a budget
# of ten requests' cost holds exactly ten, and settled spend reaches 100%.
BODY = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 8, "ignore_eos": True}


def _cli(env: dict[str, str], *args: str) -> str:
    proc = run_tierline(*args, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_budget_thresholds_fire_once_each_as_signed_webhooks(
    migrated_db: str,
    tmp_path: Path,
    tiny_zoo: Path,
    session_data_dir: Path,
    receiver: Receiver,
    request: pytest.FixtureRequest,
) -> None:
    data = seed_data_dir(tmp_path / "data", tiny_zoo, session_data_dir)
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=migrated_db,
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
        TIERLINE_CLOUD_SPECULATION="off",
        TIERLINE_CLOUD_JOB_POLL_S="0.2",
        TIERLINE_CLOUD_WEBHOOK_ALLOW_PRIVATE_NETWORKS="true",
        TIERLINE_CLOUD_BUDGET_SWEEP_INTERVAL_S="0.3",
        # The test sets the budget in the database under the running cloud: no cached tenant row (1 s by default).
        TIERLINE_CLOUD_AUTH_CACHE_S="0",
    )
    _cli(env, "tenants", "create", "watched")
    _cli(env, "tenants", "create", "other")
    key = _cli(env, "keys", "create", "--tenant", "watched")
    other = _cli(env, "keys", "create", "--tenant", "other")
    _cli(env, "billing", "prices", "set", "--model", MODEL, "--prompt", "1000", "--completion", "2000")
    engine = create_engine(migrated_db)
    request.addfinalizer(engine.dispose)
    hook = f"/budget-{uuid.uuid4().hex[:8]}"  # the receiver outlives this test (one per module)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {key}"}

    async def fire(n: int) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, headers=auth, timeout=60) as client:
            return list(await asyncio.gather(*(client.post("/v1/completions", json=BODY) for _ in range(n))))

    with cloud_process(env, port):
        secret = httpx.post(f"{url}/v1/webhook-secret", headers=auth).json()["secret"]
        bad = httpx.put(f"{url}/v1/webhook", json={"url": "ftp://example.com/x"}, headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "webhook_url"
        configured = httpx.put(f"{url}/v1/webhook", json={"url": f"{receiver.url}{hook}"}, headers=auth)
        assert configured.status_code == 200, configured.text
        assert configured.json() == {
            "object": "webhook",
            "url": f"{receiver.url}{hook}",
            "has_secret": True,
            "events": ["budget.threshold", "credit.low_balance"],
        }

        probe = httpx.post(f"{url}/v1/completions", json=BODY, headers=auth, timeout=60).json()["usage"]
        cost = (Decimal(probe["prompt_tokens"]) * 1000 + Decimal(probe["completion_tokens"]) * 2000) / 1_000_000
        budget = (10 * cost).quantize(Decimal("0.000001"))
        with Session(engine) as s:
            s.execute(update(Tenant).where(col(Tenant.name) == "watched").values(monthly_budget=budget))
            s.commit()

        first = asyncio.run(fire(7))  # 70%: no alert yet
        assert all(r.status_code == 200 for r in first)
        assert receiver.received(hook, 1, timeout=1.0) == []
        rest = asyncio.run(fire(6))  # 3 more fit (80% and 100% reached, concurrently), 3 are refused
        assert sorted(r.status_code for r in rest) == [200, 200, 200, 429, 429, 429]

        got = receiver.received(hook, 2)
        assert len(got) == 2
        events: list[dict[str, Any]] = []
        for headers, raw in got:
            assert is_valid_signature(secret, raw, headers["x-tierline-signature"])
            assert headers["x-tierline-event"] == "budget.threshold"
            events.append(json.loads(raw))
        period = period_of(datetime.now(UTC))
        by_threshold = {e["data"]["threshold"]: e for e in events}
        assert sorted(by_threshold) == [80, 100]
        assert all(e["type"] == "budget.threshold" for e in events)
        assert by_threshold[100]["data"] == {
            "tenant": "watched",
            "period": period,
            "threshold": 100,
            "spent": str(budget),
            "budget": str(budget),
            "currency": "USD",
        }
        assert 8 * cost <= Decimal(by_threshold[80]["data"]["spent"]) <= budget  # settles race: 100% may see both

        log = httpx.get(f"{url}/v1/webhook-deliveries", params={"event": "budget.threshold"}, headers=auth).json()
        assert [d["status"] for d in log["data"]] == ["delivered", "delivered"]
        assert all(d["attempt_log"][0]["status_code"] == 204 for d in log["data"])
        assert {d["id"] for d in log["data"]} == {h["x-tierline-delivery"] for h, _ in got}
        others = httpx.get(f"{url}/v1/webhook-deliveries", headers={"Authorization": f"Bearer {other}"}).json()
        assert others["data"] == []

        state = httpx.get(f"{url}/v1/budget", headers=auth).json()
        assert (state["budget"], state["spent"], state["reserved"], state["remaining"]) == (
            str(budget),
            str(budget),
            "0.000000",
            "0.000000",
        )
        assert [a["threshold"] for a in state["alerts"]] == [80, 100]

        # A replica died holding a reservation: the sweeper gives it back once its lease has run out.
        with Session(engine) as s:
            tenant = s.exec(select(Tenant).where(Tenant.name == "watched")).one()
            tenant_id = tenant.id or 0
            now = datetime.now(UTC)
            s.add(
                BudgetReservation(
                    id=uuid.uuid4().hex,
                    tenant_id=tenant_id,
                    period=period,
                    amount=Decimal("0.05"),
                    created_at=now - timedelta(minutes=10),
                    expires_at=now - timedelta(seconds=1),
                )
            )
            s.execute(
                update(BudgetPeriod)
                .where(col(BudgetPeriod.tenant_id) == tenant_id)
                .values(reserved=col(BudgetPeriod.reserved) + Decimal("0.05"))
            )
            s.commit()
        deadline = time.monotonic() + 20
        while httpx.get(f"{url}/v1/budget", headers=auth).json()["reserved"] != "0.000000":
            assert time.monotonic() < deadline, "the sweeper did not release the expired reservation"
            time.sleep(0.1)

    with Session(engine) as s:
        alerts = s.exec(select(BudgetAlert).order_by(col(BudgetAlert.threshold))).all()
        left = s.exec(select(BudgetReservation)).all()
    assert [(a.tenant_id, a.period, a.threshold) for a in alerts] == [(tenant_id, period, 80), (tenant_id, period, 100)]
    assert left == []
