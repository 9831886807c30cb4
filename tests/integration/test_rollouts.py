"""Canary rollouts end to end: a real cloud (edge sync) and a real console (management API and its rollout
controller loop) as processes on one SQLite database, and simulated devices that enroll, sync telemetry of
the version they run and install whatever version the sync answer desires.

Plus the controller pass on SQLite and PostgreSQL straight against the database: cloud usage records by arm,
``tierline rollouts tick``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from sqlmodel import Session, col, select

from cloud.edge.releases import publish_command
from console.management_api import create_token
from console.passwords import create_user
from controlplane.fleet.devices import create_enrollment_token
from controlplane.rollouts.assignment import arm, cloud_subject
from controlplane.rollouts.service import (
    RolloutSpec,
    abort,
    collect_windows,
    create_rollout,
    load_plans,
    resolve_cloud_arm,
    run_controller_pass,
)
from controlplane.storage.database import create_db
from controlplane.storage.tables import AuditLog, Device, DeviceEvent, Rollout, RolloutEvent, UsageRecord
from controlplane.tenancy.service import create_tenant
from tests.conftest import base_env, free_port, migrated_sqlite, run_server, seed_data_dir
from tests.forkserver import run_tierline

pytestmark = pytest.mark.integration

NAME = "lm-edge-onnx-int8"  # the edge artifact the rollouts move
MODEL_ID = f"tierline/{NAME}"  # what agents call it in their telemetry
NUM_BETA, NUM_PROD = 40, 4
REQUESTS_PER_SYNC = 50


@dataclass
class SimDevice:
    """An enrolled device as the cloud sees it: it reports cumulative per-version counters (like the agent's
    ``AgentStats``) in a telemetry sample at every sync and installs the version the answer desires."""

    id: str
    token: str
    ring: str
    version: str = "b1"
    counters: dict[str, dict[str, Any]] = field(default_factory=dict)

    def serve(self, *, errors: int = 0, escalations: int = 5, p95_ms: float = 100.0) -> None:
        c = self.counters.setdefault(f"{MODEL_ID}@{self.version}", {"requests": 0, "errors": 0, "escalations": 0})
        c["requests"] += REQUESTS_PER_SYNC
        c["errors"] += errors
        c["escalations"] += escalations
        c["p95_ms"] = p95_ms

    def sync(self, client: httpx.Client) -> str:
        body = {
            "models": {MODEL_ID: self.version},
            "metrics": self.counters,
            "usage": [
                {
                    "id": uuid.uuid4().hex,
                    "model": MODEL_ID,
                    "model_version": self.version,
                    "prompt_tokens": 3,
                    "completion_tokens": 2,
                    "occurred_at": time.time(),
                }
            ],
            "events": [
                {
                    "id": uuid.uuid4().hex,
                    "kind": "telemetry",
                    "payload": {"metrics": self.counters},
                    "occurred_at": time.time(),
                }
            ],
        }
        resp = client.post("/v1/edge/sync", json=body, headers={"Authorization": f"Bearer {self.token}"})
        assert resp.status_code == 200, resp.text
        desired = {d["name"]: d["version"] for d in resp.json()["desired"]}
        self.version = desired.get(NAME, self.version)
        return self.version


@dataclass
class Platform:
    cloud: httpx.Client
    console: httpx.Client
    db_url: str
    env: dict[str, str]
    token: str
    viewer_token: str
    devices: list[SimDevice]

    @property
    def beta(self) -> list[SimDevice]:
        return [d for d in self.devices if d.ring == "beta"]

    def api(self, method: str, path: str, *, token: str | None = "", **kw: Any) -> httpx.Response:
        headers = {} if token is None else {"Authorization": f"Bearer {token or self.token}"}
        return self.console.request(method, f"/api{path}", headers=headers, **kw)

    def rollout(self, rollout_id: int) -> dict[str, Any]:
        resp = self.api("GET", f"/rollouts/{rollout_id}")
        assert resp.status_code == 200, resp.text
        return dict(resp.json())

    def wait_for(self, rollout_id: int, ok: Callable[[dict[str, Any]], bool], timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            r = self.rollout(rollout_id)
            if ok(r):
                return r
            assert time.monotonic() < deadline, f"rollout {rollout_id} never got there: {r}"
            time.sleep(0.1)

    def sync_all(self, serve: Callable[[SimDevice], None] | None = None) -> dict[str, str]:
        if serve is not None:
            for d in self.devices:
                serve(d)
        return {d.id: d.sync(self.cloud) for d in self.devices}


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[Platform]:
    data = seed_data_dir(tmp_path_factory.mktemp("rollouts"), tiny_zoo, session_data_dir)
    db_url = migrated_sqlite(data)
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=db_url,
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CONSOLE_ROLLOUT_INTERVAL_S="0.2",
    )
    artifact = data / "zoo" / "tiny" / "artifacts" / NAME
    for version in ("b1", "c1", "c2", "c3"):
        out = CliRunner().invoke(publish_command, [str(artifact), "--as-version", version], env={**env})
        assert out.exit_code == 0, out.output
    engine = create_db(db_url)
    with Session(engine) as s:
        tenant = create_tenant(s, "acme")
        create_user(s, "ops", "correct horse battery", "admin")
        create_user(s, "auditor", "correct horse battery", "viewer")
        tokens = {
            ring: [create_enrollment_token(s, tenant, labels={"ring": ring}).secret for _ in range(n)]
            for ring, n in (("beta", NUM_BETA), ("prod", NUM_PROD))
        }
        s.commit()
    engine.dispose()

    def cli(*args: str) -> str:
        proc = run_tierline(*args, env=env)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        return proc.stdout.strip()

    token = cli("console", "create-token", "--username", "ops")
    engine = create_db(db_url)
    with Session(engine) as s:
        viewer_token = create_token(s, "auditor").secret
        s.commit()
    engine.dispose()
    with (
        run_server(["cloud", "serve"], env, free_port(), timeout=120) as cloud_url,
        run_server(["console", "serve"], env, free_port()) as console_url,
        httpx.Client(base_url=cloud_url, timeout=30) as cloud,
        httpx.Client(base_url=console_url, timeout=30) as console,
    ):
        devices = []
        for ring, secrets in tokens.items():
            for secret in secrets:
                enrolled = cloud.post("/v1/edge/enroll", json={"token": secret})
                assert enrolled.status_code == 200, enrolled.text
                body = enrolled.json()
                devices.append(SimDevice(body["device_id"], body["device_token"], ring))
        yield Platform(cloud, console, db_url, env, token, viewer_token, devices)


def audit_rows(platform: Platform, rollout_id: int) -> list[tuple[str, str]]:
    engine = create_db(platform.db_url)
    with Session(engine) as s:
        rows = s.exec(
            select(AuditLog.actor, AuditLog.action)
            .where(AuditLog.target == f"rollout/{rollout_id}")
            .order_by(col(AuditLog.id))
        )
        out = [(actor, action) for actor, action in rows]
    engine.dispose()
    return out


def create(platform: Platform, **body: Any) -> int:
    fields = {
        "model": NAME,
        "baseline_version": "b1",
        "scope": "edge",
        "device_selector": {"ring": "beta"},
        "steps": [25, 50, 100],
        "min_step_s": 1.0,
        "min_samples": 100,
        **body,
    }
    resp = platform.api("POST", "/rollouts", json=fields)
    assert resp.status_code == 201, resp.text
    assert resp.json()["status"] == "pending"
    return int(resp.json()["id"])


def test_the_management_api_needs_a_token_validates_and_audits(platform: Platform) -> None:
    assert platform.api("GET", "/rollouts", token=None).status_code == 401
    bad = platform.api("POST", "/rollouts", token="tlc-not-a-token", json={})
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
    cases: list[tuple[dict[str, Any], str]] = [
        ({"candidate_version": "b1"}, "candidate_version"),
        ({"candidate_version": "c1", "steps": [50, 25]}, "steps"),
        ({"candidate_version": "c1", "steps": [5, "x"]}, "steps.1"),
        ({"candidate_version": "c1", "min_samples": 0}, "min_samples"),
        ({"candidate_version": "c1", "scope": "fleet"}, "scope"),
        ({"candidate_version": "c1", "tenant": "nobody"}, "tenant"),
        ({"candidate_version": "c1", "checks": {"accuracy": {"factor": 1}}}, "checks.accuracy"),
        ({"candidate_version": "c1", "colour": "red"}, "colour"),
    ]
    base = {"model": NAME, "baseline_version": "b1", "scope": "edge"}
    for changes, param in cases:
        resp = platform.api("POST", "/rollouts", json={**base, **changes})
        assert resp.status_code == 400, (changes, resp.text)
        assert resp.json()["error"]["param"] == param, resp.text
        assert param.split(".")[0] in resp.json()["error"]["message"]
    viewer = platform.api("POST", "/rollouts", token=platform.viewer_token, json={**base, "candidate_version": "c1"})
    assert viewer.status_code == 403
    assert platform.api("GET", "/rollouts", token=platform.viewer_token).status_code == 200
    assert platform.api("GET", "/rollouts/999").status_code == 404
    assert platform.api("POST", "/rollouts/999/pause").status_code == 404
    assert platform.api("GET", "/rollouts").json() == {"object": "list", "data": []}  # nothing bad got in
    # No rollout: every device is told the most recently published version, as before rollouts existed.
    assert set(platform.sync_all().values()) == {"c3"}


def test_a_candidate_with_injected_errors_rolls_back_by_itself_and_devices_return(platform: Platform) -> None:
    rollout_id = create(platform, candidate_version="c1")
    clash = platform.api(
        "POST", "/rollouts", json={"model": NAME, "baseline_version": "b1", "candidate_version": "c3", "scope": "both"}
    )
    assert clash.status_code == 409 and clash.json()["error"]["param"] == "model"

    platform.wait_for(rollout_id, lambda r: r["status"] == "running")  # the controller starts it by itself

    # Devices converge on their sticky arm at the first sync; devices outside the selector stay on baseline.
    desired = platform.sync_all()
    for d in platform.devices:
        expected = "c1" if d.ring == "beta" and arm(rollout_id, d.id, 25) == "candidate" else "b1"
        assert desired[d.id] == expected, d
    num_candidates = sum(v == "c1" for v in desired.values())
    assert 1 <= num_candidates < NUM_BETA

    # The candidate errs on 30 % of its requests; the baseline on 2 %.
    platform.sync_all(lambda d: d.serve(errors=15 if d.version == "c1" else 1))
    r = platform.wait_for(rollout_id, lambda r: r["status"] != "running")
    assert (r["status"], r["step_index"], r["weight"]) == ("rolled_back", 0, 0.0)
    events = r["events"]
    assert [e["kind"] for e in events] == ["created", "started", "rolled_back"]
    rolled_back = events[-1]
    assert rolled_back["actor"] == "controller"
    assert rolled_back["reason"].startswith("check failed: edge error_rate 0.3 exceeds limit 0.029")
    # Judged as soon as both arms had the minimum sample, possibly before every device had synced its batch.
    window = rolled_back["metrics"]["windows"]["edge"]
    assert 100 <= window["candidate"]["requests"] == REQUESTS_PER_SYNC * window["candidate"]["devices"]
    assert window["candidate"]["devices"] <= num_candidates
    assert window["candidate"]["errors"] == 15 * window["candidate"]["devices"]
    assert 100 <= window["baseline"]["requests"] <= REQUESTS_PER_SYNC * (NUM_BETA - num_candidates)

    # Every device is told to return to the baseline at its next sync.
    assert set(platform.sync_all().values()) == {"b1"}
    # Usage records are stamped with the arm of the version that served them (billing tells them apart).
    engine = create_db(platform.db_url)
    with Session(engine) as s:
        arms = {(u.device_id, u.rollout_arm) for u in s.exec(select(UsageRecord).where(UsageRecord.tier == "edge"))}
    engine.dispose()
    beta = {d.id for d in platform.devices if d.ring == "beta"}
    assert {a for _, a in arms} >= {"candidate", "baseline"}  # (None: synced before any rollout existed)
    assert all(device in beta for device, a in arms if a == "candidate")
    # Every transition is audited, the controller's too (its start and rollback were missing).
    assert audit_rows(platform, rollout_id) == [
        ("console:ops", "rollout.create"),
        ("controller", "rollout.start"),
        ("controller", "rollout.rollback"),
    ]


def test_a_healthy_candidate_is_promoted_through_every_step(platform: Platform) -> None:
    # A step lasts 3 s at least: time for every device to converge and serve its batch on the step's weight.
    rollout_id = create(platform, candidate_version="c2", min_step_s=3.0)
    weights_seen: list[float] = []
    deadline = time.monotonic() + 60
    r = platform.rollout(rollout_id)
    while r["status"] in ("pending", "running"):
        assert time.monotonic() < deadline, r
        if r["status"] == "running" and (not weights_seen or weights_seen[-1] != r["weight"]):
            weights_seen.append(r["weight"])
            desired = platform.sync_all()  # converge on the step's assignment, then serve a batch on it
            now = platform.rollout(rollout_id)
            if (now["status"], now["weight"]) != (r["status"], r["weight"]):
                # The controller moved on while the devices synced (a busy host: syncing them all took longer than
                # the rest of the step): some synced to the next assignment. The next turn checks that one.
                r = now
                continue
            beta = [d for d in platform.beta if arm(rollout_id, d.id, r["weight"]) == "candidate"]
            assert {d.id for d in platform.devices if desired[d.id] == "c2"} == {d.id for d in beta}
            platform.sync_all(lambda d: d.serve(errors=1, escalations=5, p95_ms=104.0 if d.version == "c2" else 100.0))
        time.sleep(0.1)
        r = platform.rollout(rollout_id)
    assert r["status"] == "promoted", r
    assert weights_seen == [25.0, 50.0]
    kinds = [(e["kind"], e["weight"]) for e in r["events"]]
    assert kinds == [("created", 0.0), ("started", 25.0), ("advanced", 50.0), ("promoted", 100.0)]
    assert r["events"][-1]["reason"].startswith("every step passed: edge error_rate 0.02 within limit")
    assert all(e["metrics"]["windows"]["edge"]["candidate"]["requests"] >= 100 for e in r["events"][2:])
    assert audit_rows(platform, rollout_id) == [
        ("console:ops", "rollout.create"),
        ("controller", "rollout.start"),
        ("controller", "rollout.advance"),
        ("controller", "rollout.promote"),
    ]
    # Promoted: the candidate for every device, in the selector or not.
    assert set(platform.sync_all().values()) == {"c2"}


def test_too_little_traffic_keeps_a_step_waiting_and_never_promotes(platform: Platform) -> None:
    rollout_id = create(platform, baseline_version="c2", candidate_version="c3", steps=[50, 100], min_step_s=0)
    platform.wait_for(rollout_id, lambda r: r["status"] == "running")
    first = platform.wait_for(rollout_id, lambda r: r["last_analysis"] is not None)["last_analysis"]
    assert first["action"] == "wait"
    assert first["reason"].startswith("waiting for data: edge baseline 0/100 requests, edge candidate 0/100")

    platform.sync_all()  # converge
    small = [d for d in platform.beta if d.version == "c3"][:1] + [d for d in platform.beta if d.version == "c2"][:1]
    for d in small:
        d.serve()  # 50 requests each side: half the minimum
        d.sync(platform.cloud)
    seen = {platform.rollout(rollout_id)["last_analysis"]["at"]}
    deadline = time.monotonic() + 30
    while len(seen) < 4:  # three more controller passes after the traffic arrived
        assert time.monotonic() < deadline
        seen.add(platform.rollout(rollout_id)["last_analysis"]["at"])
        time.sleep(0.1)
    r = platform.rollout(rollout_id)
    assert (r["status"], r["step_index"], r["weight"]) == ("running", 0, 50.0)
    assert r["last_analysis"]["reason"] == (
        "waiting for data: edge baseline 50/100 requests, edge candidate 50/100 requests"
    )
    assert [e["kind"] for e in r["events"]] == ["created", "started"]

    paused = platform.api("POST", f"/rollouts/{rollout_id}/pause", json={"reason": "looking"})
    assert paused.status_code == 200 and paused.json()["status"] == "paused"
    assert platform.api("POST", f"/rollouts/{rollout_id}/pause").status_code == 409
    assert platform.api("POST", f"/rollouts/{rollout_id}/abort", token=platform.viewer_token).status_code == 403
    aborted = platform.api("POST", f"/rollouts/{rollout_id}/abort")
    assert aborted.status_code == 200 and (aborted.json()["status"], aborted.json()["weight"]) == ("aborted", 0.0)
    assert set(platform.sync_all().values()) == {"c2"}  # back on the baseline
    assert audit_rows(platform, rollout_id) == [
        ("console:ops", "rollout.create"),
        ("controller", "rollout.start"),
        ("console:ops", "rollout.pause"),
        ("console:ops", "rollout.abort"),
    ]
    listed = platform.api("GET", "/rollouts", params={"status": "aborted"}).json()["data"]
    assert [x["id"] for x in listed] == [rollout_id]

    # A publish after a rollout ended is the newest release again, for everyone.
    artifact = Path(platform.env["TIERLINE_DATA_DIR"]) / "zoo" / "tiny" / "artifacts" / NAME
    out = CliRunner().invoke(publish_command, [str(artifact), "--as-version", "c3"], env={**platform.env})
    assert out.exit_code == 0, out.output
    assert "install it at their next sync" in out.output  # no rollout governs it any more
    assert set(platform.sync_all().values()) == {"c3"}
    engine = create_db(platform.db_url)
    with Session(engine) as s:
        published = s.exec(
            select(AuditLog).where(AuditLog.action == "release.publish", AuditLog.target == f"release/{NAME}/c3")
        ).all()
    engine.dispose()
    # Both publishes of c3 (the fixture's and this one) are audited, with who and from which signed version.
    assert len(published) == 2 and all(row.actor.startswith("cli") for row in published)
    assert all((row.after or {}).get("published_from_version") for row in published)


# --- the controller pass against the database (SQLite and PostgreSQL) ------------------------------------------


def usage(tenant_id: int, which: str, version: int, *, status: str = "ok", latency_ms: float = 100.0) -> UsageRecord:
    return UsageRecord(
        id=uuid.uuid4().hex,
        tenant_id=tenant_id,
        model="tierline/lm-cloud",
        model_version=version,
        tier="cloud",
        prompt_tokens=10,
        completion_tokens=20,
        status=status,
        latency_ms=latency_ms,
        ttft_ms=10.0,
        rollout_arm=which,
    )


def test_cloud_traffic_is_judged_from_usage_records_by_arm(migrated_db: str, tmp_path: Path) -> None:
    engine = create_db(migrated_db)
    with Session(engine) as s:
        tenant = create_tenant(s, "acme")
        spec = RolloutSpec(
            model="tierline/lm-cloud",
            baseline_version="1",
            candidate_version="2",
            steps=[25, 100],
            min_step_s=0,
            min_samples=40,
        )
        rollout = create_rollout(s, spec, actor="test")
        s.commit()
        tenant_id, rollout_id = tenant.id or 0, rollout.id or 0
    assert [r.action for r in run_controller_pass(engine)] == ["start"]

    # Requests routed the way the cloud would: sticky by tenant + user; a slow candidate.
    with Session(engine) as s:
        plans = load_plans(s, "cloud")
        for i in range(400):
            route = resolve_cloud_arm(plans, model="tierline/lm-cloud", tenant_id=tenant_id, subject=f"user-{i}")
            assert route is not None and route.arm is not None
            assert route.arm == arm(rollout_id, cloud_subject(str(tenant_id), f"user-{i}"), 25)
            slow = route.arm == "candidate"
            s.add(usage(tenant_id, route.arm, int(route.version), latency_ms=250.0 if slow else 100.0 + i % 7))
        s.add(usage(tenant_id, "baseline", 1, status="error"))
        s.commit()

    proc = run_tierline("rollouts", "tick", env=base_env(tmp_path, TIERLINE_DATABASE_URL=migrated_db))
    assert proc.returncode == 0, proc.stderr
    assert f"{rollout_id}\trollback\trolled_back\tcandidate 0%\tcheck failed: cloud p95_latency_ms 250" in proc.stdout
    with Session(engine) as s:
        event = s.exec(select(RolloutEvent).where(RolloutEvent.kind == "rolled_back")).one()
        assert event.actor.endswith("(tick)")
        window = event.metrics["windows"]["cloud"] if event.metrics else {}
        assert window["baseline"]["requests"] + window["candidate"]["requests"] == 401
        assert window["baseline"]["errors"] == 1
        assert window["baseline"]["p95_latency_ms"] == 106.0
        assert window["candidate"]["p95_latency_ms"] == 250.0
        assert s.exec(select(Rollout)).one().status == "rolled_back"
        plans = load_plans(s, "cloud")
    route = resolve_cloud_arm(plans, model="tierline/lm-cloud", tenant_id=tenant_id, subject="user-1")
    assert route is not None and (route.arm, route.version) == (None, "1")
    engine.dispose()


def test_two_controllers_never_apply_a_transition_twice(migrated_db: str) -> None:
    engine = create_db(migrated_db)
    with Session(engine) as s:
        spec = RolloutSpec(model="m", baseline_version="1", candidate_version="2", min_step_s=0, min_samples=1)
        create_rollout(s, spec, actor="test")
        s.commit()
    with ThreadPoolExecutor(4) as pool:
        results = [r for batch in pool.map(lambda _: run_controller_pass(engine), range(4)) for r in batch]
    assert [r.action for r in results].count("start") == 1  # the others found it started, or lost the race
    with Session(engine) as s:
        assert [e.kind for e in s.exec(select(RolloutEvent).order_by(col(RolloutEvent.id)))] == ["created", "started"]
        assert s.exec(select(Rollout)).one().step_started_at is not None
    engine.dispose()


def test_window_starts_exclude_older_usage(migrated_db: str) -> None:
    """Records from before a step started never count in its analysis."""
    engine = create_db(migrated_db)
    with Session(engine) as s:
        tenant = create_tenant(s, "acme")
        spec = RolloutSpec(model="m", baseline_version="1", candidate_version="2", min_step_s=0, min_samples=1)
        create_rollout(s, spec, actor="test")
        s.commit()
        tenant_id = tenant.id or 0
    run_controller_pass(engine)
    with Session(engine) as s:
        old = datetime.now(UTC) - timedelta(hours=1)
        for which, version in (("baseline", 1), ("candidate", 2)):
            record = usage(tenant_id, which, version)
            record.model, record.occurred_at = "m", old
            s.add(record)
        s.commit()
    (result,) = run_controller_pass(engine)
    assert (result.action, result.reason) == (
        "wait",
        "waiting for data: cloud baseline 0/1 requests, cloud candidate 0/1 requests",
    )
    engine.dispose()


def telemetry(device: str, tenant_id: int, at: datetime, **versions: tuple[int, int]) -> DeviceEvent:
    metrics = {
        f"{MODEL_ID}@{v}": {"requests": n, "errors": e, "escalations": 0, "p95_ms": 100.0}
        for v, (n, e) in versions.items()
    }
    return DeviceEvent(
        id=uuid.uuid4().hex,
        device_id=device,
        tenant_id=tenant_id,
        kind="telemetry",
        payload={"metrics": metrics},
        occurred_at=at,
    )


def test_fleet_windows_count_what_devices_served_inside_them(migrated_db: str) -> None:
    """Cumulative agent counters become increases inside the window: a restart counts from zero, and a device
    with no sample before the window counts from its first one inside, never its whole history."""
    engine = create_db(migrated_db)
    start = datetime.now(UTC) - timedelta(minutes=5)
    with Session(engine) as s:
        tenant = create_tenant(s, "acme")
        tid = tenant.id or 0
        for device_id, ring in (
            ("dev-steady", "beta"),
            ("dev-restart", "beta"),
            ("dev-late", "beta"),
            ("dev-prod", "prod"),
        ):
            s.add(Device(id=device_id, tenant_id=tid, labels={"ring": ring}, token_hash=f"hash-{device_id}"))
        spec = RolloutSpec(
            model=NAME, baseline_version="b1", candidate_version="c1", scope="edge", device_selector={"ring": "beta"}
        )
        rollout = create_rollout(s, spec, actor="test")
        s.flush()
        minute = timedelta(minutes=1)
        s.add_all(
            [
                telemetry("dev-steady", tid, start - minute, b1=(1000, 500)),  # history before the window
                telemetry("dev-steady", tid, start + minute, b1=(1030, 501)),
                telemetry("dev-steady", tid, start + 2 * minute, b1=(1060, 502), c1=(0, 0)),
                telemetry("dev-restart", tid, start - minute, c1=(400, 0)),
                telemetry("dev-restart", tid, start + minute, c1=(420, 5)),
                telemetry("dev-restart", tid, start + 2 * minute, c1=(7, 1)),  # restarted: 7 new requests
                telemetry("dev-late", tid, start + minute, c1=(9000, 9000)),  # no reference: not counted
                telemetry("dev-late", tid, start + 2 * minute, c1=(9010, 9001)),
                telemetry("dev-prod", tid, start + minute, c1=(5, 5)),  # outside the selector
            ]
        )
        s.commit()
        rollout.step_started_at = start
        (window,) = collect_windows(s, rollout, start, datetime.now(UTC))
    assert window.source == "edge"
    assert (window.baseline.requests, window.baseline.errors, window.baseline.num_devices) == (60, 2, 1)
    assert (window.candidate.requests, window.candidate.errors, window.candidate.num_devices) == (37, 7, 2)
    assert window.candidate.p95_latency_ms == 100.0
    engine.dispose()


def test_a_rolled_back_candidate_is_billed_as_served_and_its_usage_is_summed(migrated_db: str) -> None:
    """The billing rule: a rollback never re-rates or voids what the candidate served; the rollback (and an
    abort) event carries the candidate's usage and rated cost per tenant, the basis of a credit note."""
    engine = create_db(migrated_db)
    with Session(engine) as s:
        acme, globex = create_tenant(s, "acme"), create_tenant(s, "globex")
        spec = RolloutSpec(
            model="tierline/lm-cloud", baseline_version="1", candidate_version="2", min_step_s=0, min_samples=5
        )
        first = create_rollout(s, spec, actor="test")
        s.commit()
        ids, first_id = {"acme": acme.id or 0, "globex": globex.id or 0}, first.id or 0
    run_controller_pass(engine)
    with Session(engine) as s:
        for name, n in (("acme", 6), ("globex", 3)):
            for _ in range(n):
                record = usage(ids[name], "candidate", 2, status="error")
                record.cost = Decimal("0.000125")
                s.add(record)
        for _ in range(6):
            s.add(usage(ids["acme"], "baseline", 1))
        s.add(usage(ids["acme"], "candidate", 2))  # unpriced (no price in force): counted, flagged
        s.commit()
    (result,) = run_controller_pass(engine)
    assert result.action == "rollback"
    with Session(engine) as s:
        event = s.exec(select(RolloutEvent).where(RolloutEvent.kind == "rolled_back")).one()
        assert event.metrics is not None
        assert event.metrics["candidate_usage"] == {
            "rule": "billed as served",
            "requests": 10,
            "cost": "0.001125",
            "by_tenant": [
                {
                    "tenant_id": ids["acme"],
                    "requests": 7,
                    "prompt_tokens": 70,
                    "completion_tokens": 140,
                    "cost": "0.000750",
                    "unpriced_requests": 1,
                },
                {
                    "tenant_id": ids["globex"],
                    "requests": 3,
                    "prompt_tokens": 30,
                    "completion_tokens": 60,
                    "cost": "0.000375",
                    "unpriced_requests": 0,
                },
            ],
        }
        candidate = list(s.exec(select(UsageRecord).where(UsageRecord.rollout_arm == "candidate")))
        assert len(candidate) == 10 and sum(u.cost is not None for u in candidate) == 9  # untouched by the rollback

        # An operator's abort of the next rollout sums only what its own candidate served.
        spec = RolloutSpec(
            model="tierline/lm-cloud", baseline_version="1", candidate_version="3", min_step_s=0, min_samples=5
        )
        second = create_rollout(s, spec, actor="test")
        s.commit()
        aborted = abort(s, second.id or 0, actor="test:ops", reason="wrong build")
        s.commit()
        event = s.exec(select(RolloutEvent).where(RolloutEvent.kind == "aborted")).one()
        assert aborted.id != first_id and event.metrics is not None
        assert event.metrics["candidate_usage"] == {
            "rule": "billed as served",
            "requests": 0,
            "cost": "0",
            "by_tenant": [],
        }
    engine.dispose()
