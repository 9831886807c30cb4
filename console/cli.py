"""``tierline console``."""

from __future__ import annotations

import sys

import click


@click.group()
def console() -> None:
    """The web console and the management API."""


@console.command()
@click.option("--host", default=None, help="bind address (default $TIERLINE_CONSOLE_HOST or 127.0.0.1)")
@click.option("--port", type=int, default=None, help="port (default $TIERLINE_CONSOLE_PORT or 8401)")
def serve(host: str | None, port: int | None) -> None:
    """Serve the web console (sign in at /) and the management API (/api) until SIGTERM.

    Sign-in needs a console user (create-admin). Sessions are signed with TIERLINE_SECRET_KEY;
    TIERLINE_CONSOLE_SECURE_COOKIES=1 marks the session cookie Secure behind a TLS proxy.
    """
    from console.app import create_app
    from shared.http import serve as run
    from shared.settings import CoreSettings, ServiceSettings

    svc = ServiceSettings()
    run(
        create_app(),
        host or svc.console_host,
        port if port is not None else svc.console_port,
        log_level=CoreSettings().log_level,
    )


@console.command("create-admin")
@click.option("--username", default="admin", show_default=True)
@click.option("--role", type=click.Choice(["admin", "viewer"]), default="admin", show_default=True)
@click.option("--password-stdin", is_flag=True, help="read the password from standard input instead of a prompt")
@click.option("--if-missing", is_flag=True, help="do nothing when the user exists")
def create_admin(username: str, role: str, password_stdin: bool, if_missing: bool) -> None:
    """Create a console user (password stored as an argon2id hash)."""
    from console.passwords import create_user, user_exists
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        if if_missing and user_exists(session, username):
            click.echo(f"console user {username} exists")
            return
    if password_stdin:
        password = sys.stdin.readline().rstrip("\n")
    else:
        password = click.prompt("password", hide_input=True, confirmation_prompt=True)
    with session_scope() as session:
        create_user(session, username, password, role)
    click.echo(f"created console user {username} ({role})")


@console.command("create-token")
@click.option("--username", required=True, help="the console user the token acts as")
@click.option("--name", default="", help="a label for the token")
def create_token(username: str, name: str) -> None:
    """Create a management API token for a console user and print it once (only its hash is stored)."""
    from console.management_api import create_token as issue
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        issued = issue(session, username, name=name)
        click.echo(f"console API token id {issued.record.id} for {username} (shown once):", err=True)
        click.echo(issued.secret)
