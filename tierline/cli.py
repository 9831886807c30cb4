"""The ``tierline`` command. Each tier's commands load lazily, so ``tierline edge ...`` never imports torch."""

from __future__ import annotations

import importlib
import sys

import click

from shared.errors import ApplicationError

# command name -> (module, attribute, one-line help). Modules are imported only when the command runs.
LAZY_COMMANDS: dict[str, tuple[str, str, str]] = {
    "up": ("tierline.up", "up", "Run the whole platform on localhost: cloud API, console and one edge agent."),
    "cloud": ("cloud.cli", "cloud", "The cloud tier: inference API and LLM engine."),
    "engine": ("cloud.cli", "engine", "The built-in LLM engine as a standalone OpenAI-compatible model server."),
    "console": ("console.cli", "console", "The web console and management API."),
    "edge": ("edge_agent.cli", "edge", "The edge agent daemon for devices."),
    "zoo": ("shared.zoo.cli", "zoo", "Build and verify the project's own models."),
    "db": ("controlplane.storage.cli", "db", "Database migrations."),
    "tenants": ("controlplane.tenancy.cli", "tenants", "Create and list tenants."),
    "keys": ("controlplane.tenancy.cli", "keys", "Create, list and revoke API keys."),
    "devices": ("controlplane.fleet.cli", "devices", "Edge devices: enrollment tokens, list, revoke."),
    "models": ("controlplane.registry.cli", "models", "The model registry."),
    "rollouts": ("controlplane.registry.cli", "rollouts", "Canary rollouts of model versions."),
    "bench": ("bench.cli", "bench", "Benchmarks that print JSON."),
    "billing": ("controlplane.billing.cli", "billing", "Prices, budgets and invoices."),
    "demo": ("tierline.demo_traffic", "demo", "Demo traffic through the local edge agent (tierline demo traffic)."),
    "policies": ("controlplane.policies.cli", "policies", "Escalation policies: calibrate, operating point, list."),
}
# Commands that read and write the database directly: it is migrated (SQLite) or checked (PostgreSQL) first.
DATABASE_COMMANDS = frozenset({"tenants", "keys", "devices", "models", "rollouts", "billing", "policies"})


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(LAZY_COMMANDS)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # From the table, so `tierline --help` imports no tier.
        with formatter.section("Commands"):
            formatter.write_dl([(name, LAZY_COMMANDS[name][2]) for name in self.list_commands(ctx)])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        spec = LAZY_COMMANDS.get(cmd_name)
        if spec is None:
            return None
        module_name, attr, help_text = spec
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            missing = exc.name or str(exc)
            return _missing_extra_command(cmd_name, help_text, missing)
        command = getattr(module, attr)
        if not isinstance(command, click.Command):
            raise TypeError(f"{module_name}.{attr} is not a click command")
        return command


def _missing_extra_command(name: str, help_text: str, missing: str) -> click.Command:
    extra = {"cloud": "cloud", "console": "console", "edge": "edge", "zoo": "zoo"}.get(name, "dev")

    @click.command(name=name, help=f"{help_text} (unavailable: {missing} is not installed)")
    def unavailable() -> None:
        raise click.ClickException(f"'{name}' needs {missing}; install it with: pip install 'tierline[{extra}]'")

    return unavailable


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tierline")
@click.option("--log-level", default=None, help="Logging level (default: $TIERLINE_LOG_LEVEL or INFO).")
@click.pass_context
def cli(ctx: click.Context, log_level: str | None) -> None:
    """tierline: an edge-cloud tiered inference platform behind one OpenAI-compatible API."""
    from shared.logs import configure
    from shared.settings import CoreSettings

    core = CoreSettings()
    configure(log_level or core.log_level, core.effective_log_format)
    if (
        ctx.invoked_subcommand in DATABASE_COMMANDS
        and not ctx.resilient_parsing
        and not {"--help", "-h"} & set(ctx.args)
    ):
        _check_database()


def _check_database() -> None:
    from controlplane.storage.migrate import ensure_migrated
    from controlplane.storage.session import database_url, get_db

    migrated = ensure_migrated(database_url(), get_db())
    if migrated is not None:
        click.echo(migrated, err=True)


def main() -> None:
    """Console-script entry point: application errors become one line on stderr and exit code 1."""
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except ApplicationError as exc:
        click.echo(f"error: {exc.message}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
