"""Monthly budgets on the hot path: 50 concurrent requests cannot overspend, on SQLite and on PostgreSQL.

First the reservation primitive under 50 racing threads, then the real cloud API under 50 concurrent
clients: every answered request is rated with the price in force, the settled spend equals the sum of the
usage records' costs, it never exceeds the budget, and refused requests get OpenAI's 429 insufficient_quota.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import threading
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine
from sqlmodel import Session, select

from shared.budgets import BudgetExceededError, reserve, settle
from shared.storage.models import BudgetPeriod, Tenant, UsageRecord
from tests.conftest import REPO, base_env, free_port, run_server, seed_data_dir, tierline_cmd

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
        proc = subprocess.run(tierline_cmd(*args), env=env, cwd=REPO, capture_output=True, text=True)
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
