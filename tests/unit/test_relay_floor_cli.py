"""``python -m bench.lab.relay_floor``: bad arguments are refused in one line, before any server starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tokens", "32,2"], "--tokens '32,2': expected two lengths, the first smaller"),
        (["--tokens", "2"], "--tokens '2': expected two lengths, such as 2,32"),
        (["--tokens", "a,b"], "--tokens 'a,b': expected two lengths, such as 2,32"),
        (["--paths", "gateway,nginx"], "--paths 'gateway,nginx': expected some of gateway, litestar, json, raw"),
        (["--rounds", "0"], "--rounds and --requests must be at least 1"),
        (["--serve", "raw"], "--serve needs --upstream and --port"),
    ],
)
def test_bad_arguments_are_named(args: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.lab.relay_floor", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert message in done.stderr
    assert done.stdout == ""
