"""``tierline edge``: runs on devices; imports neither torch nor a database driver."""

from __future__ import annotations

from pathlib import Path

import click

from shared.planned import planned


@click.group()
def edge() -> None:
    """The edge agent: serves small models on the device and escalates hard requests to the cloud."""


@edge.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    default=None,
    help="TOML file with agent settings (keys as in TIERLINE_EDGE_*, lower case)",
)
@click.option("--host", default=None, help="override the bind address")
@click.option("--port", type=int, default=None, help="override the port")
def run(config_file: Path | None, host: str | None, port: int | None) -> None:
    """Run the agent until SIGTERM (in-flight requests drain; a second signal forces exit)."""
    from edge_agent.app import create_app
    from edge_agent.settings import load_edge_settings
    from shared.http import serve
    from shared.settings import CoreSettings

    settings = load_edge_settings(config_file)
    serve(
        create_app(settings),
        host or settings.host,
        port if port is not None else settings.port,
        log_level=CoreSettings().log_level,
    )


edge.add_command(planned("enroll", "Enroll this device with the cloud using an enrollment token.", issue=5))
edge.add_command(planned("calibrate", "Pick the escalation threshold from validation data.", issue=6))
