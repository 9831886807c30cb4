"""``tierline cloud``."""

from __future__ import annotations

import click


@click.group()
def cloud() -> None:
    """The cloud tier: OpenAI-compatible inference API in front of the LLM engine."""


@cloud.command()
@click.option("--host", default=None, help="bind address (default $TIERLINE_CLOUD_HOST or 127.0.0.1)")
@click.option("--port", type=int, default=None, help="port (default $TIERLINE_CLOUD_PORT or 8400)")
def serve(host: str | None, port: int | None) -> None:
    """Serve the cloud API until SIGTERM (in-flight requests drain first)."""
    from cloud.app import create_app
    from shared.http import serve as run
    from shared.settings import CoreSettings, ServiceSettings

    svc = ServiceSettings()
    run(
        create_app(),
        host or svc.cloud_host,
        port if port is not None else svc.cloud_port,
        log_level=CoreSettings().log_level,
    )


def _register() -> None:
    from cloud.edge_releases import publish_command

    cloud.add_command(publish_command)


_register()
