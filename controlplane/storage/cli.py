"""``tierline db``: migrations."""

from __future__ import annotations

import click


@click.group()
def db() -> None:
    """Database migrations (SQLite by default, PostgreSQL via TIERLINE_DATABASE_URL)."""


@db.command()
@click.option("--revision", default="head", show_default=True, help="target revision")
def upgrade(revision: str) -> None:
    """Apply migrations up to REVISION."""
    from controlplane.storage.migrate import upgrade as run_upgrade
    from controlplane.storage.session import database_url

    run_upgrade(database_url(), revision)
    click.echo(f"database at {revision}")


@db.command()
def current() -> None:
    """Print the database's revision and the code's head revision."""
    from controlplane.storage.migrate import current_revision, head_revision
    from controlplane.storage.session import get_db

    click.echo(f"current: {current_revision(get_db())}  head: {head_revision()}")
