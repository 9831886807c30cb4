"""`tierline up` starts connected: registry, prices, budget, an enrolled and syncing agent with calibrated
policies; a second run on the same data directory creates nothing; the terminal stays quiet."""

from __future__ import annotations

import json
import signal
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, func
from sqlmodel import Session, col, select

from controlplane.storage.tables import (
    ApiKey,
    AuditLog,
    ConsoleUser,
    Device,
    EscalationPolicy,
    ModelAlias,
    ModelArtifact,
    ModelVersion,
    Price,
    Tenant,
    UsageRecord,
)
from tests.conftest import base_env, free_port
from tests.e2e.test_up import _pid_alive, _start_up
from tests.e2e.tour import demo_traffic_reaches_ledger_and_console
from tests.forkserver import run_tierline

pytestmark = pytest.mark.e2e
INT8 = "tierline/lm-edge-onnx-int8"


def _counts(db: str) -> dict[str, Any]:
    engine = create_engine(db)
    with Session(engine) as s:

        def n(table: Any) -> int:
            return int(s.exec(select(func.count()).select_from(table)).one())

        tenant = s.exec(select(Tenant).where(Tenant.name == "demo")).one()
        counts = {
            "tenants": n(Tenant),
            "budget": str(tenant.monthly_budget),
            "keys": n(ApiKey),
            "admins": n(ConsoleUser),
            "versions": n(ModelVersion),
            "artifacts": n(ModelArtifact),
            "aliases": n(ModelAlias),
            "prices": n(Price),
            "devices": n(Device),
            "policies": n(EscalationPolicy),
        }
    engine.dispose()
    return counts


def _stop(proc: subprocess.Popen[str], sig: int = signal.SIGINT) -> str:
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, out
    return out


def test_up_is_connected_idempotent_and_quiet(tmp_path: Path, tiny_zoo: Path, session_data_dir: Path) -> None:
    import shutil

    data = tmp_path / "data"
    shutil.copytree(session_data_dir / "keys", data / "keys")
    shutil.copytree(tiny_zoo, data / "zoo" / "tiny")
    ports = {f"TIERLINE_{n}_PORT": str(free_port()) for n in ("CLOUD", "CONSOLE", "EDGE")}
    env = base_env(
        data,
        TIERLINE_LOG_LEVEL="INFO",  # as `make demo` runs: the services' INFO lines must stay off the terminal
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
        TIERLINE_CLOUD_EDGE_SYNC_INTERVAL_S="1",
        **ports,
    )
    db = f"sqlite:///{data / 'tierline.db'}"
    up_json = data / "up.json"
    started = time.monotonic()
    proc, info = _start_up(env, up_json, None, timeout=600)
    first_ready_s = time.monotonic() - started
    try:
        first = _counts(db)
        assert first["tenants"] == 1 and first["budget"] == "50.000000"
        assert first["keys"] == 1 and first["admins"] == 1 and first["devices"] == 1
        # lm-cloud 1, lm-edge 2 (checkpoint + derived edge exports), digits-large, digits-small, digits-micro 1 each
        assert first["versions"] == 6 and first["prices"] == 7
        engine = create_engine(db)
        with Session(engine) as s:
            derived = s.exec(select(ModelVersion).where(col(ModelVersion.derived_from_id).is_not(None))).one()
            formats = {a.format for a in s.exec(select(ModelArtifact).where(ModelArtifact.version_id == derived.id))}
            assert {"onnx", "onnx-int8"} <= formats
            stable = s.exec(select(ModelAlias).where(ModelAlias.name == "stable")).all()
            assert len(stable) == 5  # lm-cloud, lm-edge and the three digits models
            edge_price = s.exec(select(Price).where(Price.model == INT8)).one()
            cloud_price = s.exec(select(Price).where(Price.model == "tierline/lm-cloud")).one()
            assert edge_price.tier == "edge" and cloud_price.tier == "cloud"
            assert edge_price.completion_per_mtok < cloud_price.completion_per_mtok
            device = s.exec(select(Device)).one()
            assert device.labels == {"site": "local", "ring": "dev"} and device.name == "local"
            actions = {a.action for a in s.exec(select(AuditLog).where(col(AuditLog.actor).startswith("cli")))}
            assert {"tenant.create", "api_key.create", "price.add", "enrollment_token.create"} <= actions
            assert {"model.version.register", "model.artifact.add", "model.alias.move"} <= actions
            # A signed policy version per edge model in the control plane, none as a file on the device.
            policies = {(p.model, p.version) for p in s.exec(select(EscalationPolicy))}
            assert policies == {("tierline/digits-small", 1), ("tierline/lm-edge", 1)}
        engine.dispose()
        assert not list((data / "edge" / "policies").glob("*.json"))

        # The agent is enrolled and runs the cloud's policies; what it answers on the device lands in the cloud's
        # ledger within a sync or two.
        deadline = time.monotonic() + 60
        while (status := httpx.get(f"{info['edge_url']}/v1/agent").json())["policies"] != {
            "tierline/digits-small": "1",
            "tierline/lm-edge": "1",
        }:
            assert time.monotonic() < deadline, f"the agent never received its policies: {status['policies']}"
            time.sleep(0.5)
        assert status["enrolled"] is True and status["device_id"] == device.id
        local = httpx.post(
            f"{info['edge_url']}/v1/completions",
            json={"model": INT8, "prompt": "import os\n", "max_tokens": 8},
            headers={"x-tierline-tier": "edge"},
            timeout=60,
        )
        assert local.status_code == 200 and local.headers["x-tierline-tier"] == "edge"
        deadline = time.monotonic() + 30
        while True:
            engine = create_engine(db)
            with Session(engine) as s:
                rows = list(s.exec(select(UsageRecord).where(UsageRecord.device_id == device.id)))
            engine.dispose()
            if rows:
                break
            assert time.monotonic() < deadline, "the edge's answer never reached the cloud's ledger"
            time.sleep(0.5)
        assert rows[0].tier == "edge" and rows[0].model == INT8
        listed = run_tierline("devices", "list", "--tenant", "demo", env=env)
        assert listed.returncode == 0 and device.id in listed.stdout, listed.stderr
        demo_traffic_reaches_ledger_and_console(env, info, db, device.id)
    finally:
        out = _stop(proc)
    assert "tierline is up" in out and info["api_key"] in out and info["console_admin_password"] in out
    assert f"device {device.id}" in out and "try next:" in out
    assert "[edge] POST /v1/completions 200" in out  # the services' access lines are shown
    for noise in ("Running upgrade", "alembic", "uvicorn", "Warning", "GET /healthz", "engine ready"):
        assert noise not in out, f"{noise!r} on the terminal:\n{out}"
    log = (data / "logs" / "up.log").read_text()
    assert "Running upgrade" in log and "engine ready" in log
    assert stat.S_IMODE((data / "demo" / "up-secrets.json").stat().st_mode) == 0o600

    # A second run on the same data directory: the same key, admin and device; nothing created twice.
    proc, again = _start_up(env, up_json, info["pids"], timeout=600)
    try:
        assert _counts(db) == first
        assert httpx.get(f"{again['edge_url']}/v1/agent").json()["device_id"] == device.id
        assert again["seeded"] == []
    finally:
        out = _stop(proc, signal.SIGTERM)
    assert again["api_key"] == info["api_key"]
    assert again["console_admin_password"] == info["console_admin_password"]
    assert not any(_pid_alive(pid) for pid in again["pids"].values())
    print(json.dumps({"first_ready_s": round(first_ready_s, 1), "second_ready_s": again["ready_s"]}))
