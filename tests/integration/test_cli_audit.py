"""Changes made with the ``tierline`` CLI leave audit_log rows, as console changes do: who, what, never a secret."""

from __future__ import annotations

import getpass
import json
import subprocess
from pathlib import Path

import pytest
from sqlmodel import Session, col, select

from controlplane.fleet.devices import enroll
from controlplane.storage.database import create_db
from controlplane.storage.tables import AuditLog
from tests.conftest import base_env, migrated_sqlite
from tests.forkserver import run_tierline

pytestmark = pytest.mark.integration


def test_cli_changes_write_audit_rows_without_secrets(tmp_path: Path) -> None:
    db_url = migrated_sqlite(tmp_path)
    env = base_env(tmp_path, TIERLINE_DATABASE_URL=db_url)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        proc = run_tierline(*args, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc

    cli("tenants", "create", "acme", "--budget", "25.00")
    key_secret = cli("keys", "create", "--tenant", "acme", "--name", "ci").stdout.strip()
    token_secret = cli("devices", "enrollment-token", "--tenant", "acme", "--label", "site=lab").stdout.strip()
    engine = create_db(db_url)
    with Session(engine) as s:
        key_id = s.exec(select(AuditLog.target).where(AuditLog.action == "api_key.create")).first()
        device, _, _ = enroll(s, token_secret, name="cam-1", labels={}, agent_version="1", runtime={})
        s.commit()
        device_id = device.id
    assert key_id is not None
    cli("keys", "revoke", key_id.removeprefix("api_key/"))
    cli("devices", "revoke", "--tenant", "acme", device_id)
    cli("billing", "prices", "set", "--model", "tierline/lm-cloud", "--prompt", "0.5", "--completion", "1.5")

    with Session(engine) as s:
        rows = s.exec(select(AuditLog).order_by(col(AuditLog.id))).all()
    engine.dispose()
    user = getpass.getuser()
    assert [(r.action, r.actor) for r in rows] == [
        ("tenant.create", f"cli:{user}"),
        ("api_key.create", f"cli:{user}"),
        ("enrollment_token.create", f"cli:{user}"),
        ("device.enroll", rows[2].target.replace("/", ":")),  # the device's enrollment, by the token that allowed it
        ("api_key.revoke", f"cli:{user}"),
        ("device.revoke", f"cli:{user}"),
        ("price.add", f"cli:{user}"),
    ]
    targets = [r.target for r in rows]
    assert targets[0] == "tenant/acme" and targets[3] == targets[5] == f"device/{device_id}"
    assert rows[3].after == {"tenant": "acme", "name": "cam-1", "labels": {"site": "lab"}, "agent_version": "1"}
    assert rows[0].after is not None and rows[0].after["monthly_budget"] == "25.00"
    assert rows[2].after == {"tenant": "acme", "labels": {"site": "lab"}, "ttl_hours": 24.0}
    written = json.dumps([[r.before, r.after, r.target] for r in rows])
    assert key_secret not in written and token_secret not in written
