"""Monthly budgets on the hot path: 50 concurrent requests cannot overspend, on SQLite and on PostgreSQL.

First the reservation primitive under 50 racing threads, then the real cloud API under 50 concurrent
clients: every answered request is rated with the price in force, the settled spend equals the sum of the
usage records' costs, it never exceeds the budget, and refused requests get OpenAI's 429 insufficient_quota.

Reservations are leased: one held by a process that died (a real one, killed before it settled) is released
once its lease runs out, and a settle racing the sweeper releases each reservation exactly once.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import threading
import time
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from controlplane.billing.budgets import BudgetExceededError, reclaim_expired, reserve, settle
from controlplane.storage.tables import BudgetPeriod, BudgetReservation, Tenant, UsageRecord
from tests.conftest import REPO, base_env, free_port, run_server, seed_data_dir
from tests.forkserver import run_tierline

pytestmark = pytest.mark.integration


def test_fifty_racing_reservations_never_commit_more_than_the_budget(migrated_db: str) -> None:
    engine = create_engine(migrated_db, pool_size=20, max_overflow=40) if "postgresql" in migrated_db else None
    engine = engine or create_engine(migrated_db, connect_args={"timeout": 30})
    with Session(engine) as s:
        tenant = Tenant(name="racer", monthly_budget=Decimal("1.00"))
        s.add(tenant)
        s.commit()
        tenant_id = tenant.id or 0
    budget, worst = Decimal("1.00"), Decimal("0.07")
    outcomes: list[Decimal | None] = []
    lock = threading.Lock()
    start = threading.Barrier(50)

    def one(seed: int) -> None:
        rng = random.Random(seed)
        start.wait()
        try:
            held = reserve(engine, tenant_id, budget, worst)
        except BudgetExceededError:
            with lock:
                outcomes.append(None)
            return
        actual = Decimal(rng.randint(1, 70)) / 1000  # at most what was reserved
        settle(engine, held, actual)
        with lock:
            outcomes.append(actual)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    with Session(engine) as s:
        row = s.exec(select(BudgetPeriod).where(BudgetPeriod.tenant_id == tenant_id)).one()
    engine.dispose()
    spent = sum((a for a in outcomes if a is not None), Decimal(0))
    assert len(outcomes) == 50
    assert row.reserved == 0 and row.spent == spent <= budget
    assert any(a is None for a in outcomes) and any(a is not None for a in outcomes)


def _engine(url: str) -> Engine:
    if "postgresql" in url:
        return create_engine(url, pool_size=20, max_overflow=40)
    return create_engine(url, connect_args={"timeout": 30})


def _tenant(engine: Engine, name: str, budget: Decimal) -> int:
    with Session(engine) as s:
        tenant = Tenant(name=name, monthly_budget=budget)
        s.add(tenant)
        s.commit()
        return tenant.id or 0


def _period(engine: Engine, tenant_id: int) -> BudgetPeriod:
    with Session(engine) as s:
        return s.exec(select(BudgetPeriod).where(BudgetPeriod.tenant_id == tenant_id)).one()


DIE_HOLDING = """
import os, sys
from decimal import Decimal
from sqlalchemy import create_engine
from controlplane.billing.budgets import reserve
reserve(create_engine(sys.argv[1]), int(sys.argv[2]), Decimal("1.00"), Decimal("0.60"), lease_s=float(sys.argv[3]))
os._exit(9)  # dies mid-request: no settle, no cleanup
"""


def test_a_reservation_held_by_a_process_that_died_is_released_when_its_lease_runs_out(migrated_db: str) -> None:
    engine = _engine(migrated_db)
    tenant_id = _tenant(engine, "crashy", Decimal("1.00"))
    lease_s = 2.0
    died = subprocess.run(
        [sys.executable, "-c", DIE_HOLDING, migrated_db, str(tenant_id), str(lease_s)], cwd=REPO, check=False
    )
    assert died.returncode == 9
    assert _period(engine, tenant_id).reserved == Decimal("0.60")
    # While the lease runs, the dead process's hold counts: 0.60 + 0.50 would exceed the budget.
    with pytest.raises(BudgetExceededError):
        reserve(engine, tenant_id, Decimal("1.00"), Decimal("0.50"))
    assert reclaim_expired(engine) == 0
    time.sleep(lease_s + 0.2)
    # Once it has run out, the next reservation that does not fit releases it first, and fits.
    held = reserve(engine, tenant_id, Decimal("1.00"), Decimal("0.50"))
    assert _period(engine, tenant_id).reserved == Decimal("0.50")
    assert settle(engine, held, Decimal("0.40")) == Decimal("0.40")
    row = _period(engine, tenant_id)
    with Session(engine) as s:
        left = s.exec(select(BudgetReservation)).all()
    engine.dispose()
    assert (row.spent, row.reserved, left) == (Decimal("0.40"), Decimal(0), [])


def test_settles_racing_the_sweeper_release_every_reservation_exactly_once(migrated_db: str) -> None:
    """Leases that run out while their requests are still settling: each amount is given back once, by the
    settle or by the sweeper, and each cost is counted once."""
    engine = _engine(migrated_db)
    tenant_id = _tenant(engine, "sweepy", Decimal("10.00"))
    held = [reserve(engine, tenant_id, Decimal("10.00"), Decimal("0.10"), lease_s=0.0) for _ in range(40)]
    start = threading.Barrier(41)
    errors: list[BaseException] = []

    def settle_one(i: int) -> None:
        start.wait()
        try:
            settle(engine, held[i], Decimal("0.05"))
        except BaseException as exc:
            errors.append(exc)

    def sweep() -> None:
        start.wait()
        for _ in range(5):
            reclaim_expired(engine)

    threads = [threading.Thread(target=settle_one, args=(i,)) for i in range(40)]
    threads.append(threading.Thread(target=sweep))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    row = _period(engine, tenant_id)
    engine.dispose()
    assert not errors
    assert row.reserved == 0 and row.spent == Decimal("2.00")


def test_the_cloud_api_refuses_what_the_budget_cannot_cover(
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

    def cli(*args: str) -> str:
        proc = run_tierline(*args, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    budget = Decimal("0.25")
    cli("tenants", "create", "thrifty", "--budget", str(budget))
    key = cli("keys", "create", "--tenant", "thrifty")
    cli("billing", "prices", "set", "--model", "tierline/lm-cloud", "--prompt", "1000", "--completion", "2000")
    body = {"model": "tierline/lm-cloud", "prompt": "def f(x):", "max_tokens": 8, "ignore_eos": True}

    async def fire(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
            return list(await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(50))))

    with run_server(["cloud", "serve"], env, free_port(), timeout=120) as url:
        responses = asyncio.run(fire(url))
        ok = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code != 200]
        assert ok and refused
        for r in refused:
            assert r.status_code == 429 and r.json()["error"]["type"] == "insufficient_quota", r.text
        # Usage records are written in batches; wait for all of them.
        engine = create_engine(migrated_db)
        ids = {r.headers["x-tierline-usage-id"] for r in ok}
        for _attempt in range(100):
            with Session(engine) as s:
                rows = [u for u in s.exec(select(UsageRecord)) if u.id in ids]
            if len(rows) == len(ids):
                break
            asyncio.run(asyncio.sleep(0.1))
    with Session(engine) as s:
        period = s.exec(select(BudgetPeriod)).one()
    engine.dispose()
    assert len(rows) == len(ok)
    assert all(u.cost is not None and u.price_id is not None for u in rows)
    # 9 prompt tokens x 1000 + 8 completion tokens x 2000 per million: the exact Decimal cost of each record.
    for u in rows:
        assert u.cost == (Decimal(u.prompt_tokens) * 1000 + Decimal(u.completion_tokens) * 2000) / 1_000_000
    total = sum((u.cost or Decimal(0) for u in rows), Decimal(0))
    assert period.reserved == 0 and period.spent == total <= budget
