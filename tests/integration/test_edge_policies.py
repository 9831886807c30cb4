"""Escalation policies and fleet targeting with real processes on localhost: a cloud, a console and an edge agent
on one database and data directory (the tiny zoo). A policy calibrated in the control plane and moved from the
console reaches the running agent within a sync or two, and the agent's escalation rate on the same traffic moves
the way the new operating point says; a device-local policy file overrides it, and the device reports which one
runs; an edge release targeted at ``ring=beta`` reaches the beta agent and not a dev device."""

from __future__ import annotations

import json
import re
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
from click.testing import CliRunner
from sqlalchemy import create_engine
from sqlmodel import Session, select

from console.passwords import create_user
from controlplane.registry import service as registry
from controlplane.storage.session import session_scope
from controlplane.storage.tables import Device, DeviceEvent, EscalationPolicy
from shared.escalation import EdgePolicy, classifier_signals, save_policy
from tests.conftest import base_env, free_port, migrated_sqlite, run_server, seed_data_dir
from tests.forkserver import run_tierline
from tests.integration.console_support import PASSWORD, login, post_form
from tests.integration.edge_support import ZOO_PAIRS_ENV
from tests.integration.test_policies import digits_validation

pytestmark = pytest.mark.integration
DIGITS = "tierline/digits-small"
SYNC_S = 0.5  # the cloud's sync interval in these tests


@dataclass
class Platform:
    data: Path
    env: dict[str, str]
    agent_env: dict[str, str]
    cloud_url: str
    console_url: str
    edge_url: str
    db: str
    validation: Path

    def cli(self, *args: str) -> str:
        proc = run_tierline(*args, env=self.env)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    def agent(self) -> dict[str, Any]:
        status: dict[str, Any] = httpx.get(f"{self.edge_url}/v1/agent", timeout=10).json()
        return status

    def device(self, name: str) -> Device:
        engine = create_engine(self.db)
        with Session(engine) as s:
            device = s.exec(select(Device).where(Device.name == name)).one()
        engine.dispose()
        return device

    def policy(self, version: int) -> EscalationPolicy:
        engine = create_engine(self.db)
        with Session(engine) as s:
            row = s.exec(
                select(EscalationPolicy).where(EscalationPolicy.model == DIGITS, EscalationPolicy.version == version)
            ).one()
        engine.dispose()
        return row


