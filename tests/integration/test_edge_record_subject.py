"""An edge answer's end user travels with its usage record: a real cloud and a real agent on localhost.

The request's ``user`` field, or the ``x-tierline-subject`` header in its place, goes with the record through the
agent's outbox to the cloud, which counts it against that end user's budgets at ingest; a request that names no
one counts against the device's ``billing.user`` label. An escalation names the same end user to the cloud.
"""

from __future__ import annotations

import time
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from sqlmodel import Session, col, select

from controlplane.billing import budget_admin
from controlplane.billing.invoicing import PriceSpec, add_price
from controlplane.fleet.devices import create_enrollment_token
from controlplane.storage.database import create_db
from controlplane.storage.tables import BudgetWindow
from controlplane.tenancy.service import create_tenant
from shared.edge_protocol import UsageItem
from shared.escalation import EdgePolicy, save_policy
from tests.conftest import base_env, free_port, seed_data_dir, server_process
from tests.forkserver import run_tierline
from tests.integration.edge_support import ZOO_PAIRS_ENV

pytestmark = pytest.mark.integration
INT8 = "tierline/lm-edge-onnx-int8"
BODY = {"model": INT8, "prompt": "def main():\n", "max_tokens": 4, "temperature": 0}
EDGE_CALL, CLOUD_CALL = Decimal("0.10"), Decimal("1.00")


def test_each_edge_record_counts_against_its_own_end_users_budget(
    migrated_db: str, tmp_path: Path, tiny_zoo: Path, session_data_dir: Path
) -> None:
    engine = create_db(migrated_db)
    with Session(engine) as s:
        tenant = create_tenant(s, "kioskco")
        budget_admin.set_budget(
            s, tenant, scope="user", ref="*", period="day", amount=Decimal("50"), is_hard=True, actor="t"
        )
        zero = Decimal(0)
        add_price(s, PriceSpec("tierline/lm-edge", zero, zero, tier="edge", per_call=EDGE_CALL), actor="t")
        add_price(s, PriceSpec(INT8, zero, zero, tier="edge", per_call=EDGE_CALL), actor="t")
        add_price(s, PriceSpec("tierline/lm-cloud", zero, zero, tier="cloud", per_call=CLOUD_CALL), actor="t")
        token = create_enrollment_token(
            s, tenant, labels={"billing.user": "dave", "billing.subjects": "any"}
        ).secret  # may name others
        s.commit()

    data = seed_data_dir(tmp_path / "data", tiny_zoo, session_data_dir)
    cloud_env = base_env(
        data,
        TIERLINE_DATABASE_URL=migrated_db,
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
    try:
        expected = {"erin": 2 * EDGE_CALL, "frank": EDGE_CALL + CLOUD_CALL, "dave": EDGE_CALL}
        cloud_port = free_port()
        cloud_url = f"http://127.0.0.1:{cloud_port}"
        logs = {"cloud": tmp_path / "cloud.log", "agent": tmp_path / "agent.log"}  # quoted when an answer is not 200
        with server_process(["cloud", "serve"], cloud_env, cloud_port, timeout=120, log=logs["cloud"]):
            enroll = ("edge", "enroll", "--cloud", cloud_url, "--token", token, "--name", "kiosk-1")
            proc = run_tierline(*enroll, env=agent_env)
            assert proc.returncode == 0, proc.stderr
            save_policy(state / "policies", EdgePolicy("tierline/lm-edge", threshold=-1e9))  # always answers locally
            edge_port = free_port()
            edge_url = f"http://127.0.0.1:{edge_port}"
            with server_process(["edge", "run"], agent_env, edge_port, log=logs["agent"]):
                sent = [
                    ({**BODY, "user": "erin"}, {}),
                    ({**BODY, "user": "erin", "stream": True}, {}),
                    ({**BODY, "user": "erin"}, {"x-tierline-subject": "frank"}),  # the header names the end user
                    (BODY, {"x-tierline-subject": "frank", "x-tierline-tier": "cloud"}),  # escalated, for frank
                    (BODY, {}),  # no one named: the device's billing.user
                ]
                for body, headers in sent:
                    r = httpx.post(f"{edge_url}/v1/completions", json=body, headers=headers, timeout=60)
                    assert r.status_code == 200, (r.text, {k: p.read_text()[-4000:] for k, p in logs.items()})
                    assert r.headers["x-tierline-tier"] == ("cloud" if "x-tierline-tier" in headers else "edge")
                deadline = time.monotonic() + 60
                while True:  # the agent syncs every 0.3 s
                    with Session(engine) as s:
                        windows = s.exec(select(BudgetWindow).where(col(BudgetWindow.subject) != "")).all()
                        spent = {w.subject: w.spent for w in windows if w.spent}
                    if spent == expected or time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
    finally:  # a failure above must not leave a connection for the next test to trip over
        engine.dispose()
    assert spent == expected
    assert all(w.reserved == 0 for w in windows)


def test_the_end_user_field_is_optional_and_bounded() -> None:
    old = {"id": "abcdefgh1", "model": INT8, "occurred_at": 1.0}
    assert UsageItem.model_validate(old).subject is None  # an older agent's record
    assert UsageItem.model_validate({**old, "subject": "x" * 128}).subject == "x" * 128
    with pytest.raises(ValueError, match="subject"):
        UsageItem.model_validate({**old, "subject": "x" * 129})
