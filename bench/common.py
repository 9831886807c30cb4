"""What every benchmark command shares: printing a result and finding (or building) the zoo it measures."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import httpx


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def tierline_server(args: list[str], env: dict[str, str], port: int, ready: str) -> Iterator[subprocess.Popen[bytes]]:
    """``tierline ARGS --host 127.0.0.1 --port PORT`` until ``ready`` answers 200 (5 min at most); SIGTERM after."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierline.cli", *args, "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(args)} exited with {proc.returncode} during start-up")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}{ready}", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(args)} did not start")
            time.sleep(0.2)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
