"""Programmatic Alembic: ``tierline db upgrade`` and the helpers tests use."""

from __future__ import annotations

import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine, make_url

from controlplane.storage.database import normalize_url
from shared.errors import ConfigurationError

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    # ConfigParser interpolation: a literal % in a password must be doubled.
    cfg.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


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
