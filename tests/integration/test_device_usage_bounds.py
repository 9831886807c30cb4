"""A device's usage is bounded by what the device could have done: a real cloud (its device gateway only), on
SQLite and PostgreSQL.

A synced record claiming 10^15 prompt and 10^15 completion tokens (billed 200,000,000 USD before, and pushing the
key's, project's and end user's budgets to ~2e8) is quarantined: stored for the operator, billed nothing, counted
against no budget, counted in the sync answer and in /metrics, listed by ``tierline billing quarantined``; a retry
changes nothing. A model the registry knows (its context length, 256) bounds its records by that context. Token
counts past what the database holds (2**63) are a 400 naming the field, never a 500. An ordinary record is
billed exactly as before. The device's rate bound (tokens per second since its previous sync) quarantines the
records of a batch past it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from controlplane.billing import budget_admin
from controlplane.billing.invoicing import PriceSpec, add_price
from controlplane.billing.pricing import period_of
from controlplane.fleet.devices import UsageBounds, create_enrollment_token, device_usage_id, enroll, ingest
from controlplane.storage.database import create_db
from controlplane.storage.tables import (
    BudgetPeriod,
    BudgetWindow,
    Device,
    Model,
    ModelArtifact,
    ModelVersion,
    UsageQuarantine,
    UsageRecord,
    WebhookDelivery,
)
from controlplane.tenancy.service import create_api_key, create_tenant
from shared.edge_protocol import UsageItem
from tests.conftest import base_env, free_port, run_server
from tests.forkserver import run_tierline

pytestmark = pytest.mark.integration

EDGE_MODEL = "tierline/lm-edge"
KNOWN_MODEL = "ctx-256-lm"  # registered below with a context of 256 tokens
PER_MTOK = Decimal("0.10")  # per million prompt or completion tokens, on the edge tier
HUGE = 10**15


@dataclass
class Cloud:
    url: str
    engine: Engine
    db_url: str
    env: dict[str, str]
    tenant_id: int
    device: dict[str, Any]

    def sync(self, usage: list[dict[str, Any]]) -> httpx.Response:
        auth = {"Authorization": f"Bearer {self.device['device_token']}"}
        return httpx.post(f"{self.url}/v1/edge/sync", json={"usage": usage}, headers=auth, timeout=30)

    def metric(self, series: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series + " ")]
        assert len(values) == 1, f"{series} not in /metrics"
        return values[0]

    def spend(self) -> tuple[Decimal, list[Decimal]]:
        """The tenant's month's settled spend and every scoped budget window's."""
        with Session(self.engine) as s:
            row = s.get(BudgetPeriod, (self.tenant_id, period_of(datetime.now(UTC))))
            windows = sorted(w.spent for w in s.exec(select(BudgetWindow)))
            return (row.spent if row is not None else Decimal(0)), windows

    def billed(self) -> list[UsageRecord]:
        with Session(self.engine) as s:
            return list(s.exec(select(UsageRecord).where(col(UsageRecord.tenant_id) == self.tenant_id)))


def _events(cloud: Cloud) -> list[int]:
    """The records counted by each usage.quarantined event queued for the tenant's webhook."""
    with Session(cloud.engine) as s:
        rows = s.exec(select(WebhookDelivery).where(col(WebhookDelivery.event) == "usage.quarantined")).all()
        return [int((r.payload or {})["data"]["count"]) for r in rows]


def _record(prompt: int, completion: int, model: str = EDGE_MODEL) -> dict[str, Any]:
    return {
        "id": uuid.uuid4().hex,
        "model": model,
        "tier": "edge",
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "occurred_at": time.time(),
    }


@pytest.fixture
def cloud(migrated_db: str, tmp_path: Path) -> Iterator[Cloud]:
    engine = create_db(migrated_db)
    with Session(engine) as s:
        tenant = create_tenant(s, "fieldco", budget=Decimal("100"))
        tenant.webhook_url = "https://hooks.example.com/tierline"
        s.add(tenant)
        key_id = create_api_key(s, tenant, name="field-app").record.id or 0
        for scope, ref in (("key", str(key_id)), ("user", "alice")):
            budget_admin.set_budget(
                s, tenant, scope=scope, ref=ref, period="month", amount=Decimal("50"), is_hard=True, actor="t"
            )
        for model in (EDGE_MODEL, KNOWN_MODEL):
            add_price(s, PriceSpec(model, PER_MTOK, PER_MTOK, tier="edge"), actor="t")
        # A model the registry knows, with its context length in its artifact's metadata.
        registered = Model(name=KNOWN_MODEL, kind="causal-lm")
        s.add(registered)
        s.flush()
        version = ModelVersion(model_id=registered.id or 0, number=1)
        s.add(version)
        s.flush()
        manifest = {"metadata": {"max_position_embeddings": 256}}
        s.add(
            ModelArtifact(
                version_id=version.id or 0,
                target="edge",
                format="onnx",
                sha256="0" * 64,
                size=1,
                uri="x",
                manifest=manifest,
            )
        )
        token = create_enrollment_token(s, tenant, labels={"billing.key": str(key_id), "billing.user": "alice"}).secret
        s.commit()
        tenant_id = tenant.id or 0
    data = tmp_path / "data"
    data.mkdir()
    env = base_env(data, TIERLINE_DATABASE_URL=migrated_db, TIERLINE_CLOUD_ZOO_PRESET="none")
    with run_server(["cloud", "serve"], env, free_port(), timeout=120) as url:
        device = httpx.post(f"{url}/v1/edge/enroll", json={"token": token, "name": "field-1"}, timeout=30).json()
        yield Cloud(url, engine, migrated_db, env, tenant_id, device)
    engine.dispose()


