"""The console's money pages on a real console server (SQLite and PostgreSQL): an admin sets budgets at every
scope, groups keys in a project, creates a plan with a dated price, puts the tenant on it with an override, tops
up prepaid credit and sets its alert line; bad input comes back on the form naming what is wrong; a viewer reads
but cannot change; a change without the CSRF token is refused; every change is audited under the admin's name."""

from __future__ import annotations

import html
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from sqlmodel import Session, col, select

from controlplane.storage.session import session_scope
from controlplane.storage.tables import (
    ApiKey,
    AuditLog,
    Budget,
    CreditAccount,
    Price,
    PricePlan,
    Project,
    Tenant,
    TenantPlan,
)
from controlplane.tenancy.service import create_api_key, create_tenant
from tests.integration.console_support import console_server, csrf_of, errors_in, post_form

pytestmark = pytest.mark.integration

PAGE = "/tenants/acme/money"


def _send(browser: httpx.Client, path: str, data: dict[str, str], page: str = PAGE) -> httpx.Response:
    return post_form(browser, path, data, page=page)


def _ok(resp: httpx.Response, to: str) -> None:
    assert resp.status_code == 303, resp.text
    assert resp.headers["location"].startswith(to)


def _banner(resp: httpx.Response) -> str:
    return html.unescape(resp.text)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_an_admin_runs_the_money_controls_from_the_console(tmp_path: Path, backend: str) -> None:
    with console_server(tmp_path, backend) as console:
        with session_scope(console.engine) as s:
            acme, other = create_tenant(s, "acme"), create_tenant(s, "other")
            key_id = create_api_key(s, acme, name="search-app").record.id or 0
            create_api_key(s, other)
        with console.signed_in("admin") as admin:
            page = admin.get(PAGE)
            assert page.status_code == 200 and "No budgets per tenant, key, project or end user yet." in page.text

            # Projects and keys.
            _ok(_send(admin, f"{PAGE}/projects", {"project": "search"}), PAGE)
            taken = _send(admin, f"{PAGE}/projects", {"project": "search"})
            assert taken.status_code == 409 and "already has a project 'search'" in _banner(taken)
            _ok(_send(admin, f"{PAGE}/key-project", {"key_id": str(key_id), "project": "search"}), PAGE)

            # Budgets at every scope; bad input is named on the form.
            for scope, ref, period, amount, kind in (
                ("key", str(key_id), "day", "5.00", "hard"),
                ("project", "search", "month", "20", "soft"),
                ("user", "*", "day", "0.50", "hard"),
                ("tenant", "", "total", "100", "hard"),
            ):
                data = {"scope": scope, "ref": ref, "period": period, "amount": amount, "kind": kind}
                _ok(_send(admin, f"{PAGE}/budgets", data), PAGE)
            good = {"scope": "key", "ref": str(key_id), "period": "day", "amount": "5.00"}
            for bad, status, message in (
                ({**good, "amount": "five"}, 400, "amount: 'five' is not an amount"),
                ({**good, "amount": "0.0000001"}, 400, "amount: at most 6 decimal places"),
                ({**good, "period": "week"}, 400, "period"),
                ({**good, "scope": "project", "ref": "nope"}, 404, "has no project 'nope'"),
            ):
                refused = _send(admin, f"{PAGE}/budgets", bad)
                assert refused.status_code == status, (bad, refused.text)
                assert any(message in e for e in errors_in(_banner(refused))), (bad, errors_in(refused.text))
                assert f'value="{bad["amount"]}"' in refused.text  # the form comes back with what was typed
            text = _banner(admin.get(PAGE))
            for name in (
                f"the daily budget of API key {key_id}",
                "the monthly budget of project 'search'",
                "the daily budget of end user '*'",
                "the total budget of the tenant",
            ):
                assert name in text, name
            with Session(console.engine) as s:
                tenant_id = s.exec(select(Tenant.id).where(col(Tenant.name) == "acme")).one()
                budgets = {(b.scope, b.period): b for b in s.exec(select(Budget).where(Budget.tenant_id == tenant_id))}
                project = s.exec(select(Project).where(col(Project.name) == "search")).one()
                assert s.get(ApiKey, key_id).project_id == project.id  # type: ignore[union-attr]
            assert {k: (b.amount, b.is_hard) for k, b in budgets.items()} == {
                ("key", "day"): (Decimal("5.00"), True),
                ("project", "month"): (Decimal("20"), False),
                ("user", "day"): (Decimal("0.50"), True),
                ("tenant", "total"): (Decimal("100"), True),
            }
            user_budget = budgets[("user", "day")].id
            _ok(_send(admin, f"{PAGE}/budgets/{user_budget}/delete", {}), PAGE)
            assert "the daily budget of end user '*'" not in _banner(admin.get(PAGE))

            # A plan with a price from tomorrow (its next version); the tenant on it, with an override.
            plans_page = "/billing/plans"
            _ok(_send(admin, plans_page, {"name": "pro", "description": "volume"}, plans_page), plans_page)
            again = _send(admin, plans_page, {"name": "pro"}, plans_page)
            assert again.status_code == 409 and "a price plan 'pro' exists already" in _banner(again)
            tomorrow = (datetime.now(UTC) + timedelta(days=1)).strftime("%Y-%m-%dT00:00")
            price = {"plan": "pro", "model": "acme/lm", "prompt_per_mtok": "1", "completion_per_mtok": "2"}
            _ok(_send(admin, "/billing/plans/prices", {**price, "per_call": "0.003"}, plans_page), plans_page)
            dated = {**price, "per_call": "0.004", "effective_from": tomorrow}
            _ok(_send(admin, "/billing/plans/prices", dated, plans_page), plans_page)
            bad_price = _send(admin, "/billing/plans/prices", {**price, "prompt_per_mtok": "lots"}, plans_page)
            assert bad_price.status_code == 400 and "prompt per mtok 'lots' is not an amount" in _banner(bad_price)
            listed = _banner(admin.get(plans_page))
            assert 'id="plan-pro"' in listed and tomorrow.replace("T", " ") in listed and "0.004 USD" in listed

            past = (datetime.now(UTC) - timedelta(days=2)).strftime("%Y-%m-%dT00:00")
            too_early = _send(admin, f"{PAGE}/plan", {"plan": "pro", "effective_from": past})
            assert too_early.status_code == 400 and "cannot start in the past" in _banner(too_early)
            _ok(_send(admin, f"{PAGE}/plan", {"plan": "pro"}), PAGE)
            override = {"model": "acme/lm", "prompt_per_mtok": "0.25", "completion_per_mtok": "0.90"}
            _ok(_send(admin, f"{PAGE}/overrides", override), PAGE)
            assert "<dd>pro</dd>" in admin.get(PAGE).text

            # Prepaid credit: a top-up, the alert line (above the balance: the page warns).
            negative = _send(admin, f"{PAGE}/top-ups", {"amount": "-1"})
            assert negative.status_code == 400 and "amount: must be at least 0" in _banner(negative)
            _ok(_send(admin, f"{PAGE}/top-ups", {"amount": "1.00", "note": "PO 17"}), PAGE)
            _ok(_send(admin, f"{PAGE}/low-balance", {"below": "2.00"}), PAGE)
            text = admin.get(PAGE).text
            assert "Prepaid credit is low: 1 USD left" in text and "PO 17" in text

            # A change needs the page's CSRF token.
            forged = admin.post(f"{PAGE}/top-ups", data={"amount": "1000"})
            assert forged.status_code == 403

        with console.signed_in("viewer") as viewer:
            page = viewer.get(PAGE)
            assert page.status_code == 200 and "the daily budget of API key" in page.text
            assert "Set a budget" not in page.text and "Top up" not in page.text
            token = csrf_of(viewer.get("/tenants").text)
            refused = viewer.post(f"{PAGE}/top-ups", data={"amount": "5", "_csrf": token})
            assert refused.status_code == 403

        with Session(console.engine) as s:
            account = s.get(CreditAccount, tenant_id)
            plan_id = s.exec(select(PricePlan.id).where(col(PricePlan.name) == "pro")).one()
            on_plan = s.exec(select(TenantPlan).where(TenantPlan.tenant_id == tenant_id)).all()
            own = s.exec(select(Price).where(Price.tenant_id == tenant_id)).all()
            in_plan = s.exec(select(Price).where(Price.plan_id == plan_id).order_by(col(Price.id))).all()
            actions = [a.action for a in s.exec(select(AuditLog).where(col(AuditLog.actor).contains("admin-")))]
        assert account is not None and account.balance == Decimal("1.00") and account.low_balance == Decimal("2.00")
        assert [t.plan_id for t in on_plan] == [plan_id]
        assert [(p.prompt_per_mtok, p.plan_id) for p in own] == [(Decimal("0.25"), None)]
        assert [p.per_call for p in in_plan] == [Decimal("0.003"), Decimal("0.004")]
        assert in_plan[1].effective_from.strftime("%Y-%m-%dT%H:%M") == tomorrow
        for action, times in (
            ("project.create", 1),
            ("api_key.project", 1),
            ("budget.set", 4),
            ("budget.delete", 1),
            ("price_plan.create", 1),
            ("price.add", 3),
            ("tenant.plan", 1),
            ("credit.top_up", 1),
            ("credit.low_balance", 1),
        ):
            assert actions.count(action) == times, (action, actions)
