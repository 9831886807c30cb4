"""``tierline console``."""

from __future__ import annotations

import sys

import click

ROLE_CHOICE = click.Choice(["admin", "viewer"])


def _actor() -> str:
    import getpass

    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):
        return "cli"


def _read_password(password_stdin: bool) -> str:
    if password_stdin:
        return sys.stdin.readline().rstrip("\n")
    return str(click.prompt("password", hide_input=True, confirmation_prompt=True))


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
@click.option("--role", type=ROLE_CHOICE, default="admin", show_default=True)
@click.option("--password-stdin", is_flag=True, help="read the password from standard input instead of a prompt")
@click.option("--if-missing", is_flag=True, help="do nothing when the user exists")
def create_admin(username: str, role: str, password_stdin: bool, if_missing: bool) -> None:
    """Create a console user (password stored as an argon2id hash)."""
    from controlplane.accounts.users import create_user, user_exists
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        if if_missing and user_exists(session, username):
            click.echo(f"console user {username} exists")
            return
    password = _read_password(password_stdin)
    with session_scope() as session:
        create_user(session, username, password, role, actor=_actor())
    click.echo(f"created console user {username} ({role})")


@console.command("create-token")
@click.option("--username", required=True, help="the console user the token acts as")
@click.option("--name", default="", help="a label for the token")
def create_token(username: str, name: str) -> None:
    """Create a management API token for a console user and print it once (only its hash is stored)."""
    from console.management_api import create_token as issue
    from controlplane.accounts.users import get_user, is_disabled
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        if is_disabled(get_user(session, username)):
            raise click.ClickException(f"console user {username} is disabled; enable it first")
        issued = issue(session, username, name=name)
        click.echo(f"console API token id {issued.record.id} for {username} (shown once):", err=True)
        click.echo(issued.secret)


@console.command("revoke-token")
@click.argument("token_id", type=int)
def revoke_token(token_id: int) -> None:
    """Revoke a management API token by id (``tokens`` lists them); requests with it get 401 at once."""
    from controlplane.accounts.users import revoke_token as revoke
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        token = revoke(session, token_id, actor=_actor())
        click.echo(f"console API token {token.id} ({token.prefix}…) revoked at {token.revoked_at:%Y-%m-%d %H:%M:%S}")


@console.command("tokens")
@click.option("--username", default=None, help="only this user's tokens")
def list_tokens(username: str | None) -> None:
    """List management API tokens: id, prefix, user, name, state, last use (never the token itself)."""
    from sqlmodel import col, select

    from controlplane.storage.session import session_scope
    from controlplane.storage.tables import ConsoleToken, ConsoleUser

    with session_scope() as session:
        query = select(ConsoleToken, ConsoleUser).join(ConsoleUser).order_by(col(ConsoleToken.id))
        if username is not None:
            query = query.where(ConsoleUser.username == username)
        for token, user in session.exec(query).all():
            state = "revoked" if token.revoked_at else "active"
            used = f"{token.last_used_at:%Y-%m-%d %H:%M}" if token.last_used_at else "never"
            click.echo(f"{token.id}\t{token.prefix}…\t{user.username}\t{token.name or '-'}\t{state}\tlast used {used}")


@console.group()
def users() -> None:
    """Console users: list, roles, passwords, disable and enable, end sessions (create one with create-admin)."""


@users.command("list")
def users_list() -> None:
    """Every console user with role, state, live sessions and API tokens."""
    from controlplane.accounts.users import list_users
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        for row in list_users(session):
            state = "disabled" if row.is_disabled else "active"
            click.echo(
                f"{row.user.username}\t{row.user.role}\t{state}\t{row.num_sessions} sessions\t{row.num_tokens} tokens"
            )


@users.command("set-role")
@click.argument("username")
@click.argument("role", type=ROLE_CHOICE)
def users_set_role(username: str, role: str) -> None:
    """Make a user an admin or a viewer (effective on its next request)."""
    from controlplane.accounts.users import get_user, set_role
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        user = get_user(session, username)
        assert user.id is not None
        set_role(session, user.id, role, actor=_actor())
    click.echo(f"console user {username} is now a {role}")


@users.command("set-password")
@click.argument("username")
@click.option("--password-stdin", is_flag=True, help="read the password from standard input instead of a prompt")
def users_set_password(username: str, password_stdin: bool) -> None:
    """Set a new password; every session of the user ends."""
    from controlplane.accounts.users import get_user, reset_password
    from controlplane.storage.session import session_scope

    password = _read_password(password_stdin)
    with session_scope() as session:
        user = get_user(session, username)
        assert user.id is not None
        ended = reset_password(session, user.id, password, actor=_actor())
    click.echo(f"password of {username} changed; {ended} sessions ended")


@users.command("disable")
@click.argument("username")
def users_disable(username: str) -> None:
    """Refuse the user's password, end its sessions and revoke its API tokens."""
    from controlplane.accounts.users import disable, get_user
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        user = get_user(session, username)
        assert user.id is not None
        disable(session, user.id, actor=_actor())
    click.echo(f"console user {username} disabled")


@users.command("enable")
@click.argument("username")
def users_enable(username: str) -> None:
    """Accept the user's password again (revoked sessions and tokens stay revoked)."""
    from controlplane.accounts.users import enable, get_user
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        user = get_user(session, username)
        assert user.id is not None
        enable(session, user.id, actor=_actor())
    click.echo(f"console user {username} enabled")


@users.command("revoke-sessions")
@click.argument("username")
def users_revoke_sessions(username: str) -> None:
    """Sign a user out everywhere (the password stays)."""
    from controlplane.accounts.users import get_user, revoke_sessions
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        user = get_user(session, username)
        assert user.id is not None
        ended = revoke_sessions(session, user.id, actor=_actor())
    click.echo(f"{ended} sessions of {username} ended")
