"""The billing management API on a real console server (SQLite and PostgreSQL): prices, invoices as JSON and
CSV, finalize / void / credit notes, and tenant usage for dashboards, readable with a tenant's own API key."""

from __future__ import annotations

import csv
import io
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlmodel import Session

from console.management_api import create_token
from console.passwords import create_user
from controlplane.billing.ledger import NewUsage, ingest_usage
from controlplane.storage.database import create_db
from controlplane.tenancy.service import create_api_key, create_tenant
from tests.conftest import base_env, free_port, run_server

pytestmark = [pytest.mark.integration, pytest.mark.postgres]

JAN = datetime(2026, 1, 1, tzinfo=UTC)


def test_billing_api_end_to_end(migrated_db: str, tmp_path: Path) -> None:
    engine = create_db(migrated_db)
    with Session(engine) as s:
        create_user(s, "ops", "correct horse battery", "admin")
        create_user(s, "auditor", "correct horse battery", "viewer")
        admin, viewer = create_token(s, "ops").secret, create_token(s, "auditor").secret
        acme, globex = create_tenant(s, "acme"), create_tenant(s, "globex")
        acme_key, globex_key = create_api_key(s, acme).secret, create_api_key(s, globex).secret
        acme_id = acme.id or 0
        s.commit()
    engine.dispose()

    env = base_env(tmp_path, TIERLINE_DATABASE_URL=migrated_db)
    with run_server(["console", "serve"], env, free_port()) as url, httpx.Client(base_url=url, timeout=30) as http:

        def api(method: str, path: str, token: str | None = admin, **kw: Any) -> httpx.Response:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            return http.request(method, f"/api{path}", headers=headers, **kw)

        # Prices: admins add, everyone with a token reads; bad fields are named.
        price = {"model": "acme/lm", "prompt_per_mtok": "2.00", "completion_per_mtok": 6, "tier": "cloud"}
        created = api("POST", "/prices", json={**price, "effective_from": "2025-01-01T00:00:00Z"})
        assert created.status_code == 201, created.text
        assert created.json()["cached_per_mtok"] == "2.00" and created.json()["currency"] == "USD"
        assert api("POST", "/prices", token=viewer, json=price).status_code == 403
        assert api("POST", "/prices", token=None, json=price).status_code == 401
        for bad, param in (
            ({**price, "prompt_per_mtok": "-1"}, "prompt_per_mtok"),
            ({**price, "completion_per_mtok": "lots"}, "completion_per_mtok"),
            ({**price, "tier": "moon"}, "tier"),
            ({**price, "currency": "dollars"}, "currency"),
            ({**price, "colour": "red"}, "colour"),
            ({**price, "per_row": "-0.01"}, "per_row"),
            ({**price, "per_row": "0.0000001"}, "per_row"),  # finer than a micro
        ):
            resp = api("POST", "/prices", json=bad)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (bad, resp.text)
        # A tensor model is priced per call and per input row.
        tensor = {"model": "acme/digits", "prompt_per_mtok": 0, "completion_per_mtok": 0, "tier": "cloud"}
        created = api("POST", "/prices", json={**tensor, "per_call": "0.001", "per_row": "0.0002"})
        assert created.status_code == 201, created.text
        fees = [Decimal(created.json()[name]) for name in ("per_call", "per_row")]
        assert fees == [Decimal("0.001"), Decimal("0.0002")]
        listed = api("GET", "/prices", token=viewer).json()["data"]
        per_row = sorted((p["model"], Decimal(p["per_row"])) for p in listed)
        assert per_row == [("acme/digits", Decimal("0.0002")), ("acme/lm", Decimal(0))]

        # Usage arrives (rated at ingestion with the price in force).
        engine = create_db(migrated_db)
        with Session(engine) as s:
            records = [
                NewUsage(
                    id=uuid.uuid4().hex,
                    tenant_id=acme_id,
                    model="acme/lm",
                    model_version=1 + i % 2,
                    tier="cloud" if i % 4 else "edge",
                    occurred_at=JAN + timedelta(hours=10 * i),
                    prompt_tokens=1000,
                    completion_tokens=500,
                )
                for i in range(30)
            ]
            ingest_usage(s, records)
            s.commit()
        engine.dispose()

        # The month's draft, then finalize; the stored invoice as JSON and CSV.
        draft = api("GET", "/tenants/acme/invoices/2026-01")
        assert draft.status_code == 200 and draft.json()["status"] == "draft", draft.text
        assert draft.json()["unpriced_records"] == 8  # the edge records: no edge price
        assert api("POST", f"/tenants/{acme_id}/invoices", token=viewer, json={"month": "2026-01"}).status_code == 403
        bad_month = api("POST", "/tenants/acme/invoices", json={"month": "January"})
        assert bad_month.status_code == 400 and bad_month.json()["error"]["param"] == "month"
        done = api("POST", f"/tenants/{acme_id}/invoices", json={"month": "2026-01"})
        assert done.status_code == 201, done.text
        invoice = done.json()
        # 15 cloud records of v2 (0.075 -> 0.08) and 7 of v1 (0.035 -> 0.04): lines round half-even one by one, the
        # total is the exact sum rounded once (0.110 -> 0.11), the difference a rounding line of -0.01.
        assert invoice["total"] == draft.json()["total"] == "0.11"
        assert [(ln["kind"], ln["amount"]) for ln in invoice["lines"] if ln["kind"] == "rounding"] == [
            ("rounding", "-0.01")
        ]
        assert invoice["lines_hash"] == draft.json()["lines_hash"]
        again = api("POST", "/tenants/acme/invoices", json={"month": "2026-01"})
        assert again.status_code == 409 and again.json()["error"]["param"] == "month"
        number = invoice["number"]
        assert api("GET", f"/invoices/{number}", token=viewer).json() == invoice
        for path in (f"/invoices/{number}?format=csv", f"/invoices/{number}.csv"):
            exported = api("GET", path)
            assert exported.status_code == 200 and exported.headers["content-type"].startswith("text/csv")
            rows = list(csv.DictReader(io.StringIO(exported.text)))
            assert sum(int(r["requests"] or 0) for r in rows if r["kind"] in ("usage", "adjustment")) == 30
            assert {r["kind"]: r["amount"] for r in rows}["total"] == "0.11"
        assert api("GET", f"/invoices/{number}?format=xml").json()["error"]["param"] == "format"
        assert api("GET", "/invoices/INV-nope").status_code == 404
        assert [i["number"] for i in api("GET", "/tenants/acme/invoices").json()["data"]] == [number]
        assert api("GET", "/tenants/nobody/invoices").status_code == 404

        # Credit notes and void.
        note = api("POST", f"/invoices/{number}/credit-notes", json={"amount": "0.10", "reason": "outage"})
        assert note.status_code == 201 and note.json()["number"].startswith("CN-"), note.text
        too_much = api("POST", f"/invoices/{number}/credit-notes", json={"amount": 0.03, "reason": "again"})
        assert too_much.status_code == 400 and too_much.json()["error"]["param"] == "amount"
        no_reason = api("POST", f"/invoices/{number}/credit-notes", json={"amount": "0.01"})
        assert no_reason.status_code == 400 and no_reason.json()["error"]["param"] == "reason"
        assert api("GET", f"/invoices/{number}").json()["balance"] == "0.01"  # 0.11 less the 0.10 credited
        voided = api("POST", f"/invoices/{number}/void", json={"reason": "wrong address"})
        assert voided.status_code == 200 and voided.json()["status"] == "void"
        assert api("POST", f"/invoices/{number}/void", json={"reason": "twice"}).status_code == 409
        assert api("GET", "/tenants/acme/invoices/2026-01").json()["status"] == "draft"  # billable again

        # Usage for dashboards: totals add up; a tenant key reads only its own tenant.
        q = {"from": "2026-01-01", "to": "2026-01-31", "group_by": "day,tier"}
        usage = api("GET", "/tenants/acme/usage", token=acme_key, params=q)
        assert usage.status_code == 200, usage.text
        body = usage.json()
        # Usage reports exact costs (to 1e-6); only invoice lines are rounded.
        assert body["totals"]["requests"] == 30 and body["totals"]["cost"] == "0.110000"
        assert body["totals"]["total_tokens"] == 30 * 1500 and body["totals"]["unpriced_records"] == 8
        assert sum(g["requests"] for g in body["groups"]) == 30
        assert sum(Decimal(g["cost"]) for g in body["groups"]) == Decimal("0.11")
        assert {g["tier"] for g in body["groups"]} == {"cloud", "edge"}
        assert body["groups"][0]["day"] == "2026-01-01"
        by_version = api("GET", f"/tenants/{acme_id}/usage", token=viewer, params={**q, "group_by": "version"})
        assert [(g["version"], g["requests"]) for g in by_version.json()["groups"]] == [(1, 15), (2, 15)]
        assert api("GET", "/tenants/acme/usage", token=globex_key, params=q).status_code == 404
        assert api("GET", f"/tenants/{acme_id}/usage", token=globex_key, params=q).status_code == 404
        assert api("GET", "/tenants/globex/usage", token=globex_key, params=q).json()["totals"]["requests"] == 0
        assert api("GET", "/tenants/acme/usage", token="tl-forged", params=q).status_code == 401
        assert api("GET", "/tenants/acme/usage", token=None, params=q).status_code == 401
        for bad_q, param in (
            ({"group_by": "colour"}, "group_by"),
            ({"from": "yesterday"}, "from"),
            ({"from": "2026-02-01", "to": "2026-01-01"}, "to"),
        ):
            resp = api("GET", "/tenants/acme/usage", params={**q, **bad_q})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
