"""``tierline edge``: runs on devices; imports neither torch nor a database driver."""

from __future__ import annotations

from pathlib import Path

import click


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


@edge.command()
@click.option("--cloud", "cloud_url", required=True, help="the cloud tier's base URL, e.g. https://api.example.com")
@click.option("--token", required=True, help="one-time enrollment token (tierline devices enrollment-token)")
@click.option("--name", default="", help="a name for this device (default: the host name)")
@click.option("--label", "labels", multiple=True, help="KEY=VALUE label for this device (repeatable)")
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    default=None,
    help="agent TOML config (for state_dir)",
)
def enroll(cloud_url: str, token: str, name: str, labels: tuple[str, ...], config_file: Path | None) -> None:
    """Enroll this device: exchange TOKEN for a device credential and the cloud's signing keys (saved 0600)."""
    import platform

    from edge_agent.cloud_link import enroll as do_enroll
    from edge_agent.settings import load_edge_settings, state_dir

    parsed = {}
    for item in labels:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--label")
        parsed[key] = value
    runtime = {"python": platform.python_version(), "machine": platform.machine(), "system": platform.system()}
    creds = do_enroll(cloud_url, token, name or platform.node(), parsed, runtime)
    path = creds.save(state_dir(load_edge_settings(config_file)))
    click.echo(f"enrolled as device {creds.device_id} of tenant {creds.tenant}; credentials in {path}")


def _register() -> None:
    from edge_agent.calibrate import calibrate_command

    edge.add_command(calibrate_command)


_register()
