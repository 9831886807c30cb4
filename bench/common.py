"""What every benchmark command shares: printing a result and finding (or building) the zoo it measures."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
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


TICK = os.sysconf("SC_CLK_TCK")


def _proc_stats() -> dict[int, list[str]]:
    """The fields after the command name of every process's /proc/PID/stat (index 1: the parent's pid)."""
    stats: dict[int, list[str]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            stats[int(stat.parent.name)] = stat.read_text().rsplit(")", 1)[1].split()
    return stats


def process_cpu_seconds(pid: int, fields: list[str] | None = None) -> float:
    """CPU seconds (user + system, every thread, live or exited) of ``pid``, to the nanosecond.

    Read from the process's CPU-time clock (``clock_getcpuclockid``'s id, ``(~pid << 3) | CPUCLOCK_SCHED``):
    /proc/PID/stat counts in clock ticks (10 ms here), which a short bench point cannot resolve; a gateway
    serving 8 requests in 25 ms of CPU read 0.0 there (CI, 2026-12-03). Falls back to the ticks of ``fields``
    (or of /proc) where the clock cannot be read, and to 0.0 for a process that is gone.
    """
    with contextlib.suppress(OSError):
        return time.clock_gettime((~pid << 3) | 2)
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = fields or Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    return 0.0


def tree_cpu_seconds(pid: int, *, root: bool = True, descendants: bool = True) -> float:
    """CPU seconds of ``pid`` (``root``) and of every live descendant (``descendants``: a proxy's workers, a
    server's engine children) plus what its reaped children used (``cutime``/``cstime``, in ticks): a worker a
    proxy recycles mid-run keeps counting, and the total never goes down."""
    stats = _proc_stats()
    total = 0.0
    for p, fields in stats.items():
        q = p
        while q and q != pid:
            q = int(stats[q][1]) if q in stats else 0
        if q != pid or (p == pid and not root) or (p != pid and not descendants):
            continue
        total += process_cpu_seconds(p, fields)
        if descendants:
            with contextlib.suppress(ValueError, IndexError):
                total += (int(fields[13]) + int(fields[14])) / TICK
    return total


def tokens_before_divergence(tokens: list[int], reference: list[int]) -> int:
    """How many leading tokens two greedy outputs share."""
    for i, (a, b) in enumerate(zip(tokens, reference, strict=False)):
        if a != b:
            return i
    return min(len(tokens), len(reference))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def served(
    cmd: list[str],
    env: dict[str, str] | None,
    ready_url: str,
    what: str,
    *,
    headers: dict[str, str] | None = None,
    log: Path | None = None,
    start_timeout_s: float = 300.0,
) -> Iterator[subprocess.Popen[bytes]]:
    """``cmd`` running until ``ready_url`` answers 200 (``headers`` sent; ``start_timeout_s`` at most; ``what`` names
    it in errors, which quote the tail of its output); SIGTERM after (SIGKILL a minute later). Its output goes to
    ``log``, else a temporary file."""
    with log.open("w+b") if log is not None else tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + start_timeout_s
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    out.seek(0)
                    tail = out.read()[-2000:].decode(errors="replace")
                    how = f"exited with {proc.returncode}" if proc.poll() is not None else "did not start"
                    raise RuntimeError(f"{what} {how} during start-up: {tail}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(ready_url, headers=headers, timeout=1).status_code == 200:
                        break
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


def tierline_server(
    args: list[str], env: dict[str, str], port: int, ready: str
) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """``tierline ARGS --host 127.0.0.1 --port PORT`` until ``ready`` answers 200 (5 min at most); SIGTERM after."""
    cmd = [sys.executable, "-m", "tierline.cli", *args, "--host", "127.0.0.1", "--port", str(port)]
    return served(cmd, env, f"http://127.0.0.1:{port}{ready}", " ".join(args))
