"""Commands whose bodies belong to a later issue: present in --help, and a clear one-line refusal."""

from __future__ import annotations

import click


def planned(name: str, help_text: str, *, issue: int) -> click.Command:
    @click.command(
        name=name,
        help=f"{help_text} [not available yet: planned in issue #{issue}]",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    )
    def command() -> None:
        raise click.UsageError(f"'{name}' is not available in this version yet (planned in issue #{issue})")

    return command
