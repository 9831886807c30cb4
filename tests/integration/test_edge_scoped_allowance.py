"""A device's allowance follows the tightest budget its traffic counts against: a real cloud, devices syncing
through its device gateway, on SQLite and PostgreSQL.

A device whose enrollment token attributes it to an API key (and so the key's project) and an end user has its
synced usage counted against those budgets too, and is told at sync what is left of the tightest of them, by
name; a device with no attribution gets the tenant's. Spend the key makes through the cloud API shows in the
device's allowance. A device cannot attribute itself.
"""

from __future__ import annotations

import time
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlmodel import Session, col, select

from controlplane.billing import budget_admin
from controlplane.billing.invoicing import PriceSpec, add_price
from controlplane.fleet.devices import create_enrollment_token
from controlplane.storage.database import create_db
from controlplane.storage.tables import Budget, BudgetWindow, UsageRecord
from controlplane.tenancy.service import create_api_key, create_tenant
from edge_agent.allowance import AllowanceGuard, QuotaExhaustedError
from shared.edge_protocol import Allowance
from shared.errors import ValidationError
from tests.conftest import base_env, free_port, run_server, seed_data_dir

pytestmark = pytest.mark.integration

EDGE_MODEL, CLOUD_MODEL = "tierline/lm-edge", "tierline/lm-cloud"
ALICE = "the daily budget of end user 'alice'"
PROJECT = "the monthly budget of project 'field'"
TENANT_DAY = "the daily budget of the tenant"


def _record(n: int = 1) -> list[dict[str, Any]]:
    return [
        {"id": uuid.uuid4().hex, "model": EDGE_MODEL, "tier": "edge", "prompt_tokens": 5, "occurred_at": time.time()}
        for _ in range(n)
    ]


