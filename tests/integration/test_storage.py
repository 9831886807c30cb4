"""Migrations and the tenancy records, on SQLite and (when configured) PostgreSQL."""

from __future__ import annotations

import uuid
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlalchemy.engine import Engine
from sqlmodel import Session, SQLModel

from controlplane.storage.database import create_db
from controlplane.storage.migrate import alembic_config, current_revision, downgrade, head_revision, upgrade
from controlplane.storage.tables import UsageRecord
from controlplane.tenancy.service import authenticate, create_api_key, create_tenant, revoke_api_key
from shared.errors import AuthenticationError, ConflictError, NotFoundError, ValidationError

pytestmark = pytest.mark.integration

EXPECTED_TABLES = {
    "tenant",
    "api_key",
    "console_user",
    "model",
    "model_version",
    "model_artifact",
    "usage_record",
    "device",
    "audit_log",
}


def test_migrations_apply_from_empty_and_match_the_models(db_url: str) -> None:
    engine = create_db(db_url)
    assert current_revision(engine) is None  # never migrated
    upgrade(db_url)
    with engine.connect() as conn:  # the revision read without Alembic is Alembic's own
        assert current_revision(engine) == MigrationContext.configure(conn).get_current_revision()
    script_head = ScriptDirectory.from_config(alembic_config(db_url)).get_current_head()
    assert current_revision(engine) == head_revision() == script_head
    assert set(inspect(engine).get_table_names()) >= EXPECTED_TABLES
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), SQLModel.metadata)
    assert diff == [], f"models and migrations drifted: {diff}"
    engine.dispose()


def test_downgrade_to_base_and_up_again(db_url: str) -> None:
    upgrade(db_url)
    downgrade(db_url, "base")
    engine = create_db(db_url)
    assert not EXPECTED_TABLES & set(inspect(engine).get_table_names())
    upgrade(db_url)
    assert set(inspect(engine).get_table_names()) >= EXPECTED_TABLES
    engine.dispose()


def test_sqlite_runs_in_wal_mode_with_foreign_keys(tmp_path: Path) -> None:
    engine = create_db(f"sqlite:///{tmp_path / 'wal.db'}")
    with engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
    engine.dispose()


def test_keys_authenticate_revoke_and_expire(migrated_db: str) -> None:
    engine = create_db(migrated_db)
    with Session(engine) as s:
        acme = create_tenant(s, "acme", budget=Decimal("12.50"))
        other = create_tenant(s, "other")
        issued = create_api_key(s, acme, name="ci")
        expired = create_api_key(s, acme, expires_at=datetime.now(UTC) - timedelta(seconds=1))
        other_key = create_api_key(s, other)
        s.commit()
        assert issued.secret.startswith("tl-") and len(issued.secret) >= 3 + 43
        assert issued.secret not in issued.record.key_hash
        tenant, key = authenticate(s, issued.secret)
        assert (tenant.name, key.id) == ("acme", issued.record.id)
        assert tenant.monthly_budget == Decimal("12.500000")
        with pytest.raises(AuthenticationError, match="expired"):
            authenticate(s, expired.secret)
        with pytest.raises(AuthenticationError, match="invalid"):
            authenticate(s, issued.secret + "x")
        # A tenant cannot revoke another tenant's key, even knowing its id.
        with pytest.raises(NotFoundError):
            revoke_api_key(s, other_key.record.id or 0, tenant=acme)
        revoke_api_key(s, issued.record.id or 0, tenant=acme)
        s.commit()
        with pytest.raises(AuthenticationError, match="revoked"):
            authenticate(s, issued.secret)
        assert authenticate(s, other_key.secret)[0].name == "other"
    engine.dispose()


def test_tenant_names_are_validated_and_unique(migrated_db: str) -> None:
    engine = create_db(migrated_db)
    with Session(engine) as s:
        create_tenant(s, "acme")
        with pytest.raises(ConflictError):
            create_tenant(s, "acme")
        with pytest.raises(ValidationError, match="lowercase"):
            create_tenant(s, "Not OK")
    engine.dispose()


