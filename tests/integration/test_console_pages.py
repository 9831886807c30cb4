"""Every console page and form as an admin uses them, against a real ``tierline console serve`` on SQLite and
PostgreSQL: tenants, API keys, fleet, rollouts, overview numbers, models, billing, the audit log."""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from sqlmodel import Session, col, select

from controlplane.fleet import devices
from controlplane.storage.session import session_scope
from controlplane.storage.tables import (
    ApiKey,
    AuditLog,
    BudgetAlert,
    Device,
    EnrollmentToken,
    Invoice,
    InvoiceLine,
    Model,
    ModelAlias,
    ModelArtifact,
    ModelVersion,
    Price,
    Rollout,
    Tenant,
    UsageRecord,
)
from controlplane.tenancy.service import authenticate, create_tenant
from tests.conftest import DB_BACKENDS
from tests.integration.console_support import Console, console_server, csrf_of, errors_in, post_form

pytestmark = pytest.mark.integration

UPLOAD_CAP = 1 << 20  # the console's artifact size limit in these tests


@pytest.fixture(scope="module", params=DB_BACKENDS)
def console(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    tmp = Path(tmp_path_factory.mktemp("console"))
    with console_server(
        tmp,
        request.param,
        TIERLINE_MAX_ARTIFACT_BYTES=str(UPLOAD_CAP),
        TIERLINE_REGISTRY_DERIVE_TFLITE="false",  # ONNX and INT8 only: a TFLite conversion takes seconds
    ) as running:
        yield running


@pytest.fixture(scope="module")
def admin(console: Console) -> Iterator[httpx.Client]:
    """One signed-in admin browser for the module (sign-in is tested in test_console_auth)."""
    with console.signed_in("admin") as browser:
        yield browser


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def tenant_row(console: Console, name: str) -> Tenant:
    with Session(console.engine) as session:
        return session.exec(select(Tenant).where(Tenant.name == name)).one()


def make_tenant(console: Console, name: str | None = None) -> Tenant:
    with session_scope(console.engine) as session:
        return create_tenant(session, name or unique("t"))


# --- tenants ------------------------------------------------------------------------------------------------------


def test_create_a_tenant_and_edit_its_limits(console: Console, admin: httpx.Client) -> None:
    name = unique("acme")
    resp = post_form(admin, "/tenants", {"name": name, "display_name": "Acme Corp", "monthly_budget": "100.50"})
    assert resp.status_code == 303 and resp.headers["location"] == f"/tenants/{name}"
    page = admin.get(f"/tenants/{name}")
    assert page.status_code == 200 and "Acme Corp" in page.text and "100.50 USD" in page.text

    resp = post_form(
        admin,
        f"/tenants/{name}/edit",
        {"display_name": "Acme", "monthly_budget": "", "requests_per_minute": "600", "max_concurrent": "4"},
        page=f"/tenants/{name}/edit",
    )
    assert resp.status_code == 303
    tenant = tenant_row(console, name)
    assert (tenant.display_name, tenant.monthly_budget, tenant.requests_per_minute, tenant.max_concurrent) == (
        "Acme",
        None,
        600,
        4,
    )
    assert tenant.is_active is False  # the box was left unticked: the tenant is disabled
    assert "This tenant is disabled" in admin.get(f"/tenants/{name}").text


@pytest.mark.parametrize(
    ("form", "field", "message"),
    [
        ({"name": "Not Valid!"}, "name", "must be 1-64 chars"),
        ({"name": ""}, "name", "name is required"),
        ({"name": "ok-name", "monthly_budget": "lots"}, "monthly_budget", "is not an amount"),
        ({"name": "ok-name", "monthly_budget": "-5"}, "monthly_budget", "non-negative"),
        ({"name": "ok-name", "requests_per_minute": "1.5"}, "requests_per_minute", "whole number"),
    ],
)
def test_tenant_form_shows_what_is_wrong_under_the_field(
    console: Console, admin: httpx.Client, form: dict[str, str], field: str, message: str
) -> None:
    form = {**form, "name": form["name"].replace("ok-name", unique("ok"))}
    resp = post_form(admin, "/tenants", form, page="/tenants/new")
    assert resp.status_code == 400
    assert f'id="e-{field}"' in resp.text
    assert any(message in e for e in errors_in(resp.text)), errors_in(resp.text)
    assert 'value="' + form.get("monthly_budget", "") + '"' in resp.text  # what was typed is kept


def test_a_duplicate_tenant_is_refused_inline(console: Console, admin: httpx.Client) -> None:
    name = make_tenant(console).name
    resp = post_form(admin, "/tenants", {"name": name}, page="/tenants/new")
    assert resp.status_code == 400 and "already exists" in resp.text


def test_tenants_are_searched_and_paged(console: Console, admin: httpx.Client) -> None:
    tag = uuid.uuid4().hex[:6]
    for i in range(27):
        make_tenant(console, f"page-{tag}-{i:02d}")
    first = admin.get(f"/tenants?q=page-{tag}")
    assert first.text.count(f'href="/tenants/page-{tag}-') == 25
    assert "Page 1 of 2" in first.text
    second = admin.get(f"/tenants?q=page-{tag}&page=2")
    assert f"page-{tag}-26" in second.text and f"page-{tag}-00" not in second.text
    # Search as you type: HTMX gets the rows alone, not the whole page.
    partial = admin.get(f"/tenants?q=page-{tag}-13", headers={"HX-Request": "true"})
    assert f"page-{tag}-13" in partial.text and "<html" not in partial.text
    empty = admin.get("/tenants?q=no-such-tenant-anywhere")
    assert "No tenant matches" in empty.text


def test_tenant_page_shows_usage_to_date_and_a_budget_alert(console: Console, admin: httpx.Client) -> None:
    tenant = make_tenant(console)
    now = datetime.now(UTC)
    with session_scope(console.engine) as session:
        db_tenant = session.get(Tenant, tenant.id)
        assert db_tenant is not None
        db_tenant.monthly_budget = Decimal(10)
        session.add(db_tenant)
        for i in range(3):
            session.add(
                UsageRecord(
                    id=uuid.uuid4().hex,
                    tenant_id=tenant.id or 0,
                    model="tiny",
                    tier="cloud",
                    prompt_tokens=10,
                    completion_tokens=5 + i,
                    cost=Decimal("2.5"),
                    occurred_at=now,
                )
            )
        session.add(
            BudgetAlert(
                tenant_id=tenant.id or 0,
                period=now.strftime("%Y-%m"),
                threshold=80,
                spent=Decimal(8),
                budget=Decimal(10),
            )
        )
    page = admin.get(f"/tenants/{tenant.name}").text
    assert "80 % of the budget used" in page
    assert re.search(r"Requests this month</dt><dd>3<", page)
    assert re.search(r"Tokens this month</dt><dd>48<", page)
    assert "7.50 USD" in page


# --- API keys -----------------------------------------------------------------------------------------------------


def test_a_new_key_is_shown_once_and_works_until_revoked(console: Console, admin: httpx.Client) -> None:
    tenant = make_tenant(console)
    resp = post_form(admin, "/keys", {"tenant": tenant.name, "name": "production"}, page=f"/tenants/{tenant.name}")
    assert resp.status_code == 201
    secret = re.search(r'id="new-secret" readonly value="(tl-[^"]+)"', resp.text)
    assert secret, "the key is shown with a copy button"
    assert 'data-copy="new-secret"' in resp.text
    with Session(console.engine) as session:
        found_tenant, key = authenticate(session, secret.group(1))
    assert found_tenant.name == tenant.name
    # Only its prefix is ever shown again.
    listing = admin.get(f"/keys?tenant={tenant.name}").text
    assert secret.group(1) not in listing and key.prefix in listing and "never" in listing
    assert f'<a href="/tenants/{tenant.name}">{tenant.name}</a>' in listing

    confirm = admin.get(f"/keys/{key.id}/revoke")
    assert confirm.status_code == 200 and "cannot be undone" in confirm.text
    resp = admin.post(f"/keys/{key.id}/revoke", data={"_csrf": csrf_of(confirm.text)})
    assert resp.status_code == 303 and resp.headers["location"] == f"/tenants/{tenant.name}"
    assert "revoked" in admin.get(f"/tenants/{tenant.name}").text
    with Session(console.engine) as session:
        assert session.get(ApiKey, key.id).revoked_at is not None  # type: ignore[union-attr]
        actions = session.exec(select(AuditLog.action).where(AuditLog.target == f"api_key/{key.id}")).all()
    assert sorted(actions) == ["api_key.create", "api_key.revoke"]
    # Revoking twice is a conflict, not a 500.
    again = admin.post(f"/keys/{key.id}/revoke", data={"_csrf": csrf_of(confirm.text)})
    assert again.status_code == 409 and "already revoked" in again.text


def test_key_form_names_a_missing_or_unknown_tenant(console: Console, admin: httpx.Client) -> None:
    make_tenant(console)  # so the form is offered
    resp = post_form(admin, "/keys", {"tenant": ""}, page="/keys")
    assert resp.status_code == 400 and "tenant is required" in resp.text
    resp = post_form(admin, "/keys", {"tenant": "no-such-tenant"}, page="/keys")
    assert resp.status_code == 400 and "no tenant named" in resp.text
    resp = post_form(admin, "/keys", {"tenant": "x", "expires_in_days": "0"}, page="/keys")
    assert resp.status_code == 400 and "expires in days must be between 1 and 3650" in resp.text


# --- fleet --------------------------------------------------------------------------------------------------------


def test_enrollment_tokens_and_devices(console: Console, admin: httpx.Client) -> None:
    tenant = make_tenant(console)
    resp = post_form(
        admin, "/fleet/enrollment-tokens", {"tenant": tenant.name, "labels": "ring=beta, site=lab"}, page="/fleet"
    )
    assert resp.status_code == 201
    token = re.search(r'id="new-secret" readonly value="(tle-[^"]+)"', resp.text)
    assert token
    with session_scope(console.engine) as session:
        device, _, _ = devices.enroll(
            session, token.group(1), name="kiosk-1", labels={}, agent_version="0.9.1", runtime={}
        )
        device.versions = {"tierline/lm-edge": "tiny-2"}
        device.metrics = {"tierline/lm-edge@tiny-2": {"requests": 200, "errors": 1, "escalations": 30}}
        session.add(device)
        device_id = device.id
    page = admin.get(f"/fleet?tenant={tenant.name}").text
    assert device_id in page and "ring=beta" in page and "online" in page
    assert "15.0 %" in page and "tiny-2" in page and "0.9.1" in page
    assert "used by" in page

    # A device last seen long ago is offline.
    with session_scope(console.engine) as session:
        d = session.get(Device, device_id)
        assert d is not None
        d.last_seen_at = datetime.now(UTC) - timedelta(hours=2)
        session.add(d)
    assert "offline" in admin.get(f"/fleet?q={device_id}").text

    resp = post_form(admin, f"/fleet/devices/{device_id}/revoke", {}, page=f"/fleet/devices/{device_id}/revoke")
    assert resp.status_code == 303
    with Session(console.engine) as session:
        assert session.get(Device, device_id).status == "revoked"  # type: ignore[union-attr]


def test_an_unused_enrollment_token_can_be_revoked(console: Console, admin: httpx.Client) -> None:
    tenant = make_tenant(console)
    post_form(admin, "/fleet/enrollment-tokens", {"tenant": tenant.name}, page="/fleet")
    with Session(console.engine) as session:
        record = session.exec(select(EnrollmentToken).where(EnrollmentToken.tenant_id == tenant.id)).one()
    confirm = admin.get(f"/fleet/enrollment-tokens/{record.id}/revoke")
    assert "No device will be able to enroll" in confirm.text
    resp = admin.post(f"/fleet/enrollment-tokens/{record.id}/revoke", data={"_csrf": csrf_of(confirm.text)})
    assert resp.status_code == 303
    resp = post_form(admin, "/fleet/enrollment-tokens", {"tenant": tenant.name, "labels": "no pairs"}, page="/fleet")
    assert resp.status_code == 400 and "key=value" in resp.text


def test_fleet_filters_say_when_nothing_matches(console: Console, admin: httpx.Client) -> None:
    page = admin.get("/fleet?tenant=nobody-here")
    assert page.status_code == 200 and "No device matches" in page.text


# --- rollouts -----------------------------------------------------------------------------------------------------


def test_rollout_from_the_form_through_pause_resume_and_abort(console: Console, admin: httpx.Client) -> None:
    model = unique("chat")
    form = {"model": model, "baseline_version": "1", "candidate_version": "2", "scope": "cloud", "steps": "10, 50, 100"}
    resp = post_form(admin, "/rollouts", form, page="/rollouts/new")
    assert resp.status_code == 303
    path = resp.headers["location"]
    rollout_id = int(path.rsplit("/", 1)[1])
    detail = admin.get(path).text
    assert "pending" in detail and "created" in detail and 'hx-trigger="every 5s"' in detail

    assert post_form(admin, f"{path}/resume", {}, page=path).status_code == 303  # start now
    assert post_form(admin, f"{path}/pause", {"reason": "lunch"}, page=path).status_code == 303
    detail = admin.get(path).text
    assert "paused" in detail and "lunch" in detail and 'aria-current="step"' in detail
    # Pausing a paused rollout is refused with the reason, not a 500.
    resp = post_form(admin, f"{path}/pause", {}, page=path)
    assert resp.status_code == 409 and "cannot be paused" in resp.text

    confirm = admin.get(f"{path}/abort")
    assert "everyone returns to the baseline" in confirm.text
    resp = admin.post(f"{path}/abort", data={"_csrf": csrf_of(confirm.text), "reason": "bad latency"})
    assert resp.status_code == 303
    detail = admin.get(path).text
    assert "aborted" in detail and "bad latency" in detail and "every 5s" not in detail  # no polling when final
    # The poll that sees it final swaps in an element that polls no more.
    live = admin.get(f"{path}/live", headers={"HX-Request": "true"}).text
    assert live.lstrip().startswith('<div id="rollout-live">') and "hx-trigger" not in live
    with Session(console.engine) as session:
        assert session.get(Rollout, rollout_id).status == "aborted"  # type: ignore[union-attr]
    listing = admin.get("/rollouts?status=aborted").text
    assert model in listing


def test_rollout_promote_after_confirming(console: Console, admin: httpx.Client) -> None:
    model = unique("lm")
    resp = post_form(admin, "/rollouts", {"model": model, "baseline_version": "a", "candidate_version": "b"}, page="/")
    path = resp.headers["location"]
    confirm = admin.get(f"{path}/promote")
    assert "Promote rollout" in confirm.text
    assert admin.post(f"{path}/promote", data={"_csrf": csrf_of(confirm.text)}).status_code == 303
    assert "promoted" in admin.get(path).text


@pytest.mark.parametrize(
    ("form", "field", "message"),
    [
        ({"baseline_version": "1", "candidate_version": "1"}, "candidate_version", "must differ"),
        ({"steps": "50, 10"}, "steps", "strictly ascending"),
        ({"steps": "five"}, "steps", "separated by commas"),
        ({"scope": "moon"}, "_form", "scope must be one of"),
        ({"min_samples": "0"}, "min_samples", "between 1"),
        ({"tenant": "no-such-tenant"}, "_form", "no tenant named"),
    ],
)
def test_rollout_form_shows_what_is_wrong(
    console: Console, admin: httpx.Client, form: dict[str, str], field: str, message: str
) -> None:
    data = {"model": unique("m"), "baseline_version": "1", "candidate_version": "2", "scope": "cloud", **form}
    resp = post_form(admin, "/rollouts", data, page="/rollouts/new")
    assert resp.status_code == 400
    assert any(message in e for e in errors_in(resp.text)), errors_in(resp.text)
    if field != "_form":
        assert f'id="e-{field}"' in resp.text or f'name="{field}"' in resp.text


def test_rollout_detail_draws_candidate_against_baseline(console: Console, admin: httpx.Client) -> None:
    with session_scope(console.engine) as session:
        rollout = Rollout(
            model=unique("drawn"),
            baseline_version="1",
            candidate_version="2",
            scope="cloud",
            steps=[50.0, 100.0],
            status="running",
            weight=50.0,
            last_analysis={
                "at": datetime.now(UTC).isoformat(),
                "action": "wait",
                "reason": "checks pass; step has run 10s of 300s",
                "checks": [
                    {
                        "source": "cloud",
                        "metric": "error_rate",
                        "baseline": 0.01,
                        "candidate": 0.02,
                        "limit": 0.03,
                        "outcome": "pass",
                    },
                ],
            },
        )
        session.add(rollout)
        session.flush()
        rollout_id = rollout.id
    page = admin.get(f"/rollouts/{rollout_id}").text
    assert "cloud error_rate" in page and "bar-candidate" in page and 'class="limit"' in page
    assert "checks pass; step has run" in page
    live = admin.get(f"/rollouts/{rollout_id}/live", headers={"HX-Request": "true"})
    assert live.status_code == 200 and "<html" not in live.text and "bar-baseline" in live.text
    assert admin.get("/rollouts/999999").status_code == 404


# --- overview, models, billing, audit -----------------------------------------------------------------------------


def test_overview_numbers_come_from_recent_usage(console: Console, admin: httpx.Client) -> None:
    tenant = make_tenant(console)
    stats_path = f"/overview/stats?window=5&tenant={tenant.name}"
    assert "No requests in this window" in admin.get(stats_path).text
    now = datetime.now(UTC)
    with session_scope(console.engine) as session:
        for i in range(20):  # 15 on the edge at 10..150 ms, 5 in the cloud at 160..200 ms, one error
            session.add(
                UsageRecord(
                    id=uuid.uuid4().hex,
                    tenant_id=tenant.id or 0,
                    model="tiny",
                    tier="edge" if i < 15 else "cloud",
                    prompt_tokens=100,
                    completion_tokens=50,
                    status="error" if i == 19 else "ok",
                    latency_ms=float(10 * (i + 1)),
                    occurred_at=now - timedelta(seconds=30),
                )
            )
        for _ in range(10):  # shadow replays: the quality monitor's, not users' requests
            session.add(
                UsageRecord(
                    id=uuid.uuid4().hex,
                    tenant_id=tenant.id or 0,
                    model="tiny",
                    tier="shadow",
                    prompt_tokens=100,
                    occurred_at=now - timedelta(seconds=30),
                )
            )
        # Outside the 5-minute window: not counted.
        session.add(
            UsageRecord(
                id=uuid.uuid4().hex,
                tenant_id=tenant.id or 0,
                model="tiny",
                tier="cloud",
                occurred_at=now - timedelta(hours=2),
            )
        )
    page = admin.get(f"/?tenant={tenant.name}").text
    assert f'hx-get="{stats_path.replace("&", "&amp;")}"' in page and 'hx-trigger="every 5s"' in page
    stats = admin.get(stats_path, headers={"HX-Request": "true"}).text
    assert "<html" not in stats
    tiles = {
        label: (value, note)
        for label, note, value in re.findall(
            r'class="label">([^<]+?) ?(?:<small class="muted">([^<]*)</small>)?</span><span class="value">([^<]+)<',
            stats,
        )
    }
    # The rates are over the span the traffic was seen in (it began 30 s ago; a minute at least), not the 5 minutes
    # of the window: 20 requests in 60 s, not in 300 (0.07/s was shown while 2/s were sent). Shadow replays are
    # neither requests nor edge answers.
    assert tiles == {
        "Requests/s": ("0.33", "over 1m 00s"),
        "Tokens/s": ("50.0", "over 1m 00s"),
        "Answered on the edge": ("75.0 %", "shadow replays excluded"),
        "Error rate": ("5.00 %", ""),
    }
    rows = re.findall(r"<tr><td>(\w+)</td>.*?<td class=\"num\">(\d+) ms</td></tr>", stats, re.S)
    assert rows == [("cloud", "200"), ("edge", "150")]  # nearest-rank p95 per tier
    assert re.search(r"<td>shadow</td><td class=\"num\">10</td>", stats)  # shown as its own row
    # The chart: all 20 fell in one 10-second slice of the window: one column of two colours.
    bars = re.findall(r"<title>[\d:]+ (\w+): (\d+) requests</title>", stats)
    assert sorted(bars) == [("cloud", "5"), ("edge", "15")]
    # A wider window counts the old record too; every tenant's traffic is at least this tenant's.
    day = admin.get(f"/overview/stats?window=1440&tenant={tenant.name}").text
    assert re.search(r"<td>cloud</td><td class=\"num\">6</td>", day)
    day_bars = re.findall(r"<title>[\d:]+ (\w+): (\d+) requests</title>", day)
    assert sorted(day_bars) == [("cloud", "1"), ("cloud", "5"), ("edge", "15")]  # two hours apart: two columns
    assert admin.get("/overview/stats?tenant=no-such-tenant").status_code == 404


def test_models_list_and_detail_with_artifacts_aliases_and_lineage(console: Console, admin: httpx.Client) -> None:
    name = unique("tiny-lm")
    digest = "ab" * 32
    with session_scope(console.engine) as session:
        model = Model(name=name, kind="causal-lm", description="a tiny model")
        session.add(model)
        session.flush()
        v1 = ModelVersion(model_id=model.id or 0, number=1, status="active", source="zoo://tiny")
        session.add(v1)
        session.flush()
        v2 = ModelVersion(model_id=model.id or 0, number=2, derived_from_id=v1.id, tags=["int8"])
        session.add(v2)
        session.flush()
        session.add(
            ModelArtifact(
                version_id=v2.id or 0,
                target="edge",
                format="onnx-int8",
                sha256=digest,
                size=12345,
                uri="file:///zoo/tiny/edge.onnx",
            )
        )
        session.add(ModelAlias(model_id=model.id or 0, name="stable", version_id=v1.id or 0, updated_by="console:x"))
        model_id = model.id
    listing = admin.get(f"/models?q={name}").text
    assert name in listing and "stable → v1" in listing
    detail = admin.get(f"/models/{name}").text
    assert digest in detail and "onnx-int8" in detail and "12,345 B" in detail
    assert "derived from <strong>v1</strong>" in detail and "int8" in detail
    assert admin.get("/models/no-such-model").status_code == 404
    assert "No model matches" in admin.get("/models?q=zzz-none").text

    # Point the alias at v2, move v2 forward, retire v1 after confirming.
    resp = post_form(admin, f"/models/{name}/aliases", {"alias": "stable", "version": "2"}, page=f"/models/{name}")
    assert resp.status_code == 303
    assert "stable → v2" in admin.get(f"/models?q={name}").text
    resp = post_form(admin, f"/models/{name}/aliases", {"alias": "bad alias!", "version": "2"}, page="/models")
    assert resp.status_code == 400 and 'id="e-alias"' in resp.text
    resp = post_form(admin, f"/models/{name}/aliases", {"alias": "canary", "version": "9"}, page="/models")
    assert resp.status_code == 400 and "has no version 9" in resp.text
    resp = post_form(admin, f"/models/{name}/versions/2/status", {"status": "validated"}, page="/models")
    assert resp.status_code == 303
    confirm = admin.get(f"/models/{name}/versions/1/retire")
    assert "cannot be undone" in confirm.text
    resp = admin.post(f"/models/{name}/versions/1/status", data={"_csrf": csrf_of(confirm.text), "status": "retired"})
    assert resp.status_code == 303
    with Session(console.engine) as session:
        statuses = dict(
            session.exec(
                select(ModelVersion.number, ModelVersion.status).where(ModelVersion.model_id == model_id)
            ).all()
        )
        actions = session.exec(select(AuditLog.action).where(AuditLog.target.startswith(f"model/{name}"))).all()
    assert statuses == {1: "retired", 2: "validated"}
    assert sorted(actions) == ["model.alias.move", "model.version.status", "model.version.status"]
    # Backwards is refused with the reason.
    resp = post_form(admin, f"/models/{name}/versions/2/status", {"status": "registered"}, page="/models")
    assert resp.status_code == 409 and "cannot become registered" in resp.text


def test_register_versions_from_the_models_page(console: Console, admin: httpx.Client) -> None:
    name = unique("registered")
    resp = post_form(
        admin, "/models", {"name": name, "kind": "tensor", "source": "run-17", "tags": "a, b"}, page="/models"
    )
    assert resp.status_code == 303 and resp.headers["location"] == f"/models/{name}#v1"
    resp = post_form(admin, "/models", {"name": name, "label": "int8", "derived_from": "1"}, page="/models")
    assert resp.headers["location"] == f"/models/{name}#v2"
    detail = admin.get(f"/models/{name}").text
    assert "derived from <strong>v1</strong>" in detail and "run-17" in detail and "tensor" in detail
    assert "No artifacts for this version yet" in detail
    bad = post_form(admin, "/models", {"name": "has space"}, page="/models")
    assert bad.status_code == 400 and 'id="e-name"' in bad.text
    bad = post_form(admin, "/models", {"name": name, "derived_from": "7"}, page="/models")
    assert bad.status_code == 400 and 'id="e-derived_from"' in bad.text and "has no version 7" in bad.text
    bad = post_form(admin, "/models", {"name": name, "kind": "causal-lm"}, page="/models")
    assert bad.status_code == 400 and "is a tensor model" in bad.text


def test_billing_chart_price_book_and_invoices(console: Console, admin: httpx.Client) -> None:
    tenant = make_tenant(console)
    now = datetime.now(UTC)
    model = unique("billed")
    with session_scope(console.engine) as session:
        for days_ago, tier in ((0, "edge"), (1, "cloud"), (1, "edge")):
            session.add(
                UsageRecord(
                    id=uuid.uuid4().hex,
                    tenant_id=tenant.id or 0,
                    model=model,
                    tier=tier,
                    prompt_tokens=1000,
                    completion_tokens=500,
                    cost=Decimal("0.75"),
                    occurred_at=now - timedelta(days=days_ago),
                )
            )
        session.add(
            Price(
                model=model,
                prompt_per_mtok=Decimal("0.5"),
                completion_per_mtok=Decimal("1.5"),
                cached_per_mtok=Decimal("0.1"),
                effective_from=now - timedelta(days=30),
            )
        )
        session.add(
            Price(
                model=model,
                tier="edge",
                prompt_per_mtok=Decimal("0.2"),
                completion_per_mtok=Decimal("0.4"),
                cached_per_mtok=Decimal("0.1"),
                effective_from=now + timedelta(days=3),
            )
        )
        invoice = Invoice(
            tenant_id=tenant.id or 0,
            period="2026-01",
            number=unique("INV"),
            status="finalized",
            subtotal=Decimal("2.25"),
            total=Decimal("2.25"),
            lines_hash="cd" * 32,
            finalized_at=now,
        )
        session.add(invoice)
        session.flush()
        session.add(
            InvoiceLine(
                invoice_id=invoice.id or 0,
                kind="usage",
                usage_period="2026-01",
                model=model,
                tier="edge",
                requests=3,
                prompt_tokens=3000,
                completion_tokens=1500,
                amount=Decimal("2.25"),
            )
        )
        invoice_id, number = invoice.id, str(invoice.number)
    page = admin.get("/billing?group=model&metric=tokens&days=7").text
    assert '<svg class="chart"' in page and model in page and '<rect class="c' in page
    assert "upcoming" in page  # the price from next week
    assert number in page
    by_tier = admin.get("/billing?group=tier&metric=cost").text
    assert "edge" in by_tier and "cloud" in by_tier
    detail = admin.get(f"/billing/invoices/{invoice_id}").text
    assert "2.25 USD" in detail and "cd" * 32 in detail and model in detail
    assert admin.get("/billing/invoices/999999").status_code == 404
    # Unknown chart options fall back to the defaults instead of failing.
    assert admin.get("/billing?group=planet&metric=mass&days=3").status_code == 200


def test_finalize_a_month_and_download_its_csv(console: Console, admin: httpx.Client) -> None:
    tenant = make_tenant(console)
    model = unique("invoiced")
    with session_scope(console.engine) as session:
        for tier, cost in (("edge", "0.125"), ("cloud", "1.10"), ("cloud", "0.90")):
            session.add(
                UsageRecord(
                    id=uuid.uuid4().hex,
                    tenant_id=tenant.id or 0,
                    model=model,
                    tier=tier,
                    prompt_tokens=100,
                    completion_tokens=10,
                    cost=Decimal(cost),
                    occurred_at=datetime(2026, 1, 15, tzinfo=UTC),
                )
            )
    preview = admin.get(f"/billing/finalize?tenant={tenant.name}&month=2026-01")
    assert (
        preview.status_code == 200 and "Draft for" in preview.text and "2.12 USD" in preview.text
    )  # 0.125 rounds to 0.12 per line
    # The preview lists what it would bill, line by line (it showed only "Lines 2"), and offers the button.
    lines = re.findall(r'<td data-label="Model">([^<]+)</td><td data-label="Tier">(\w+)</td>', preview.text)
    assert sorted(lines) == [(model, "cloud"), (model, "edge")]
    assert "2.00 USD" in preview.text and "0.12 USD" in preview.text and "Finalize 2026-01</button>" in preview.text
    resp = admin.post(
        "/billing/finalize", data={"_csrf": csrf_of(preview.text), "tenant": tenant.name, "month": "2026-01"}
    )
    assert resp.status_code == 303
    detail = admin.get(resp.headers["location"]).text
    number = re.search(r"Invoice (INV-202601-\d+)", detail)
    assert number and "2.12 USD" in detail and "Download CSV" in detail
    csv = admin.get(resp.headers["location"] + "/csv")
    assert csv.status_code == 200 and csv.headers["content-type"].startswith("text/csv")
    assert f'filename="{number.group(1)}.csv"' in csv.headers["content-disposition"]
    assert csv.text.splitlines()[0].startswith("kind,usage_period,model")
    assert sum(1 for line in csv.text.splitlines() if model in line) == 2  # one line per tier
    # Twice is refused, and so is a month that has not ended.
    again = admin.post(
        "/billing/finalize", data={"_csrf": csrf_of(preview.text), "tenant": tenant.name, "month": "2026-01"}
    )
    assert again.status_code == 409 and "already invoiced" in again.text
    future = admin.get(f"/billing/finalize?tenant={tenant.name}&month=2099-01")
    assert future.status_code == 200  # a preview of the future is fine, without a button...
    assert "Finalize 2099-01</button>" not in future.text and "can be finalized from 2099-02-01" in future.text
    this_month = f"{datetime.now(UTC):%Y-%m}"
    current = admin.get(f"/billing/finalize?tenant={tenant.name}&month={this_month}").text
    assert f"Finalize {this_month}</button>" not in current and "has not ended" in current
    resp = admin.post(
        "/billing/finalize", data={"_csrf": csrf_of(preview.text), "tenant": tenant.name, "month": "2099-01"}
    )
    assert resp.status_code == 400 and "has not ended" in resp.text  # ...finalizing it is not
    bad = admin.get(f"/billing/finalize?tenant={tenant.name}&month=January")
    assert bad.status_code == 400 and 'id="e-month"' in bad.text


def test_add_a_price_to_the_price_book(console: Console, admin: httpx.Client) -> None:
    model = unique("priced")
    form = {"model": model, "prompt_per_mtok": "0.40", "completion_per_mtok": "1.60", "tier": "cloud"}
    resp = post_form(
        admin, "/billing/prices", {**form, "effective_from": "2030-01-01T00:00"}, page="/billing/prices/new"
    )
    assert resp.status_code == 303
    with Session(console.engine) as session:
        price = session.exec(select(Price).where(Price.model == model)).one()
    assert (price.prompt_per_mtok, price.cached_per_mtok, price.tier) == (Decimal("0.4"), Decimal("0.4"), "cloud")
    page = admin.get("/billing").text
    assert model in page and "upcoming" in page
    resp = post_form(admin, "/billing/prices", {**form, "prompt_per_mtok": "cheap"}, page="/billing/prices/new")
    assert resp.status_code == 400 and 'id="e-prompt_per_mtok"' in resp.text
    resp = post_form(admin, "/billing/prices", {**form, "completion_per_mtok": ""}, page="/billing/prices/new")
    assert resp.status_code == 400 and "completion per mtok is required" in resp.text


def test_audit_log_is_searchable(console: Console, admin: httpx.Client) -> None:
    name = unique("logged")
    post_form(admin, "/tenants", {"name": name}, page="/tenants/new")
    page = admin.get(f"/audit?q={name}").text
    assert "tenant.create" in page and f"tenant/{name}" in page and "console:admin-" in page
    assert "Nothing matches" in admin.get("/audit?q=zzz-nothing-like-this").text


def test_unknown_pages_and_bad_parameters_are_4xx(console: Console, admin: httpx.Client) -> None:
    assert admin.get("/tenants/no-such-tenant").status_code == 404
    assert admin.get("/tenants/no-such-tenant/edit").status_code == 404
    assert admin.get("/tenants?page=notanumber").status_code == 400
    assert admin.get("/tenants?page=-3").status_code == 200  # clamped to the first page
    assert admin.get("/rollouts/1/explode").status_code == 404


# --- models: upload, derive, the escalation curve ----------------------------------------------------------------


def upload(
    client: httpx.Client,
    files: list[tuple[str, bytes]],
    form: dict[str, str] | None = None,
    *,
    token: str | None = "",
    htmx: bool = True,
    **fields: str,
) -> httpx.Response:
    """Post the models page's upload form as htmx does: multipart, the CSRF token in the X-CSRF-Token header."""
    headers = {"HX-Request": "true"} if htmx else {}
    if token is not None:
        headers["X-CSRF-Token"] = token or csrf_of(client.get("/models").text)
    parts = [("file", (name, body, "application/octet-stream")) for name, body in files]
    return client.post("/model-uploads", data={**(form or {}), **fields}, files=parts, headers=headers)


def artifacts_of(console: Console, name: str, number: int) -> list[ModelArtifact]:
    with Session(console.engine) as session:
        return list(
            session.exec(
                select(ModelArtifact)
                .join(ModelVersion, col(ModelVersion.id) == ModelArtifact.version_id)
                .join(Model, col(Model.id) == ModelVersion.model_id)
                .where(Model.name == name, ModelVersion.number == number)
                .order_by(col(ModelArtifact.id))
            )
        )


def test_upload_a_version_from_the_models_page(console: Console, admin: httpx.Client) -> None:
    name = unique("uploaded")
    body = b"\x08\x01" + uuid.uuid4().bytes * 64  # stands in for an ONNX file
    resp = upload(admin, [("model.onnx", body)], name=name, kind="tensor", tags="ci, small", alias="stable")
    assert resp.status_code == 200 and resp.headers["hx-redirect"] == f"/models/{name}#v1", resp.text
    (artifact,) = artifacts_of(console, name, 1)
    assert (artifact.target, artifact.format, artifact.status) == ("cloud", "onnx", "ready")
    assert artifact.manifest["files"] == [
        {"path": "model.onnx", "sha256": hashlib.sha256(body).hexdigest(), "size": len(body)}
    ]
    page = admin.get(f"/models/{name}").text
    assert artifact.sha256 in page and "stable" in page and "upload by console:admin-" in page
    assert f'href="/models?upload={name}#upload"' in page
    assert f'id="u-name" name="name" type="text" value="{name}"' in admin.get(f"/models?upload={name}").text
    with Session(console.engine) as session:
        actions = set(session.exec(select(AuditLog.action).where(col(AuditLog.target).startswith(f"model/{name}"))))
    assert {"model.create", "model.version.register", "model.artifact.add", "model.alias.move"} <= actions
    # Without htmx (a script posting the form) the answer is a redirect; empty fields are left out.
    resp = upload(admin, [("model.onnx", body)], htmx=False, name=name, label="", alias="", format="")
    assert resp.status_code == 303 and resp.headers["location"] == f"/models/{name}#v2"


def test_upload_form_errors_come_back_inline(console: Console, admin: httpx.Client) -> None:
    name = unique("bad-upload")
    cases = [
        ({"name": "no spaces please"}, [("model.onnx", b"x")], "u-e-name"),
        ({"name": name}, [("", b"")], "u-e-file"),  # the file input left empty
        ({"name": name}, [("weights.bin", b"x")], "u-e-format"),
        ({"name": name, "format": "tflite", "kind": "tensor"}, [("a.tflite", b"x")], ""),  # tflite: an edge format
        ({"name": name, "label": "bad label!"}, [("model.onnx", b"x")], "u-e-label"),
    ]
    for fields, files, error_id in cases:
        resp = upload(admin, files, fields)
        if not error_id:
            assert resp.status_code == 200, resp.text
            continue
        assert resp.status_code == 400, (fields, resp.text)
        assert f'id="{error_id}"' in resp.text and 'id="upload-form"' in resp.text, (fields, errors_in(resp.text))
        assert fields["name"] in resp.text  # what was typed comes back
    # Past the size limit: 413 with the reason under the file field, nothing kept.
    resp = upload(admin, [("model.onnx", b"\0" * (UPLOAD_CAP + 1))], name=name)
    assert resp.status_code == 413 and 'id="u-e-file"' in resp.text and "TIERLINE_MAX_ARTIFACT_BYTES" in resp.text
    announced = upload(admin, [("model.onnx", b"\0" * (UPLOAD_CAP + (2 << 20)))], name=name)
    assert announced.status_code == 413 and 'id="u-e-file"' in announced.text
    with Session(console.engine) as session:
        assert len(artifacts_of(console, name, 2)) == 0 and session.exec(select(Model).where(Model.name == name)).one()
    staging = list((console.data_dir / "artifacts").rglob("*.part"))
    assert staging == [], staging


def test_upload_needs_an_admin_and_the_csrf_header(console: Console, admin: httpx.Client) -> None:
    name = unique("refused-upload")
    files = [("model.onnx", b"onnx")]
    resp = upload(admin, files, token=None, name=name)
    assert resp.status_code == 403 and "CSRF" in resp.text
    # A token in the body is not read: the body is streamed to the store, never parsed before the guard.
    token = csrf_of(admin.get("/models").text)
    resp = upload(admin, files, token=None, name=name, _csrf=token)
    assert resp.status_code == 403
    with console.signed_in("viewer") as viewer:
        resp = upload(viewer, files, name=name)
        assert resp.status_code == 403 and "only an admin" in resp.text
        assert "Upload a version" not in viewer.get("/models").text
    with Session(console.engine) as session:
        assert session.exec(select(Model).where(Model.name == name)).first() is None


def test_derive_edge_artifacts_from_an_uploaded_checkpoint(
    console: Console, admin: httpx.Client, tmp_path: Path
) -> None:
    from tests.integration.test_registry import make_checkpoint

    name = unique("edge-lm")
    ckpt = make_checkpoint(tmp_path / "lm")
    files = [(p.name, p.read_bytes()) for p in sorted(ckpt.iterdir())]
    assert upload(admin, files, name=name, kind="causal-lm").status_code == 200
    page = admin.get(f"/models/{name}").text
    assert "Derive edge artifacts" in page and 'hx-trigger="every' not in page

    token = csrf_of(page)
    resp = admin.post(f"/models/{name}/versions/1/derive", data={"_csrf": token})
    assert resp.status_code == 303 and resp.headers["location"] == f"/models/{name}#v2"
    page = admin.get(f"/models/{name}").text
    assert {a.format: a.status for a in artifacts_of(console, name, 2)} == {"onnx": "pending", "onnx-int8": "pending"}
    # While the job runs (seconds: export, quantize, compare), the section polls itself.
    assert 'hx-trigger="every 2s"' in page and "Deriving edge artifacts" in page
    deadline = time.monotonic() + 90
    while any(a.status == "pending" for a in artifacts_of(console, name, 2)):
        assert time.monotonic() < deadline, "the derive job did not finish"
        time.sleep(0.2)
    statuses = {a.format: a.status for a in artifacts_of(console, name, 2)}
    assert statuses == {"onnx": "ready", "onnx-int8": "ready"}
    # The polled section (htmx asks for the page and keeps #versions) now stops polling.
    page = admin.get(f"/models/{name}", headers={"HX-Request": "true"}).text
    assert 'hx-trigger="every' not in page and "derived from <strong>v1</strong>" in page
    assert "agrees with its source checkpoint on" in page

    # Only a cloud checkpoint derives: the derived version refuses, inline.
    resp = admin.post(f"/models/{name}/versions/2/derive", data={"_csrf": token})
    assert resp.status_code == 400 and 'id="derive-error-2"' in resp.text and "hf-safetensors" in resp.text
    assert admin.post(f"/models/{name}/versions/9/derive", data={"_csrf": token}).status_code == 404
    assert admin.post("/models/no-such-model/versions/1/derive", data={"_csrf": token}).status_code == 404
    assert admin.post(f"/models/{name}/versions/1/derive", data={}).status_code == 403  # no CSRF token
    with console.signed_in("viewer") as viewer:
        resp = viewer.post(f"/models/{name}/versions/1/derive", data={"_csrf": csrf_of(viewer.get("/").text)})
        assert resp.status_code == 403
        assert "Derive edge artifacts" not in viewer.get(f"/models/{name}").text
    assert len(artifacts_of(console, name, 3)) == 0  # nothing refused started a job


def test_calibrated_escalation_curve(console: Console, admin: httpx.Client) -> None:
    from shared.escalation import EdgePolicy, save_policy

    policies = console.data_dir / "edge" / "policies"  # where `tierline up`'s agent keeps them
    if not any(policies.glob("*.json")):
        page = admin.get("/models").text
        assert "No calibrated escalation policy" in page and "tierline edge calibrate" in page
    name = unique("curved")
    curve = [
        {"threshold": None, "edge_share": 0.0, "quality": 0.80},
        {"threshold": -0.5, "edge_share": 0.4, "quality": 0.79},
        {"threshold": -1.5, "edge_share": 0.7, "quality": 0.74},
        {"threshold": -3.0, "edge_share": 1.0, "quality": 0.60},
    ]
    calibration = {
        "curve": curve,
        "edge_share": 0.4,
        "quality": 0.79,
        "cloud_only_quality": 0.80,
        "max_quality_loss": 0.01,
        "num_items": 500,
        "calibrated_at": "2026-11-30T12:00:00+00:00",
    }
    save_policy(policies, EdgePolicy(model=f"tierline/{name}", threshold=-0.5, calibration=calibration))
    (policies / "broken.json").write_text("{not json")
    page = admin.get("/models").text
    assert f"tierline/{name}" in page and "40.0 %" in page and "-0.5" in page
    svg = re.search(rf'id="policy-tierline__{name}".*?</svg>', page, re.S)
    assert svg and "<polyline" in svg.group(0) and '<circle class="chosen"' in svg.group(0)
    assert len(re.search(r'points="([^"]+)"', svg.group(0)).group(1).split()) == 4  # type: ignore[union-attr]
    assert "cannot read edge policy" in page  # a broken file is named, the page still works
    # The model's own page shows its curve (the policy names it under the tierline/ namespace).
    with session_scope(console.engine) as session:
        from controlplane.registry import service as registry

        registry.ensure_model(session, name, "causal-lm", actor="test")
    assert 'class="chosen"' in admin.get(f"/models/{name}").text
    (policies / "broken.json").unlink()


# --- billing: void and credit notes ------------------------------------------------------------------------------


def finalized_invoice(console: Console, admin: httpx.Client) -> int:
    """A tenant's January invoice of 2.00 USD, finalized through the console; returns its id."""
    tenant = make_tenant(console)
    with session_scope(console.engine) as session:
        session.add(
            UsageRecord(
                id=uuid.uuid4().hex,
                tenant_id=tenant.id or 0,
                model=unique("m"),
                tier="cloud",
                prompt_tokens=10,
                completion_tokens=1,
                cost=Decimal("2.00"),
                occurred_at=datetime(2026, 1, 10, tzinfo=UTC),
            )
        )
    resp = post_form(admin, "/billing/finalize", {"tenant": tenant.name, "month": "2026-01"}, page="/billing")
    assert resp.status_code == 303, resp.text
    return int(resp.headers["location"].rsplit("/", 1)[-1])


def test_issue_credit_notes_on_an_invoice(console: Console, admin: httpx.Client) -> None:
    invoice_id = finalized_invoice(console, admin)
    path = f"/billing/invoices/{invoice_id}"
    page = admin.get(path).text
    assert "Issue credit note" in page and "at most 2.00 USD" in page
    for fields, error in (
        ({"amount": "", "reason": "x"}, "amount is required"),
        ({"amount": "abc", "reason": "goodwill"}, "is not an amount"),
        ({"amount": "0.001", "reason": "goodwill"}, "at most 2 decimals"),
        ({"amount": "5", "reason": "goodwill"}, "more than what is left"),
        ({"amount": "1", "reason": " "}, "say why"),
    ):
        resp = post_form(admin, f"{path}/credit-notes", fields, page=path)
        assert resp.status_code == 400, fields
        assert any(error in e for e in errors_in(resp.text)), (fields, errors_in(resp.text))
        assert f'value="{fields["amount"]}"' in resp.text  # what was typed comes back
    resp = post_form(admin, f"{path}/credit-notes", {"amount": "0.75", "reason": "outage on the 3rd"}, page=path)
    assert resp.status_code == 303
    page = admin.get(path).text
    assert re.search(r"CN-202601-\d+: 0.75 USD — outage on the 3rd", page) and "at most 1.25 USD" in page
    assert re.search(r"Due after credits</dt><dd>1.25 USD", page)
    with Session(console.engine) as session:
        row = session.exec(
            select(AuditLog).where(AuditLog.action == "invoice.credit").order_by(col(AuditLog.id).desc())
        )
        audit = row.first()
    assert audit and audit.actor.startswith("console:admin-") and audit.after and audit.after["amount"] == "0.75"
    # Refused: without a CSRF token, and to a viewer.
    assert admin.post(f"{path}/credit-notes", data={"amount": "0.25", "reason": "x"}).status_code == 403
    with console.signed_in("viewer") as viewer:
        assert "Issue credit note" not in viewer.get(path).text
        token = csrf_of(viewer.get("/").text)
        resp = viewer.post(f"{path}/credit-notes", data={"_csrf": token, "amount": "0.25", "reason": "x"})
        assert resp.status_code == 403
    with Session(console.engine) as session:
        assert session.get(Invoice, invoice_id).credits == Decimal("0.75")  # type: ignore[union-attr]


def test_void_an_invoice_after_confirming(console: Console, admin: httpx.Client) -> None:
    invoice_id = finalized_invoice(console, admin)
    path = f"/billing/invoices/{invoice_id}"
    assert "Void…" in admin.get(path).text
    confirm = admin.get(f"{path}/void")
    assert confirm.status_code == 200 and "This cannot be undone" in confirm.text
    assert admin.post(f"{path}/void", data={"reason": "wrong prices"}).status_code == 403  # no CSRF token
    with console.signed_in("viewer") as viewer:
        token = csrf_of(viewer.get("/").text)
        assert viewer.post(f"{path}/void", data={"_csrf": token, "reason": "x"}).status_code == 403
    resp = post_form(admin, f"{path}/void", {"reason": ""}, page=f"{path}/void")
    assert resp.status_code == 400 and 'id="e-reason"' in resp.text and "say why" in resp.text
    resp = post_form(admin, f"{path}/void", {"reason": "priced with the wrong book"}, page=f"{path}/void")
    assert resp.status_code == 303
    page = admin.get(path).text
    assert "priced with the wrong book" in page and "Void…" not in page and "Issue credit note" not in page
    with Session(console.engine) as session:
        invoice = session.get(Invoice, invoice_id)
        assert invoice is not None and invoice.status == "void"
        assert session.exec(select(UsageRecord).where(UsageRecord.invoice_id == invoice_id)).first() is None
        assert session.exec(select(AuditLog).where(AuditLog.action == "invoice.void")).first()
    again = post_form(admin, f"{path}/void", {"reason": "twice"}, page=path)
    assert again.status_code == 409 and "only a finalized invoice" in again.text
    assert admin.get("/billing/invoices/999999/void").status_code == 404


def test_unknown_urls_get_a_page_and_the_api_keeps_json(console: Console, admin: httpx.Client) -> None:
    for path in ("/no-such-page", "/models/x/y/z/w"):
        resp = admin.get(path)
        assert resp.status_code == 404 and resp.headers["content-type"].startswith("text/html"), path
        assert "Not found" in resp.text and 'href="/"' in resp.text
    resp = admin.put("/tenants")
    assert resp.status_code == 405 and resp.headers["content-type"].startswith("text/html")
    api = admin.get("/api/no-such-thing")
    assert api.status_code == 404 and api.json()["error"]["type"]
    assert admin.get("/schema/openapi.json").headers["content-type"].startswith("application/")