def test_a_record_beyond_its_models_context_is_quarantined_never_billed_and_listed(cloud: Cloud) -> None:
    # An ordinary record: billed exactly as before (150 tokens at 0.10 per million), on every budget it counts on.
    ordinary = cloud.sync([_record(100, 50)])
    assert ordinary.status_code == 200, ordinary.text
    assert ordinary.json()["accepted"] == 1 and ordinary.json()["quarantined"] == 0
    cost = Decimal(150) * PER_MTOK / 1_000_000
    [record] = cloud.billed()
    assert record.cost == cost and record.prompt_tokens == 100 and record.completion_tokens == 50
    spent, windows = cloud.spend()
    assert spent == cost and windows == [cost, cost]  # the key's and alice's month
    allowance = Decimal(ordinary.json()["allowance"]["remaining"])

    # 10^15 prompt and completion tokens: no edge model holds that. Quarantined, not billed, no budget moved.
    absurd = _record(HUGE, HUGE)
    answer = cloud.sync([absurd])
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["accepted"] == 0 and body["quarantined"] == 1
    assert Decimal(body["allowance"]["remaining"]) == allowance
    assert len(cloud.billed()) == 1
    assert cloud.spend() == (cost, [cost, cost])
    assert cloud.metric("tierline_usage_quarantined_total") == 1.0
    assert _events(cloud) == [1]  # the tenant's webhook is told (usage.quarantined), once

    # A retried batch: the verdict stands, nothing is billed or counted twice.
    again = cloud.sync([absurd])
    assert again.status_code == 200 and again.json()["quarantined"] == 1 and again.json()["accepted"] == 0
    assert cloud.metric("tierline_usage_quarantined_total") == 1.0 and _events(cloud) == [1]
    assert len(cloud.billed()) == 1 and cloud.spend() == (cost, [cost, cost])

    # The model the registry knows: its context (256) bounds its records, an ordinary one is billed.
    known = cloud.sync([_record(200, 56, KNOWN_MODEL), _record(256 * 8 + 1, 0, KNOWN_MODEL)])
    assert known.status_code == 200, known.text
    assert known.json()["accepted"] == 1 and known.json()["quarantined"] == 1
    assert cloud.metric("tierline_usage_quarantined_total") == 2.0

    # The operator lists them, with the bound each broke.
    proc = run_tierline("billing", "quarantined", "--tenant", "fieldco", env=cloud.env)
    assert proc.returncode == 0, proc.stderr
    listed = proc.stdout
    stored_id = device_usage_id(cloud.tenant_id, cloud.device["device_id"], absurd["id"])
    assert stored_id in listed and str(HUGE) in listed and "context" in listed
    assert listed.count("\n") == 2
    with Session(cloud.engine) as s:
        held = s.get(UsageQuarantine, stored_id)
        assert held is not None and held.prompt_tokens == HUGE and held.device_id == cloud.device["device_id"]


def test_a_token_count_past_what_the_database_holds_is_a_400_naming_the_field(cloud: Cloud) -> None:
    for field in ("prompt_tokens", "completion_tokens"):
        for count in (2**63, 2**100):
            answer = cloud.sync([{**_record(1, 1), field: count}])
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["param"] == f"usage.0.{field}"
    assert cloud.billed() == [] and cloud.spend()[0] == Decimal(0)
    # The largest count the protocol takes, and one past what the ledger's own columns hold, are counts: no model
    # has that context, so they are quarantined, never billed, never an error.
    held = cloud.sync([{**_record(1, 1), field: 2**63 - 1}, {**_record(1, 1), field: 2**31}])
    assert held.status_code == 200 and held.json()["quarantined"] == 2, held.text
    assert cloud.billed() == [] and cloud.spend()[0] == Decimal(0)


def test_records_past_the_devices_rate_are_quarantined(migrated_db: str) -> None:
    engine = create_db(migrated_db)
    bounds = UsageBounds(max_tokens_per_s=10.0, burst_tokens=1000)
    with Session(engine) as s:
        tenant = create_tenant(s, "ratey")
        token = create_enrollment_token(s, tenant).secret
        device, _, _ = enroll(s, token, name="r", labels={}, agent_version="", runtime={})
        s.commit()
        device_id, tenant_id = device.id, tenant.id or 0
    with Session(engine) as s:
        found = s.get(Device, device_id)
        assert found is not None
        device = found
        device.last_seen_at = datetime.now(UTC) - timedelta(seconds=10)  # its previous sync: 10 s ago
        s.add(device)
        s.commit()
        # 10 tokens/s x 10 s + 1000: 1100 tokens; four records of 300 -> the fourth is past it.
        items = [UsageItem.model_validate(_record(200, 100)) for _ in range(4)]
        counts = ingest(s, device, items, [], bounds=bounds)
        s.commit()
        assert counts.accepted == 3 and counts.quarantined == 1 and len(counts.quarantined_ids) == 1
        [held] = s.exec(select(UsageQuarantine)).all()
        assert "rate" in held.reason and held.id == device_usage_id(tenant_id, device_id, items[3].id)
        # The same batch again: three duplicates, the fourth still quarantined (not billed now).
        again = ingest(s, device, items, [], bounds=bounds)
        s.commit()
        assert again.accepted == 0 and again.duplicates == 3 and again.quarantined == 1 and again.quarantined_ids == ()
        assert len(s.exec(select(UsageRecord)).all()) == 3
    engine.dispose()
