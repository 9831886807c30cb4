"""The tenant's allowance reaches the edge agent at sync: a real cloud and a real agent on localhost.

Local answers are billed like cloud ones (the synced usage is rated with the edge price and added to the tenant's
spend); once the cloud reports the allowance used up, the agent refuses local requests with OpenAI's 429
``insufficient_quota`` (the default) or, configured to escalate, sends them to the cloud, which enforces the
budget itself.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, update
from sqlmodel import Session, col, select

from controlplane.fleet.devices import device_usage_id
from controlplane.storage.tables import BudgetAlert, BudgetPeriod, Tenant, UsageRecord
from shared.escalation import EdgePolicy, save_policy
from tests.conftest import base_env, free_port, migrated_sqlite, run_server, seed_data_dir
from tests.forkserver import run_tierline
from tests.integration.edge_support import ZOO_PAIRS_ENV

pytestmark = pytest.mark.integration
INT8 = "tierline/lm-edge-onnx-int8"
BODY = {"model": INT8, "prompt": "def main():\n", "max_tokens": 8, "temperature": 0}
BUDGET = Decimal("40")  # at 1 per token, a few local answers


def _cli(env: dict[str, str], *args: str) -> str:
    proc = run_tierline(*args, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def _allowance(edge_url: str) -> dict[str, Any] | None:
    allowance: dict[str, Any] | None = httpx.get(f"{edge_url}/v1/agent", timeout=10).json()["allowance"]
    return allowance


def _wait_for_allowance(edge_url: str, is_wanted: Any, timeout: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        allowance = _allowance(edge_url)
        if allowance is not None and is_wanted(allowance):
            return allowance
        assert time.monotonic() < deadline, f"the agent was not told the expected allowance (has {allowance})"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[dict[str, Any]]:
    data = seed_data_dir(tmp_path_factory.mktemp("allowance"), tiny_zoo, session_data_dir)
    db = migrated_sqlite(data)
    cloud_env = base_env(
        data,
        TIERLINE_DATABASE_URL=db,
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
        TIERLINE_CLOUD_EDGE_SYNC_INTERVAL_S="0.3",
        TIERLINE_CLOUD_SPECULATION="off",
    )
    state = data / "agent-state"
    agent_env = base_env(
        data,
        TIERLINE_EDGE_ZOO_DIR=str(data / "zoo" / "tiny"),
        TIERLINE_EDGE_STATE_DIR=str(state),
        TIERLINE_EDGE_CLOUD_DEADLINE_S="20",
        **ZOO_PAIRS_ENV,
    )
    _cli(cloud_env, "tenants", "create", "frugal", "--budget", str(BUDGET))
    for model, tier in ((INT8, "edge"), ("tierline/lm-cloud", "cloud")):
        _cli(cloud_env, "billing", "prices", "set", "--model", model, "--tier", tier, "--prompt", "1000000",
             "--completion", "1000000")  # fmt: skip
    token = _cli(cloud_env, "devices", "enrollment-token", "--tenant", "frugal")
    with run_server(["cloud", "serve"], cloud_env, free_port(), timeout=120) as cloud_url:
        _cli(agent_env, "edge", "enroll", "--cloud", cloud_url, "--token", token, "--name", "thrifty-1")
        save_policy(state / "policies", EdgePolicy("tierline/lm-edge", threshold=-1e9))  # always answers locally
        yield {"db": db, "cloud_url": cloud_url, "agent_env": agent_env}


def test_the_agent_refuses_local_answers_once_the_allowance_is_used_up(fleet: dict[str, Any]) -> None:
    with run_server(["edge", "run"], fleet["agent_env"], free_port()) as edge_url:
        told = _wait_for_allowance(edge_url, lambda a: True)
        assert told["remaining"] is not None and Decimal(told["remaining"]) == BUDGET and told["currency"] == "USD"
        served: list[str] = []
        left = BUDGET
        while left > 0:
            assert len(served) < 10, "local answers are not billed against the allowance"
            r = httpx.post(f"{edge_url}/v1/completions", json=BODY, timeout=60)
            assert r.status_code == 200 and r.headers["x-tierline-tier"] == "edge", r.text
            served.append(r.headers["x-tierline-usage-id"])
            # The next sync carries the record up and the smaller allowance down.
            told = _wait_for_allowance(edge_url, lambda a, was=left: Decimal(a["remaining"]) < was)
            left = Decimal(told["remaining"])

        refused = httpx.post(f"{edge_url}/v1/completions", json=BODY, timeout=60)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["type"] == "insufficient_quota"
        assert "x-tierline-tier" not in refused.headers  # refused on the device, not sent anywhere
        streamed = httpx.post(f"{edge_url}/v1/completions", json={**BODY, "stream": True}, timeout=60)
        assert streamed.status_code == 429

    engine = create_engine(fleet["db"])
    with Session(engine) as s:
        rows = [
            u
            for u in s.exec(select(UsageRecord))
            if u.id in {device_usage_id(u.tenant_id, u.device_id or "", r) for r in served}
        ]
        period = s.exec(select(BudgetPeriod)).one()
        alerts = s.exec(select(BudgetAlert).order_by(col(BudgetAlert.threshold))).all()
    engine.dispose()
    # Every local answer was billed at the edge price (1 per token), and nothing more.
    assert len(rows) == len(served)
    assert all(u.tier == "edge" and u.cost == u.prompt_tokens + u.completion_tokens for u in rows)
    assert period.spent == sum((u.cost or Decimal(0) for u in rows), Decimal(0)) >= BUDGET
    # Edge spend fires the budget alerts too (at the sync that carried it), once each.
    assert [a.threshold for a in alerts] == [80, 100]


def test_configured_to_escalate_the_agent_sends_requests_to_the_cloud_which_holds_the_budget(
    fleet: dict[str, Any],
) -> None:
    engine = create_engine(fleet["db"])
    with Session(engine) as s:
        s.execute(update(Tenant).where(col(Tenant.name) == "frugal").values(monthly_budget=Decimal(0)))
        s.commit()
    engine.dispose()
    env = {**fleet["agent_env"], "TIERLINE_EDGE_ON_QUOTA_EXHAUSTED": "escalate"}
    with run_server(["edge", "run"], env, free_port()) as edge_url:
        _wait_for_allowance(edge_url, lambda a: Decimal(a["remaining"]) == 0)
        r = httpx.post(f"{edge_url}/v1/completions", json=BODY, timeout=60)
        assert r.headers["x-tierline-tier"] == "cloud"
        assert r.headers["x-tierline-escalation-reason"] == "quota-exhausted"
        # The cloud reserves against the same budget before generating, and it is spent.
        assert r.status_code == 429 and r.json()["error"]["type"] == "insufficient_quota", r.text
