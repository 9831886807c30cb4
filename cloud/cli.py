"""``tierline cloud``."""

from __future__ import annotations

from pathlib import Path

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


@click.group()
def engine() -> None:
    """The built-in LLM engine on its own: an OpenAI-compatible model server (no tenants, no database)."""


@engine.command("serve")
@click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="model directory (config.json, safetensors, tokenizer)",
)
@click.option("--name", default=None, help="the model's id on the wire (default: the directory's name)")
@click.option("--host", default="127.0.0.1", show_default=True, help="bind address")
@click.option("--port", type=int, default=8000, show_default=True, help="port")
@click.option(
    "--api-key-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="require this key (Authorization: Bearer) on /v1/*; the file must be mode 0600",
)
def engine_serve(model_dir: Path, name: str | None, host: str, port: int, api_key_file: Path | None) -> None:
    """Serve one model with /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics.

    Engine settings are the cloud's (TIERLINE_CLOUD_KV_CACHE_MB, _MAX_NUM_SEQS, _DEVICE, ...); SIGTERM drains
    in-flight requests first.
    """
    if not (model_dir / "config.json").is_file():
        raise click.BadParameter(f"{model_dir} has no config.json", param_hint="--model")
    from cloud.serving.engine_server import create_engine_app, load_engine, read_key_file
    from shared.http import serve as run
    from shared.settings import CoreSettings

    key = read_key_file(api_key_file) if api_key_file is not None else None
    # Loaded before the server starts: a checkpoint the engine cannot serve is one line and exit code 1.
    engine = load_engine(model_dir)
    run(create_engine_app(model_dir, name, api_key=key, engine=engine), host, port, log_level=CoreSettings().log_level)


def _register() -> None:
    from cloud.edge.releases import publish_command

    cloud.add_command(publish_command)


_register()
