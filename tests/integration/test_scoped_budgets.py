"""Budgets per API key, project and end user, held all at once with the tenant's, on SQLite and PostgreSQL.

50 racing reservations split across two keys of one project, then the real cloud API under 50 concurrent clients:
no key budget and no project budget is ever committed beyond its limit, a refused request gets 429
insufficient_quota naming the budget that stopped it, and the settled spend of each budget equals the costs of the
usage records of its key(s). End users (``user`` / ``x-tierline-subject``) each get their own budget.
"""

from __future__ import annotations

import asyncio
import random
import re
import subprocess
import threading
import time
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from controlplane.billing import budget_admin
from controlplane.billing.budgets import (
    BudgetExceededError,
    add_spend,
    reserve,
    reserve_request,
    settle,
    tightest_remaining,
)
from controlplane.billing.scopes import Attribution, applicable
from controlplane.storage.tables import ApiKey, Budget, BudgetPeriod, BudgetWindow, Tenant, UsageRecord
from tests.conftest import base_env, free_port, run_server, seed_data_dir
from tests.forkserver import run_tierline

pytestmark = pytest.mark.integration

STOPPED_BY = r"^the (monthly budget of project 'search'|daily budget of API key \d+) \(\d"


def _engine(url: str) -> Engine:
    if "postgresql" in url:
        return create_engine(url, pool_size=25, max_overflow=40)
    return create_engine(url, connect_args={"timeout": 30})


def _window(engine: Engine, budget_id: int, subject: str = "") -> BudgetWindow:
    with Session(engine) as s:
        return s.exec(
            select(BudgetWindow).where(BudgetWindow.budget_id == budget_id, BudgetWindow.subject == subject)
        ).one()


def test_fifty_racing_requests_on_two_keys_of_a_project_overspend_no_budget(migrated_db: str) -> None:
    engine = _engine(migrated_db)
    with Session(engine) as s:
        tenant = Tenant(name="proj-racer")
        s.add(tenant)
        s.flush()
        project = budget_admin.create_project(s, tenant, "search", "test")
        keys = [ApiKey(tenant_id=tenant.id or 0, prefix=f"k{i}", key_hash=f"h-racer-{i}") for i in range(2)]
        for k in keys:
            s.add(k)
        s.flush()
        for k in keys:
            budget_admin.assign_key(s, tenant, k.id or 0, project, "test")
        key_budgets = [
            budget_admin.set_budget(
                s, tenant, scope="key", ref=str(k.id), period="day", amount=Decimal("0.60"), is_hard=True, actor="t"
            )
            for k in keys
        ]
        project_budget = budget_admin.set_budget(
            s, tenant, scope="project", ref="search", period="month", amount=Decimal("1.00"), is_hard=True, actor="t"
        )
        s.commit()
        tenant_id, key_ids, project_id = tenant.id or 0, [k.id or 0 for k in keys], project.id
        budget_ids = [b.id or 0 for b in key_budgets]
        project_budget_id = project_budget.id or 0
    worst = Decimal("0.07")
    outcomes: list[tuple[int, Decimal | None, str]] = []
    lock = threading.Lock()
    start = threading.Barrier(50)

    def one(i: int) -> None:
        rng = random.Random(i)
        which = i % 2
        start.wait()
        with Session(engine) as s:
            windows = applicable(s, tenant_id, datetime.now(UTC), key_id=key_ids[which], project_id=project_id)
        try:
            held = reserve(engine, tenant_id, None, worst, windows=windows)
        except BudgetExceededError as exc:
            with lock:
                outcomes.append((which, None, exc.message))
            return
        actual = Decimal(rng.randint(1, 70)) / 1000
        settle(engine, held, actual)
        with lock:
            outcomes.append((which, actual, ""))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(outcomes) == 50
    project_row = _window(engine, project_budget_id)
    key_rows = [_window(engine, b) for b in budget_ids]
    engine.dispose()
    for which in (0, 1):
        spent = sum((a for w, a, _ in outcomes if w == which and a is not None), Decimal(0))
        assert key_rows[which].reserved == 0 and key_rows[which].spent == spent <= Decimal("0.60")
    total = sum((a for _, a, _ in outcomes if a is not None), Decimal(0))
    assert project_row.reserved == 0 and project_row.spent == total <= Decimal("1.00")
    refusals = [m for _, a, m in outcomes if a is None]
    assert refusals, "50 x 0.07 must exceed a project budget of 1.00"
    assert all(re.search(STOPPED_BY, m) for m in refusals), refusals


