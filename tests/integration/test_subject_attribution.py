"""Whose end-user budgets a device's traffic counts against: its enrollment's ``billing.user``, and another end user
only where the enrollment allows it (``billing.subjects=any``). A real cloud (SQLite and PostgreSQL) and a real
edge agent on localhost.

A device labelled ``billing.user=dave`` cannot move its spend to ``erin``: its escalation naming her is refused
(403, ``body.user``), a synced record naming her is booked to dave (never refused: an outbox must drain), and its
agent, told the rule at sync, refuses the request itself (400 naming the header or the field). A device enrolled
with ``billing.subjects=any`` may name her.
"""

from __future__ import annotations

import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from controlplane.billing import budget_admin
from controlplane.billing.invoicing import PriceSpec, add_price
from controlplane.billing.scopes import SUBJECTS_LABEL, USER_LABEL
from controlplane.fleet.devices import create_enrollment_token
from controlplane.storage.database import create_db
from controlplane.storage.tables import BudgetWindow
from controlplane.tenancy.service import create_tenant
from shared.errors import ValidationError
from shared.escalation import EdgePolicy, save_policy
from tests.conftest import base_env, free_port, run_server, seed_data_dir
from tests.forkserver import run_tierline
from tests.integration.edge_support import ZOO_PAIRS_ENV

pytestmark = pytest.mark.integration
CLOUD_LM, EDGE_LM = "tierline/lm-cloud", "tierline/lm-edge"
EDGE_CALL, CLOUD_CALL = Decimal("0.10"), Decimal("1.00")
PROMPT = {"model": CLOUD_LM, "prompt": "def main():\n", "max_tokens": 2, "temperature": 0}


def _setup(engine: Engine) -> dict[str, str]:
    """A tenant with a budget per end user, prices, and enrollment tokens: dave's device, dave's device that may
    name others, and a device with no end user."""
    with Session(engine) as s:
        tenant = create_tenant(s, "kioskco")
        budget_admin.set_budget(
            s, tenant, scope="user", ref="*", period="day", amount=Decimal("50"), is_hard=True, actor="t"
        )
        zero = Decimal(0)
        add_price(s, PriceSpec(EDGE_LM, zero, zero, tier="edge", per_call=EDGE_CALL), actor="t")
        add_price(s, PriceSpec(CLOUD_LM, zero, zero, tier="cloud", per_call=CLOUD_CALL), actor="t")
        with pytest.raises(ValidationError, match=SUBJECTS_LABEL):  # "any" is its only value
            create_enrollment_token(s, tenant, labels={SUBJECTS_LABEL: "erin"})
        tokens = {
            "dave": create_enrollment_token(s, tenant, labels={USER_LABEL: "dave"}).secret,
            "any": create_enrollment_token(s, tenant, labels={USER_LABEL: "dave", SUBJECTS_LABEL: "any"}).secret,
            "plain": create_enrollment_token(s, tenant).secret,
            "agent": create_enrollment_token(s, tenant, labels={USER_LABEL: "dave"}).secret,
        }
        s.commit()
    return tokens


def _spent(engine: Engine) -> dict[str, Decimal]:
    with Session(engine) as s:
        windows = s.exec(select(BudgetWindow).where(col(BudgetWindow.subject) != "")).all()
        return {w.subject: w.spent for w in windows if w.spent}


def _wait_for(engine: Engine, expected: dict[str, Decimal]) -> dict[str, Decimal]:
    deadline = time.monotonic() + 30
    while (spent := _spent(engine)) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return spent


def _escalate(url: str, device: str, user: str | None) -> httpx.Response:
    body: dict[str, Any] = {**PROMPT, **({"user": user} if user is not None else {})}
    return httpx.post(
        f"{url}/v1/edge/escalate",
        json={"endpoint": "completions", "reason": "client-asked", "body": body},
        headers={"Authorization": f"Bearer {device}"},
        timeout=60,
    )


def _sync(url: str, device: str, records: list[tuple[str, str | None]]) -> httpx.Response:
    usage = [
        {"id": rid, "model": EDGE_LM, "prompt_tokens": 3, "completion_tokens": 2, "occurred_at": time.time()}
        | ({"subject": subject} if subject is not None else {})
        for rid, subject in records
    ]
    return httpx.post(
        f"{url}/v1/edge/sync", json={"usage": usage}, headers={"Authorization": f"Bearer {device}"}, timeout=60
    )


