"""The live quality monitor with real processes on localhost: a cloud (shadow share 1), a console and an edge agent
in device group ``lab`` on one database and data directory (the tiny zoo), the pair with a real gap
(``digits-micro`` on the device, ``digits-large`` in the cloud).

A policy calibrated on the micro model's validation set raises no alert over 200+ shadow samples; the same policy
deliberately mis-set (a threshold that keeps every digit on the device) raises one within 200, shown on the model
page and the overview with a recalibrated threshold that an admin accepts as the next version. Shadow work is
billed once per batch, as tier ``shadow``, and never changes what the client got."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from sqlalchemy import create_engine
from sqlmodel import Session, col, func, select

from console.passwords import create_user
from controlplane.policies import service
from controlplane.registry import service as registry
from controlplane.registry.artifacts import platform_signing_key
from controlplane.storage.session import session_scope
from controlplane.storage.tables import AuditLog, EscalationPolicy, QualityAlert, ShadowSample, UsageRecord
from edge_agent.cloud_link import Credentials
from shared.escalation import EdgePolicy
from tests.conftest import base_env, free_port, migrated_sqlite, run_server, seed_data_dir
from tests.forkserver import run_tierline
from tests.integration.console_support import PASSWORD, login, post_form
from tests.integration.edge_support import ZOO_PAIRS_ENV

pytestmark = pytest.mark.integration
MICRO = "tierline/digits-micro"
SYNC_S = 0.5
ROWS_PER_REQUEST = 20


@dataclass
class Platform:
    data: Path
    env: dict[str, str]
    agent_env: dict[str, str]
    cloud_url: str
    console_url: str
    edge_url: str
    db: str

    def cli(self, *args: str) -> str:
        proc = run_tierline(*args, env=self.env)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    def agent(self) -> dict[str, Any]:
        status: dict[str, Any] = httpx.get(f"{self.edge_url}/v1/agent", timeout=10).json()
        return status

    def query(self, read: Callable[[Session], Any]) -> Any:
        engine = create_engine(self.db)
        try:
            with Session(engine) as s:
                return read(s)
        finally:
            engine.dispose()


def wait_for(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, f"{what}: not within {timeout:.0f}s"
        time.sleep(0.05)


def micro_validation(zoo: Path, dest: Path) -> Path:
    """The validation half of the micro/large pair on the held-out digits (what bench cascade exports)."""
    from bench.cascade_bench import evaluate, export_validation
    from bench.cascade_tasks import run_digits
    from shared.zoo.registry import ZooLayout

    task = run_digits(ZooLayout(zoo), "digits-micro")
    export_validation(dest, [(task, evaluate(task, 0).validation_rows)])
    return dest


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[Platform]:
    data = seed_data_dir(tmp_path_factory.mktemp("monitor"), tiny_zoo, session_data_dir)
    db = migrated_sqlite(data)
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=db,
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_EDGE_SYNC_INTERVAL_S=str(SYNC_S),
        TIERLINE_CLOUD_EDGE_SHADOW_SHARE="1.0",
        TIERLINE_CLOUD_EDGE_SHADOW_ROWS_PER_MINUTE="100000",
    )
    agent_env = base_env(
        data,
        TIERLINE_EDGE_ZOO_DIR=str(data / "zoo" / "tiny"),
        TIERLINE_EDGE_STATE_DIR=str(data / "agent-state"),
        TIERLINE_EDGE_CLOUD_DEADLINE_S="20",
        **ZOO_PAIRS_ENV,
    )
    p = Platform(data, env, agent_env, "", "", "", db)
    p.cli("tenants", "create", "acme")
    token = p.cli("devices", "enrollment-token", "--tenant", "acme", "--label", "group=lab")
    validation = micro_validation(tiny_zoo, data / "micro-validation.jsonl")
    out = p.cli("policies", "calibrate", "--model", MICRO, "--data", str(validation), "--max-quality-loss", "0.01")
    assert f"{MICRO} v1:" in out
    with ExitStack() as stack:
        p.cloud_url = stack.enter_context(run_server(["cloud", "serve"], env, free_port(), timeout=120))
        run_tierline(
            "edge", "enroll", "--cloud", p.cloud_url, "--token", token, "--name", "lab-1", env=agent_env, check=True
        )
        p.edge_url = stack.enter_context(run_server(["edge", "run"], agent_env, free_port()))
        console_env = {**env, "TIERLINE_SECRET_KEY": "test-" + uuid.uuid4().hex}
        p.console_url = stack.enter_context(run_server(["console", "serve"], console_env, free_port()))
        engine = create_engine(db)
        with session_scope(engine) as session:
            create_user(session, "ops", PASSWORD, "admin")
            registry.ensure_model(session, "digits-micro", "tensor", actor="test")
        engine.dispose()
        yield p


def classify(p: Platform, rows: list[list[float]]) -> dict[str, Any]:
    resp = httpx.post(f"{p.edge_url}/v1/inference", json={"model_id": MICRO, "inputs": rows}, timeout=60)
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def send(p: Platform, rows: list[list[float]]) -> list[dict[str, Any]]:
    """The rows in requests of ``ROWS_PER_REQUEST``; returns the answers once the sampler has sent every batch."""
    answers = [classify(p, rows[i : i + ROWS_PER_REQUEST]) for i in range(0, len(rows), ROWS_PER_REQUEST)]

    def settled() -> bool:
        s = p.agent()["shadow"]
        return bool(s["queued"] == 0 and s["sent"] + s["dropped"] + s["refused"] == s["offered"])

    wait_for("the sampler sent its batches", settled)
    return answers


def samples_of(p: Platform, version: int) -> tuple[int, int]:
    def read(s: Session) -> tuple[int, int]:
        rows = s.exec(
            select(ShadowSample.agrees).where(ShadowSample.model == MICRO, ShadowSample.policy_version == version)
        ).all()
        return len(rows), sum(bool(r) for r in rows)

    result: tuple[int, int] = p.query(read)
    return result


def alerts_of(p: Platform, version: int) -> list[QualityAlert]:
    result: list[QualityAlert] = p.query(
        lambda s: list(s.exec(select(QualityAlert).where(QualityAlert.policy_version == version)))
    )
    return result


def test_a_mis_set_policy_raises_an_alert_within_200_samples_and_a_correct_one_none(
    platform: Platform, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shared.zoo.digits import load_split

    p = platform
    split = load_split()
    rows = split.x_held_out.tolist()
    wait_for("v1 reaches the agent", lambda: p.agent()["policies"] == {MICRO: "1"})
    assert p.agent()["shadow"]["share"] == 1.0

    # The calibrated policy: every held-out digit, its confident ones answered on the device and shadowed.
    answers = send(p, rows)
    n1, k1 = samples_of(p, 1)
    edge_rows = sum(a["tiers"].count("edge") for a in answers)
    assert n1 == edge_rows >= 200  # every edge-answered row was shadowed once, none of the escalated ones
    assert alerts_of(p, 1) == []
    assert p.agent()["shadow"]["dropped"] == 0 and p.agent()["shadow"]["refused"] == 0

    # Deliberately mis-set: the same calibration, a threshold that keeps every digit on the micro model.
    monkeypatch.setenv("TIERLINE_DATA_DIR", str(p.data))
    engine = create_engine(p.db)
    with session_scope(engine) as session:
        v1 = service.get_version(session, MICRO, 1)
        loose = dataclasses.replace(EdgePolicy.from_json(v1.policy), threshold=0.0)
        service._store(
            session,
            loose,
            max_quality_loss=v1.max_quality_loss,
            data_sha256=v1.data_sha256,
            data_items=v1.data_items,
            target=[],
            derived_from=1,
            actor="test:mis-set",
            key=platform_signing_key(),
            action="escalation_policy.test",
        )
    engine.dispose()
    wait_for("v2 reaches the agent", lambda: p.agent()["policies"] == {MICRO: "2"})
    sent = rows[:200]
    before = [classify(p, sent[i : i + ROWS_PER_REQUEST]) for i in range(0, 200, ROWS_PER_REQUEST)]
    send(p, [])  # let the sampler settle
    n2, k2 = samples_of(p, 2)
    assert n2 == 200 and all(set(a["tiers"]) == {"edge"} for a in before)
    (alert,) = alerts_of(p, 2)
    assert alert.model == MICRO and alert.device_group == "lab" and alert.status == "open"
    assert alert.num_samples <= 200
    assert alert.upper_bound < alert.promised
    assert alert.proposed_threshold is not None and alert.proposed_threshold > 0.0
    print({"v1": {"samples": n1, "agreement": k1 / n1}, "v2": {"samples": n2, "agreement": k2 / n2,
           "alert_at": alert.num_samples, "promised": alert.promised, "upper": alert.upper_bound,
           "proposed_threshold": alert.proposed_threshold}})  # fmt: skip

    # The client's answers under shadowing are the device's own: the same outputs with and without a sampler.
    again = classify(p, sent[:ROWS_PER_REQUEST])
    assert np.allclose(np.array(again["outputs"]), np.array(before[0]["outputs"]))
    send(p, [])
    n2 = samples_of(p, 2)[0]

    # Shadow work is billed once per batch, as tier shadow, with the cloud model and the sampled rows.
    def billed(s: Session) -> tuple[int, int, set[str]]:
        records = s.exec(select(UsageRecord).where(UsageRecord.tier == "shadow")).all()
        ids = {u for u in s.exec(select(ShadowSample.usage_id)).all()}
        assert {r.model for r in records} == {"tierline/digits-large"}
        assert all(r.escalation_reason == "quality-monitor" for r in records)
        return len(records), sum(r.rows for r in records), ids

    num_records, num_rows, sample_ids = p.query(billed)
    assert num_rows == n1 + n2 and len(sample_ids) == num_records

    # A retried batch (the agent resends under the same id) is not billed or counted twice.
    creds = Credentials.load(Path(p.agent_env["TIERLINE_EDGE_STATE_DIR"]))
    assert creds is not None
    batch = {
        "id": uuid.uuid4().hex,
        "model": MICRO,
        "cloud_model": "tierline/digits-large",
        "policy_version": 2,
        "inputs": rows[:3],
        "edge_answers": [0, 0, 0],
        "confidences": [0.5, 0.5, 0.5],
        "occurred_at": time.time(),
    }
    auth = {"Authorization": f"Bearer {creds.device_token}"}
    first = httpx.post(f"{p.cloud_url}/v1/edge/shadow", json=batch, headers=auth, timeout=30)
    retry = httpx.post(f"{p.cloud_url}/v1/edge/shadow", json=batch, headers=auth, timeout=30)
    assert first.status_code == retry.status_code == 200, first.text
    assert first.json()["duplicate"] is False and retry.json()["duplicate"] is True
    assert p.query(billed)[0] == num_records + 1
    assert samples_of(p, 2)[0] == n2 + 3
    unknown = httpx.post(
        f"{p.cloud_url}/v1/edge/shadow", json={**batch, "id": uuid.uuid4().hex, "policy_version": 99}, headers=auth
    )
    assert unknown.status_code == 404 and "policy_version" in unknown.text
    bad = httpx.post(f"{p.cloud_url}/v1/edge/shadow", json={**batch, "id": "x" * 8, "confidences": []}, headers=auth)
    assert bad.status_code == 400 and "confidences" in bad.text

    # The console: the alert on the overview and the model page; the admin accepts the proposal as v3.
    with httpx.Client(base_url=p.console_url, follow_redirects=False, timeout=30) as admin:
        assert login(admin, "ops", PASSWORD).status_code == 303
        assert 'id="quality-alerts"' in admin.get("/").text
        page = admin.get("/models/digits-micro").text
        assert f'id="quality-alert-{alert.id}"' in page and "promised" in page
        accepted = post_form(
            admin, f"/models/digits-micro/quality-alerts/{alert.id}/accept", {}, page="/models/digits-micro"
        )
        assert accepted.status_code == 303, accepted.text
        assert f'id="quality-alert-{alert.id}"' not in admin.get("/models/digits-micro").text
        assert 'id="quality-alerts"' not in admin.get("/").text
    v3: EscalationPolicy = p.query(
        lambda s: s.exec(
            select(EscalationPolicy).where(EscalationPolicy.model == MICRO, EscalationPolicy.version == 3)
        ).one()
    )
    assert v3.threshold == alert.proposed_threshold and v3.derived_from == 2 and v3.created_by == "console:ops"
    assert alerts_of(p, 2)[0].status == "accepted" and alerts_of(p, 2)[0].accepted_version == 3
    actions = p.query(
        lambda s: set(s.exec(select(AuditLog.action).where(col(AuditLog.action).like("quality_alert.%"))).all())
    )
    assert actions == {"quality_alert.raise", "quality_alert.accept"}
    # The CLI lists it resolved; a second accept is refused by name.
    assert p.cli("policies", "alerts") == "no quality alerts"
    assert f"alert {alert.id} (accepted): {MICRO} v2 group lab" in p.cli("policies", "alerts", "--all")
    again_accepted = run_tierline("policies", "accept-alert", str(alert.id), env=p.env)
    assert again_accepted.returncode != 0 and "already accepted" in again_accepted.stderr
    wait_for("v3 reaches the agent", lambda: p.agent()["policies"] == {MICRO: "3"})
    # The recalibrated threshold sends the doubtful digits up again.
    tiers = [t for a in send(p, rows[:200]) for t in a["tiers"]]
    assert 0 < tiers.count("cloud") < 200
    assert p.query(lambda s: s.exec(select(func.count()).select_from(QualityAlert)).one()) == 1

    # A tenant's own share wins over the cloud's: 0 turns the monitor off for its devices at their next sync.
    assert "shadow share 0.0" in p.cli("tenants", "shadow-share", "acme", "0")
    wait_for("the agent hears share 0", lambda: p.agent()["shadow"]["share"] == 0.0)
    counted = p.query(lambda s: s.exec(select(func.count()).select_from(ShadowSample)).one())
    send(p, rows[:40])
    assert p.query(lambda s: s.exec(select(func.count()).select_from(ShadowSample)).one()) == counted
    p.cli("tenants", "shadow-share", "acme", "--default")
    wait_for("back to the cloud's share", lambda: p.agent()["shadow"]["share"] == 1.0)
