"""``tierline models`` and ``tierline rollouts``."""

from __future__ import annotations

import click

from shared.planned import planned


@click.group()
def models() -> None:
    """The model registry: models, versions, artifacts."""


@models.command("list")
def models_list() -> None:
    """List registered models."""
    from sqlmodel import select

    from shared.storage.models import Model
    from shared.storage.session import session_scope

    with session_scope() as session:
        rows = list(session.exec(select(Model).order_by(Model.name)))
    if not rows:
        click.echo("no models registered", err=True)
    for m in rows:
        click.echo(f"{m.id}\t{m.name}\t{m.kind}\t{m.description}")


models.add_command(planned("push", "Register a model version from PATH.", issue=7))


@click.group()
def rollouts() -> None:
    """Canary rollouts of model versions to cloud traffic and device fleets."""


for _name in ("create", "list", "get", "pause", "resume", "promote", "abort"):
    rollouts.add_command(planned(_name, f"Rollouts: {_name}.", issue=7))
