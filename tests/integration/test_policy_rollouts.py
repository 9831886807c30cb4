"""Escalation-policy rollouts (SQLite and PostgreSQL): a policy version rolled out to a sticky share of the fleet
like a model version, each device sent its arm's version at sync, and each step judged on the arms' escalation
rate (device telemetry), cost per request (the ledger: the devices' edge records and their escalations), errors
and p95; a failed check rolls back and every device returns to the baseline version."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from controlplane.fleet.devices import ingest
from controlplane.policies import service as policies
from controlplane.rollouts.assignment import arm
from controlplane.rollouts.metrics import POLICIES_KEY
from controlplane.rollouts.service import (
    RolloutSpec,
    create_rollout,
    get_rollout,
    policy_window,
    promote,
    run_controller_pass,
)
from controlplane.storage.database import create_db
from controlplane.storage.tables import Device, DeviceEvent, RolloutEvent, ShadowSample, UsageRecord
from controlplane.tenancy.service import create_tenant
from shared.artifacts import load_or_create_signing_key
from shared.edge_protocol import EventItem
from shared.errors import ConflictError, ValidationError
from shared.escalation import EdgePolicy

pytestmark = pytest.mark.integration
MODEL = "tierline/lm-edge-onnx-int8"
NUM_BETA, NUM_PROD = 30, 4


@pytest.fixture
def engine(migrated_db: str) -> Iterator[Engine]:
    eng = create_db(migrated_db)
    yield eng
    eng.dispose()


def new_version(session: Session, threshold: float, key_path: Path) -> int:
    """A signed policy version of MODEL at ``threshold`` (as calibrate or a moved operating point would store)."""
    row = policies._store(
        session,
        EdgePolicy(model=MODEL, threshold=threshold),
        max_quality_loss=0.01,
        data_sha256="0" * 64,
        data_items=0,
        target=[],
        derived_from=None,
        actor="test",
        key=load_or_create_signing_key(key_path),
        action="escalation_policy.calibrate",
    )
    return row.version


def fleet(session: Session) -> tuple[int, list[Device]]:
    tenant = create_tenant(session, "acme")
    tid = tenant.id or 0
    devices = [
        Device(id=f"dev-{ring}-{i}", tenant_id=tid, labels={"ring": ring}, token_hash=f"h-{ring}-{i}")
        for ring, n in (("beta", NUM_BETA), ("prod", NUM_PROD))
        for i in range(n)
    ]
    session.add_all(devices)
    session.flush()
    return tid, devices


def desired(session: Session) -> dict[str, int]:
    out = {}
    for d in session.exec(select(Device)).all():
        rows = policies.desired_rows(session, d)
        out[d.id] = rows[0].version if rows else 0
    return out


def report(session: Session, tid: int, at: datetime, *, escalate: dict[int, float], cost: dict[int, str]) -> None:
    """Every device reports the policy version it was sent and a telemetry sample (cumulative counters: 100 more
    requests each time, ``escalate[version]`` of them escalated) with an edge and a cloud usage record."""
    want = desired(session)
    for d in session.exec(select(Device)).all():
        version = want[d.id]
        d.policies = {MODEL: str(version)}
        session.add(d)
        before = session.exec(
            select(DeviceEvent).where(DeviceEvent.device_id == d.id).order_by(DeviceEvent.occurred_at.desc())  # type: ignore[attr-defined]
        ).first()
        counters = dict(((before.payload if before else {}).get("metrics") or {}).get(f"{MODEL}@demo-1") or {})
        requests = int(counters.get("requests", 0)) + 100
        escalations = int(counters.get("escalations", 0)) + round(100 * escalate[version])
        metrics = {f"{MODEL}@demo-1": {"requests": requests, "errors": 0, "escalations": escalations, "p95_ms": 50.0}}
        session.add(
            DeviceEvent(
                id=uuid.uuid4().hex,
                device_id=d.id,
                tenant_id=tid,
                kind="telemetry",
                payload={"metrics": metrics},
                occurred_at=at,
            )
        )
        for tier, reason in (("edge", None), ("cloud", "low-confidence")):
            session.add(
                UsageRecord(
                    id=uuid.uuid4().hex,
                    tenant_id=tid,
                    device_id=d.id,
                    model=MODEL if tier == "edge" else "tierline/lm-cloud",
                    tier=tier,
                    escalation_reason=reason,
                    cost=Decimal(cost[version]) if tier == "cloud" else Decimal("0.000001"),
                    price_id=1,
                    occurred_at=at,
                )
            )
    session.commit()


def test_a_policy_version_goes_to_its_arm_and_a_costlier_one_rolls_back(engine: Engine, tmp_path: Path) -> None:
    key = tmp_path / "signing.key"
    with Session(engine) as s:
        tid, _ = fleet(s)
        v1 = new_version(s, -3.0, key)
        v2 = new_version(s, -1.0, key)  # a stricter operating point: escalates more
        spec = RolloutSpec(
            model="lm-edge-onnx-int8",
            baseline_version=str(v1),
            candidate_version=str(v2),
            kind="policy",
            device_selector={"ring": "beta"},
            steps=[50, 100],
            min_step_s=0,
            min_samples=200,
        )
        rollout = create_rollout(s, spec, actor="test")
        s.commit()
        rid = rollout.id or 0
        assert (rollout.model, rollout.scope, rollout.kind) == (MODEL, "edge", "policy")
        assert rollout.checks["cost_per_request"] == {"factor": 1.1, "slack": 0.0}
        # Pending: the fleet is frozen on the baseline, although v2 is the newest version.
        assert set(desired(s).values()) == {v1}
        # One policy rollout of a model at a time.
        with pytest.raises(ConflictError):
            create_rollout(s, spec, actor="test")

    assert [r.action for r in run_controller_pass(engine)] == ["start"]
    start = datetime.now(UTC)
    with Session(engine) as s:
        want = desired(s)
        for device_id, version in want.items():
            canary = device_id.startswith("dev-beta") and arm(rid, device_id, 50) == "candidate"
            assert version == (v2 if canary else v1), device_id
        assert 5 < sum(1 for v in want.values() if v == v2) < NUM_BETA  # a sticky share of beta, never prod
        # Devices report what they were sent; the candidate escalates 40 % (and costs more), the baseline 10 %.
        escalate, cost = {v1: 0.1, v2: 0.4}, {v1: "0.0001", v2: "0.0004"}
        report(s, tid, start + timedelta(seconds=1), escalate=escalate, cost=cost)
        report(s, tid, start + timedelta(seconds=2), escalate=escalate, cost=cost)
        report(s, tid, start + timedelta(seconds=3), escalate=escalate, cost=cost)
        window = policy_window(s, get_rollout(s, rid), start, datetime.now(UTC) + timedelta(seconds=5))
    assert window.source == "policy"
    assert window.candidate.value("escalation_rate") == pytest.approx(0.4)
    assert window.baseline.value("escalation_rate") == pytest.approx(0.1)
    # Ledger cost per record: the cloud record's cost and a micro-cent edge record, averaged.
    assert window.candidate.value("cost_per_request") == Decimal("0.0002005")
    assert window.baseline.value("cost_per_request") == Decimal("0.0000505")

    (result,) = run_controller_pass(engine, now=datetime.now(UTC) + timedelta(seconds=5))
    assert result.action == "rollback", result.reason
    assert "policy escalation_rate 0.4 exceeds limit" in result.reason
    assert "policy cost_per_request 0.0002005 exceeds limit" in result.reason
    with Session(engine) as s:
        assert set(desired(s).values()) == {v1}  # everyone back on the baseline version
        event = s.exec(select(RolloutEvent).where(RolloutEvent.kind == "rolled_back")).one()
        assert event.metrics is not None and "candidate_usage" not in event.metrics
        assert event.metrics["windows"]["policy"]["candidate"]["devices"] > 0


def test_a_healthy_policy_version_is_promoted_and_a_newer_one_takes_over_after(engine: Engine, tmp_path: Path) -> None:
    key = tmp_path / "signing.key"
    with Session(engine) as s:
        tid, _ = fleet(s)
        v1, v2 = new_version(s, -3.0, key), new_version(s, -4.0, key)
        spec = RolloutSpec(
            model=MODEL,
            baseline_version=str(v1),
            candidate_version=str(v2),
            kind="policy",
            steps=[50, 100],
            min_step_s=0,
            min_samples=100,
        )
        rid = create_rollout(s, spec, actor="test").id or 0
        s.commit()
    run_controller_pass(engine)
    start = datetime.now(UTC)
    with Session(engine) as s:
        escalate, cost = {v1: 0.2, v2: 0.1}, {v1: "0.0002", v2: "0.0002"}  # escalates less: cheaper per request
        for i in (1, 2):
            report(s, tid, start + timedelta(seconds=i), escalate=escalate, cost=cost)
    (result,) = run_controller_pass(engine, now=datetime.now(UTC) + timedelta(seconds=5))
    assert result.action == "promote", result.reason
    with Session(engine) as s:
        assert set(desired(s).values()) == {v2}  # prod included: the rollout had no selector
        v3 = new_version(s, -5.0, key)
        row = policies.get_version(s, MODEL, v3)
        row.created_at = datetime.now(UTC) + timedelta(seconds=10)  # after the (simulated) promotion time
        s.add(row)
        s.commit()
        assert set(desired(s).values()) == {v3}  # made after the rollout ended: the newest again
        assert get_rollout(s, rid).status == "promoted"


def shadow(session: Session, tid: int, at: datetime, per_device: int, disagree: dict[int, int]) -> None:
    """The live quality monitor's samples: ``per_device`` per device under the version it runs, the first
    ``disagree[version]`` of them answered differently by the cloud."""
    for device_id, version in desired(session).items():
        session.add_all(
            ShadowSample(
                usage_id=f"shadow-{device_id}",
                tenant_id=tid,
                device_id=device_id,
                model=MODEL,
                policy_version=version,
                device_group="",
                confidence=0.5,
                agrees=i >= disagree[version],
                created_at=at,
            )
            for i in range(per_device)
        )
    session.commit()


def test_a_cheaper_policy_version_that_disagrees_with_the_cloud_rolls_back(engine: Engine, tmp_path: Path) -> None:
    """Escalating less always looks cheaper: what it keeps on the edge is judged by the shadow samples."""
    key = tmp_path / "signing.key"
    with Session(engine) as s:
        tid, _ = fleet(s)
        v1, v2 = new_version(s, -3.0, key), new_version(s, -6.0, key)  # v2 keeps far more on the edge
        spec = RolloutSpec(
            model=MODEL,
            baseline_version=str(v1),
            candidate_version=str(v2),
            kind="policy",
            steps=[50, 100],
            min_step_s=0,
            min_samples=100,
        )
        create_rollout(s, spec, actor="test")
        s.commit()
    run_controller_pass(engine)
    start = datetime.now(UTC)
    with Session(engine) as s:
        escalate, cost = {v1: 0.2, v2: 0.05}, {v1: "0.0002", v2: "0.0002"}  # fewer escalations: cheaper
        for i in (1, 2):
            report(s, tid, start + timedelta(seconds=i), escalate=escalate, cost=cost)
        # Too few shadow samples for a verdict on agreement: the step waits rather than promoting blind.
        shadow(s, tid, start + timedelta(seconds=2), 1, {v1: 0, v2: 1})
    (result,) = run_controller_pass(engine, now=datetime.now(UTC) + timedelta(seconds=5))
    assert result.action == "wait", result.reason
    assert "disagreement_rate: fewer than 30 shadow samples" in result.reason
    with Session(engine) as s:
        # 1 in 20 of the baseline's edge answers differ from the cloud's, 1 in 4 of the candidate's.
        shadow(s, tid, start + timedelta(seconds=3), 20, {v1: 1, v2: 5})
        assert set(desired(s).values()) == {v1, v2}
    (result,) = run_controller_pass(engine, now=datetime.now(UTC) + timedelta(seconds=5))
    assert result.action == "rollback", result.reason
    assert "policy disagreement_rate" in result.reason and "exceeds limit" in result.reason
    assert "escalation_rate" not in result.reason and "cost_per_request" not in result.reason  # those passed
    with Session(engine) as s:
        assert set(desired(s).values()) == {v1}
        event = s.exec(select(RolloutEvent).where(RolloutEvent.kind == "rolled_back")).one()
        assert event.metrics is not None
        candidate = event.metrics["windows"]["policy"]["candidate"]
        assert candidate["shadow_samples"] >= 30 and candidate["disagreement_rate"] > 0.2


def test_an_unconverged_or_overriding_device_is_not_counted(engine: Engine, tmp_path: Path) -> None:
    key = tmp_path / "signing.key"
    with Session(engine) as s:
        tid, devices = fleet(s)
        v1, v2 = new_version(s, -3.0, key), new_version(s, -4.0, key)
        spec = RolloutSpec(
            model=MODEL, baseline_version=str(v1), candidate_version=str(v2), kind="policy", steps=[100], min_samples=1
        )
        rid = create_rollout(s, spec, actor="test").id or 0
        s.commit()
    run_controller_pass(engine)
    start = datetime.now(UTC)
    with Session(engine) as s:
        report(s, tid, start + timedelta(seconds=1), escalate={v1: 0.1, v2: 0.1}, cost={v1: "0", v2: "0"})
        report(s, tid, start + timedelta(seconds=2), escalate={v1: 0.1, v2: 0.1}, cost={v1: "0", v2: "0"})
        for i, d in enumerate(s.exec(select(Device)).all()):
            d.policies = {MODEL: "override" if i % 2 else str(v1)}  # its own file, or not switched yet
            s.add(d)
        s.commit()
        window = policy_window(s, get_rollout(s, rid), start, datetime.now(UTC) + timedelta(seconds=5))
    assert window.candidate.requests == 0 and window.baseline.requests == 0
    with Session(engine) as s:
        promote(s, rid, actor="test")
        s.commit()
        assert set(desired(s).values()) == {v2}
    assert len(devices) == NUM_BETA + NUM_PROD


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"candidate_version": "9"}, "candidate_version"),
        ({"baseline_version": "one"}, "baseline_version"),
        ({"model": "no-such-model"}, "model"),
        ({"scope": "both"}, "scope"),
        ({"kind": "weights"}, "kind"),
    ],
)
def test_a_bad_policy_rollout_is_refused_naming_the_field(
    engine: Engine, tmp_path: Path, change: dict[str, str], param: str
) -> None:
    with Session(engine) as s:
        v1, v2 = new_version(s, -3.0, tmp_path / "k"), new_version(s, -4.0, tmp_path / "k")
        fields = {"model": MODEL, "baseline_version": str(v1), "candidate_version": str(v2), "kind": "policy", **change}
        with pytest.raises(ValidationError) as err:
            create_rollout(s, RolloutSpec(**fields), actor="test")  # type: ignore[arg-type]
        assert err.value.param == param


def sample(device: str, tid: int, at: datetime, requests: int, escalations: int, used: str | None) -> DeviceEvent:
    """A telemetry sample as the cloud stores it: cumulative counters, and the policy its sync reported in use."""
    payload: dict[str, object] = {
        "metrics": {f"{MODEL}@demo-1": {"requests": requests, "errors": 0, "escalations": escalations, "p95_ms": 9.0}}
    }
    if used is not None:
        payload[POLICIES_KEY] = {MODEL: used}
    return DeviceEvent(
        id=uuid.uuid4().hex, device_id=device, tenant_id=tid, kind="telemetry", payload=payload, occurred_at=at
    )


def test_each_increase_counts_for_the_version_its_sync_reported(engine: Engine, tmp_path: Path) -> None:
    """A device that switched inside the window: what it served before the switch counts for the baseline, after
    it for the candidate; what it served on its own policy file (override) counts for neither arm."""
    key = tmp_path / "signing.key"
    start = datetime.now(UTC) - timedelta(minutes=10)
    minute = timedelta(minutes=1)
    with Session(engine) as s:
        tid = create_tenant(s, "acme").id or 0
        s.add(Device(id="dev-switch", tenant_id=tid, labels={}, token_hash="h1", policies={MODEL: "2"}))
        s.add(Device(id="dev-own", tenant_id=tid, labels={}, token_hash="h2", policies={MODEL: "override"}))
        v1, v2 = new_version(s, -3.0, key), new_version(s, -4.0, key)
        spec = RolloutSpec(model=MODEL, baseline_version=str(v1), candidate_version=str(v2), kind="policy", steps=[100])
        rollout = create_rollout(s, spec, actor="test")
        s.flush()
        s.add_all(
            [
                sample("dev-switch", tid, start - minute, 1000, 100, "1"),  # the reference, before the window
                sample("dev-switch", tid, start + minute, 1100, 110, "1"),  # +100, 10 escalated: baseline
                sample("dev-switch", tid, start + 2 * minute, 1300, 170, "2"),  # +200, 60 escalated: candidate
                sample("dev-switch", tid, start + 3 * minute, 1400, 200, "2"),  # +100, 30 escalated: candidate
                sample("dev-own", tid, start - minute, 10, 0, "override"),
                sample("dev-own", tid, start + minute, 500, 400, "override"),  # neither arm
            ]
        )
        s.commit()
        window = policy_window(s, rollout, start, datetime.now(UTC))
    assert (window.baseline.requests, window.baseline.escalations) == (100, 10)
    assert (window.candidate.requests, window.candidate.escalations) == (300, 90)
    assert window.candidate.num_devices == window.baseline.num_devices == 1


def test_a_sync_stores_the_policies_in_use_with_its_telemetry(engine: Engine) -> None:
    with Session(engine) as s:
        tid = create_tenant(s, "acme").id or 0
        device = Device(id="dev-a", tenant_id=tid, labels={}, token_hash="h")
        s.add(device)
        s.flush()
        events = [
            EventItem(id=uuid.uuid4().hex, kind="telemetry", payload={"metrics": {}}, occurred_at=time.time()),
            EventItem(id=uuid.uuid4().hex, kind="event", payload={"type": "x"}, occurred_at=time.time()),
        ]
        ingest(s, device, [], events, policies={MODEL: "3"})
        s.commit()
        stored = {e.kind: e.payload for e in s.exec(select(DeviceEvent)).all()}
    assert stored["telemetry"] == {"metrics": {}, POLICIES_KEY: {MODEL: "3"}}
    assert stored["event"] == {"type": "x"}