def test_soft_budgets_count_without_refusing_and_edge_allowance_follows_the_tightest(migrated_db: str) -> None:
    engine = _engine(migrated_db)
    with Session(engine) as s:
        tenant = Tenant(name="soft-one", monthly_budget=Decimal("50.00"))
        s.add(tenant)
        s.flush()
        soft = budget_admin.set_budget(
            s, tenant, scope="tenant", ref=None, period="total", amount=Decimal("0.10"), is_hard=False, actor="t"
        )
        daily = budget_admin.set_budget(
            s, tenant, scope="tenant", ref=None, period="day", amount=Decimal("2.00"), is_hard=True, actor="t"
        )
        s.commit()
        tenant_id, soft_id, daily_id = tenant.id or 0, soft.id or 0, daily.id or 0
    for _ in range(3):  # 0.15 on a soft 0.10: counted, never refused
        with Session(engine) as s:
            windows = applicable(s, tenant_id, datetime.now(UTC))
        settle(engine, reserve(engine, tenant_id, Decimal("50.00"), Decimal("0.05"), windows=windows), Decimal("0.05"))
    assert _window(engine, soft_id).spent == Decimal("0.15")
    # Edge usage synced counts against the tenant-wide windows too; the allowance is the tightest hard budget left.
    with Session(engine) as s:
        add_spend(s, tenant_id, datetime.now(UTC), Decimal("1.25"))
        s.commit()
        stored = s.get(Tenant, tenant_id)
        assert stored is not None
        assert tightest_remaining(s, stored) == Decimal("2.00") - Decimal("0.15") - Decimal("1.25")
    assert _window(engine, daily_id).spent == Decimal("1.40")
    engine.dispose()


def test_budget_input_is_checked(migrated_db: str) -> None:
    engine = _engine(migrated_db)
    with Session(engine) as s:
        tenant, other = Tenant(name="checked"), Tenant(name="other-co")
        s.add(tenant)
        s.add(other)
        s.flush()
        foreign = ApiKey(tenant_id=other.id or 0, prefix="x", key_hash="h-foreign")
        s.add(foreign)
        s.flush()
        cases: list[tuple[dict[str, Any], str]] = [
            ({"scope": "team", "ref": "x", "period": "day"}, "scope"),
            ({"scope": "key", "ref": str(foreign.id), "period": "day"}, "ref"),  # another tenant's key
            ({"scope": "project", "ref": "nope", "period": "day"}, "project"),
            ({"scope": "user", "ref": "", "period": "day"}, "ref"),
            ({"scope": "tenant", "ref": None, "period": "week"}, "period"),
        ]
        for fields, param in cases:
            with pytest.raises(Exception) as caught:
                budget_admin.set_budget(s, tenant, amount=Decimal(1), is_hard=True, actor="t", **fields)
            assert getattr(caught.value, "param", None) == param, (fields, caught.value)
        assert s.exec(select(Budget)).all() == []
    engine.dispose()


