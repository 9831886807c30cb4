"""The CLI surface: every command has --help; planned commands refuse in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from shared.cli import LAZY_COMMANDS, cli
from tests.conftest import REPO

SURFACE = [
    ["up"],
    ["cloud", "serve"],
    ["console", "serve"],
    ["console", "create-admin"],
    ["edge", "run"],
    ["edge", "enroll"],
    ["edge", "calibrate"],
    ["zoo", "build"],
    ["zoo", "verify"],
    ["zoo", "train"],
    ["db", "upgrade"],
    ["tenants", "create"],
    ["tenants", "list"],
    ["keys", "create"],
    ["keys", "revoke"],
    ["devices", "enrollment-token"],
    ["devices", "list"],
    ["devices", "revoke"],
    ["billing", "prices", "set"],
    ["billing", "prices", "list"],
    ["cloud", "publish"],
    ["models", "list"],
    ["rollouts", "create"],
    ["rollouts", "list"],
    ["rollouts", "tick"],
    ["console", "create-token"],
    ["bench", "cascade"],
    ["edge", "calibrate"],
    ["bench", "zoo"],
    ["bench", "engine"],
    ["bench", "spec"],
    ["bench", "prefix"],
    ["bench", "tensor"],
    ["bench", "api"],
    ["bench", "edge"],
]


@pytest.mark.parametrize("path", SURFACE, ids=" ".join)
def test_help_everywhere(path: list[str]) -> None:
    result = CliRunner().invoke(cli, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage: " in result.output


def test_root_help_lists_every_group() -> None:
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    for name in LAZY_COMMANDS:
        assert name in result.output


def test_planned_command_says_where_it_comes_from() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "shared.cli", "models", "push", "x"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "planned in issue #7" in proc.stderr and "Traceback" not in proc.stderr


def test_edge_commands_never_import_torch() -> None:
    code = (
        "import sys; from click.testing import CliRunner; from shared.cli import cli; "
        "r = CliRunner().invoke(cli, ['edge', 'run', '--help']); "
        "print(r.exit_code, 'torch' in sys.modules, 'sqlalchemy' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert proc.stdout.split() == ["0", "False", "False"]
