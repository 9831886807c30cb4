"""What every benchmark command shares: printing a result and finding (or building) the zoo it measures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import click


def emit(result: dict[str, Any], as_json: bool) -> None:
    """One JSON object with --json; a readable two-column table otherwise."""
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    width = max((len(k) for k in result), default=0)
    for key, value in result.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        click.echo(f"{key:<{width}}  {value}")


def zoo_root(preset: str, zoo_dir: Path | None) -> Path:
    """The built zoo preset (building it first when missing: the benchmarks need its artifacts).

    A build runs in a child process (its output on stderr), so that it leaves nothing in this one: the peak
    RSS a benchmark reports is its own, not a model training's or an export's.
    """
    from shared.settings import CoreSettings
    from shared.zoo.build import is_built
    from shared.zoo.presets import get_preset
    from shared.zoo.registry import ZooLayout

    base = zoo_dir or CoreSettings().zoo_dir
    if not is_built(ZooLayout(base / preset), get_preset(preset)):
        cmd = [sys.executable, "-m", "tierline.cli", "zoo", "build", "--preset", preset, "--out", str(base)]
        subprocess.run(cmd, check=True, stdout=sys.stderr)
    return base / preset