def test_usage_record_id_is_unique(migrated_db: str) -> None:
    from sqlalchemy.exc import IntegrityError

    engine = create_db(migrated_db)
    with Session(engine) as s:
        tenant = create_tenant(s, "acme")
        s.add(UsageRecord(id="req-1", tenant_id=tenant.id or 0, model="m", tier="edge", prompt_tokens=3))
        s.commit()
        s.add(UsageRecord(id="req-1", tenant_id=tenant.id or 0, model="m", tier="edge", prompt_tokens=3))
        with pytest.raises(IntegrityError):
            s.commit()
    engine.dispose()


@pytest.mark.postgres
def test_a_dropped_postgres_connection_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection PostgreSQL dropped (a restart, an idle timeout) is not handed out again: one idle for a while
    is pinged and replaced before use; one used a moment ago fails once, and every connection after it is new."""
    from sqlalchemy.exc import OperationalError

    from controlplane.storage import database
    from tests.conftest import PG_URL

    if not PG_URL:
        pytest.skip("PostgreSQL not configured: set TIERLINE_TEST_DATABASE_URL")
    admin = create_db(PG_URL)

    def drop_connections_of(db: Engine) -> None:
        with db.connect() as conn:
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        with admin.begin() as conn:
            assert conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}).scalar_one()

    def ask(db: Engine) -> int:
        with db.connect() as conn:
            return int(conn.execute(text("SELECT 1")).scalar_one())

    try:
        monkeypatch.setattr(database, "PING_IDLE_S", 0.0)  # every connection counts as idle: always pinged
        pinged = create_db(PG_URL, pool_size=1)
        drop_connections_of(pinged)
        assert ask(pinged) == 1  # the ping saw the dead connection: a new one answered
        pinged.dispose()

        monkeypatch.setattr(database, "PING_IDLE_S", 3600.0)  # never idle: never pinged
        unpinged = create_db(PG_URL, pool_size=1)
        drop_connections_of(unpinged)
        with pytest.raises(OperationalError):
            ask(unpinged)
        assert ask(unpinged) == 1  # the disconnect invalidated the pool: the next checkout reconnects
        unpinged.dispose()
    finally:
        admin.dispose()


@pytest.mark.postgres
def test_a_process_keeps_connections_only_for_the_databases_it_keeps_handles_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process that asked for more databases than it keeps handles for (a test run, a tool going over several
    databases) closes the connections of the handles it drops: PostgreSQL sees only the kept handles' ones, not
    connections left open until the garbage collector finds them (which then warned in whatever code ran)."""
    from controlplane.storage import session
    from tests.conftest import PG_URL, _postgres_schema

    if not PG_URL:
        pytest.skip("PostgreSQL not configured: set TIERLINE_TEST_DATABASE_URL")
    app = f"tl_handles_{uuid.uuid4().hex[:8]}"
    admin = create_db(PG_URL)

    def open_connections() -> int:
        with admin.connect() as conn:
            query = text("SELECT count(*) FROM pg_stat_activity WHERE application_name = :app")
            return int(conn.execute(query, {"app": app}).scalar_one())

    with ExitStack() as stack:
        urls = [f"{stack.enter_context(_postgres_schema())}&application_name={app}" for _ in range(6)]
        try:
            for url in urls:
                monkeypatch.setenv("TIERLINE_DATABASE_URL", url)
                with session.get_db().connect() as conn:
                    assert conn.execute(text("SELECT 1")).scalar_one() == 1
            assert open_connections() == session.MAX_HANDLES < len(urls)
        finally:
            for key, db in list(session._handles.items()):
                if key[0] in urls:
                    db.dispose()
                    del session._handles[key]
            admin.dispose()