def wait_for(what: str, check: Callable[[], bool], timeout: float = 20.0) -> float:
    """Seconds until ``check`` holds; fails naming ``what`` after ``timeout`` (generous: a loaded host)."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, f"{what}: not within {timeout:.0f}s"
        time.sleep(0.05)
    return time.monotonic() - started


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[Platform]:
    data = seed_data_dir(tmp_path_factory.mktemp("policies"), tiny_zoo, session_data_dir)
    db = migrated_sqlite(data)
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=db,
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_EDGE_SYNC_INTERVAL_S=str(SYNC_S),
    )
    agent_env = base_env(
        data,
        TIERLINE_EDGE_ZOO_DIR=str(data / "zoo" / "tiny"),
        TIERLINE_EDGE_STATE_DIR=str(data / "agent-state"),
        TIERLINE_EDGE_CLOUD_DEADLINE_S="20",
        **ZOO_PAIRS_ENV,
    )
    validation = digits_validation(tiny_zoo, data / "digits-validation.jsonl")
    p = Platform(data, env, agent_env, "", "", "", db, validation)
    p.cli("tenants", "create", "acme")
    token = p.cli("devices", "enrollment-token", "--tenant", "acme", "--label", "ring=beta")
    with ExitStack() as stack:
        p.cloud_url = stack.enter_context(run_server(["cloud", "serve"], env, free_port(), timeout=120))
        run_tierline(
            "edge", "enroll", "--cloud", p.cloud_url, "--token", token, "--name", "beta-1", env=agent_env, check=True
        )
        p.edge_url = stack.enter_context(run_server(["edge", "run"], agent_env, free_port()))
        # The console on the same database and data directory (the same signing key), as `tierline up` runs it.
        console_env = {**env, "TIERLINE_SECRET_KEY": "test-" + uuid.uuid4().hex}
        p.console_url = stack.enter_context(run_server(["console", "serve"], console_env, free_port()))
        engine = create_engine(db)
        with session_scope(engine) as session:
            create_user(session, "ops", PASSWORD, "admin")
            registry.ensure_model(session, "digits-small", "tensor", actor="test")
        engine.dispose()
        yield p


def classify(p: Platform, rows: list[list[float]], tier: str | None = None) -> dict[str, Any]:
    headers = {"x-tierline-tier": tier} if tier else {}
    resp = httpx.post(
        f"{p.edge_url}/v1/inference", json={"model_id": DIGITS, "inputs": rows}, headers=headers, timeout=60
    )
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def predicted_tiers(policy: EscalationPolicy, logits: np.ndarray) -> list[str]:
    """What the stored policy version says each row does: escalate when its confidence is below the threshold."""
    edge = EdgePolicy.from_json(policy.policy)
    signals = classifier_signals(logits)
    conf = edge.router.confidences(signals) if edge.router is not None else signals[edge.signal]
    return ["cloud" if c < edge.threshold else "edge" for c in conf]


def test_a_policy_moved_in_the_console_reaches_the_agent_and_moves_its_escalation_rate(platform: Platform) -> None:
    from shared.zoo.digits import load_split

    p = platform
    rows = load_split().x_held_out.tolist()  # the same traffic before and after: every held-out digit
    local = np.array(classify(p, rows, tier="edge")["outputs"], dtype=np.float64)
    assert p.agent()["policies"] == {}  # nothing calibrated yet: the agent runs its default

    # v1: calibrated in the control plane with a loose bound (most digits answered on the device).
    out = p.cli("policies", "calibrate", "--model", DIGITS, "--data", str(p.validation), "--max-quality-loss", "0.05")
    assert f"{DIGITS} v1:" in out
    wait_for("v1 reaches the agent", lambda: p.agent()["policies"] == {DIGITS: "1"})
    v1 = p.policy(1)
    first = classify(p, rows)["tiers"]
    assert first == predicted_tiers(v1, local)
    rate_1 = first.count("cloud") / len(rows)

    # v2: an admin asks for no quality loss at all, on the console's model page.
    with httpx.Client(base_url=p.console_url, follow_redirects=False, timeout=30) as admin:
        assert login(admin, "ops", PASSWORD).status_code == 303
        page = admin.get("/models/digits-small").text
        assert "policy v1" in page and 'id="operating-point"' in page
        moved = post_form(
            admin, "/models/digits-small/policy", {"max_quality_loss": "0", "target": ""}, page="/models/digits-small"
        )
        assert moved.status_code == 303, moved.text
        took = wait_for("v2 reaches the agent", lambda: p.agent()["policies"] == {DIGITS: "2"})
        # The console shows both versions, v2 derived from v1, with the chart of the curve and its chosen point.
        page = admin.get("/models/digits-small").text
        versions = re.search(r'id="policy-versions".*?</table>', page, re.S)
        assert versions and "v2" in versions.group(0) and "from v1" in versions.group(0) and "v1" in versions.group(0)
        assert "policy v2" in page and '<circle class="chosen"' in page
        bad = post_form(admin, "/models/digits-small/policy", {"max_quality_loss": "7"}, page="/models/digits-small")
        assert bad.status_code == 400 and "max quality loss" in bad.text.lower()
    assert took < 10 * SYNC_S + 5  # a sync or two on a loaded host
    v2 = p.policy(2)
    assert v2.derived_from == 1 and v2.threshold > v1.threshold and v2.created_by == "console:ops"
    second = classify(p, rows)["tiers"]
    assert second == predicted_tiers(v2, local)
    rate_2 = second.count("cloud") / len(rows)
    # Stricter operating point, more escalations, as many as the curve said (on the validation half of this data).
    assert rate_2 > rate_1
    assert rate_2 == pytest.approx(1 - v2.policy["calibration"]["edge_share"], abs=0.05)
    assert rate_1 == pytest.approx(1 - v1.policy["calibration"]["edge_share"], abs=0.05)
    wait_for("the device record says v2 runs", lambda: p.device("beta-1").policies == {DIGITS: "2"})
    shares = {f"v{v.version}": v.policy["calibration"]["edge_share"] for v in (v1, v2)}
    rates = {"v1": rate_1, "v2": rate_2}
    print(json.dumps({"escalation_rate": rates, "validation_edge_share": shares, "took_s": round(took, 2)}))

    # A device-local file wins over the cloud's policy, without a restart, and the device says so.
    policy_dir = Path(p.agent_env["TIERLINE_EDGE_STATE_DIR"]) / "policies"
    save_policy(policy_dir, EdgePolicy(DIGITS, signal="max_prob", threshold=2.0))  # above any probability
    wait_for("the override is used", lambda: p.agent()["policies"] == {DIGITS: "override"})
    assert set(classify(p, rows[:20])["tiers"]) == {"cloud"}
    wait_for("the device record says override", lambda: p.device("beta-1").policies == {DIGITS: "override"})
    (policy_dir / "tierline__digits-small.json").unlink()
    wait_for("back to the cloud's v2", lambda: p.agent()["policies"] == {DIGITS: "2"})
    assert classify(p, rows)["tiers"] == second


def test_a_policy_that_fails_verification_is_refused(platform: Platform) -> None:
    """A row whose bytes changed after signing (a tampered database) is not used: the agent keeps what it runs."""
    p = platform
    before = p.agent()["policies"]
    engine = create_engine(p.db)
    with Session(engine) as s:
        latest = s.exec(select(EscalationPolicy).order_by(EscalationPolicy.version.desc())).first()  # type: ignore[attr-defined]
        assert latest is not None
        forged = EscalationPolicy(
            **{
                **latest.model_dump(exclude={"id", "created_at"}),
                "version": latest.version + 1,
                "policy": {**latest.policy, "threshold": -1.0},
            }
        )
        forged_version = forged.version
        s.add(forged)
        s.commit()
    engine.dispose()
    wait_for(
        "the refusal is reported",
        lambda: any(e.get("type") == "policy.refused" for e in _events(p)),
    )
    assert p.agent()["policies"] == before
    engine = create_engine(p.db)
    with Session(engine) as s:
        s.delete(s.exec(select(EscalationPolicy).where(EscalationPolicy.version == forged_version)).one())
        s.commit()
    engine.dispose()


def _events(p: Platform) -> list[dict[str, Any]]:
    engine = create_engine(p.db)
    with Session(engine) as s:
        payloads = [e.payload for e in s.exec(select(DeviceEvent).where(DeviceEvent.kind == "event"))]
    engine.dispose()
    return payloads


def test_a_release_targeted_at_beta_reaches_the_beta_device_and_not_a_dev_device(platform: Platform) -> None:
    from cloud.edge.releases import publish_command

    p = platform
    token = p.cli("devices", "enrollment-token", "--tenant", "acme", "--label", "ring=dev")
    enrolled = httpx.post(f"{p.cloud_url}/v1/edge/enroll", json={"token": token, "name": "dev-1"}, timeout=30)
    assert enrolled.status_code == 200, enrolled.text
    dev_auth = {"Authorization": f"Bearer {enrolled.json()['device_token']}"}

    def dev_desired() -> dict[str, str]:
        resp = httpx.post(f"{p.cloud_url}/v1/edge/sync", json={}, headers=dev_auth, timeout=30)
        assert resp.status_code == 200, resp.text
        return {d["name"]: d["version"] for d in resp.json()["desired"]}

    # The agent reports its facts at sync: releases and policies can target them.
    runtime = p.device("beta-1").runtime
    assert runtime["memory_mb"] > 0 and "onnxruntime" in runtime["runtimes"] and runtime["machine"]
    # ... and which runtime/format serves each model, with the runtime guard's numbers (edge_agent.runtime_guard)
    serving = runtime["serving"]["tierline/lm-edge"]
    assert serving["chosen"] in {c["format"] for c in serving["candidates"] if c["eligible"]}
    keys = {"runtime", "format", "ms_per_token", "agreement", "eligible", "reason"}
    assert all(keys <= set(c) for c in serving["candidates"])
    # ... and each model served under its artifact's own name, in the format the name fixes (issue 40)
    fixed = runtime["serving"]["tierline/lm-edge-onnx-int8"]
    assert fixed["fixed"] is True and fixed["chosen"].startswith("onnx") and fixed["candidates"] == []

    out = p.cli("devices", "target-release", "digits-small", "b1", "--target", "ring=beta")
    assert "for ring=beta" in out
    artifact = p.data / "zoo" / "tiny" / "artifacts" / "digits-small"
    published = CliRunner().invoke(
        publish_command, [str(artifact), "--as-version", "b1"], env={"TIERLINE_DATA_DIR": str(p.data)}
    )
    assert published.exit_code == 0, published.output

    def agent_version() -> str | None:
        models = httpx.get(f"{p.edge_url}/v1/models", timeout=10).json()["data"]
        return next((m.get("version") for m in models if m["id"] == DIGITS), None)

    wait_for("the beta agent installs b1", lambda: agent_version() == "b1", timeout=60)
    assert "digits-small" not in dev_desired()  # the dev device is never told of it

    # Retargeted at dev as well: now the dev device is told.
    p.cli("devices", "target-release", "digits-small", "b1", "--target", "ring!=prod")
    assert dev_desired().get("digits-small") == "b1"
    p.cli("devices", "target-release", "digits-small", "b1", "--target", "ring=beta")

    # The fleet page: filtered by label, desired against actual per device.
    with httpx.Client(base_url=p.console_url, follow_redirects=False, timeout=30) as admin:
        assert login(admin, "ops", PASSWORD).status_code == 303
        beta = admin.get("/fleet", params={"label": "ring=beta"}).text
        assert "<small>beta-1</small>" in beta and "<small>dev-1</small>" not in beta  # names (ids are dev-<hex>)
        row = re.search(r"<small>digits-small</small> <code>([^<]+)</code> / <code>([^<]+)</code>", beta)
        assert row and row.groups() == ("b1", "b1")
        dev = admin.get("/fleet", params={"label": "ring=dev"}).text
        assert "<small>dev-1</small>" in dev and "<small>beta-1</small>" not in dev
        assert admin.get("/fleet", params={"label": "nonsense"}).status_code == 400


def test_the_management_api_lists_reads_and_moves_policies(platform: Platform) -> None:
    p = platform
    engine = create_engine(p.db)
    with session_scope(engine) as session:
        create_user(session, "watcher", PASSWORD, "viewer")
    engine.dispose()
    admin = {"Authorization": f"Bearer {p.cli('console', 'create-token', '--username', 'ops')}"}
    viewer = {"Authorization": f"Bearer {p.cli('console', 'create-token', '--username', 'watcher')}"}
    api = f"{p.console_url}/api/policies"
    listed = httpx.get(api, headers=viewer, timeout=30)
    assert listed.status_code == 200, listed.text
    versions = [v["version"] for v in listed.json()["data"] if v["model"] == DIGITS]
    assert versions[:2] == [2, 1]
    one = httpx.get(f"{api}/digits-small", params={"version": 1}, headers=viewer, timeout=30).json()
    assert one["version"] == 1 and one["curve"] and one["policy"]["signal"] == one["signal"]
    assert httpx.get(f"{api}/tierline__digits-small", headers=viewer, timeout=30).json()["version"] == versions[0]
    body = {"max_quality_loss": 0.02, "target": ["ring=beta"]}
    refused = httpx.post(f"{api}/digits-small/operating-point", json=body, headers=viewer, timeout=30)
    assert refused.status_code == 403
    bad = httpx.post(f"{api}/digits-small/operating-point", json={**body, "shadow": 1}, headers=admin, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "shadow"
    bad = httpx.post(
        f"{api}/digits-small/operating-point", json={**body, "target": ["ring"]}, headers=admin, timeout=30
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "target"
    moved = httpx.post(f"{api}/digits-small/operating-point", json=body, headers=admin, timeout=30)
    assert moved.status_code == 201, moved.text
    new = moved.json()
    assert new["version"] == versions[0] + 1 and new["target"] == [{"key": "ring", "op": "=", "value": "beta"}]
    assert new["created_by"] == "console:ops"
    wait_for("the API's version reaches the beta agent", lambda: p.agent()["policies"] == {DIGITS: str(new["version"])})
    missing = httpx.get(f"{api}/nothing-here", headers=viewer, timeout=30)
    assert missing.status_code == 404
    # And from the console: recalibrated on the kept validation set, a version of its own (no curve re-read).
    with httpx.Client(base_url=p.console_url, follow_redirects=False, timeout=60) as browser:
        assert login(browser, "ops", PASSWORD).status_code == 303
        page = "/models/digits-small"
        done = post_form(browser, "/models/digits-small/policy/calibrate", {"max_quality_loss": "0.01"}, page=page)
        assert done.status_code == 303, done.text
    latest = p.policy(new["version"] + 1)
    assert latest.derived_from is None and latest.data_sha256 == new["data_sha256"] and latest.max_quality_loss == 0.01
    assert latest.target == new["target"]  # kept from the version before
