"""The fleet in the console, on a real ``tierline console serve`` over SQLite and PostgreSQL: a device's own page
(under its tenant: another tenant's device is a 404), release targets from the fleet page and the management API
(audited, a bad selector a 400 naming ``target``), a policy rollout from the API; and ``tierline cloud publish
--target`` on a real publish."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from click.testing import CliRunner
from sqlmodel import Session, col, select

from console.management_api import create_token
from controlplane.fleet.targets import release_targets, set_release_target
from controlplane.policies import service as policies
from controlplane.storage.database import create_db
from controlplane.storage.session import session_scope
from controlplane.storage.tables import AuditLog, Device, EdgePublish, Model, UsageRecord
from controlplane.tenancy.service import create_tenant
from shared.artifacts import load_or_create_signing_key
from shared.escalation import EdgePolicy
from shared.targeting import bucket
from tests.conftest import DB_BACKENDS, base_env, migrated_sqlite, seed_data_dir
from tests.integration.console_support import Console, console_server, errors_in, post_form

pytestmark = pytest.mark.integration
MODEL = "tierline/lm-edge-onnx-int8"
SERVING = {
    MODEL: {
        "chosen": "llamacpp",
        "candidates": [
            {
                "runtime": "llamacpp",
                "format": "gguf-q8_0",
                "ms_per_token": 7.25,
                "agreement": 0.97,
                "eligible": True,
                "reason": "fastest eligible",
            },
            {
                "runtime": "onnxruntime",
                "format": "onnx-int8",
                "ms_per_token": 11.5,
                "agreement": 0.99,
                "eligible": True,
                "reason": "slower",
            },
            {
                "runtime": "tflite",
                "format": "tflite-int8",
                "ms_per_token": None,
                "agreement": 0.61,
                "eligible": False,
                "reason": "agreement below 0.9",
            },
        ],
    },
    "tierline/broken": "not a dict",  # what a device sends is shown, never trusted
    # The traffic often goes to a model asked for by its artifact's name: its format is fixed by the name.
    "tierline/lm-micro-onnx-int8": {"chosen": "onnx-int8", "fixed": True, "candidates": []},
}


@pytest.fixture(scope="module", params=DB_BACKENDS)
def console(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    with console_server(Path(tmp_path_factory.mktemp("fleet-console")), request.param) as running:
        yield running


@pytest.fixture(scope="module")
def admin(console: Console) -> Iterator[httpx.Client]:
    with console.signed_in("admin") as browser:
        yield browser


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def make_device(console: Console, tenant: str, *, serving: bool = True) -> str:
    device_id = unique("dev")
    now = datetime.now(UTC)
    with session_scope(console.engine) as s:
        t = create_tenant(s, tenant)
        assert t.id is not None
        runtime = {"machine": "x86_64", "memory_mb": 4096, "cpus": 4, "system": "Linux", "runtimes": ["onnxruntime"]}
        if serving:
            runtime["serving"] = SERVING
        s.add(
            Device(
                id=device_id,
                tenant_id=t.id,
                name="kiosk-7",
                labels={"ring": "beta", "site": "lab"},
                token_hash=uuid.uuid4().hex,
                agent_version="0.9.1",
                runtime=runtime,
                versions={MODEL: "demo-1"},
                policies={MODEL: "override"},
                metrics={f"{MODEL}@demo-1": {"requests": 40, "errors": 1, "escalations": 10, "p95_ms": 41.0}},
                last_seen_at=now,
            )
        )
        for i, (tier, reason) in enumerate(  # and two shadow replays: the quality monitor's, not answers
            [("edge", None)] * 5
            + [("cloud", "low-confidence")] * 3
            + [("cloud", "prompt-too-long")]
            + [("shadow", None)] * 2
        ):
            s.add(
                UsageRecord(
                    id=uuid.uuid4().hex,
                    tenant_id=t.id,
                    device_id=device_id,
                    model=MODEL if tier == "edge" else "tierline/lm-cloud",
                    tier=tier,
                    escalation_reason=reason,
                    prompt_tokens=3,
                    completion_tokens=4,
                    latency_ms=20.0 + i,
                    occurred_at=now - timedelta(minutes=i),
                )
            )
        # An old record, outside the page's 24 hours.
        s.add(
            UsageRecord(
                id=uuid.uuid4().hex,
                tenant_id=t.id,
                device_id=device_id,
                model=MODEL,
                tier="edge",
                occurred_at=now - timedelta(days=3),
            )
        )
    return device_id


def test_a_device_page_shows_its_state_usage_and_runtime_choice(console: Console, admin: httpx.Client) -> None:
    acme, globex = unique("acme"), unique("globex")
    device_id = make_device(console, acme)
    other = make_device(console, globex, serving=False)

    resp = admin.get(f"/tenants/{acme}/devices/{device_id}")
    assert resp.status_code == 200, resp.text
    page = resp.text
    assert re.findall(r'<a href="([^"]+)" aria-current="page">', page) == ["/fleet"]  # not "Tenants"
    assert f"<code>{device_id}</code>" in page and "kiosk-7" in page and "0.9.1" in page
    assert '<span class="tag">ring=beta</span>' in page and '<span class="tag">site=lab</span>' in page
    # The facts targets select on, the sticky bucket included.
    for fact, value in (("arch", "x86_64"), ("memory_mb", "4096"), ("runtime", "onnxruntime"), ("system", "Linux")):
        assert f"<dt>device.{fact}</dt><dd>{value}</dd>" in page
    assert f"<dt>device.bucket</dt><dd>{bucket(device_id)}</dd>" in page
    assert "online" in page
    # Desired vs actual: the loaded model, and a policy the device overrides with its own file.
    assert re.search(r'<tr class="model">.*?<small>lm-edge-onnx-int8</small>.*?<code>demo-1</code>', page, re.S)
    assert "device file wins" in page
    # Usage over 24 h: 5 on the edge, 4 escalated, by reason (the 3-day-old record left out).
    assert "<dt>Answered on the edge</dt><dd>5 <small" in page and "55.6 %" in page
    assert "<dt>Escalated to the cloud</dt><dd>4</dd>" in page
    assert '<span class="tag">low-confidence 3</span>' in page and '<span class="tag">prompt-too-long 1</span>' in page
    assert page.count('<tr><td data-label="When">') == 12  # the shadow replays are listed, as such
    # The agent's runtime choice, as it reported it; the malformed entry is left out.
    choice = page[page.index('id="runtime-choice"') :]
    assert "chose <code>llamacpp</code>" in choice
    assert re.search(r'<tr class="chosen">\s*<td data-label="Runtime">llamacpp <span', choice)
    assert "7.25" in choice and "97.0 %" in choice and "agreement below 0.9" in choice
    assert "tierline/broken" not in page
    assert re.search(
        r'<code>tierline/lm-micro-onnx-int8</code></td><td data-label="Runs as">onnx-int8 <small', choice
    )  # each served model's runtime, not only the plain id's (issue 40)
    assert '<td data-label="Eligible">no</td>' in choice
    # Counters per version.
    assert f"<code>{MODEL}@demo-1</code>" in page and "41 ms" in page

    # Under the other tenant, or unknown: a 404; the short URL redirects to the tenant's page.
    assert admin.get(f"/tenants/{globex}/devices/{device_id}").status_code == 404
    assert admin.get(f"/tenants/{acme}/devices/{other}").status_code == 404
    assert admin.get(f"/tenants/{acme}/devices/dev-nope").status_code == 404
    short = admin.get(f"/fleet/devices/{device_id}")
    assert short.status_code == 303 and short.headers["location"] == f"/tenants/{acme}/devices/{device_id}"
    assert admin.get("/fleet/devices/dev-nope").status_code == 404
    # No runtime choice reported: no such section.
    assert 'id="runtime-choice"' not in admin.get(f"/tenants/{globex}/devices/{other}").text
    # The fleet page links each device to its page.
    fleet = admin.get("/fleet", params={"q": device_id}).text
    assert f'href="/tenants/{acme}/devices/{device_id}"' in fleet
    # A viewer may read it.
    with console.signed_in("viewer") as viewer:
        assert viewer.get(f"/tenants/{acme}/devices/{device_id}").status_code == 200


def test_release_targets_from_the_fleet_page(console: Console, admin: httpx.Client) -> None:
    name = unique("lm-edge")
    resp = post_form(
        admin, "/fleet/release-targets", {"name": name, "version": "v2", "target": "ring=beta, device.bucket<=19"}
    )
    assert resp.status_code == 303, resp.text
    with Session(console.engine) as s:
        assert release_targets(s)[(name, "v2")] == [
            {"key": "ring", "op": "=", "value": "beta"},
            {"key": "device.bucket", "op": "<=", "value": "19"},
        ]
        row = s.exec(select(AuditLog).where(AuditLog.target == f"release/{name}/v2")).one()
        assert row.action == "release.target" and row.actor.startswith("console:")
    page = admin.get("/fleet").text
    listed = page[page.index('id="release-targets"') :]
    assert name in listed and '<span class="tag">device.bucket&lt;=19</span>' in listed
    assert "not published yet" in listed

    bad = post_form(admin, "/fleet/release-targets", {"name": name, "version": "v2", "target": "ring"})
    assert bad.status_code == 400
    assert any(e.startswith("target: ") and "is not KEY=VALUE" in e for e in errors_in(bad.text))
    bad = post_form(admin, "/fleet/release-targets", {"name": name, "version": "v2", "target": "device.gpu=yes"})
    assert bad.status_code == 400 and any("unknown device fact" in e for e in errors_in(bad.text))
    with Session(console.engine) as s:  # unchanged by the refused forms
        assert len(release_targets(s)[(name, "v2")]) == 2

    # An empty target sends it to every device again.
    assert post_form(admin, "/fleet/release-targets", {"name": name, "version": "v2", "target": ""}).status_code == 303
    with Session(console.engine) as s:
        assert (name, "v2") not in release_targets(s)

    with console.signed_in("viewer") as viewer:
        page = viewer.get("/fleet").text
        assert 'action="/fleet/release-targets"' not in page
        csrf = re.search(r'name="_csrf" value="([^"]+)"', page)
        token = csrf.group(1) if csrf else ""
        refused = viewer.post("/fleet/release-targets", data={"name": name, "version": "v2", "_csrf": token})
        assert refused.status_code == 403


def api(console: Console, role: str = "admin") -> httpx.Client:
    username = console.user(role)
    with session_scope(console.engine) as s:
        secret = create_token(s, username).secret
    return httpx.Client(base_url=console.url, headers={"Authorization": f"Bearer {secret}"}, timeout=30)


def test_release_targets_and_devices_from_the_management_api(console: Console) -> None:
    name = unique("digits")
    acme, globex = unique("acme"), unique("globex")
    device_id = make_device(console, acme)
    with api(console) as ops, api(console, "viewer") as viewer:
        resp = ops.put(f"/api/releases/{name}/b1/target", json={"target": ["ring=beta", "device.memory_mb>=2048"]})
        assert resp.status_code == 200, resp.text
        assert resp.json()["describe"] == "ring=beta, device.memory_mb>=2048"
        with Session(console.engine) as s:
            audit = s.exec(select(AuditLog).where(AuditLog.target == f"release/{name}/b1")).one()
            assert audit.actor.startswith("console:admin-") and audit.after == {"target": resp.json()["describe"]}

        bad = ops.put(f"/api/releases/{name}/b1/target", json={"target": ["ring"]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "target", bad.text
        bad = ops.put(f"/api/releases/{name}/b1/target", json={"target": ["device.memory_mb>=lots"]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "target", bad.text
        assert viewer.put(f"/api/releases/{name}/b1/target", json={"target": []}).status_code == 403
        assert httpx.put(f"{console.url}/api/releases/{name}/b1/target", json={"target": []}).status_code == 401

        listed = viewer.get("/api/releases").json()["data"]
        mine = next(r for r in listed if r["name"] == name)
        assert mine == {
            "name": name,
            "version": "b1",
            "target": ["ring=beta", "device.memory_mb>=2048"],
            "describe": "ring=beta, device.memory_mb>=2048",
            "published": False,
        }

        device = viewer.get(f"/api/tenants/{acme}/devices/{device_id}")
        assert device.status_code == 200, device.text
        body = device.json()
        assert body["facts"]["arch"] == "x86_64" and body["facts"]["bucket"] == bucket(device_id)
        assert body["runtime"]["serving"][MODEL]["chosen"] == "llamacpp"
        assert viewer.get(f"/api/tenants/{globex}/devices/{device_id}").status_code == 404


def test_a_policy_rollout_from_the_management_api_and_the_form(
    console: Console, admin: httpx.Client, tmp_path: Path
) -> None:
    key = load_or_create_signing_key(tmp_path / "signing.key")
    model = f"tierline/{unique('lm')}"
    with session_scope(console.engine) as s:
        for threshold in (-3.0, -2.0):
            policies._store(
                s,
                EdgePolicy(model=model, threshold=threshold),
                max_quality_loss=0.01,
                data_sha256="0" * 64,
                data_items=0,
                target=[],
                derived_from=None,
                actor="test",
                key=key,
                action="escalation_policy.calibrate",
            )
    short = model.removeprefix("tierline/")
    with session_scope(console.engine) as s:
        s.add(Model(name=short, kind="causal-lm"))
    # The model's page offers to canary each policy version against the one before it.
    page = admin.get(f"/models/{short}").text
    link = f'href="/rollouts/new?kind=policy&amp;model={quote(model)}&amp;baseline=1&amp;candidate=2"'
    assert link in page
    with api(console) as ops:
        body = {"model": short, "baseline_version": "1", "candidate_version": "2", "kind": "policy", "steps": [20, 100]}
        resp = ops.post("/api/rollouts", json=body)
        assert resp.status_code == 201, resp.text
        made = resp.json()
        assert (made["kind"], made["model"], made["scope"]) == ("policy", model, "edge")
        assert made["checks"]["cost_per_request"] == {"factor": 1.1, "slack": 0.0}
        bad = ops.post("/api/rollouts", json={**body, "candidate_version": "7"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "candidate_version", bad.text
        assert ops.post(f"/api/rollouts/{made['id']}/abort", json={}).status_code == 200
    # The console form, filled in from the query string (as a policy's page links to it).
    form = admin.get("/rollouts/new", params={"kind": "policy", "model": short, "baseline": "1", "candidate": "2"})
    assert '<option value="policy" selected>' in form.text
    fields = {
        "kind": "policy",
        "model": short,
        "baseline_version": "1",
        "candidate_version": "2",
        "scope": "edge",
        "steps": "20, 100",
    }
    created = post_form(admin, "/rollouts", fields, page="/rollouts/new")
    assert created.status_code == 303, created.text
    detail = admin.get(created.headers["location"]).text
    assert f"escalation policy of {model}" in detail


def test_publish_with_a_target_sets_it_in_the_same_transaction(
    tmp_path: Path, tiny_zoo: Path, session_data_dir: Path
) -> None:
    from cloud.edge.releases import publish_command

    data = seed_data_dir(tmp_path / "data", tiny_zoo, session_data_dir)
    db_url = migrated_sqlite(data)
    env = base_env(data, TIERLINE_DATABASE_URL=db_url)
    artifact = data / "zoo" / "tiny" / "artifacts" / "digits-small"

    bad = CliRunner().invoke(publish_command, [str(artifact), "--as-version", "t1", "--target", "ring"], env=env)
    assert bad.exit_code == 2 and "--target" in bad.output and "'ring' is not KEY=VALUE" in bad.output
    engine = create_db(db_url)
    with Session(engine) as s:
        assert s.exec(select(EdgePublish)).all() == []  # refused before anything was published

    out = CliRunner().invoke(
        publish_command,
        [str(artifact), "--as-version", "t1", "--target", "ring=beta", "--target", "site!=lab"],
        env=env,
    )
    assert out.exit_code == 0, out.output
    assert "the devices ring=beta, site!=lab selects install it" in out.output
    with Session(engine) as s:
        assert release_targets(s)[("digits-small", "t1")] == [
            {"key": "ring", "op": "=", "value": "beta"},
            {"key": "site", "op": "!=", "value": "lab"},
        ]
        actions = s.exec(select(AuditLog.action).order_by(col(AuditLog.id))).all()
        assert "release.target" in actions
        # Without --target a publish again keeps the version's target.
    again = CliRunner().invoke(publish_command, [str(artifact), "--as-version", "t1"], env=env)
    assert again.exit_code == 0, again.output
    with Session(engine) as s:
        assert len(release_targets(s)[("digits-small", "t1")]) == 2
        set_release_target(s, "digits-small", "t1", [], actor="t")
        s.commit()
    engine.dispose()