def test_a_device_names_another_end_user_only_if_its_enrollment_allows(
    migrated_db: str, tmp_path: Path, tiny_zoo: Path, session_data_dir: Path
) -> None:
    engine = create_db(migrated_db)
    tokens = _setup(engine)
    data = seed_data_dir(tmp_path / "data", tiny_zoo, session_data_dir)
    cloud_env = base_env(
        data,
        TIERLINE_DATABASE_URL=migrated_db,
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
        TIERLINE_CLOUD_SPECULATION="off",
    )
    try:
        with run_server(["cloud", "serve"], cloud_env, free_port(), timeout=180) as url:
            devices = {}
            for name in ("dave", "any", "plain"):
                r = httpx.post(f"{url}/v1/edge/enroll", json={"token": tokens[name], "name": name}, timeout=30)
                assert r.status_code == 200, r.text
                devices[name] = r.json()["device_token"]
            claimed = httpx.post(
                f"{url}/v1/edge/enroll",
                json={"token": tokens["agent"], "labels": {SUBJECTS_LABEL: "any"}},  # not the device's to claim
                timeout=30,
            )
            assert claimed.status_code == 400 and claimed.json()["error"]["param"] == "labels", claimed.text

            # Escalations: refused when they name someone the device may not name; nothing is billed for them.
            for device in ("dave", "plain"):
                refused = _escalate(url, devices[device], "erin")
                assert refused.status_code == 403, refused.text
                error = refused.json()["error"]
                assert error["param"] == "body.user" and error["code"] == "end_user_not_allowed", error
                assert f"{SUBJECTS_LABEL}=any" in error["message"]
            for device, user in (("dave", None), ("dave", "dave"), ("any", "erin")):
                r = _escalate(url, devices[device], user)
                assert r.status_code == 200, r.text
            assert _wait_for(engine, {"dave": 2 * CLOUD_CALL, "erin": CLOUD_CALL}) == {
                "dave": 2 * CLOUD_CALL,
                "erin": CLOUD_CALL,
            }

            # Synced records: one naming someone the device may not name is booked to its own end user (stored,
            # counted, never refused: the agent's outbox must drain).
            synced: list[tuple[str, list[tuple[str, str | None]]]] = [
                ("dave", [("dave-rec-erin", "erin"), ("dave-rec-none", None)]),
                ("any", [("any-rec-erin", "erin")]),
                ("plain", [("plain-rec-erin", "erin")]),
            ]
            for device, records in synced:
                r = _sync(url, devices[device], records)
                assert r.status_code == 200, r.text
                assert r.json()["accepted"] == len(records), r.text
            expected = {"dave": 2 * CLOUD_CALL + 2 * EDGE_CALL, "erin": CLOUD_CALL + EDGE_CALL}
            assert _wait_for(engine, expected) == expected
    finally:
        engine.dispose()


def test_an_agent_refuses_a_request_naming_an_end_user_its_device_may_not_name(
    migrated_db: str, tmp_path: Path, tiny_zoo: Path, session_data_dir: Path
) -> None:
    engine = create_db(migrated_db)
    tokens = _setup(engine)
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
        **ZOO_PAIRS_ENV,
    )
    body = {"model": "tierline/lm-edge-onnx-int8", "prompt": "def main():\n", "max_tokens": 2, "temperature": 0}
    try:
        with run_server(["cloud", "serve"], cloud_env, free_port(), timeout=180) as cloud_url:
            enroll = ("edge", "enroll", "--cloud", cloud_url, "--token", tokens["agent"], "--name", "a")
            proc = run_tierline(*enroll, env=agent_env)
            assert proc.returncode == 0, proc.stderr
            save_policy(state / "policies", EdgePolicy(EDGE_LM, threshold=-1e9))  # always answers locally
            with run_server(["edge", "run"], agent_env, free_port()) as edge_url:
                deadline = time.monotonic() + 30
                while True:  # the agent learns the rule at its first sync (every 0.3 s)
                    r = httpx.post(
                        f"{edge_url}/v1/completions", json=body, headers={"x-tierline-subject": "erin"}, timeout=60
                    )
                    if r.status_code != 200 or time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert error["param"] == "x-tierline-subject" and error["code"] == "end_user_not_allowed", error
                assert "'dave'" in error["message"] and f"{SUBJECTS_LABEL}=any" in error["message"]
                by_field = httpx.post(f"{edge_url}/v1/completions", json={**body, "user": "erin"}, timeout=60)
                assert by_field.status_code == 400 and by_field.json()["error"]["param"] == "user", by_field.text
                own = httpx.post(f"{edge_url}/v1/completions", json=body, headers={"x-tierline-subject": "dave"})
                assert own.status_code == 200, own.text
    finally:
        engine.dispose()