def _sync(url: str, device: dict[str, Any], usage: list[dict[str, Any]]) -> dict[str, Any]:
    auth = {"Authorization": f"Bearer {device['device_token']}"}
    resp = httpx.post(f"{url}/v1/edge/sync", json={"usage": usage}, headers=auth, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["accepted"] == len(usage)
    allowance: dict[str, Any] = resp.json()["allowance"]
    return allowance


def _told(allowance: dict[str, Any]) -> tuple[Decimal, str]:
    return Decimal(allowance["remaining"]), allowance["budget"]


def test_a_device_is_told_the_tightest_budget_of_its_key_project_end_user_and_tenant(
    migrated_db: str, tmp_path: Path, tiny_zoo: Path, session_data_dir: Path
) -> None:
    engine = create_db(migrated_db)
    with Session(engine) as s:
        tenant = create_tenant(s, "fieldco", budget=Decimal("100"))
        other = create_tenant(s, "elsewhere")
        issued = create_api_key(s, tenant, name="field-app")
        foreign = create_api_key(s, other, name="not-theirs")
        key_id = issued.record.id or 0
        project = budget_admin.create_project(s, tenant, "field", actor="t")
        budget_admin.assign_key(s, tenant, key_id, project, actor="t")
        for scope, ref, period, amount in (
            ("key", str(key_id), "day", "5.00"),
            ("project", "field", "month", "3.00"),
            ("user", "alice", "day", "2.00"),
            ("tenant", None, "day", "10.00"),
        ):
            budget_admin.set_budget(
                s, tenant, scope=scope, ref=ref, period=period, amount=Decimal(amount), is_hard=True, actor="t"
            )
        zero = Decimal(0)
        add_price(s, PriceSpec(EDGE_MODEL, zero, zero, tier="edge", per_call=Decimal("0.50")), actor="t")
        add_price(s, PriceSpec(CLOUD_MODEL, zero, zero, tier="cloud", per_call=Decimal("1.20")), actor="t")
        attributed = create_enrollment_token(
            s, tenant, labels={"billing.key": str(key_id), "billing.user": "alice", "site": "north"}
        ).secret
        plain = create_enrollment_token(s, tenant).secret
        # Attribution names the tenant's own key and project only.
        for labels in ({"billing.key": str(foreign.record.id)}, {"billing.project": "nope"}, {"billing.user": "*"}):
            with pytest.raises(ValidationError, match="labels"):
                create_enrollment_token(s, tenant, labels=labels)
        s.commit()
        budget_ids = {(b.scope, b.period): b.id or 0 for b in s.exec(select(Budget))}

    data = seed_data_dir(tmp_path / "data", tiny_zoo, session_data_dir)
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=migrated_db,
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
        TIERLINE_CLOUD_SPECULATION="off",
    )
    with run_server(["cloud", "serve"], env, free_port(), timeout=120) as url:
        # A device cannot pick whose budgets it counts against (and the refused token stays unused).
        claimed = httpx.post(f"{url}/v1/edge/enroll", json={"token": plain, "labels": {"billing.user": "mallory"}})
        assert claimed.status_code == 400 and "billing.user" in claimed.json()["error"]["message"], claimed.text
        field = httpx.post(f"{url}/v1/edge/enroll", json={"token": attributed, "name": "field-1"}).json()
        lobby = httpx.post(f"{url}/v1/edge/enroll", json={"token": plain, "name": "lobby-1"}).json()

        assert _told(_sync(url, field, [])) == (Decimal("2.00"), ALICE)
        assert _told(_sync(url, lobby, [])) == (Decimal("10.00"), TENANT_DAY)

        # 3 local answers at 0.50: alice's 2.00 a day has 0.50 left; the key, project and tenant day count them too.
        assert _told(_sync(url, field, _record(3))) == (Decimal("0.50"), ALICE)
        # The key spends 1.20 through the cloud: its project (3.00 a month) has 0.30 left, now the tightest.
        body = {"model": CLOUD_MODEL, "prompt": "def f(x):", "max_tokens": 4}
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {issued.secret}"})
        assert r.status_code == 200, r.text
        assert _told(_sync(url, field, [])) == (Decimal("0.30"), PROJECT)
        allowance = _sync(url, lobby, _record(1))  # unattributed usage counts against the tenant only
        assert _told(allowance) == (Decimal("10.00") - Decimal("3.20"), TENANT_DAY)
        assert allowance["currency"] == "USD"

    with Session(engine) as s:
        edge = s.exec(select(UsageRecord).where(col(UsageRecord.tier) == "edge")).all()
        windows = {(w.budget_id, w.subject): w for w in s.exec(select(BudgetWindow))}
    engine.dispose()
    # The field device's records carry its key; the lobby's none.
    assert sorted((u.device_id == field["device_id"], u.api_key_id) for u in edge) == [
        (False, None),
        (True, key_id),
        (True, key_id),
        (True, key_id),
    ]
    spent = {scope: windows[(budget_ids[(scope, period)], "")].spent for scope, period in budget_ids}
    assert spent == {
        "key": Decimal("2.70"),  # 3 x 0.50 synced + 1.20 through the cloud
        "project": Decimal("2.70"),
        "user": Decimal("1.50"),  # the cloud request named no end user
        "tenant": Decimal("3.20"),
    }
    assert all(w.reserved == 0 for w in windows.values())


def test_the_agent_names_the_budget_that_stopped_it() -> None:
    guard = AllowanceGuard()
    guard.update(Allowance(remaining=Decimal(0), currency="USD", period="2026-03", budget=PROJECT))
    with pytest.raises(QuotaExhaustedError, match="the monthly budget of project 'field' is used up"):
        guard.must_escalate(can_escalate=False)


def _escalate(url: str, device: dict[str, Any], **body: Any) -> httpx.Response:
    auth = {"Authorization": f"Bearer {device['device_token']}"}
    request = {"model": CLOUD_MODEL, "prompt": "def f(x):", "max_tokens": 4, **body}
    data = {"endpoint": "completions", "reason": "low-confidence", "body": request}
    return httpx.post(f"{url}/v1/edge/escalate", json=data, headers=auth, timeout=60)


