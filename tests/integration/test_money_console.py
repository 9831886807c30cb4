"""Money controls in the console, on a real console server (SQLite and PostgreSQL): projects, budgets, plans and
prepaid credit through the management API (admins change, viewers read, bad input is named, every change is
audited), and the tenant page's section with its low-balance alert."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlmodel import Session, col, select

from console.management_api import create_token
from controlplane.storage.session import session_scope
from controlplane.storage.tables import AuditLog
from controlplane.tenancy.service import create_api_key, create_tenant
from tests.integration.console_support import console_server

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_money_controls_through_the_api_and_the_tenant_page(tmp_path: Path, backend: str) -> None:
    with console_server(tmp_path, backend) as console:
        admin_name, viewer_name = console.user("admin"), console.user("viewer")
        with session_scope(console.engine) as s:
            admin, viewer = create_token(s, admin_name).secret, create_token(s, viewer_name).secret
            acme, other = create_tenant(s, "acme"), create_tenant(s, "other")
            key_id = create_api_key(s, acme).record.id
            foreign_key_id = create_api_key(s, other).record.id
        http = httpx.Client(base_url=console.url, timeout=30)

        def api(method: str, path: str, token: str = admin, **kw: Any) -> httpx.Response:
            return http.request(method, f"/api{path}", headers={"Authorization": f"Bearer {token}"}, **kw)

        created = api("POST", "/tenants/acme/projects", json={"name": "search"})
        assert created.status_code == 201, created.text
        assert api("POST", "/tenants/acme/projects", json={"name": "search"}).status_code == 409
        assert api("PUT", f"/tenants/acme/keys/{key_id}/project", json={"project": "search"}).status_code == 200
        moved = api("PUT", f"/tenants/acme/keys/{foreign_key_id}/project", json={"project": "search"})
        assert moved.status_code == 404 and moved.json()["error"]["param"] == "key_id"  # another tenant's key
        assert api("GET", "/tenants/acme/projects", viewer).json()["data"][0]["key_ids"] == [key_id]

        budget = {"scope": "project", "ref": "search", "period": "day", "amount": "5.00"}
        made = api("POST", "/tenants/acme/budgets", json=budget)
        assert made.status_code == 201, made.text
        assert made.json()["name"] == "the daily budget of project 'search'" and made.json()["remaining"] == "5.000000"
        assert api("POST", "/tenants/acme/budgets", viewer, json=budget).status_code == 403
        for bad, param in (
            ({**budget, "scope": "team"}, "scope"),
            ({**budget, "period": "week"}, "period"),
            ({**budget, "amount": 5.0}, "amount"),  # money is a string, never a float
            ({**budget, "amount": "-1"}, "amount"),
            ({**budget, "amount": "0.0000001"}, "amount"),
            ({**budget, "colour": "red"}, "colour"),
            ({**budget, "scope": "key", "ref": str(foreign_key_id)}, "ref"),
        ):
            resp = api("POST", "/tenants/acme/budgets", json=bad)
            assert resp.status_code in (400, 404) and resp.json()["error"]["param"] == param, (bad, resp.text)
        user_budget = api("POST", "/tenants/acme/budgets", json={"scope": "user", "ref": "*", "period": "month",
                                                                "amount": "0.50", "is_hard": False})  # fmt: skip
        assert user_budget.status_code == 201
        listed = api("GET", "/tenants/acme/budgets", viewer).json()["data"]
        assert [(b["scope"], b["is_hard"]) for b in listed] == [("project", True), ("user", False)]
        assert api("DELETE", f"/tenants/acme/budgets/{user_budget.json()['id']}").status_code == 204
        assert api("DELETE", f"/tenants/other/budgets/{made.json()['id']}").status_code == 404

        assert api("POST", "/plans", json={"name": "pro", "description": "volume"}).status_code == 201
        price = {"model": "acme/lm", "prompt_per_mtok": "1", "completion_per_mtok": "2", "plan": "pro",
                 "per_call": "0.003"}  # fmt: skip
        assert api("POST", "/prices", json=price).status_code == 201
        override = api("POST", "/prices", json={**price, "plan": None, "tenant": "acme"})
        assert override.status_code == 201 and override.json()["tenant_id"] is not None
        both = api("POST", "/prices", json={**price, "tenant": "acme"})
        assert both.status_code == 400 and both.json()["error"]["param"] == "plan"
        assert api("POST", "/tenants/acme/plan", json={"plan": "nope"}).status_code == 404
        on_plan = api("POST", "/tenants/acme/plan", json={"plan": "pro"})
        assert on_plan.status_code == 201 and on_plan.json()["plan"] == "pro"
        plans = {p["name"]: p for p in api("GET", "/plans", viewer).json()["data"]}
        assert set(plans) == {"default", "pro"} and plans["pro"]["num_tenants"] == 1
        assert plans["pro"]["prices"][0]["per_call"].startswith("0.003")

        assert api("PUT", "/tenants/acme/credit/low-balance", json={"below": "10"}).status_code == 404  # not prepaid
        topped = api("POST", "/tenants/acme/credit/top-ups", json={"amount": "25.00", "note": "PO 7"})
        assert topped.status_code == 201 and topped.json()["balance"].startswith("25.")
        assert api("POST", "/tenants/acme/credit/top-ups", json={"amount": "0"}).json()["error"]["param"] == "amount"
        assert api("PUT", "/tenants/acme/credit/low-balance", json={"below": "30.00"}).status_code == 200
        shown = api("GET", "/tenants/acme/credit", viewer).json()
        assert shown["is_low"] is True and [e["kind"] for e in shown["entries"]] == ["top_up"]

        with Session(console.engine) as s:
            actions = set(s.exec(select(AuditLog.action).where(col(AuditLog.actor).contains(admin_name))).all())
        assert {
            "project.create",
            "api_key.project",
            "budget.set",
            "budget.delete",
            "price_plan.create",
            "price.add",
            "tenant.plan",
            "credit.top_up",
            "credit.low_balance",
        } <= actions, actions

        with console.signed_in("viewer") as browser:
            page = browser.get("/tenants/acme")
        assert page.status_code == 200
        assert "Prepaid credit is low" in page.text and "the daily budget of project &#39;search&#39;" in page.text
        assert "<dd>pro</dd>" in page.text
        http.close()
