"""Programmatic Alembic: ``tierline db upgrade`` and the helpers tests use."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import inspect, text
from sqlalchemy.engine import Engine, make_url

from controlplane.storage.database import normalize_url
from shared.errors import ConfigurationError

if TYPE_CHECKING:
    from alembic.config import Config

# Alembic is imported where a migration runs, not by every CLI command and server start that only checks the
# revision (~0.3 s of CPU each: Alembic, and every migration script loaded to find the head).
_REVISION = re.compile(r'^(down_revision|revision)\b[^=]*=\s*(None|"([^"]*)")', re.MULTILINE)

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def alembic_config(url: str) -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    # ConfigParser interpolation: a literal % in a password must be doubled.
    cfg.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def head_revision() -> str | None:
    """The revision no other migration revises, read from the scripts' ``revision``/``down_revision`` lines (what
    Alembic's ``ScriptDirectory.get_current_head`` returns, without loading every script; a test holds the two
    equal). The history is linear: two heads are an error."""
    revisions: set[str] = set()
    revised: set[str] = set()
    for path in sorted((MIGRATIONS_DIR / "versions").glob("*.py")):
        fields = {m.group(1): m.group(3) for m in _REVISION.finditer(path.read_text())}
        if "revision" not in fields:
            raise ConfigurationError(f'{path.name}: a migration without a `revision = "..."` line')
        revisions.add(fields["revision"])
        if fields.get("down_revision"):
            revised.add(fields["down_revision"])
    heads = revisions - revised
    if len(heads) > 1:
        raise ConfigurationError(f"the migrations have {len(heads)} heads: {sorted(heads)}")
    return next(iter(heads), None)


def current_revision(engine: Engine) -> str | None:
    """The database's revision (Alembic's ``alembic_version`` row), None when never migrated."""
    with engine.connect() as conn:
        if not inspect(conn).has_table("alembic_version"):
            return None
        rows = conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
    if len(rows) > 1:
        raise ConfigurationError(f"the database is at {len(rows)} revisions at once: {sorted(rows)}")
    return rows[0] if rows else None


def is_up_to_date(engine: Engine) -> bool:
    return current_revision(engine) == head_revision()


def ensure_migrated(url: str, engine: Engine) -> str | None:
    """Make a CLI's database usable: an embedded SQLite database behind the code (or never migrated) is upgraded
    here, returning one line that says so; a PostgreSQL one behind is a ConfigurationError naming the command
    that migrates it (its migrations are the operator's to run, once for every replica). None: already at head."""
    alembic_logger = logging.getLogger("alembic")
    level = alembic_logger.level
    alembic_logger.setLevel(logging.WARNING)  # a CLI's output is its answer, not Alembic's progress
    try:
        head = head_revision()
        try:
            current = current_revision(engine)
        except Exception as exc:
            raise ConfigurationError(f"the database at {_shown(url)} is unreachable: {type(exc).__name__}") from None
        if current == head:
            return None
        if make_url(normalize_url(url)).get_backend_name() != "sqlite":
            raise ConfigurationError(
                f"the database at {_shown(url)} is at revision {current or 'none (never migrated)'}, the code at "
                f"{head}: run `tierline db upgrade` first"
            )
        try:
            upgrade(url)
        except Exception as exc:  # e.g. a database migrated by a newer release than this code
            raise ConfigurationError(
                f"migrating the database at {_shown(url)} from {current or 'no revision'} to {head} failed: {exc}"
            ) from None
        return f"migrated the database at {_shown(url)} to {head} (it was at {current or 'no revision'})"
    finally:
        alembic_logger.setLevel(level)


def _shown(url: str) -> str:
    return make_url(normalize_url(url)).render_as_string(hide_password=True)
