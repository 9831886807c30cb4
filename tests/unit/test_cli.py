"""The CLI surface: every command has --help; bad input is refused in one line, without a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.conftest import REPO
from tierline.cli import LAZY_COMMANDS, cli

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
    ["billing", "invoice"],
    ["billing", "void"],
    ["billing", "credit"],
    ["bench", "billing"],
    ["cloud", "publish"],
    ["models", "list"],
    ["models", "push"],
    ["models", "versions"],
    ["models", "show"],
    ["models", "alias"],
    ["models", "status"],
    ["models", "tag"],
    ["models", "derive"],
    ["models", "export"],
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


def test_push_of_a_missing_path_is_a_one_line_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-checkpoint"
    proc = subprocess.run(
        [sys.executable, "-m", "tierline.cli", "models", "push", str(missing), "--name", "x"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "TIERLINE_DATA_DIR": str(tmp_path)},
    )
    assert proc.returncode == 2
    assert "no-such-checkpoint" in proc.stderr and "Traceback" not in proc.stderr


def test_edge_commands_never_import_torch() -> None:
    code = (
        "import sys; from click.testing import CliRunner; from tierline.cli import cli; "
        "r = CliRunner().invoke(cli, ['edge', 'run', '--help']); "
        "print(r.exit_code, 'torch' in sys.modules, 'sqlalchemy' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert proc.stdout.split() == ["0", "False", "False"]