def test_the_cloud_api_holds_keys_projects_and_end_users_to_their_budgets(
    migrated_db: str, tmp_path: Path, tiny_zoo: Path, session_data_dir: Path
) -> None:
    data = seed_data_dir(tmp_path / "data", tiny_zoo, session_data_dir)
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=migrated_db,
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
        TIERLINE_CLOUD_SPECULATION="off",
    )

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        proc = run_tierline(*args, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc

    cli("tenants", "create", "teamco")
    secrets, key_ids = [], []
    for name in ("a", "b", "c"):
        made = cli("keys", "create", "--tenant", "teamco", "--name", name)
        secrets.append(made.stdout.strip())
        key_ids.append(int(re.search(r"key id (\d+)", made.stderr).group(1)))  # type: ignore[union-attr]
    budget = ("billing", "budgets", "set", "--tenant", "teamco")
    cli("billing", "projects", "create", "--tenant", "teamco", "search")
    for key_id in key_ids[:2]:
        cli("billing", "projects", "add-key", "--tenant", "teamco", "--project", "search", str(key_id))
        cli(*budget, "--scope", "key", "--ref", str(key_id), "--period", "day", "--amount", "0.30")
    cli(*budget, "--scope", "project", "--ref", "search", "--period", "month", "--amount", "0.45")
    cli("billing", "prices", "set", "--model", "tierline/lm-cloud", "--prompt", "1000", "--completion", "2000")
    body = {"model": "tierline/lm-cloud", "prompt": "def f(x):", "max_tokens": 8, "ignore_eos": True}

    async def fire(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            sends = [
                c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {secrets[i % 2]}"})
                for i in range(50)
            ]
            return list(await asyncio.gather(*sends))

    with run_server(["cloud", "serve"], env, free_port(), timeout=120) as url:
        responses = asyncio.run(fire(url))
        ok = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code != 200]
        assert ok and refused
        for r in refused:
            error = r.json()["error"]
            assert r.status_code == 429 and error["type"] == "insufficient_quota", r.text
            assert re.search(STOPPED_BY, error["message"]), r.text
        engine = create_engine(migrated_db)
        ids = {r.headers["x-tierline-usage-id"] for r in ok}
        deadline = time.monotonic() + 30
        while True:
            with Session(engine) as s:
                records = s.exec(select(UsageRecord).where(col(UsageRecord.id).in_(ids))).all()
            if len(records) == len(ids) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert len(records) == len(ids)
        with Session(engine) as s:
            budgets = {(b.scope, b.ref): b.id or 0 for b in s.exec(select(Budget)).all()}
            project_id = str(s.exec(select(ApiKey).where(ApiKey.id == key_ids[0])).one().project_id)
        for key_id in key_ids[:2]:
            row = _window(engine, budgets[("key", str(key_id))])
            cost = sum((r.cost or Decimal(0) for r in records if r.api_key_id == key_id), Decimal(0))
            assert row.reserved == 0 and row.spent == cost <= Decimal("0.30")
        project_row = _window(engine, budgets[("project", project_id)])
        total = sum((r.cost or Decimal(0) for r in records), Decimal(0))
        assert project_row.reserved == 0 and project_row.spent == total <= Decimal("0.45")

        # Each end user has a budget of their own; x-tierline-subject names the end user before the body's user.
        cli(*budget, "--scope", "user", "--ref", "*", "--period", "day", "--amount", "0.03")
        third = {"Authorization": f"Bearer {secrets[2]}"}

        def ask(user: str, **headers: str) -> httpx.Response:
            return httpx.post(f"{url}/v1/completions", json={**body, "user": user}, headers={**third, **headers})

        assert ask("alice").status_code == 200
        second = ask("alice")
        assert second.status_code == 429, second.text
        assert "the daily budget of end user 'alice'" in second.json()["error"]["message"]
        assert ask("bob").status_code == 200
        assert ask("carol", **{"x-tierline-subject": "alice"}).status_code == 429
        assert ask("carol").status_code == 200
        engine.dispose()


def test_a_window_row_gone_since_it_was_seen_is_made_again(migrated_db: str) -> None:
    """A process remembers the window rows it has seen so a request does not create them again; a row deleted
    behind its back (the budget stays) is made again, and the hold is neither refused nor lost."""
    engine = _engine(migrated_db)
    with Session(engine) as s:
        tenant = Tenant(name="forgetful")
        s.add(tenant)
        s.flush()
        key = ApiKey(tenant_id=tenant.id or 0, prefix="f", key_hash="h-forgetful")
        s.add(key)
        s.flush()
        budget = budget_admin.set_budget(
            s, tenant, scope="key", ref=str(key.id), period="day", amount=Decimal("1.00"), is_hard=True, actor="t"
        )
        s.commit()
        tenant_id, key_id, budget_id = tenant.id or 0, key.id or 0, budget.id or 0

    def hold_and_settle() -> None:
        with Session(engine) as s:
            windows = applicable(s, tenant_id, datetime.now(UTC), key_id=key_id)
        settle(engine, reserve(engine, tenant_id, None, Decimal("0.10"), windows=windows), Decimal("0.10"))

    hold_and_settle()
    assert _window(engine, budget_id).spent == Decimal("0.10")
    with Session(engine) as s:
        for row in s.exec(select(BudgetWindow).where(BudgetWindow.budget_id == budget_id)):
            s.delete(row)
        s.commit()
    hold_and_settle()
    row = _window(engine, budget_id)
    assert (row.spent, row.reserved) == (Decimal("0.10"), Decimal(0))
    engine.dispose()


def test_a_sync_holding_the_month_and_a_request_making_its_windows_never_deadlock(migrated_db: str) -> None:
    """A device's sync books its spend in one order, the tenant's month and then its end user's windows, and so does
    a cloud request's hold. A request that must first make the end user's window rows makes and commits them
    before it holds: left uncommitted, a sync holding the month would wait on them while the request waits on the
    month (PostgreSQL: "deadlock detected", the escalation a 500). Both finish and both amounts are counted."""
    engine = _engine(migrated_db)
    with Session(engine) as s:
        tenant = Tenant(name="crosswise", monthly_budget=Decimal("50.00"))
        s.add(tenant)
        s.flush()
        daily = budget_admin.set_budget(
            s, tenant, scope="user", ref="frank", period="day", amount=Decimal("5.00"), is_hard=True, actor="t"
        )
        s.commit()
        tenant_id, daily_id = tenant.id or 0, daily.id or 0
    now = datetime.now(UTC)
    with Session(engine) as s:  # the month's row exists; frank's window rows do not yet
        add_spend(s, tenant_id, now, Decimal("0.01"))
        s.commit()
    assert not _windows(engine, daily_id)
    frank = Attribution(subject="frank")
    outcome: dict[str, Any] = {}

    def request() -> None:
        try:
            outcome["hold"] = reserve_request(engine, tenant_id, Decimal("50.00"), Decimal("0.10"), frank)
        except Exception as exc:
            outcome["error"] = exc

    with Session(engine) as sync:
        sync.execute(  # the sync holds the month's row, as add_spend does first
            update(BudgetPeriod).where(col(BudgetPeriod.tenant_id) == tenant_id).values(spent=BudgetPeriod.spent)
        )
        thread = threading.Thread(target=request)
        thread.start()
        time.sleep(1.5)  # the request has made frank's window rows and waits on the month
        add_spend(sync, tenant_id, now, Decimal("0.02"), frank)
        sync.commit()
    thread.join(60)
    assert "error" not in outcome, outcome
    assert outcome.get("hold") is not None
    [row] = _windows(engine, daily_id)  # frank's day
    assert (row.spent, row.reserved) == (Decimal("0.02"), Decimal("0.10"))
    engine.dispose()


def _windows(engine: Engine, budget_id: int) -> list[BudgetWindow]:
    with Session(engine) as s:
        return list(s.exec(select(BudgetWindow).where(BudgetWindow.budget_id == budget_id)))
