"""``python -m bench.lab.gateway_ab``: bad arguments are refused in one line, before any server starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--b-env", "TIERLINE_CLOUD_USAGE_CHECKPOINT_TOKENS"],
            "--b-env 'TIERLINE_CLOUD_USAGE_CHECKPOINT_TOKENS': expected NAME=VALUE",
        ),
        (["--b-env", "=0"], "--b-env '=0': expected NAME=VALUE"),
        (["--b-tree", "/nonexistent/checkout"], "--b-tree /nonexistent/checkout: not a tierline checkout"),
        (["--paced", "20"], "--paced '20': expected TTFT_MS,TOKEN_MS, e.g. 20,10"),
    ],
)
def test_bad_arguments_are_named(args: list[str], message: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.lab.gateway_ab", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert message in done.stderr
    assert done.stdout == ""
