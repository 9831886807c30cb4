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


@db.command()
@click.option("--timeout", type=click.FloatRange(min=0), default=300.0, show_default=True, help="seconds to wait")
@click.option(
    "--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True, help="seconds between tries"
)
def wait(timeout: float, interval: float) -> None:
    """Wait until the database is at the code's head revision (a pod's init container while migrations run)."""
    import time

    from controlplane.storage.migrate import current_revision, head_revision
    from controlplane.storage.session import get_db

    head = head_revision()
    deadline = time.monotonic() + timeout
    current: str | None = None
    problem = ""
    while True:
        try:
            current = current_revision(get_db())
            problem = ""
        except Exception as exc:  # not reachable yet: keep waiting, name the error at the end
            problem = f" ({type(exc).__name__})"
        if current == head:
            click.echo(f"database at head {head}")
            return
        if time.monotonic() >= deadline:
            raise click.ClickException(
                f"database at {current or 'no revision'}{problem}, code at {head} after {timeout:.0f}s: "
                "run `tierline db upgrade`"
            )
        time.sleep(interval)
