"""An API key's last use is recorded from its usage (issue 40: a key used a minute ago read "Last used: never"),
on both billing paths: the usage writer's batches (no budget) and the settle of a budget hold (one statement on
PostgreSQL), against a real ``tierline cloud serve`` on SQLite and PostgreSQL."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine
from sqlmodel import Session, select

from controlplane.storage.tables import ApiKey
from tests.conftest import base_env, free_port, run_server, seed_data_dir
from tests.forkserver import run_tierline

pytestmark = pytest.mark.integration


def test_a_keys_last_use_is_recorded_on_both_billing_paths(
    migrated_db: str, tmp_path: Path, tiny_zoo: Path, session_data_dir: Path
) -> None:
    data = seed_data_dir(tmp_path / "data", tiny_zoo, session_data_dir)
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=migrated_db,
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_SPECULATION="off",
    )

    def cli(*args: str) -> str:
        proc = run_tierline(*args, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    cli("tenants", "create", "spender")
    cli("tenants", "create", "budgeted", "--budget", "100")
    keys = {
        "spender": cli("keys", "create", "--tenant", "spender"),
        "budgeted": cli("keys", "create", "--tenant", "budgeted"),
    }
    unused = cli("keys", "create", "--tenant", "spender")
    cli("billing", "prices", "set", "--model", "tierline/lm-cloud", "--prompt", "1", "--completion", "2")
    body = {"model": "tierline/lm-cloud", "prompt": "def f(x):", "max_tokens": 4}
    engine = create_engine(migrated_db)

    def last_used() -> dict[str, datetime | None]:
        with Session(engine) as s:
            return {k.prefix: k.last_used_at for k in s.exec(select(ApiKey))}

    try:
        with run_server(["cloud", "serve"], env, free_port(), timeout=120) as url:
            started = datetime.now(UTC)
            for key in keys.values():
                r = httpx.post(
                    f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60
                )
                assert r.status_code == 200, r.text
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                seen = last_used()
                if all(seen[k[:10]] is not None for k in keys.values()):
                    break
                time.sleep(0.1)
        seen = last_used()
        for name, key in keys.items():
            at = seen[key[:10]]
            assert at is not None, f"{name}'s key reads 'never' after a request"
            at = at if at.tzinfo else at.replace(tzinfo=UTC)
            assert started - timedelta(seconds=5) <= at <= datetime.now(UTC), (name, at)
        assert seen[unused[:10]] is None  # a key never used still says so
    finally:
        engine.dispose()