def _refused_by(resp: httpx.Response) -> str:
    assert resp.status_code == 429 and resp.json()["error"]["type"] == "insufficient_quota", resp.text
    message: str = resp.json()["error"]["message"]
    return message


def test_escalations_are_held_against_the_budgets_of_the_devices_attribution(
    migrated_db: str, tmp_path: Path, tiny_zoo: Path, session_data_dir: Path
) -> None:
    engine = create_db(migrated_db)
    with Session(engine) as s:
        tenant = create_tenant(s, "escalateco", budget=Decimal("100"))
        issued = create_api_key(s, tenant, name="field-app")
        key_id = issued.record.id or 0
        for scope, ref in (("key", str(key_id)), ("user", "dave")):
            budget_admin.set_budget(
                s, tenant, scope=scope, ref=ref, period="day", amount=Decimal("2.00"), is_hard=True, actor="t"
            )
        zero = Decimal(0)
        add_price(s, PriceSpec(CLOUD_MODEL, zero, zero, tier="cloud", per_call=Decimal("1.20")), actor="t")
        tokens = {
            name: create_enrollment_token(s, tenant, labels=labels).secret
            for name, labels in (
                ("field", {"billing.key": str(key_id)}),
                ("desk", {"billing.user": "dave", "billing.subjects": "any"}),
            )
        }
        plain = create_enrollment_token(s, tenant).secret
        s.commit()

    data = seed_data_dir(tmp_path / "data", tiny_zoo, session_data_dir)
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=migrated_db,
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
        TIERLINE_CLOUD_SPECULATION="off",
    )
    key_budget = f"the daily budget of API key {key_id}"
    with run_server(["cloud", "serve"], env, free_port(), timeout=120) as url:
        field, desk = (httpx.post(f"{url}/v1/edge/enroll", json={"token": tokens[n]}).json() for n in ("field", "desk"))
        lobby = httpx.post(f"{url}/v1/edge/enroll", json={"token": plain}).json()

        # The key's 2.00 a day pays one escalation at 1.20; the second cannot be held on what is left (0.80).
        first = _escalate(url, field)
        assert first.status_code == 200, first.text
        assert key_budget in _refused_by(_escalate(url, field))
        # Exactly as a direct call with the key is refused; a device not attributed to it still escalates.
        direct = {"model": CLOUD_MODEL, "prompt": "def f(x):", "max_tokens": 4}
        auth = {"Authorization": f"Bearer {issued.secret}"}
        assert key_budget in _refused_by(httpx.post(f"{url}/v1/completions", json=direct, headers=auth))
        for _ in range(2):
            assert _escalate(url, lobby).status_code == 200

        # The device's end user (billing.user) is the default; a request naming its own user counts against that.
        assert _escalate(url, desk).status_code == 200
        assert "the daily budget of end user 'dave'" in _refused_by(_escalate(url, desk))
        assert _escalate(url, desk, user="erin").status_code == 200
        assert "the daily budget of end user 'dave'" in _refused_by(_escalate(url, desk, user="dave"))

    with Session(engine) as s:
        cloud = s.exec(select(UsageRecord).where(col(UsageRecord.tier) == "cloud")).all()
        windows = {w.budget_id: w for w in s.exec(select(BudgetWindow))}
        budgets = {b.scope: b.id or 0 for b in s.exec(select(Budget))}
    engine.dispose()
    # Each escalation is billed once, the attributed device's under its key.
    by_device = sorted((u.device_id == field["device_id"], u.api_key_id) for u in cloud if u.status == "ok")
    assert by_device == [(False, None)] * 4 + [(True, key_id)]
    assert windows[budgets["key"]].spent == Decimal("1.20")
    assert windows[budgets["user"]].spent == Decimal("1.20")
    assert all(w.reserved == 0 for w in windows.values())
